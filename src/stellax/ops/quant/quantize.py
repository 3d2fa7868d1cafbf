"""The `quantize` op: a float array → `QArray` (see `reference` for the
per-format formulas), with an optional Hadamard rotation first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, checks, register
from . import examples
from . import formats as F
from . import mosaic_tpu as tpu_kernels
from . import triton as kernels
from .base import SCALE_DTYPES, quantize_xla, resolve_block_shape
from .configs import QuantizeConfig, quantize_heuristic, quantize_space
from .hadamard_transform import hadamard_transform
from .qarray import QArray, scale_shape
from .tpu_configs import QuantTpuConfig, quantize_tpu_heuristic, quantize_tpu_space

BLOCK_KERNEL_FORMATS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")


def _scale_dtype(fmt: F.Format, scale_dtype) -> str | None:
    if scale_dtype is None:
        return None
    if fmt.scale != "float":
        raise ValueError(f"scale_dtype: format {fmt.name} has fixed {fmt.scale} scales; pass None, "
                         f"got {np.dtype(scale_dtype).name}")
    if np.dtype(scale_dtype) not in [np.dtype(d) for d in SCALE_DTYPES]:
        raise ValueError(f"scale_dtype: expected one of {[np.dtype(d).name for d in SCALE_DTYPES]}, "
                         f"got {np.dtype(scale_dtype).name}")
    return np.dtype(scale_dtype).name


def check_quantize(x, key=None, *, format="int8", axis=-1, block_shape=None, scale_dtype=None,
                   rotation=None) -> Call:
    """Checked `quantize_op` arguments: ``x`` float (rank >= 1), ``key`` a PRNG
    key or ``None``, ``block_shape`` one size per dimension (default: the
    format's block along ``axis``), ``scale_dtype`` a float scale dtype name."""
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    fmt = F.get_format(format)
    axis = checks.normalize_axis("axis", axis, x.ndim)
    if 0 in x.shape:
        raise ValueError(f"x: expected a non-empty array (a QArray has positive sizes), got shape {tuple(x.shape)}")
    if block_shape is None:
        block_shape = resolve_block_shape(fmt, x.shape, axis, None)
    block_shape = tuple(int(b) for b in block_shape)
    if len(block_shape) != x.ndim:
        raise ValueError(f"block_shape: expected {x.ndim} sizes, got {block_shape}")
    scale_dtype = _scale_dtype(fmt, scale_dtype)
    if key is not None and fmt.element.kind not in ("float", "int"):
        raise ValueError("stochastic_rounding_key: unsupported for this format")
    return Call({"x": x, "key": key}, {"format": fmt.name, "axis": axis, "block_shape": block_shape,
                                       "scale_dtype": scale_dtype, "rotation": rotation})


def _xla(call: Call, config=None):
    del config
    return quantize_xla(call.x, call.key, fmt=call.format, block_shape=call.block_shape, axis=call.axis,
                        scale_dtype=call.scale_dtype, rotation=call.rotation)


def _bytes(call: Call) -> float:
    """Read ``x``, write the codes and float32 scales."""
    fmt = F.get_format(call.format)
    n = float(np.prod(call.x.shape))
    scales = float(np.prod(scale_shape(call.x.shape, call.block_shape)))
    return n * np.dtype(call.x.dtype).itemsize + n * fmt.element.bits / 8 + scales * 4


def _flops(call: Call) -> float:
    return float(np.prod(call.x.shape)) * 6


def _triton_requirements(call: Call):
    fmt = F.get_format(call.format)
    ndim = call.x.ndim
    if not fmt.is_mx and fmt.name not in BLOCK_KERNEL_FORMATS:
        return (f"the Triton quantize kernels cover the MX formats and {list(BLOCK_KERNEL_FORMATS)}; "
                f"got {fmt.name}")
    if not fmt.is_mx:
        g = call.block_shape[-1]
        if any(b != 1 for b in call.block_shape[:-1]) or g not in (32, 64, 128, 256):
            return (f"the Triton quantize kernel for {fmt.name} takes 1-D blocks of 32–256 (a power of two) along "
                    f"the last axis; got block_shape {call.block_shape}")
        if call.scale_dtype not in (None, "float32"):
            return f"the Triton quantize kernel writes float32 scales; got scale_dtype {call.scale_dtype}"
    if call.key is not None:
        return "the Triton quantize kernel rounds to nearest-even only (no stochastic_rounding_key)"
    if call.axis != ndim - 1:
        return f"the Triton quantize kernel quantizes along the last axis, got axis {call.axis} of rank {ndim}"
    if call.x.shape[-1] < 32:
        return f"the Triton quantize kernel needs at least one whole block of 32, got {call.x.shape[-1]}"
    return None


def _writes_float8(call: Call) -> bool:
    """Whether the Triton quantize kernel writes float8 codes for ``call`` (fp8 and MXFP8 formats)."""
    return np.dtype(F.get_format(call.format).storage_dtype).name.startswith("float8")


def _triton(call: Call, config: QuantizeConfig) -> QArray:
    """Rows of the last axis through `triton.block_quantize` (int/fp8, float32
    scales) or `triton.mx_quantize` (MX, E8M0 scales)."""
    fmt = F.get_format(call.format)
    shape = call.x.shape
    rows = int(np.prod(shape[:-1]))
    x = call.x.reshape(rows, shape[-1])
    if not fmt.is_mx:
        g = call.block_shape[-1]
        config = config if config.block_k % g == 0 else config.replace(block_k=max(g, config.block_k))
        values, scales = kernels.block_quantize(x, fmt=fmt.name, group=g, config=config)
        values = values.reshape(*shape[:-1], values.shape[-1])
        if fmt.element.kind == "float":
            values = jax.lax.bitcast_convert_type(values, fmt.element.dtype)
        scales = scales.reshape(*shape[:-1], scales.shape[-1])
    else:
        values, codes = kernels.mx_quantize(x, fmt=fmt.name, config=config)
        values = values.reshape(*shape[:-1], values.shape[-1])
        if not fmt.packed:
            values = jax.lax.bitcast_convert_type(values, fmt.element.dtype)
        scales = jax.lax.bitcast_convert_type(codes, jnp.float8_e8m0fnu).reshape(*shape[:-1], codes.shape[-1])
    return QArray(values, scales, format=fmt.name, shape=shape, block_shape=call.block_shape, axis=call.axis,
                  rotation=call.rotation, _validate=False)


quantize_op = register(Op(
    "quantize",
    family="quant",
    check=check_quantize,
    reference=_xla,
    implementations=[
        Implementation("mosaic_tpu", tpu_kernels.quantize_run, backend="mosaic_tpu", config_type=QuantTpuConfig,
                       heuristic=quantize_tpu_heuristic, space=quantize_tpu_space,
                       requirements=tpu_kernels.quantize_requirements),
        Implementation("triton", _triton, backend="triton", config_type=QuantizeConfig,
                       heuristic=quantize_heuristic, space=quantize_space, requirements=_triton_requirements,
                       writes_float8=_writes_float8),
        Implementation("xla", _xla)],
    flops=_flops,
    bytes_accessed=_bytes,
    examples=examples.quantize_examples,
    benchmarks=examples.quantize_benchmarks,
))


def _rotate(x, axis: int, rotate):
    """``x`` Hadamard-rotated along ``axis`` and the rotation block (``None``: no rotation)."""
    if rotate is None or rotate is False:
        return x, None
    block, key = rotate, None
    if isinstance(rotate, tuple):
        if len(rotate) != 2:
            raise ValueError(f"rotate: expected True, an int or (block_size, key), got {rotate!r}")
        block, key = rotate
    if block is True:
        block = x.shape[axis]
    moved = jnp.moveaxis(x, axis, -1)
    # Always float32-accurate (not the caller's matmul precision): the rotation is part of the
    # quantization recipe, and a bf16 pass would add its rounding to every rotated value.
    moved = hadamard_transform(moved, block_size=block, random_signs_key=key, precision="highest")
    return jnp.moveaxis(moved, -1, axis), int(block)


def quantize(x, format, *, axis=-1, block_size=None, scale_dtype=None, stochastic_rounding_key=None,
             rotate=None, implementation=None):
    """Quantize ``x`` into a `QArray`.

    Args:
      x: float32/bfloat16/float16 array.
      format: ``"int8"``, ``"int8_asym"``, ``"int4"``, ``"int4_asym"``,
        ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"mxfp8_e4m3"`` (alias ``"mxfp8"``),
        ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
      axis: the quantized axis (the contraction axis of a matmul operand:
        -1 for activations ``[M, K]``, 0 for weights ``[K, N]``). 4-bit codes
        are packed along it and 1-D blocks lie along it.
      block_size: ``None`` (the format's default: per channel for int8/fp8,
        128 for int4, 32 for MX, 16 for NVFP4), ``"tensor"``, ``"channel"``
        (one scale per slice along ``axis``), an int (blocks of that many
        along ``axis``; a trailing partial block is treated as zero-padded), or
        a pair ``(rows, cols)`` of 2-D blocks over the last two dimensions
        (``(128, 128)`` DeepSeek-V3 fp8 weights, ``(16, 16)`` NVFP4 weights).
        MX formats take only 32, NVFP4 only 16 or (16, 16).
      scale_dtype: float32 (default), bfloat16, float16 or float8_e8m0fnu
        (power-of-two scales rounded up) for int/fp8 formats; MX (E8M0) and
        NVFP4 (E4M3) scales are fixed.
      stochastic_rounding_key: a JAX PRNG key: round elements stochastically
        (unbiased) instead of to nearest-even; scales are unchanged.
      rotate: apply a normalized Hadamard transform along ``axis`` before
        quantizing: ``True`` (the whole axis), an int block size (16–256 for
        the Triton kernel), or ``(block_size, random_signs_key)``. The
        rotation is recorded in ``QArray.rotation``; `dequantize` returns the
        rotated values (undo with ``hadamard_transform(..., inverse=True)``).
        Rotate both matmul operands with the same block and key: ``(x Rᵀ)(R w) = x w``.
      implementation: ``None`` (the Mosaic TPU kernel on a TPU / Triton on a
        GPU for 1-D blocks along the last axis, else XLA), ``"mosaic_tpu"``,
        ``"triton"`` or ``"xla"``.

    Returns:
      A `QArray` (see `stellax.ops.quant.qarray` for the layout).
    """
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    fmt = F.get_format(format)
    axis = checks.normalize_axis("axis", axis, x.ndim)
    if 0 in x.shape:
        raise ValueError(f"x: expected a non-empty array (a QArray has positive sizes), got shape {tuple(x.shape)}")
    x, rotation = _rotate(x, axis, rotate)
    block_shape = resolve_block_shape(fmt, x.shape, axis, block_size)
    return quantize_op(x, stochastic_rounding_key, format=fmt.name, axis=axis, block_shape=block_shape,
                       scale_dtype=scale_dtype, rotation=rotation, implementation=implementation)
