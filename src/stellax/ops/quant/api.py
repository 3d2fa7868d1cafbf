"""Public quantization API: `quantize`, `dequantize`, `hadamard_transform`
(registered ops) — `quantized_matmul` lives in `matmul.py`."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Example, Implementation, Op, register
from ...core import checks
from ...core.config import is_power_of_two
from . import formats as F
from . import hadamard as H
from .configs import (DequantConfig, HadamardConfig, QuantizeConfig, dequant_heuristic, dequant_space,
                      hadamard_heuristic, hadamard_space, quantize_heuristic, quantize_space)
from .qarray import QArray, scale_shape
from .reference import dequantize_reference, quantize_reference

SCALE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e8m0fnu)


# -- block shapes ----------------------------------------------------------------------


def resolve_block_shape(fmt: F.Format, shape, axis: int, block_size) -> tuple[int, ...]:
    """``block_size`` (None | "tensor" | "channel" | int | (rows, cols)) → a
    block size per dimension (capped at the dimension)."""
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
    if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool):
        if block_size < 1:
            raise ValueError(f"block_size: expected a positive int, got {block_size}")
        out = [1] * ndim
        out[axis] = min(int(block_size), shape[axis])
        return tuple(out)
    if isinstance(block_size, (tuple, list)) and len(block_size) == 2 and all(
            isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b >= 1 for b in block_size):
        if ndim < 2:
            raise ValueError(f"block_size: 2-D blocks {tuple(block_size)} need a rank >= 2 input, got rank {ndim}")
        if axis < ndim - 2:
            raise ValueError(f"block_size: 2-D blocks cover the last two dimensions; axis must be one of them, "
                             f"got axis {axis} for rank {ndim}")
        return tuple([1] * (ndim - 2) + [min(int(block_size[0]), shape[-2]), min(int(block_size[1]), shape[-1])])
    raise ValueError(f"block_size: expected None, 'tensor', 'channel', an int or a pair of ints, got {block_size!r}")


# -- quantize op -----------------------------------------------------------------------


def _check_quantize(x, key=None, *, format="int8", axis=-1, block_shape=None, scale_dtype=None,
                    rotation=None) -> Call:
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    fmt = F.get_format(format)
    axis = checks.normalize_axis("axis", axis, x.ndim)
    if block_shape is None:
        block_shape = resolve_block_shape(fmt, x.shape, axis, None)
    block_shape = tuple(int(b) for b in block_shape)
    if len(block_shape) != x.ndim:
        raise ValueError(f"block_shape: expected {x.ndim} sizes, got {block_shape}")
    if scale_dtype is not None:
        if fmt.scale != "float":
            raise ValueError(f"scale_dtype: format {fmt.name} has fixed {fmt.scale} scales; pass None, "
                             f"got {np.dtype(scale_dtype).name}")
        if np.dtype(scale_dtype) not in [np.dtype(d) for d in SCALE_DTYPES]:
            raise ValueError(f"scale_dtype: expected one of {[np.dtype(d).name for d in SCALE_DTYPES]}, "
                             f"got {np.dtype(scale_dtype).name}")
        scale_dtype = np.dtype(scale_dtype).name
    if key is not None and fmt.element.kind not in ("float", "int"):
        raise ValueError("stochastic_rounding_key: unsupported for this format")
    return Call({"x": x, "key": key}, {"format": fmt.name, "axis": axis, "block_shape": block_shape,
                                       "scale_dtype": scale_dtype, "rotation": rotation})


@functools.partial(jax.jit, static_argnames=("fmt", "block_shape", "axis", "scale_dtype", "rotation"))
def _quantize_jit(x, key, *, fmt, block_shape, axis, scale_dtype, rotation):
    noise = None if key is None else jax.random.uniform(key, x.shape, jnp.float32)
    sd = None if scale_dtype is None else jnp.dtype(scale_dtype)
    return quantize_reference(x, fmt, block_shape, axis, scale_dtype=sd, noise=noise, rotation=rotation)


def _quantize_run(call: Call, config=None):
    del config
    return _quantize_jit(call.x, call.key, fmt=call.format, block_shape=call.block_shape, axis=call.axis,
                         scale_dtype=call.scale_dtype, rotation=call.rotation)


def _quantize_bytes(call: Call) -> float:
    fmt = F.get_format(call.format)
    n = float(np.prod(call.x.shape))
    scales = float(np.prod(scale_shape(call.x.shape, call.block_shape)))
    return n * np.dtype(call.x.dtype).itemsize + n * fmt.element.bits / 8 + scales * 4


def _quantize_flops(call: Call) -> float:
    return float(np.prod(call.x.shape)) * 6


_EXAMPLE_FORMATS = (("int8", "channel"), ("int8_asym", 64), ("int4", 32), ("fp8_e4m3", (128, 128)),
                    ("fp8_e5m2", "tensor"), ("mxfp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16))


def _quantize_examples(dtype):
    out = []
    for i, (name, block) in enumerate(_EXAMPLE_FORMATS):
        x = jax.random.normal(jax.random.PRNGKey(i), (37, 200), jnp.float32).astype(dtype)
        fmt = F.get_format(name)
        bs = resolve_block_shape(fmt, x.shape, 1, block)
        out.append(Example(f"{name} block={block} x=37x200", (x,), {"format": name, "axis": -1, "block_shape": bs}))
    return out


def _quantize_benchmarks(platform):
    big = platform.backend == "gpu"
    shape = (8192, 8192) if big else (512, 1024)
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    out = []
    for name, block in (("int8", "channel"), ("fp8_e4m3", 128), ("mxfp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16)):
        fmt = F.get_format(name)
        out.append(Example(f"{name} {shape}", (x,), {"format": name, "axis": -1,
                                                    "block_shape": resolve_block_shape(fmt, shape, 1, block)}))
    return out


BLOCK_KERNEL_FORMATS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")


def _quantize_requirements(call: Call):
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


def _quantize_triton(call: Call, config):
    from . import triton as kernels
    fmt = F.get_format(call.format)
    x = call.x
    shape = x.shape
    rows = int(np.prod(shape[:-1]))
    if not fmt.is_mx:
        g = call.block_shape[-1]
        config = config if config.block_k % g == 0 else config.replace(block_k=max(g, config.block_k))
        values, scales = kernels.block_quantize(x.reshape(rows, shape[-1]), fmt=fmt.name, group=g, config=config)
        values = values.reshape(*shape[:-1], values.shape[-1])
        if fmt.element.kind == "float":
            values = jax.lax.bitcast_convert_type(values, fmt.element.dtype)
        return QArray(values, scales.reshape(*shape[:-1], scales.shape[-1]), format=fmt.name, shape=shape,
                      block_shape=call.block_shape, axis=call.axis, rotation=call.rotation, _validate=False)
    values, codes = kernels.mx_quantize(x.reshape(rows, shape[-1]), fmt=fmt.name, config=config)
    values = values.reshape(*shape[:-1], values.shape[-1])
    if not fmt.packed:
        values = jax.lax.bitcast_convert_type(values, fmt.element.dtype)
    scales = jax.lax.bitcast_convert_type(codes, jnp.float8_e8m0fnu).reshape(*shape[:-1], codes.shape[-1])
    return QArray(values, scales, format=fmt.name, shape=shape, block_shape=call.block_shape, axis=call.axis,
                  rotation=call.rotation, _validate=False)


quantize_op = register(Op(
    "quantize",
    family="quant",
    check=_check_quantize,
    reference=lambda call: _quantize_run(call),
    implementations=[
        Implementation("triton", _quantize_triton, backend="triton", config_type=QuantizeConfig,
                       heuristic=quantize_heuristic, space=quantize_space, requirements=_quantize_requirements),
        Implementation("xla", _quantize_run)],
    flops=_quantize_flops,
    bytes_accessed=_quantize_bytes,
    examples=_quantize_examples,
    benchmarks=_quantize_benchmarks,
))


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
      implementation: ``None`` or ``"xla"``.

    Returns:
      A `QArray` (see `stellax.ops.quant.qarray` for the layout).
    """
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    fmt = F.get_format(format)
    axis = checks.normalize_axis("axis", axis, x.ndim)
    rotation = None
    if rotate is not None and rotate is not False:
        block, key = rotate, None
        if isinstance(rotate, tuple):
            if len(rotate) != 2:
                raise ValueError(f"rotate: expected True, an int or (block_size, key), got {rotate!r}")
            block, key = rotate
        if block is True:
            block = x.shape[axis]
        moved = jnp.moveaxis(x, axis, -1)
        moved = hadamard_transform(moved, block_size=block, random_signs_key=key)
        x = jnp.moveaxis(moved, -1, axis)
        rotation = int(block)
    block_shape = resolve_block_shape(fmt, x.shape, axis, block_size)
    return quantize_op(x, stochastic_rounding_key, format=fmt.name, axis=axis, block_shape=block_shape,
                       scale_dtype=scale_dtype, rotation=rotation, implementation=implementation)


