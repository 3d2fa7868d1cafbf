"""What the quant ops share: the argument checks of the four ops (into a `Call`),
block-shape resolution, the allowed scale dtypes, byte counts, and the flattening of
`quantized_matmul` operands into named `Call` entries and back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.config import is_power_of_two
from ...core.pallas import nbytes
from ...core.precision import resolve_precision
from . import formats as F
from .qarray import QArray, qarray_fields, qarray_from_call

SCALE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e8m0fnu)
#: `quantized_matmul`'s weight formats (float x) and (x, w) format pairs; its output dtypes.
WEIGHT_FORMATS = ("int8", "int8_asym", "int4", "int4_asym", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2",
                  "mxfp4", "nvfp4")
PAIRS = {("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "fp8_e5m2"), ("fp8_e5m2", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"),
         ("int8", "int8"), ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e5m2"),
         ("mxfp8_e4m3", "mxfp8_e5m2"), ("mxfp8_e5m2", "mxfp8_e4m3")}
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def resolve_block_shape(fmt: F.Format, shape, axis: int, block_size) -> tuple[int, ...]:
    """``block_size`` → one block size per dimension of ``shape``.

    Args:
      fmt: the format (its ``default_block`` replaces ``None``; its ``blocks``,
        when set, are the only sizes allowed).
      shape: the logical shape of the array; ``axis``: the quantized axis.
      block_size: ``None`` | ``"tensor"`` | ``"channel"`` | an int (1-D blocks
        along ``axis``) | ``(rows, cols)`` (2-D blocks over the last two
        dimensions); sizes are capped at the dimension.

    Returns:
      ``block_shape`` (``len(shape)`` ints).
    """
    ndim = len(shape)
    if block_size is None:
        block_size = fmt.default_block
    if fmt.blocks is not None and block_size not in fmt.blocks and not (
            isinstance(block_size, list) and tuple(block_size) in fmt.blocks):
        raise ValueError(f"block_size: format {fmt.name} takes blocks of {list(fmt.blocks)}, got {block_size!r}")
    if isinstance(block_size, str):
        if block_size == "tensor":
            return tuple(shape)
        if block_size == "channel":
            out = [1] * ndim
            out[axis] = shape[axis]
            return tuple(out)
        raise ValueError(f"block_size: expected None, 'tensor', 'channel', an int or a pair of ints, got {block_size!r}")
    if _is_int(block_size):
        if block_size < 1:
            raise ValueError(f"block_size: expected a positive int, got {block_size}")
        out = [1] * ndim
        out[axis] = min(int(block_size), shape[axis])
        return tuple(out)
    if isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(
            _is_int(b) and b >= 1 for b in block_size):
        if ndim < 2:
            raise ValueError(f"block_size: 2-D blocks {tuple(block_size)} need a rank >= 2 input, got rank {ndim}")
        if axis < ndim - 2:
            raise ValueError(f"block_size: 2-D blocks cover the last two dimensions; axis must be one of them, "
                             f"got axis {axis} for rank {ndim}")
        return tuple([1] * (ndim - 2) + [min(int(block_size[0]), shape[-2]), min(int(block_size[1]), shape[-1])])
    raise ValueError(f"block_size: expected None, 'tensor', 'channel', an int or a pair of ints, got {block_size!r}")


def array_bytes(call: Call) -> float:
    """Bytes of every array operand of ``call`` (absent ones count 0)."""
    return float(sum(nbytes(a) for a in call.arrays.values()))


def flatten_operands(x, w) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of `quantized_matmul_op` for operands ``x``, ``w``.

    ``x``: a float array ``[..., K]`` or a `QArray` (fields prefixed ``x_``);
    ``w``: a `QArray` ``[K, N]`` (fields prefixed ``w_``). A float ``x`` fills
    ``x_values`` and leaves the other ``x_`` arrays ``None`` (no ``x_`` options).
    """
    if not isinstance(w, QArray):
        raise TypeError(f"w: expected a QArray (quantize the weights with axis=0), got {type(w).__name__}; "
                        f"a float w with a QArray x is not supported (dequantize x or quantize w)")
    wa, wo = qarray_fields(w, "w_")
    if isinstance(x, QArray):
        xa, xo = qarray_fields(x, "x_")
    else:
        xa = {"x_values": x, "x_scales": None, "x_zero_points": None, "x_tensor_scale": None}
        xo = {}
    arrays = {**xa, **wa}
    return tuple(arrays.values()), {**xo, **wo}


