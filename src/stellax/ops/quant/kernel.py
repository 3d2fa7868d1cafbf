"""Dequantizing `QArray` tiles inside Pallas kernels (for any op family).

Outside the kernel, `kernel_operands` turns a `QArray` into plain arrays in a
kernel-friendly layout; inside, `decode_codes` / `decode_packed_pairs` /
`decode_scale` turn loaded tiles into float32 values. All helpers are
jnp-only (no gathers, no lookup tables, no 4-bit dtypes), lower through the
Pallas Triton backend and run in interpret mode. `quantized_matmul`'s kernel
(`triton_matmul.py`) is written with them.

Recipe for a kernel that contracts over the quantized axis (``w [K, N]``,
``axis=0``; for a stacked MoE weight ``[E, K, N]`` with ``axis=1`` index the
expert first)::

    ops = kernel_operands(w)              # outside the kernel
    # in the K loop, step k0 .. k0+bk (bk divides ops.group, so one scale row):
    codes = load(ops.values tile)         # [bk, bn] (or [bk/2, bn] bytes if ops.packed)
    vals = decode_codes(codes, ops.format)                     # unpacked formats
    vals = decode_packed_pairs(codes.T, ops.format)            # packed: [bn, bk], K interleaved back
    vals = vals - zero_point_row          # ops.zero_points[k0 // ops.group, n-tile] if present
    s = decode_scale(load(ops.scales[k0 // ops.group, n-tile]))
    acc += dot(x_tile, vals.astype(x.dtype)) * s                # scale constant over the step's K
    ...
    y = acc * ops.tensor_scale[0]         # NVFP4 only, in the epilogue
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import formats as F
from .qarray import QArray


@dataclasses.dataclass(frozen=True)
class KernelOperands:
    """A `QArray` as kernel inputs.

    Attributes:
      values: the stored codes (int8, float8_e4m3fn/e5m2, or uint8 with two
        4-bit codes per byte along ``axis``).
      scales: per-block scales with the blocks of every non-quantized
        dimension expanded to per-element (so a tile indexes them like the
        values), and the quantized axis kept at one row per block: for
        ``w [K, N]`` with ``axis=0`` it is ``[ceil(K / group), N]``. E8M0 scales
        are given as their uint8 codes; bf16/f16 scales as float32; E4M3 and
        float32 unchanged.
      zero_points: int8 with the layout of ``scales``, or ``None``.
      tensor_scale: float32 ``[1]`` or ``None``.
      format: the format name; ``group``: the block length along ``axis``
        (the whole axis when per-channel / per-tensor); ``packed``: 4-bit.
    """

    values: jax.Array
    scales: jax.Array
    zero_points: jax.Array | None
    tensor_scale: jax.Array | None
    format: str
    axis: int
    group: int
    packed: bool


def _expand_other_dims(s, q: QArray):
    for d, b in enumerate(q.block_shape):
        if d == q.axis or b == 1 and s.shape[d] == q.shape[d]:
            continue
        s = jnp.repeat(s, b, axis=d, total_repeat_length=s.shape[d] * b)
        s = jax.lax.slice_in_dim(s, 0, q.shape[d], axis=d)
    return s


def kernel_operands(q: QArray) -> KernelOperands:
    """The arrays a kernel reads for ``q`` (see `KernelOperands`)."""
    s = q.scales
    if np.dtype(s.dtype) == np.dtype(jnp.float8_e8m0fnu):  # codes before any reshape: see F.e8m0_from_codes
        s = jax.lax.bitcast_convert_type(s, jnp.uint8)
    s = _expand_other_dims(s, q)
    if np.dtype(s.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        s = s.astype(jnp.float32)
    zp = None if q.zero_points is None else _expand_other_dims(q.zero_points, q)
    ts = None if q.tensor_scale is None else q.tensor_scale.astype(jnp.float32).reshape(1)
    return KernelOperands(q.values, s, zp, ts, q.format, q.axis, q.block_shape[q.axis], q.spec.packed)


def decode_scale(s):
    """Loaded scales → float32: uint8 tiles are E8M0 codes (0xFF → NaN)."""
    if jnp.dtype(s.dtype) == jnp.uint8:
        return F.e8m0_to_float(s)
    return s.astype(jnp.float32)


def decode_codes(codes, format: str):
    """Unpacked element codes (int8 / fp8 / float32 tiles) → float32 values."""
    del format
    return codes.astype(jnp.float32)


def decode_nibbles(nibbles, format: str):
    """4-bit codes (int32/uint8 in [0, 16)) → float32 values of ``format``."""
    if F.get_format(format).element.kind == "int":
        return F.int4_decode(nibbles).astype(jnp.float32)
    return F.e2m1_decode(nibbles)


def decode_packed_pairs(tile, format: str):
    """Bytes ``[..., n]`` whose last axis is the packed axis → float32
    ``[..., 2n]`` in element order (low nibble first). Uses a last-axis
    join + reshape, the form Triton supports: load a ``[bk/2, bn]`` weight
    tile, pass ``tile.T`` and contract the result's last axis."""
    t = tile.astype(jnp.int32)
    lo = decode_nibbles(t & 0xF, format)
    hi = decode_nibbles((t >> 4) & 0xF, format)
    out = jnp.stack([lo, hi], axis=-1)
    return out.reshape(*tile.shape[:-1], tile.shape[-1] * 2)