# -- dequantize op -------------------------------------------------------------------


def _check_dequantize(values, scales, zero_points=None, tensor_scale=None, *, format, shape, block_shape, axis,
                      dtype="float32", rotation=None) -> Call:
    q = QArray(values, scales, zero_points, tensor_scale, format=format, shape=shape, block_shape=block_shape,
               axis=axis, rotation=rotation)
    dtype = np.dtype(dtype)
    if dtype not in [np.dtype(d) for d in checks.FLOAT_DTYPES]:
        raise TypeError(f"dtype: expected one of float32/bfloat16/float16, got {dtype.name}")
    return Call({"values": values, "scales": scales, "zero_points": zero_points, "tensor_scale": tensor_scale},
                {"format": q.format, "shape": q.shape, "block_shape": q.block_shape, "axis": q.axis,
                 "dtype": dtype.name, "rotation": rotation})


def qarray_of(call: Call, prefix: str = "") -> QArray:
    a, o = call.arrays, call.options
    return QArray(a[prefix + "values"], a[prefix + "scales"], a[prefix + "zero_points"], a[prefix + "tensor_scale"],
                  format=o[prefix + "format"], shape=o[prefix + "shape"], block_shape=o[prefix + "block_shape"],
                  axis=o[prefix + "axis"], rotation=o.get(prefix + "rotation"), _validate=False)