def matmul_operands(call: Call):
    """``(x, w)`` of a checked `quantized_matmul` call: ``w`` a `QArray`, ``x`` a float array or a `QArray`."""
    w = qarray_from_call(call, "w_")
    x = call.x_values if call.x_format is None else qarray_from_call(call, "x_")
    return x, w


# -- argument checks ------------------------------------------------------------------------
def require_quantizable(x, format, axis):
    """``(x, format, axis)`` checked for quantizing: ``x`` float, rank >= 1, non-empty; the
    `Format`; ``axis`` normalized."""
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    fmt = F.get_format(format)
    axis = checks.normalize_axis("axis", axis, x.ndim)
    if 0 in x.shape:
        raise ValueError(f"x: expected a non-empty array (a QArray has positive sizes), got shape {tuple(x.shape)}")
    return x, fmt, axis


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
    x, fmt, axis = require_quantizable(x, format, axis)
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


def check_dequantize(values, scales, zero_points=None, tensor_scale=None, *, format, shape, block_shape, axis,
                     dtype="float32", rotation=None) -> Call:
    """Checked `dequantize_op` arguments: the `QArray` fields (validated as a
    `QArray`) and the output ``dtype`` (float32/bfloat16/float16)."""
    q = QArray(values, scales, zero_points, tensor_scale, format=format, shape=shape, block_shape=block_shape,
               axis=axis, rotation=rotation)
    dtype = np.dtype(dtype)
    if dtype not in [np.dtype(d) for d in checks.FLOAT_DTYPES]:
        raise TypeError(f"dtype: expected one of float32/bfloat16/float16, got {dtype.name}")
    return Call({"values": values, "scales": scales, "zero_points": zero_points, "tensor_scale": tensor_scale},
                {"format": q.format, "shape": q.shape, "block_shape": q.block_shape, "axis": q.axis,
                 "dtype": dtype.name, "rotation": rotation})


def check_hadamard(x, signs=None, *, block=None, inverse=False, precision=None) -> Call:
    """Checked `hadamard_op` arguments: ``x [..., n]`` float, ``block`` a power
    of two dividing ``n`` (default ``n``), ``signs`` ``[block]`` or ``None``."""
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    n = x.shape[-1]
    block = n if block is None else block
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"block_size: expected an int, got {type(block).__name__}")
    block = int(block)
    if not is_power_of_two(block):
        raise ValueError(f"block_size: the Walsh–Hadamard transform needs a power-of-two size, got {block}"
                         + (" (the last axis; pass block_size=a power of two dividing it)" if block == n else ""))
    if n % block:
        raise ValueError(f"block_size: {block} must divide the last axis (size {n})")
    if signs is not None:
        checks.require_shape("random signs", signs, (block,), "block_size")
    return Call({"x": x, "signs": signs},
                {"block": block, "inverse": bool(inverse), "precision": resolve_precision(precision)})


