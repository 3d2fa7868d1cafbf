"""What the quant ops share: block-shape resolution, the allowed scale dtypes,
the XLA quantize path (also used to build the examples), byte counts and the
flattening of `quantized_matmul` operands into named `Call` entries."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call
from ...core.pallas import nbytes
from . import formats as F
from .qarray import QArray, qarray_fields
from .reference import quantize_reference

SCALE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e8m0fnu)


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


@functools.partial(jax.jit, static_argnames=("fmt", "block_shape", "axis", "scale_dtype", "rotation"))
def quantize_xla(x, key, *, fmt: str, block_shape, axis: int, scale_dtype: str | None, rotation: int | None):
    """``x`` (float, any shape) → `QArray` by the golden formulas (`reference.quantize_reference`).

    ``key``: a PRNG key for stochastic rounding (uniform ``[0, 1)`` noise of
    ``x``'s shape) or ``None`` (round to nearest even); ``scale_dtype``: a dtype
    name or ``None`` (the format's); ``rotation`` is only recorded.
    """
    noise = None if key is None else jax.random.uniform(key, x.shape, jnp.float32)
    sd = None if scale_dtype is None else jnp.dtype(scale_dtype)
    return quantize_reference(x, fmt, block_shape, axis, scale_dtype=sd, noise=noise, rotation=rotation)


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
