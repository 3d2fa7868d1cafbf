"""torch.Tensor <-> jax.Array exchange over DLPack, both ways, zero-copy.

What happens on each crossing:

* ``to_jax(t)``: ``t`` is detached (no autograd state crosses) and made
  contiguous only when it is not (a strided view is copied once by torch;
  a contiguous tensor is never copied). The DLPack capsule is handed to XLA,
  which wraps the same memory: no host round trip, no copy. A CPU buffer that
  XLA cannot use in place (not 16-byte aligned, e.g. a view at an odd storage
  offset) is copied by XLA on the same device. ``int64`` tensors are narrowed
  to ``int32`` by torch first (JAX runs with 32-bit integers).
* ``to_torch(a)``: the XLA output buffer is exported with DLPack and wrapped
  by ``torch.from_dlpack``: the same memory, no copy.
* CUDA stream order (the DLPack stream protocol, which both sides implement):
  ``to_jax`` asks the torch tensor's ``__dlpack__`` for a capsule *on JAX's
  stream for external-ready events*; torch records an event on its current
  stream and makes that stream wait, so JAX never reads the tensor before the
  torch kernels that write it have finished. ``to_torch`` goes through
  ``torch.from_dlpack``, which passes torch's *current* stream to
  ``jax.Array.__dlpack__``; XLA makes that stream wait on the event of the
  computation that produced the buffer, so torch never reads the output before
  the JAX kernel has finished. Nothing blocks the host. Devices are kept
  (``cuda:i`` <-> JAX GPU device ``i``).
* Formats DLPack cannot carry (``float4_e2m1fn``, ``int4``/``uint4``,
  ``int2``/``uint2``, ``float8_e3m4``/``float8_e4m3``/``float8_e4m3b11fnuz``)
  cross as a `PackedTensor`: a ``uint8`` torch tensor plus the format name and
  the logical shape. Sub-byte values are packed along the last axis, the first
  element in the low bits of each byte (two fp4/int4 values or four int2
  values per byte; the last axis is padded with zeros to a whole byte). 8-bit
  formats are bit-cast one element per byte. ``to_jax(packed)`` unpacks
  exactly (bit-for-bit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

__all__ = ["PackedTensor", "to_jax", "to_torch", "torch_dtype", "torch_struct", "jax_dtype", "pack_jax", "unpack_jax"]

# -- dtype tables ----------------------------------------------------------------
_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.float64: jnp.float64,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name) and hasattr(jnp, _name):
        _TORCH_TO_JAX[getattr(torch, _name)] = getattr(jnp, _name)
_JAX_TO_TORCH = {np.dtype(v): k for k, v in _TORCH_TO_JAX.items()}

#: Bits per element of the formats that cross as packed uint8.
_PACKED_BITS = {"float4_e2m1fn": 4, "int4": 4, "uint4": 4, "int2": 2, "uint2": 2,
                "float8_e3m4": 8, "float8_e4m3": 8, "float8_e4m3b11fnuz": 8}
_UNSIGNED = {2: "uint2", 4: "uint4", 8: "uint8"}


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a JAX/numpy dtype (``TypeError`` if torch has none)."""
    try:
        return _JAX_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype: {np.dtype(dtype).name} has no torch equivalent; it crosses as a PackedTensor") from None


def jax_dtype(dtype: torch.dtype):
    """The JAX dtype of a torch dtype (``TypeError`` if JAX has none)."""
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"dtype: torch {dtype} has no JAX equivalent") from None