def check_quantized_matmul(x_values, x_scales, x_zero_points, x_tensor_scale, w_values, w_scales, w_zero_points,
                           w_tensor_scale, *, x_format=None, x_shape=None, x_block_shape=None, x_axis=None,
                           x_rotation=None, w_format, w_shape, w_block_shape, w_axis, w_rotation=None,
                           preferred_element_type="bfloat16", precision=None) -> Call:
    """Checked `quantized_matmul_op` arguments: the `QArray` fields of ``w``
    (``w_`` prefix) and of ``x`` (``x_``; only ``x_values`` for a float ``x``),
    see `base.flatten_operands`; the options gain ``m``, ``n``, ``k`` and the
    K blocks of in-loop scales ``x_group_k`` / ``w_group_k`` (``None``: one
    scale along K)."""
    w = QArray(w_values, w_scales, w_zero_points, w_tensor_scale, format=w_format, shape=w_shape,
               block_shape=w_block_shape, axis=w_axis, rotation=w_rotation)
    if w.ndim != 2:
        raise ValueError(f"w: expected a rank-2 QArray [K, N], got shape {w.shape}")
    if w.axis != 0:
        raise ValueError(f"w: expected a QArray quantized along axis 0 (the contraction axis K of [K, N]), "
                         f"got axis {w.axis}; quantize the weights with axis=0")
    k, n = w.shape
    if x_format is None:
        x = checks.require_float("x", x_values)
        if x.ndim < 1 or x.shape[-1] != k:
            raise ValueError(f"x: expected shape [..., {k}] (K = w.shape[0]), got {tuple(x.shape)}")
        if w.format not in WEIGHT_FORMATS:
            raise ValueError(f"quantized_matmul: unsupported weight format {w.format}")
        m = int(np.prod(x.shape[:-1]))
        x_group = None
        if w.rotation is not None:
            raise ValueError("quantized_matmul: w was quantized with rotate=...; rotate x the same way "
                             "(quantize it with the same rotate, or hadamard_transform it) and pass a QArray x")
    else:
        xq = QArray(x_values, x_scales, x_zero_points, x_tensor_scale, format=x_format, shape=x_shape,
                    block_shape=x_block_shape, axis=x_axis, rotation=x_rotation)
        if (xq.format, w.format) not in PAIRS:
            raise ValueError(f"quantized_matmul: unsupported pair x={xq.format} × w={w.format}; supported: weight-only "
                             f"(float x, w in {list(WEIGHT_FORMATS)}) or {sorted(PAIRS)}")
        if xq.ndim != 2 or xq.axis != 1:
            raise ValueError(f"x: expected a rank-2 QArray [M, K] quantized along axis 1, got shape {xq.shape} "
                             f"axis {xq.axis}")
        if xq.shape[1] != k:
            raise ValueError(f"x: expected K = {k} (w.shape[0]), got shape {xq.shape}")
        if xq.rotation != w.rotation:
            raise ValueError(f"quantized_matmul: x and w must share a rotation, got x.rotation={xq.rotation} "
                             f"w.rotation={w.rotation}")
        m = xq.shape[0]
        x_group = xq.block_shape[1] if xq.scales.shape[1] > 1 else None
    dtype = np.dtype(preferred_element_type)
    if dtype not in [np.dtype(d) for d in OUT_DTYPES]:
        raise TypeError(f"preferred_element_type: expected float32/bfloat16/float16, got {dtype.name}")
    w_group = w.block_shape[0] if w.scales.shape[0] > 1 else None
    arrays = {"x_values": x_values, "x_scales": x_scales, "x_zero_points": x_zero_points,
              "x_tensor_scale": x_tensor_scale, "w_values": w_values, "w_scales": w_scales,
              "w_zero_points": w_zero_points, "w_tensor_scale": w_tensor_scale}
    options = {"x_format": x_format, "x_shape": None if x_shape is None else tuple(x_shape),
               "x_block_shape": None if x_block_shape is None else tuple(x_block_shape), "x_axis": x_axis,
               "x_rotation": x_rotation, "w_format": w.format, "w_shape": w.shape, "w_block_shape": w.block_shape,
               "w_axis": w.axis, "w_rotation": w.rotation, "preferred_element_type": dtype.name,
               "m": m, "n": n, "k": k, "x_group_k": x_group, "w_group_k": w_group,
               "precision": resolve_precision(precision)}
    return Call(arrays, options)