_dequantize_jit = jax.jit(dequantize_reference, static_argnums=(1,))


def _dequantize_run(call: Call, config=None):
    del config
    return _dequantize_jit(qarray_of(call), jnp.dtype(call.dtype))


def _dequantize_bytes(call: Call) -> float:
    total = 0.0
    for a in call.arrays.values():
        if a is not None:
            total += float(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
    return total + float(np.prod(call.shape)) * np.dtype(call.dtype).itemsize


def _flat(q: QArray):
    return ((q.values, q.scales, q.zero_points, q.tensor_scale),
            {"format": q.format, "shape": q.shape, "block_shape": q.block_shape, "axis": q.axis,
             "rotation": q.rotation})


def _dequantize_examples(dtype):
    out = []
    for ex in _quantize_examples(jnp.float32):
        q = quantize_op(*ex.args, **ex.kwargs)
        args, kw = _flat(q)
        out.append(Example(ex.label, args, {**kw, "dtype": np.dtype(dtype).name}))
    return out


def _dequantize_benchmarks(platform):
    out = []
    for ex in _quantize_benchmarks(platform):
        x = jnp.zeros(ex.args[0].shape, jnp.float32)
        q = jax.eval_shape(lambda x: quantize_op(x, **ex.kwargs), x)
        args, kw = _flat(q)
        out.append(Example(ex.label, args, {**kw, "dtype": "bfloat16"}))
    return out


def _dequantize_requirements(call: Call):
    ndim = len(call.shape)
    if call.axis != ndim - 1 or any(b != 1 for b in call.block_shape[:-1]):
        return ("the Triton dequantize kernel takes 1-D blocks along the last axis (quantize with axis=-1); "
                f"got axis {call.axis}, block_shape {call.block_shape}")
    g = call.block_shape[-1]
    if -(-call.shape[-1] // g) > 1 and (g & (g - 1)):
        return f"the Triton dequantize kernel needs a power-of-two block along the axis, got {g}"
    return None


def _dequantize_triton(call: Call, config):
    from . import triton as kernels
    from .kernel import kernel_operands
    q = qarray_of(call)
    ops = kernel_operands(q)
    k = q.shape[-1]
    rows = int(np.prod(q.shape[:-1]))
    lead = q.shape[:-1]
    values = ops.values.reshape(rows, ops.values.shape[-1])
    scales = ops.scales.reshape(rows, ops.scales.shape[-1])
    zp = None if ops.zero_points is None else ops.zero_points.reshape(rows, -1)
    out = kernels.dequantize(values, scales, zp, ops.tensor_scale, rows=rows, k=k, group=ops.group,
                             one_block=scales.shape[-1] == 1, fmt=q.format, out_dtype=jnp.dtype(call.dtype),
                             config=config)
    return out.reshape(*lead, k)


dequantize_op = register(Op(
    "dequantize",
    family="quant",
    check=_check_dequantize,
    reference=lambda call: _dequantize_run(call),
    implementations=[
        Implementation("triton", _dequantize_triton, backend="triton", config_type=DequantConfig,
                       heuristic=dequant_heuristic, space=dequant_space, requirements=_dequantize_requirements),
        Implementation("xla", _dequantize_run)],
    flops=lambda call: float(np.prod(call.shape)) * 3,
    bytes_accessed=_dequantize_bytes,
    examples=_dequantize_examples,
    benchmarks=_dequantize_benchmarks,
))


def dequantize(qx: QArray, dtype=jnp.float32, *, implementation=None, config=None):
    """Values of a `QArray`: ``(code - zero_point) * scale * tensor_scale``
    computed in float32, returned in ``dtype`` (float32/bfloat16/float16).

    ``implementation``: ``None`` (the Triton kernel on a GPU when the blocks
    are 1-D along the last axis, else XLA), ``"triton"`` or ``"xla"``;
    ``config``: a `DequantConfig`."""
    if not isinstance(qx, QArray):
        raise TypeError(f"qx: expected a QArray, got {type(qx).__name__}")
    args, kw = _flat(qx)
    return dequantize_op(*args, **kw, dtype=np.dtype(dtype).name, implementation=implementation, config=config)


# -- hadamard op ---------------------------------------------------------------------


def _check_hadamard(x, signs=None, *, block=None, inverse=False) -> Call:
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
    return Call({"x": x, "signs": signs}, {"block": block, "inverse": bool(inverse)})


_hadamard_xla_jit = jax.jit(H.hadamard_xla, static_argnames=("block", "inverse"))


def _hadamard_xla(call: Call, config=None):
    del config
    return _hadamard_xla_jit(call.x, block=call.block, signs=call.signs, inverse=call.inverse)


def _hadamard_triton(call: Call, config):
    from . import triton as kernels
    return kernels.hadamard(call.x, call.signs, block=call.block, inverse=call.inverse, config=config)


def _hadamard_requirements(call: Call):
    if not 16 <= call.block <= 256:
        return f"the Triton Hadamard kernel takes blocks of 16–256, got {call.block}"
    return None


def _hadamard_examples(dtype):
    out = []
    for i, (shape, block, signed, inverse) in enumerate((((5, 64), None, False, False), ((3, 7, 256), 32, True, False),
                                                         ((11, 512), 128, True, True), ((4, 16), 16, False, True))):
        kx, ks = jax.random.split(jax.random.PRNGKey(100 + i))
        x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
        b = shape[-1] if block is None else block
        signs = H.random_signs(ks, b) if signed else None
        out.append(Example(f"x={shape} block={b} signs={signed} inverse={inverse}", (x, signs),
                           {"block": b, "inverse": inverse}))
    return out


def _hadamard_benchmarks(platform):
    rows = 16384 if platform.backend == "gpu" else 256
    return [Example(f"x=({rows},4096) block={b}", (jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16), None),
                    {"block": b}) for b in (32, 128, 256)]


hadamard_op = register(Op(
    "hadamard_transform",
    family="quant",
    check=_check_hadamard,
    reference=lambda call: H.hadamard_reference(call.x, block=call.block, signs=call.signs, inverse=call.inverse),
    implementations=[
        Implementation("triton", _hadamard_triton, backend="triton", config_type=HadamardConfig,
                       heuristic=hadamard_heuristic, space=hadamard_space, requirements=_hadamard_requirements),
        Implementation("xla", _hadamard_xla),
    ],
    flops=lambda call: float(np.prod(call.x.shape)) * math.log2(call.block),
    bytes_accessed=lambda call: 2.0 * float(np.prod(call.x.shape)) * np.dtype(call.x.dtype).itemsize,
    examples=_hadamard_examples,
    benchmarks=_hadamard_benchmarks,
))


def hadamard_transform(x, *, block_size=None, random_signs_key=None, inverse=False, implementation=None,
                       config=None):
    """Normalized fast Walsh–Hadamard transform over the last axis.

    Args:
      x: ``[..., n]`` float32/bfloat16/float16.
      block_size: ``None`` (the whole last axis) or a power of two dividing
        ``n``: the transform is applied to each consecutive block. The Triton
        kernel takes 16–256; other sizes run in XLA. Non-powers of two raise
        ``ValueError``.
      random_signs_key: a PRNG key for random ±1 signs ``d`` (randomized
        Hadamard: ``v → H(d ⊙ v)/√b``); the same key gives the same signs.
      inverse: apply the inverse (``w → d ⊙ (H w)/√b``; without signs the
        transform is its own inverse).
      implementation, config: ``None`` / ``"triton"`` / ``"xla"``; a `HadamardConfig`.

    Returns:
      An array like ``x`` (float32 math inside).
    """
    x = checks.require_float("x", x)
    block = x.shape[-1] if block_size is None else block_size
    signs = None
    if random_signs_key is not None:
        if isinstance(block, (int, np.integer)) and not isinstance(block, bool) and block > 0:
            signs = H.random_signs(random_signs_key, int(block))
    return hadamard_op(x, signs, block=block, inverse=inverse, implementation=implementation, config=config)
