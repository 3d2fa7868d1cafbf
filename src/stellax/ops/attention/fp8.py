"""FP8 attention: `dot_product_attention` with `QArray` query/key/value.

Any of ``query``/``key``/``value`` may be a `QArray` in ``fp8_e4m3`` or
``fp8_e5m2`` (the others stay float arrays). Supported scale layouts: every
dimension of the scales is either 1 (shared) or full (one scale per index),
except the head dim, which has one scale — i.e. for ``q [B..., T, N, H]`` the
scales broadcast as ``[B...|1, T|1, N|1, 1]``. This covers

* per tensor (``quantize(x, f, block_size="tensor")``),
* per head / per (batch, head) (`quantize_for_attention` ``scales="head"``),
* per token and head — quantized along the head dim, one scale per
  ``(b, t, n)`` row (the default ``quantize(x, f)``: ``axis=-1``, per channel).

Blocks that split a dimension into several partial groups (e.g. 128-token
blocks), zero points, rotations and other formats raise ``ValueError`` naming
the argument.

Math: the golden dequantizes to float32 then runs the float32 golden. The
Triton kernel loads the fp8 tiles (1 byte per element, no dequantized copy
of K/V in memory), converts them to bf16 in registers (exact for e4m3 and
e5m2), multiplies the ``q·kᵀ`` logits by ``s_q·s_k`` and the probabilities by
``s_v`` before ``p·v``. ``xla_chunked`` dequantizes q/k/v up front (to the
output dtype) and runs the usual chunked loop. The output dtype is
``preferred_element_type`` (bfloat16 by default). The op has the float op's
implementations but ``mosaic_tpu`` (`base.FP8_BACKENDS`: ``triton``,
``xla_chunked``, ``xla``, with the float op's configs): its canonical operands
carry the codes, their per-row scales and the output dtype (`base.Canonical`).

Gradients: the quantized operands are constants — their codes and scales get
zero cotangents. Float operands mixed with quantized ones (e.g. a bf16 query
against fp8 K/V), ``bias`` and ``sinks`` get the true gradients of the
attention of the dequantized operands (the backward kernels run on
dequantized copies).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Example, checks
from ..quant import QArray, quantize_op
from .backward import run_forward
from .base import BACKENDS, FP8_BACKENDS, check_attention, forward_bytes, forward_flops, reference

FORMATS = ("fp8_e4m3", "fp8_e5m2")
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
_NAMES = ("query", "key", "value")


def is_quantized(*xs) -> bool:
    return any(isinstance(x, QArray) for x in xs)


def _check_operand(name: str, x):
    """``x`` → ``(values, row_scales | None)``; row scales are float32
    ``[B...|1, L|1, heads|1]`` (the scales without the head-dim axis)."""
    if not isinstance(x, QArray):
        return x, None
    if x.format not in FORMATS:
        raise ValueError(f"{name}: fp8 attention takes QArrays in {list(FORMATS)}, got format {x.format}")
    if x.rotation is not None:
        raise ValueError(f"{name}: a rotated QArray (rotate={x.rotation}) is not supported by attention")
    if x.ndim < 3:
        raise ValueError(f"{name}: expected rank >= 3 ([..., L, heads, head_dim]), got shape {x.shape}")
    for d, (b, s) in enumerate(zip(x.block_shape, x.shape)):
        last = d == x.ndim - 1
        if (last and b != s) or (not last and b not in (1, s)):
            raise ValueError(
                f"{name}: unsupported scale layout: block_shape {x.block_shape} for shape {x.shape} (scales "
                f"{tuple(x.scales.shape)}); fp8 attention takes one scale per head-dim row and, on every other "
                f"dimension, either one scale per index or one shared scale (per tensor, per head, per token "
                f"and head) — dim {d} has blocks of {b}")
    if isinstance(x.scales, jax.ShapeDtypeStruct):   # abstract operands (the static GPU tier lowers those)
        return x.values, jax.ShapeDtypeStruct(tuple(x.scales.shape[:-1]), jnp.float32)
    scales = x.scales.astype(jnp.float32)
    return x.values, scales.reshape(scales.shape[:-1])


def quantize_for_attention(x, format: str = "fp8_e4m3", *, scales: str = "token"):
    """Quantize an attention operand ``[B..., L, heads, head_dim]`` for
    `dot_product_attention`: ``scales`` is ``"tensor"``, ``"head"`` (one
    scale per (batch, head)) or ``"token"`` (per token and head, along the
    head dim)."""
    x = jnp.asarray(x)
    if scales == "tensor":
        block = tuple(x.shape)
    elif scales == "head":
        block = (1,) * (x.ndim - 3) + (x.shape[-3], 1, x.shape[-1])
    elif scales == "token":
        block = (1,) * (x.ndim - 1) + (x.shape[-1],)
    else:
        raise ValueError(f"scales: expected 'tensor', 'head' or 'token', got {scales!r}")
    return quantize_op(x, format=format, axis=-1, block_shape=block)


# -- checks -----------------------------------------------------------------------------
def check_fp8_attention(query, key, value, bias=None, mask=None, *, preferred_element_type=None, **kwargs) -> Call:
    """Checks of `dot_product_attention` (run on bf16 stand-ins for the
    operands' shapes) plus the fp8 operands' formats and scale layouts."""
    trio = (query, key, value)
    if not is_quantized(*trio):
        raise ValueError("query/key/value: fp8 attention needs at least one QArray operand")
    operands = [_check_operand(n, x) for n, x in zip(_NAMES, trio)]
    float_dtype = None
    for n, x in zip(_NAMES, trio):
        if isinstance(x, QArray):
            continue
        checks.require_float(n, x)
        if float_dtype is not None and np.dtype(x.dtype) != float_dtype:
            raise TypeError(f"{n}: float operands of fp8 attention must share a dtype, got "
                            f"{np.dtype(x.dtype).name} and {float_dtype.name}")
        float_dtype = np.dtype(x.dtype)
    dtype = np.dtype(jnp.bfloat16 if preferred_element_type is None else preferred_element_type)
    if dtype not in [np.dtype(d) for d in OUT_DTYPES]:
        raise TypeError(f"preferred_element_type: expected bfloat16/float16/float32, got {dtype.name}")
    stand_ins = [jax.ShapeDtypeStruct(tuple(x.shape), jnp.bfloat16) for x in trio]
    checked = check_attention(*stand_ins, bias, mask, **kwargs)
    arrays = dict(checked.arrays)
    for n, (values, s) in zip(_NAMES, operands):
        arrays[n] = values
        arrays[n[0] + "_scales"] = s
    return Call(arrays, {**checked.options, "preferred_element_type": dtype.name})


# -- built-in calls -----------------------------------------------------------------------
def _fp8_qkv(seed, b, t, n, k, h, dtype, scales):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q, key, v = (jax.random.normal(r, (b, t, heads, h), jnp.float32).astype(dtype)
                 for r, heads in ((kq, n), (kk, k), (kv, k)))
    return tuple(quantize_for_attention(x, "fp8_e4m3", scales=scales) for x in (q, key, v))


def fp8_examples(dtype):
    """Small calls for `stellax check`: e4m3 operands quantized from ``dtype``
    normals, per-token scales with GQA (causal), per-head scales (full)."""
    return [Example("e4m3 token scales B=2 T=S=128 N=4 K=2 H=64 causal",
                    _fp8_qkv(0, 2, 128, 4, 2, 64, dtype, "token"), {"is_causal": True}),
            Example("e4m3 head scales B=1 T=S=96 N=2 K=2 H=32", _fp8_qkv(1, 1, 96, 2, 2, 32, dtype, "head"), {})]


def fp8_benchmarks(platform):
    """Benchmark calls on a GPU: e4m3 with per-token scales at head dim 128, T = 16k (the bf16
    headline's shape, non-causal first) and 8k; none on a CPU."""
    if platform.backend == "cpu":
        return []
    return [Example(f"e4m3 B=1 T=S={t} N=16 H=128 {'causal' if causal else 'full'}",
                    _fp8_qkv(0, 1, t, 16, 16, 128, jnp.bfloat16, "token"), {"is_causal": causal})
            for t, causal in ((16384, False), (16384, True), (8192, False))]


attention_fp8_op = BACKENDS.op(
    "attention_fp8", run_forward, only=FP8_BACKENDS, check=check_fp8_attention, reference=reference,
    flops=forward_flops, bytes_accessed=forward_bytes, examples=fp8_examples, benchmarks=fp8_benchmarks,
    differentiable=("bias", "sinks"))