def torch_struct(shape, dtype) -> tuple[tuple, torch.dtype]:
    """The torch ``(shape, dtype)`` a JAX array of ``shape``/``dtype`` crosses
    as: the same for the dtypes torch has; ``uint8`` with the last axis
    packed (`PackedTensor`'s layout) for the formats DLPack cannot carry."""
    shape = tuple(int(d) for d in shape)
    name = np.dtype(dtype).name
    if name not in _PACKED_BITS:
        return shape, torch_dtype(dtype)
    bits = _PACKED_BITS[name]
    if bits == 8 or not shape:
        return shape, torch.uint8
    return (*shape[:-1], -(-shape[-1] * bits // 8)), torch.uint8


# -- packed formats ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PackedTensor:
    """A tensor in a format DLPack cannot carry, as packed ``uint8`` bytes.

    Attributes:
      data: ``uint8`` tensor ``[..., ceil(shape[-1] * bits / 8)]``.
      format: the element type's name (``"float4_e2m1fn"``, ``"int4"``, ...).
      shape: the logical shape.
    """

    data: torch.Tensor
    format: str
    shape: tuple

    @property
    def bits(self) -> int:
        return _PACKED_BITS[self.format]

    def to(self, device) -> "PackedTensor":
        return PackedTensor(self.data.to(device), self.format, self.shape)


def _needs_packing(dtype) -> bool:
    return np.dtype(dtype).name in _PACKED_BITS


def pack_jax(a: jax.Array) -> jax.Array:
    """Pack an array of a sub-byte / exotic 8-bit format into ``uint8`` bytes (in JAX)."""
    name = np.dtype(a.dtype).name
    bits = _PACKED_BITS[name]
    raw = jax.lax.bitcast_convert_type(a, getattr(jnp, _UNSIGNED[bits]))
    if bits == 8:
        return raw
    per_byte = 8 // bits
    pad = (-a.shape[-1]) % per_byte
    raw = raw.astype(jnp.uint8)
    if pad:
        raw = jnp.pad(raw, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    raw = raw.reshape(*raw.shape[:-1], raw.shape[-1] // per_byte, per_byte)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    # The fields do not overlap, so their sum is their bitwise OR.
    return jnp.sum(raw << shifts, axis=-1, dtype=jnp.uint8)


def unpack_jax(data: jax.Array, format: str, shape: tuple) -> jax.Array:
    """Inverse of `pack_jax`: ``uint8`` bytes back to ``format`` with ``shape``."""
    bits = _PACKED_BITS[format]
    target = getattr(jnp, format)
    if bits == 8:
        return jax.lax.bitcast_convert_type(data.reshape(shape), target)
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    mask = jnp.uint8((1 << bits) - 1)
    fields = (data[..., None] >> shifts) & mask
    fields = fields.reshape(*data.shape[:-1], data.shape[-1] * per_byte)[..., : shape[-1]]
    fields = fields.reshape(shape).astype(getattr(jnp, _UNSIGNED[bits]))
    return jax.lax.bitcast_convert_type(fields, target)


_pack_jit = jax.jit(pack_jax)
_unpack_jit = jax.jit(unpack_jax, static_argnums=(1, 2))


# -- the crossings ---------------------------------------------------------------------
_DEVICE_CACHE: dict[tuple[str, int], Any] = {}


def _jax_device(t: torch.Tensor):
    key = (t.device.type, t.device.index or 0)
    dev = _DEVICE_CACHE.get(key)
    if dev is None:
        platform = {"cpu": "cpu", "cuda": "gpu"}.get(t.device.type)
        if platform is None:
            raise TypeError(f"tensor: device {t.device} is not supported (cpu or cuda)")
        try:
            dev = jax.devices(platform)[key[1]] if platform == "gpu" else jax.devices("cpu")[0]
        except (RuntimeError, IndexError) as e:
            raise RuntimeError(f"tensor: on {t.device}, but JAX has no matching {platform} device "
                               f"(JAX devices: {jax.devices()}); install a CUDA-enabled jax or move the "
                               f"tensor to the CPU") from e
        _DEVICE_CACHE[key] = dev
    return dev


def to_jax(t, *, copy_if_unaligned: bool = True) -> jax.Array:
    """A torch tensor (or `PackedTensor`) as a `jax.Array` on the same device,
    sharing memory where possible (see the module docstring).

    Goes through the public `jax.dlpack.from_dlpack` (which asks the tensor
    for a capsule on JAX's external-ready stream). ``copy_if_unaligned=False``
    raises ``ValueError`` instead of copying a buffer XLA cannot use in place.
    """
    if isinstance(t, PackedTensor):
        data = to_jax(t.data)
        return _unpack_jit(data, t.format, tuple(t.shape))
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.int64:
        t = t.to(torch.int32)
    if not t.is_contiguous():
        t = t.contiguous()
    _jax_device(t)  # a clear error for a device JAX does not have
    return jax.dlpack.from_dlpack(t, copy=None if copy_if_unaligned else False)


def to_torch(a: jax.Array):
    """A `jax.Array` as a torch tensor on the same device, sharing memory; a
    `PackedTensor` for formats DLPack cannot carry."""
    if _needs_packing(a.dtype):
        return PackedTensor(to_torch(_pack_jit(a)), np.dtype(a.dtype).name, tuple(a.shape))
    return torch.from_dlpack(a)
