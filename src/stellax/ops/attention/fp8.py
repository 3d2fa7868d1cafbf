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
``preferred_element_type`` (bfloat16 by default).

Gradients: the quantized operands are constants — their codes and scales get
zero cotangents. Float operands mixed with quantized ones (e.g. a bf16 query
against fp8 K/V), ``bias`` and ``sinks`` get the true gradients of the
attention of the dequantized operands (the backward kernels run on
dequantized copies).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, backward_implementation, checks, register
from ..quant.quantize import quantize_op
from ..quant.qarray import QArray

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
    from .api import check_attention
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
    base = check_attention(*stand_ins, bias, mask, **kwargs)
    arrays = dict(base.arrays)
    for n, (values, s) in zip(_NAMES, operands):
        arrays[n] = values
        arrays[n[0] + "_scales"] = s
    return Call(arrays, {**base.options, "preferred_element_type": dtype.name})


# -- canonical form -----------------------------------------------------------------------
def _canonical_scales(s, b, length, heads):
    """``[B...|1, L|1, heads|1]`` → ``[B, L, heads]`` float32 (None for a float operand)."""
    if s is None:
        return None
    lead = s.shape[:-2]
    s = s.reshape((int(np.prod(lead)) if lead else 1,) + tuple(s.shape[-2:]))
    return jnp.broadcast_to(s, (b, length, heads))


def _canonical(call: Call):
    from .api import canonicalize
    c = canonicalize(call)
    b, t, n, _ = c.q.shape
    s, kh = c.k.shape[1:3]
    scales = (_canonical_scales(call.q_scales, b, t, n), _canonical_scales(call.k_scales, b, s, kh),
              _canonical_scales(call.v_scales, b, s, kh))
    return c, scales


def _dequantize(x, s, dtype):
    """Canonical codes and row scales → ``dtype`` (a constant: no gradient)."""
    if s is None:
        return x
    x, s = jax.lax.stop_gradient(x), jax.lax.stop_gradient(s)
    return (x.astype(jnp.float32) * s[..., None]).astype(dtype)


def _dequantized(c, scales, dtype):
    q, k, v = (_dequantize(x, s, dtype) for x, s in zip((c.q, c.k, c.v), scales))
    # Mixed float/quantized operands: compute in the common dtype.
    return dataclasses.replace(c, q=q.astype(dtype), k=k.astype(dtype), v=v.astype(dtype))


def _finalize(call, out, lse):
    from .api import finalize
    return finalize(call, out.astype(call.preferred_element_type), lse)


# -- implementations ----------------------------------------------------------------------
def _reference(call: Call):
    from .reference import attention_forward_reference
    c, scales = _canonical(call)
    d = _dequantized(c, scales, jnp.float32)
    out, lse = attention_forward_reference(*d.arrays, **d.statics)
    return _finalize(call, out, lse)


def _run_chunked(call: Call, config):
    from .api import attention_with_vjp
    c, scales = _canonical(call)
    d = _dequantized(c, scales, jnp.dtype(call.preferred_element_type))
    out, lse = attention_with_vjp("xla_chunked", config, d)
    return _finalize(call, out, lse)


def _run_triton(call: Call, config):
    from . import triton as kernels
    from .api import attention_backward_op
    c, scales = _canonical(call)
    out_dtype = jnp.dtype(call.preferred_element_type)
    kernel_scales = tuple(jnp.ones(x.shape[:3], jnp.float32) if s is None else s
                          for x, s in zip((c.q, c.k, c.v), scales))
    statics = c.statics

    def run_forward(q, k, v, sq, sk, sv, bias, sinks, mask, q_pos, kv_pos, q_seg, kv_seg):
        cc = dataclasses.replace(c, q=q, k=k, v=v, bias=bias, sinks=sinks, mask=mask, q_pos=q_pos,
                                 kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg)
        return kernels.forward(cc, config, scales=(sq, sk, sv), out_dtype=out_dtype)

    @jax.custom_vjp
    def attend(*operands):
        return run_forward(*operands)

    def fwd(*operands):
        out, lse = run_forward(*operands)
        return (out, lse), (operands, out, lse)

    def bwd(res, cotangents):
        (q, k, v, sq, sk, sv, bias, sinks, mask, q_pos, kv_pos, q_seg, kv_seg), out, lse = res
        d_out, d_lse = cotangents
        quantized = [s is not None for s in scales]
        dq_, dk_, dv_ = (_dequantize(x, s, out_dtype) if qz else x.astype(out_dtype)
                         for x, s, qz in zip((q, k, v), (sq, sk, sv), quantized))
        dq, dk, dv, dbias, dsinks = attention_backward_op(
            dq_, dk_, dv_, bias, mask, sinks, out, lse, d_out.astype(out.dtype), d_lse, q_pos, kv_pos, q_seg,
            kv_seg, **statics, implementation=backward_implementation(attention_backward_op, "triton"))
        grads = [jnp.zeros_like(x) if qz else g.astype(x.dtype)
                 for x, g, qz in zip((q, k, v), (dq, dk, dv), quantized)]
        return (*grads, jnp.zeros_like(sq), jnp.zeros_like(sk), jnp.zeros_like(sv), dbias, dsinks,
                None, None, None, None, None)

    attend.defvjp(fwd, bwd)
    out, lse = attend(c.q, c.k, c.v, *kernel_scales, c.bias, c.sinks, c.mask, c.q_pos, c.kv_pos, c.q_seg,
                      c.kv_seg)
    return _finalize(call, out, lse)


def _flops(call: Call) -> float:
    from .api import _attention_flops
    return _attention_flops(call)


def _bytes(call: Call) -> float:
    from .api import _attention_bytes
    return _attention_bytes(call)


def _implementations():
    from . import configs
    return [
        Implementation("triton", _run_triton, backend="triton", config_type=configs.FlashConfig,
                       heuristic=configs.flash_heuristic, space=configs.flash_space,
                       requirements=configs.flash_requirements),
        Implementation("xla_chunked", _run_chunked, config_type=configs.ChunkedConfig,
                       heuristic=configs.chunked_heuristic, space=configs.chunked_space),
        Implementation("xla", lambda call, config: _reference(call)),
    ]


attention_fp8_op = register(Op(
    "attention_fp8",
    family="attention",
    check=check_fp8_attention,
    reference=_reference,
    implementations=_implementations(),
    flops=_flops,
    bytes_accessed=_bytes,
    differentiable=("bias", "sinks"),
))
