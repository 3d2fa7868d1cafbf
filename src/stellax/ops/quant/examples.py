"""Example calls (`stellax check`, tests) and benchmark shapes (`stellax bench`)
of the quant ops: `quantize`, `dequantize`, `hadamard_transform` and
`quantized_matmul`.

Quantized operands are built with the XLA quantize path (`base.quantize_xla`,
what `quantize` runs on a CPU), so the examples do not depend on the ops they
feed. Shapes are not multiples of the blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example, Platform
from . import formats as F
from .base import flatten_operands, resolve_block_shape
from .hadamard import random_signs
from .qarray import QArray, qarray_fields
from .xla import quantize_xla

QUANTIZE_FORMATS = (("int8", "channel"), ("int8_asym", 64), ("int4", 32), ("fp8_e4m3", (128, 128)),
                    ("fp8_e5m2", "tensor"), ("mxfp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16))
WEIGHT_ONLY = (("int8", "channel"), ("int8_asym", 128), ("int4", 128), ("int4_asym", 64), ("fp8_e4m3", "channel"),
               ("fp8_e5m2", (128, 128)), ("mxfp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16), ("nvfp4", (16, 16)))
ACT_WEIGHT = ((("fp8_e4m3", 128), ("fp8_e4m3", (128, 128))), (("fp8_e4m3", "channel"), ("fp8_e5m2", "channel")),
              (("int8", "channel"), ("int8", "channel")), (("int8", 64), ("int8", 64)),
              (("mxfp8_e4m3", 32), ("mxfp8_e4m3", 32)))


def quantize_example(x, format: str, axis: int, block_size) -> QArray:
    """``quantize(x, format, axis=axis, block_size=block_size)`` without
    rotation or stochastic rounding, by the XLA path (``axis`` >= 0)."""
    fmt = F.get_format(format)
    block_shape = resolve_block_shape(fmt, x.shape, axis, block_size)
    return quantize_xla(x, None, fmt=fmt.name, block_shape=block_shape, axis=axis, scale_dtype=None, rotation=None)


def _quantize_kwargs(format: str, shape, block) -> dict:
    fmt = F.get_format(format)
    return {"format": format, "axis": -1, "block_shape": resolve_block_shape(fmt, shape, len(shape) - 1, block)}


# -- quantize ----------------------------------------------------------------------------
def quantize_examples(dtype) -> list[Example]:
    """One ``x [37, 200]`` of ``dtype`` per format of `QUANTIZE_FORMATS`, quantized along the last axis."""
    out = []
    for i, (name, block) in enumerate(QUANTIZE_FORMATS):
        x = jax.random.normal(jax.random.PRNGKey(i), (37, 200), jnp.float32).astype(dtype)
        out.append(Example(f"{name} block={block} x=37x200", (x,), _quantize_kwargs(name, x.shape, block)))
    return out


def quantize_benchmarks(platform: Platform) -> list[Example]:
    """bf16 ``[8192, 8192]`` on a GPU (``[512, 1024]`` elsewhere) in five formats."""
    shape = (8192, 8192) if platform.backend == "gpu" else (512, 1024)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return [Example(f"{name} {shape}", (x,), _quantize_kwargs(name, shape, block))
            for name, block in (("int8", "channel"), ("fp8_e4m3", 128), ("mxfp8_e4m3", 32), ("mxfp4", 32),
                                ("nvfp4", 16))]


# -- dequantize --------------------------------------------------------------------------
def _dequantize_example(label: str, q: QArray, dtype) -> Example:
    arrays, options = qarray_fields(q)
    return Example(label, tuple(arrays.values()), {**options, "dtype": np.dtype(dtype).name})


def dequantize_examples(dtype) -> list[Example]:
    """The `quantize_examples` (float32 inputs) quantized, dequantized to ``dtype``."""
    out = []
    for ex in quantize_examples(jnp.float32):
        q = quantize_xla(*ex.args, None, fmt=ex.kwargs["format"], block_shape=ex.kwargs["block_shape"],
                         axis=ex.args[0].ndim - 1, scale_dtype=None, rotation=None)
        out.append(_dequantize_example(ex.label, q, dtype))
    return out


def dequantize_benchmarks(platform: Platform) -> list[Example]:
    """The `quantize_benchmarks` shapes as abstract `QArray`\\ s, dequantized to bf16."""
    out = []
    for ex in quantize_benchmarks(platform):
        x = jnp.zeros(ex.args[0].shape, jnp.float32)
        q = jax.eval_shape(lambda x: quantize_xla(x, None, fmt=ex.kwargs["format"], axis=x.ndim - 1,
                                                  block_shape=ex.kwargs["block_shape"], scale_dtype=None,
                                                  rotation=None), x)
        out.append(_dequantize_example(ex.label, q, jnp.bfloat16))
    return out


# -- hadamard_transform ---------------------------------------------------------------------
def hadamard_examples(dtype) -> list[Example]:
    """Four ``(x, signs)`` calls: whole-axis and blocked, with and without random signs, forward and inverse."""
    out = []
    for i, (shape, block, signed, inverse) in enumerate((((5, 64), None, False, False), ((3, 7, 256), 32, True, False),
                                                         ((11, 512), 128, True, True), ((4, 16), 16, False, True))):
        kx, ks = jax.random.split(jax.random.PRNGKey(100 + i))
        x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
        b = shape[-1] if block is None else block
        signs = random_signs(ks, b) if signed else None
        out.append(Example(f"x={shape} block={b} signs={signed} inverse={inverse}", (x, signs),
                           {"block": b, "inverse": inverse}))
    return out


def hadamard_benchmarks(platform: Platform) -> list[Example]:
    """bf16 ``[16384, 4096]`` on a GPU (``[256, 4096]`` elsewhere), blocks 32/128/256."""
    rows = 16384 if platform.backend == "gpu" else 256
    return [Example(f"x=({rows},4096) block={b}", (jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16), None),
                    {"block": b}) for b in (32, 128, 256)]


# -- quantized_matmul -----------------------------------------------------------------------
def example_operands(dtype, m=37, k=300, n=130, seed=0) -> list[tuple[str, object, QArray]]:
    """``(label, x, w)``: the weight-only pairs of `WEIGHT_ONLY` (``x [m, k]`` in
    ``dtype``) and the activation × weight pairs of `ACT_WEIGHT` (both `QArray`)."""
    out = []
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
    for fmt, block in WEIGHT_ONLY:
        out.append((f"{fmt}[{block}] weights", x.astype(dtype), quantize_example(w, fmt, 0, block)))
    for (xf, xb), (wf, wb) in ACT_WEIGHT:
        out.append((f"{xf}[{xb}] x {wf}[{wb}]", quantize_example(x, xf, 1, xb), quantize_example(w, wf, 0, wb)))
    return out


def matmul_examples(dtype) -> list[Example]:
    """`example_operands` flattened into `quantized_matmul_op` calls with ``dtype`` output."""
    out = []
    for label, x, w in example_operands(dtype):
        args, kwargs = flatten_operands(x, w)
        out.append(Example(label, args, {**kwargs, "preferred_element_type": np.dtype(dtype).name}))
    return out


def _abstract_quantized(a, fmt: str, axis: int, block) -> QArray:
    return jax.eval_shape(lambda a: quantize_example(a, fmt, axis, block), a)


def matmul_benchmarks(platform: Platform) -> list[Example]:
    """``4096×8192×8192`` on a GPU (``64×512×256`` elsewhere): bf16 × five weight
    formats and three activation × weight pairs, bf16 output."""
    m, k, n = (4096, 8192, 8192) if platform.backend == "gpu" else (64, 512, 256)
    xs = jnp.zeros((m, k), jnp.float32)
    ws = jnp.zeros((k, n), jnp.float32)
    out = []
    for fmt, block in (("int8", "channel"), ("int4", 128), ("fp8_e4m3", "channel"), ("mxfp4", 32), ("nvfp4", 16)):
        args, kw = flatten_operands(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), _abstract_quantized(ws, fmt, 0, block))
        out.append(Example(f"bf16 x {fmt} weights {m}x{k}x{n}", args, {**kw, "preferred_element_type": "bfloat16"}))
    for (xf, xb), (wf, wb) in ((("fp8_e4m3", 128), ("fp8_e4m3", (128, 128))), (("int8", "channel"), ("int8", "channel")),
                               (("mxfp8_e4m3", 32), ("mxfp8_e4m3", 32))):
        args, kw = flatten_operands(_abstract_quantized(xs, xf, 1, xb), _abstract_quantized(ws, wf, 0, wb))
        out.append(Example(f"{xf} x {wf} {m}x{k}x{n}", args, {**kw, "preferred_element_type": "bfloat16"}))
    return out
