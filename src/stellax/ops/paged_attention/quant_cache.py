"""Quantized KV-cache pages: formats, packing, rotation, full-precision windows.

A quantized page pool stores, for the logical pages ``[num_pages, page_size,
K, H]`` (``K`` kv heads; MLA latents have no head axis: ``[num_pages,
page_size, H]``):

* ``data``: the codes. ``int8`` (int8) and ``fp8`` (float8 e4m3) store one
  value per byte; ``int4`` stores one code per ``uint4`` element
  (``data [.., H]``): XLA packs two per byte, lane-dense on a TPU (a
  ``[pages, PS, K, 128]`` uint4 pool is 64 bytes a row, where ``uint8 [..,
  64]`` rows were padded to 128 lanes in HBM), two per byte little end first
  on CPUs and GPUs (the bytes of `pack_codes`; `packed_bytes` is that view).
  ``int2`` packs 4 values per uint8 along ``H``, little end first (byte ``j``
  holds ``x[4j + i]`` in bit field ``i``), so ``data.shape[-1] = H // 4``
  (XLA:TPU has no uint2 layout for a second-minor axis under 16, e.g. 8 kv
  heads, so int2 rows of 128 channels stay 32 bytes padded to 128 lanes there).
  `KVQuant.per_element` is the number of codes per stored element.
* ``scale`` (and ``zero`` for the asymmetric int4/int2): one per group of
  ``group_size`` values along ``group_axis``:

  - ``"head_dim"``: groups of consecutive channels of one token and head,
    ``scale [num_pages, page_size, K, H // group_size]``. ``group_size = H``
    is the per-token-per-head scale (the int8/fp8 default).
  - ``"token"``: groups of ``group_size`` consecutive tokens of one page, per
    channel (KIVI's per-channel key quantization),
    ``scale [num_pages, page_size // group_size, K, H]``.
  - ``"tensor"``: one scale for the whole pool, ``scale []`` (float32; int8 /
    fp8 only). A static, calibrated scale (vLLM's per-layer ``k_scale`` /
    ``v_scale``): `quantize_pages` sets it from the pool's absolute maximum,
    `quantize_with_scale` writes codes with a given one; `update_kv_cache`
    does not re-range it (it raises: write with `quantize_with_scale`).

  Symmetric (int8, fp8):  ``x ≈ code · scale``, ``scale = amax / qmax``.
  Asymmetric (int4, int2): ``x ≈ code · scale + zero``, ``zero = min``,
  ``scale = (max - min) / (2^bits - 1)``, ``code ∈ [0, 2^bits)``.
  Scales are rounded to ``scale_dtype`` *before* the codes are computed, so
  dequantization is exactly what quantization assumed.
* ``part`` (`KVQuant.part`, optional): the codes are one half of a combined
  ``[num_pages, page_size, 2, K, H]`` buffer holding keys (part 0) and values
  (part 1) of every token, as vLLM's pages do; the key and value pools are two
  `QuantizedPages` sharing that ``data`` (read in place, never split or copied).
  Logical shape, `shape`, stays ``[num_pages, page_size, K, H]``.
* ``signs`` (optional rotation): ``±1 [H]``. Values are rotated before
  quantization by ``R x = WHT(signs ⊙ x) / √H`` (random-sign Walsh–Hadamard;
  orthogonal, so ``(R q)·(R k) = q·k``). Outliers concentrated in a few
  channels are spread over all of them, so low-bit groups see a smaller range.
  Attention rotates the query instead of un-rotating keys, and un-rotates the
  output once (``Σ p R v = R Σ p v``). Instead of signs, ``signs`` may hold
  calibrated orthogonal matrices ``[K, H, H]`` (one per KV head; ``[H, H]``
  shared by all heads or a head-less MLA pool): ``R x = R[k] x``, chosen from
  attention statistics by `rotation.calibrate_kv_rotation` (OSCAR class) and
  given to `init_quantized_pages` / `quantize_pages` as ``rotation=``.
* ``window`` (optional, int2/int4 in practice): a full-precision copy of the
  first ``sink_tokens`` and the last ``recent_tokens`` tokens of every
  sequence, ``[max_seqs, sink_tokens + recent_tokens, K, H]``: slot ``p`` for
  positions ``p < sink_tokens``, slot ``sink_tokens + p % recent_tokens`` for
  the recent ring. Attention reads positions in the windows from here and the
  rest from the quantized pages (as OSCAR and KIVI do). Window values are
  stored rotated when rotation is on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: Format name → (bits, symmetric, largest code magnitude / number of levels).
_FORMATS = {
    "int8": (8, True, 127.0),
    "fp8": (8, True, 448.0),
    "fp8_e5m2": (8, True, 57344.0),
    "int4": (4, False, 15.0),
    "int2": (2, False, 3.0),
}
_ALIASES = {"float8_e4m3fn": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8", "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2"}
FORMATS = tuple(_FORMATS)
FP8_FORMATS = ("fp8", "fp8_e5m2")
GROUP_AXES = ("head_dim", "token", "tensor")


def canonical_format(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"format: expected a string, got {type(name).__name__}")
    name = _ALIASES.get(name.lower(), name.lower())
    if name not in _FORMATS:
        raise ValueError(f"format: expected one of {list(FORMATS)} (or {sorted(_ALIASES)}), got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How one cache tensor (keys or values) is quantized (static, hashable).

    Attributes:
      format: ``"int8"``, ``"fp8"`` (e4m3), ``"fp8_e5m2"``, ``"int4"`` or ``"int2"``.
      group_size: values per scale along ``group_axis``; ``None`` means the
        whole head (``H``, per-token-per-head) on ``"head_dim"`` and 32 tokens
        on ``"token"``. Must divide ``H`` (``head_dim``) or the page size
        (``token``).
      group_axis: ``"head_dim"`` (per token, groups of channels),
        ``"token"`` (per channel, groups of tokens within a page: KIVI keys)
        or ``"tensor"`` (one float32 scale for the pool; int8/fp8, no
        ``group_size``).
      scale_dtype: dtype of the stored scales and zero points; ``None`` is
        float32 for int8/fp8 (one per token and head) and float16 for
        int4/int2 (a zero point rounded to bfloat16 would lose too much of a
        large channel offset against a 4-level step).
      rotation: rotate before quantizing: ``False``; ``True`` (or
        ``"hadamard"``): a random-sign Walsh–Hadamard transform (``H`` a power
        of two); ``"calibrated"``: the pool holds calibrated per-head
        matrices (`rotation.calibrate_kv_rotation`), given as ``rotation=`` /
        ``key_rotation=`` / ``value_rotation=`` when the pool is made (a pool
        made with matrices and a spec without rotation gets this value).
      seed: seed of the rotation's signs.
      sink_tokens, recent_tokens: full-precision windows (see the module doc).
      window_dtype: dtype of the windows.
      part: ``None``, or 0 / 1: the pool's codes are the keys (0) / values (1)
        half of a combined ``[num_pages, page_size, 2, K, H]`` buffer (see the
        module doc; ``"tensor"`` scales, no windows or rotation).
      clip: range ratio ``τ`` in ``(0, 1]`` of head-axis groups (OSCAR's clip
        thresholds, fitted by `rotation.calibrate_kv_clip`): each group's
        range is shrunk about its midpoint to ``τ`` times its width
        (asymmetric formats: ``[m - τ(m - lo), m + τ(hi - m)]``, ``m = (lo +
        hi) / 2``; symmetric: ``τ · max |x|``) and values outside it saturate
        at the end codes. Trading the rare extremes' error for a finer step
        lowers the mean error at 2 and 4 bits. ``1.0`` (the default) is the
        plain min/max range.
    """

    format: str = "int8"
    group_size: int | None = None
    group_axis: str = "head_dim"
    scale_dtype: Any = None
    rotation: bool = False
    seed: int = 0
    sink_tokens: int = 0
    recent_tokens: int = 0
    window_dtype: Any = jnp.bfloat16
    part: int | None = None
    clip: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "format", canonical_format(self.format))
        if self.group_axis not in GROUP_AXES:
            raise ValueError(f"KVQuant.group_axis: expected one of {list(GROUP_AXES)}, got {self.group_axis!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                            or self.group_size <= 0):
            raise ValueError(f"KVQuant.group_size: expected a positive int or None, got {self.group_size!r}")
        for name in ("sink_tokens", "recent_tokens", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"KVQuant.{name}: expected an int >= 0, got {value!r}")
        if self.rotation == "hadamard":
            object.__setattr__(self, "rotation", True)
        if not isinstance(self.rotation, bool) and self.rotation != "calibrated":
            raise TypeError(f"KVQuant.rotation: expected a bool, 'hadamard' or 'calibrated', got {self.rotation!r}")
        if self.group_axis == "tensor":
            if self.bits != 8 or self.group_size is not None:
                raise ValueError(f"KVQuant.group_axis: a per-tensor scale is for int8/fp8 codes without "
                                 f"group_size, got format={self.format!r}, group_size={self.group_size!r}")
            if self.scale_dtype is not None and np.dtype(self.scale_dtype) != np.dtype(jnp.float32):
                raise ValueError(f"KVQuant.scale_dtype: a per-tensor scale is float32, got "
                                 f"{np.dtype(self.scale_dtype).name}")
        if self.part is not None and (self.part not in (0, 1) or isinstance(self.part, bool)
                                      or self.group_axis != "tensor" or self.rotation or self.window):
            raise ValueError(f"KVQuant.part: expected None, or 0 (keys) / 1 (values) of a combined buffer with "
                             f"a per-tensor scale, no rotation and no windows; got part={self.part!r}, "
                             f"group_axis={self.group_axis!r}, rotation={self.rotation}, windows={self.window}")
        clip = self.clip
        if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating)) or not 0 < clip <= 1:
            raise ValueError(f"KVQuant.clip: expected a range ratio in (0, 1], got {clip!r}")
        object.__setattr__(self, "clip", float(clip))
        if self.clip != 1.0 and self.group_axis != "head_dim":
            raise ValueError(f"KVQuant.clip: clipping is for head-axis groups (each token's groups are quantized "
                             f"once); group_axis={self.group_axis!r} re-ranges or fixes its scales, so clip must "
                             f"be 1.0, got {self.clip}")
        scale_dtype = self.scale_dtype
        if scale_dtype is None:
            scale_dtype = jnp.float32 if self.symmetric else jnp.float16
        scale_dtype = np.dtype(scale_dtype)
        if scale_dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
            raise ValueError(f"KVQuant.scale_dtype: expected float32, bfloat16 or float16, got {scale_dtype.name}")
        object.__setattr__(self, "scale_dtype", scale_dtype)
        object.__setattr__(self, "window_dtype", np.dtype(self.window_dtype))

    # -- derived ----------------------------------------------------------
    @property
    def bits(self) -> int:
        return _FORMATS[self.format][0]

    @property
    def symmetric(self) -> bool:
        return _FORMATS[self.format][1]

    @property
    def qmax(self) -> float:
        """Largest code magnitude (symmetric) or number of levels - 1."""
        return _FORMATS[self.format][2]

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def per_element(self) -> int:
        """Codes per element of ``data``: 4 for int2 (packed uint8), else 1 (int4 is ``uint4``)."""
        return 4 if self.bits == 2 else 1

    @property
    def storage_dtype(self):
        if self.format == "int4":
            return np.dtype(jnp.uint4)
        if self.format == "int8":
            return np.dtype(jnp.int8)
        if self.format == "fp8":
            return np.dtype(jnp.float8_e4m3fn)
        if self.format == "fp8_e5m2":
            return np.dtype(jnp.float8_e5m2)
        return np.dtype(jnp.uint8)

    @property
    def window(self) -> int:
        return self.sink_tokens + self.recent_tokens

    def group(self, head_dim: int) -> int:
        if self.group_axis == "tensor":
            raise ValueError("update_kv_cache: a per-tensor ('tensor') scale is static (calibrated, e.g. vLLM's "
                             "k_scale / v_scale) and has no groups to re-range; write codes with "
                             "quantize_with_scale")
        if self.group_size is not None:
            return self.group_size
        return head_dim if self.group_axis == "head_dim" else 32

    def check_shape(self, page_size: int, head_dim: int, what: str = "pages") -> None:
        """Raise a ValueError when this format cannot store ``[.., page_size, .., head_dim]``."""
        if self.group_axis == "tensor":
            return
        g = self.group(head_dim)
        if head_dim % self.per_element:
            raise ValueError(f"{what}: {self.format} packs {self.per_element} values per byte; head_dim "
                             f"{head_dim} is not a multiple of {self.per_element}")
        if self.group_axis == "head_dim" and head_dim % g:
            raise ValueError(f"{what}: group_size {g} must divide head_dim {head_dim}")
        if self.group_axis == "token" and page_size % g:
            raise ValueError(f"{what}: per-channel (token-axis) groups of {g} tokens must divide "
                             f"page_size {page_size}")
        if self.rotation is True and head_dim & (head_dim - 1):
            raise ValueError(f"{what}: the Hadamard rotation needs a power-of-two head_dim, got {head_dim}")

    def bytes_per_token(self, head_dim: int, num_heads: int = 1) -> float:
        """Average cache bytes per token (all heads), windows excluded."""
        if self.group_axis == "tensor":
            return float(num_heads * head_dim)
        g = self.group(head_dim)
        data = head_dim / self.per_byte
        per_scale = np.dtype(self.scale_dtype).itemsize * (1 if self.symmetric else 2)
        scales = (head_dim / g if self.group_axis == "head_dim" else head_dim / g) * per_scale
        return float(num_heads * (data + scales))


# -- the Walsh–Hadamard rotation ---------------------------------------------------
def hadamard(x, axis: int = -1):
    """Orthonormal fast Walsh–Hadamard transform along ``axis`` (length a power
    of two): ``WHT(x) / √n``, its own inverse. ``log2(n)`` butterfly stages."""
    x = jnp.moveaxis(jnp.asarray(x), axis, -1)
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: the transformed axis must have a power-of-two length, got {n}")
    lead = x.shape[:-1]
    h = 1
    y = x
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2)
        h *= 2
    y = y.reshape(*lead, n) * jnp.asarray(1.0 / math.sqrt(n), y.dtype)
    return jnp.moveaxis(y, -1, axis)


def rotation_signs(head_dim: int, seed: int = 0):
    """The rotation's random signs: ``±1`` float32 ``[head_dim]``."""
    return jax.random.rademacher(jax.random.PRNGKey(seed), (head_dim,), jnp.float32)


def _head_matrices(rotation, num: int):
    """Per-head matrices ``[num, H, H]`` of ``rotation [K, H, H]`` for ``num``
    heads: ``num = K`` (cache heads) or ``num = K·G`` (query heads; head ``n``
    uses ``R[n // G]``)."""
    k = rotation.shape[0]
    if num == k:
        return rotation
    if num % k:
        raise ValueError(f"rotation: {k} per-head rotations cannot serve {num} heads")
    return jnp.repeat(rotation, num // k, axis=0)


def rotate(x, signs, *, head_axis: int = -2):
    """``R x`` along the last axis (float32 out).

    ``signs`` is the pool's rotation: ``±1 [H]`` (random-sign Hadamard,
    ``R x = WHT(signs ⊙ x) / √H``), or calibrated orthogonal matrices (see
    `rotation`): ``[H, H]`` shared by all heads, or ``[K, H, H]`` per KV head,
    ``x``'s axis ``head_axis`` holding the ``K`` heads (or ``K·G`` query
    heads: head ``n`` uses ``R[n // G]``): ``y_i = Σ_j R[k]_ij x_j``."""
    x = x.astype(jnp.float32)
    r = signs.astype(jnp.float32)
    if r.ndim == 1:
        return hadamard(x * r)
    if r.ndim == 2:
        return jnp.einsum("...j,ij->...i", x, r, precision=jax.lax.Precision.HIGHEST)
    xm = jnp.moveaxis(x, head_axis, -2)
    y = jnp.einsum("...kj,kij->...ki", xm, _head_matrices(r, xm.shape[-2]), precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(y, -2, head_axis)


def unrotate(y, signs, *, head_axis: int = -2):
    """``Rᵀ y`` (the inverse of `rotate`; Hadamard: ``signs ⊙ WHT(y) / √H``)."""
    y = y.astype(jnp.float32)
    r = signs.astype(jnp.float32)
    if r.ndim == 1:
        return hadamard(y) * r
    if r.ndim == 2:
        return jnp.einsum("...i,ij->...j", y, r, precision=jax.lax.Precision.HIGHEST)
    ym = jnp.moveaxis(y, head_axis, -2)
    x = jnp.einsum("...ki,kij->...kj", ym, _head_matrices(r, ym.shape[-2]), precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(x, -2, head_axis)


def pool_rotation(spec: KVQuant, rotation, num_heads: int | None, head_dim: int, what: str = "rotation"):
    """``(spec, signs)`` of a new pool: the array it stores in its ``signs``
    field (the Hadamard signs when ``spec.rotation is True``, the checked
    calibrated ``rotation`` (see `check_rotation`), or None) and its
    spec (``rotation="calibrated"`` when matrices are given)."""
    if rotation is None:
        if spec.rotation == "calibrated":
            raise ValueError(f"{what}: KVQuant(rotation='calibrated') needs the rotation matrices "
                             "[num_kv_heads, head_dim, head_dim] (rotation= / key_rotation= / value_rotation=)")
        return spec, (rotation_signs(head_dim, spec.seed) if spec.rotation else None)
    if spec.rotation is True:
        raise ValueError(f"{what}: a calibrated rotation replaces the random Hadamard one (it already holds a "
                         "Hadamard transform); use it with KVQuant(rotation=False) or 'calibrated'")
    return dataclasses.replace(spec, rotation="calibrated"), check_rotation(what, rotation, num_heads, head_dim)


# -- calibrated rotations ------------------------------------------------------
#: Largest ``max |R Rᵀ - I|`` accepted for a float32 rotation.
ORTHOGONALITY_TOLERANCE = 1e-3


def orthogonality_error(rotation) -> float:
    """``max |R Rᵀ - I|`` over all matrices of ``rotation [..., H, H]``."""
    r = np.asarray(rotation, np.float64)
    eye = np.eye(r.shape[-1])
    return float(np.max(np.abs(np.einsum("...ij,...kj->...ik", r, r) - eye))) if r.size else 0.0


def check_rotation(name: str, rotation, num_heads: int | None, head_dim: int):
    """Validate a cache rotation: float ``[K, H, H]`` (or ``[H, H]``, shared by
    all heads; the only form for a head-less MLA pool, where ``[1, H, H]`` is
    accepted too) and orthogonal (checked when concrete, i.e. outside
    ``jit``). Returns it as a float32 jax array ``[K, H, H]`` / ``[H, H]``."""
    if not hasattr(rotation, "shape") or not hasattr(rotation, "dtype"):
        raise TypeError(f"{name}: expected an array [num_kv_heads, head_dim, head_dim], got "
                        f"{type(rotation).__name__}")
    shape = tuple(rotation.shape)
    if not jnp.issubdtype(rotation.dtype, jnp.floating):
        raise TypeError(f"{name}: expected a floating dtype, got {np.dtype(rotation.dtype).name}")
    if num_heads is None:
        if shape == (1, head_dim, head_dim):
            rotation, shape = rotation[0], (head_dim, head_dim)
        expected = [(head_dim, head_dim)]
    else:
        expected = [(num_heads, head_dim, head_dim), (head_dim, head_dim)]
    if shape not in expected:
        want = " or ".join(str(e) for e in expected)
        raise ValueError(f"{name}: expected shape {want} ([num_kv_heads, head_dim, head_dim] of the cache), "
                         f"got {shape}")
    if not isinstance(rotation, jax.core.Tracer):
        err = orthogonality_error(rotation)
        if not err <= ORTHOGONALITY_TOLERANCE:
            raise ValueError(f"{name}: expected an orthogonal rotation (max |R Rᵀ - I| <= "
                             f"{ORTHOGONALITY_TOLERANCE}), got max |R Rᵀ - I| = {err:.3g}")
    return jnp.asarray(rotation, jnp.float32)


# -- packing -----------------------------------------------------------------------
def pack_codes(codes, bits: int):
    """Unsigned codes ``[..., H]`` (values < 2^bits) → uint8 ``[..., H·bits/8]``."""
    per = 8 // bits
    if per == 1:
        return codes.astype(jnp.uint8)
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = c[..., 0]
    for j in range(1, per):
        out = out | (c[..., j] << jnp.uint8(bits * j))
    return out


def unpack_codes(packed, bits: int):
    """Inverse of `pack_codes`: uint8 ``[..., H·bits/8]`` → uint8 codes ``[..., H]``."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = jnp.uint8((1 << bits) - 1)
    parts = [(packed >> jnp.uint8(bits * j)) & mask for j in range(per)]
    return jnp.stack(parts, axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


# -- quantize / dequantize ---------------------------------------------------------
def quantize_rows(x, spec: KVQuant):
    """Quantize float ``x [..., H]`` (already rotated if the spec rotates)
    with head-axis groups → ``(data [..., H/per_byte], scale [..., H/g],
    zero or None)``."""
    x = x.astype(jnp.float32)
    g = spec.group(x.shape[-1])
    y = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
    codes, scale, zero = _quantize_groups(y, spec, axis=-1)
    codes = codes.reshape(x.shape)
    return store_codes(codes, spec), scale[..., 0], None if zero is None else zero[..., 0]


def _quantize_groups(y, spec: KVQuant, axis: int):
    """Quantize ``y`` with one scale per slice along ``axis`` (kept as size 1)."""
    sdt = spec.scale_dtype
    if spec.symmetric:
        amax = jnp.max(jnp.abs(y), axis=axis, keepdims=True)
        if spec.clip != 1.0:
            amax = amax * spec.clip
        scale = (amax / spec.qmax).astype(sdt)
        s = scale.astype(jnp.float32)
        safe = jnp.where(s > 0, s, 1.0)
        if spec.format == "int8":
            codes = jnp.clip(jnp.round(y / safe), -spec.qmax, spec.qmax)
        else:
            codes = jnp.clip(y / safe, -spec.qmax, spec.qmax)
        return codes, scale, None
    lo = jnp.min(y, axis=axis, keepdims=True)
    hi = jnp.max(y, axis=axis, keepdims=True)
    if spec.clip != 1.0:
        mid = (lo + hi) / 2
        lo, hi = mid - spec.clip * (mid - lo), mid + spec.clip * (hi - mid)
    return codes_for_range(y, lo, hi, spec)


def codes_for_range(y, lo, hi, spec: KVQuant):
    """Asymmetric codes of ``y`` for the range ``[lo, hi]`` (broadcast against
    ``y``): ``zero = lo``, ``scale = (hi - zero) / qmax`` (in the spec's scale
    dtype), ``codes = clip(round((y - zero) / scale), 0, qmax)`` (float32)
    → ``(codes, scale, zero)``."""
    sdt = spec.scale_dtype
    zero = lo.astype(sdt)
    z = zero.astype(jnp.float32)
    scale = ((hi - z) / spec.qmax).astype(sdt)
    s = scale.astype(jnp.float32)
    safe = jnp.where(s > 0, s, 1.0)
    codes = jnp.clip(jnp.round((y - z) / safe), 0, spec.qmax)
    return codes, scale, zero


def store_codes(codes, spec: KVQuant):
    """Float32 codes ``[..., H]`` → the stored data: int8, float8_e4m3fn, uint4
    (int4, ``[..., H]``), or uint8 with 4 codes per byte (int2, `pack_codes`)."""
    if spec.format == "int8":
        return codes.astype(jnp.int8)
    if spec.format == "int4":
        return codes.astype(jnp.uint8).astype(jnp.uint4)
    if spec.format in FP8_FORMATS:
        return codes.astype(spec.storage_dtype)
    return pack_codes(codes.astype(jnp.uint8), spec.bits)


def load_codes(data, spec: KVQuant):
    """Stored data → float32 codes ``[..., H]``. int4 codes given as packed uint8 bytes
    ``[..., H/2]`` (`packed_bytes`' view, as a torch ``uint8`` tensor carries them) are unpacked."""
    if spec.format == "int4" and np.dtype(data.dtype) == np.dtype(jnp.uint8):
        return unpack_codes(data, 4).astype(jnp.float32)
    if spec.per_element == 1:
        return data.astype(jnp.float32)
    return unpack_codes(data, spec.bits).astype(jnp.float32)


def packed_bytes(data):
    """The bytes of an int4 pool's ``uint4`` codes ``[..., H]`` as uint8 ``[..., H/2]``
    (byte ``j``: ``x[2j]`` low, ``x[2j+1]`` high nibble, as `pack_codes`); other
    data as it is. On a TPU this is a relayout copy of the whole array (the
    uint8 rows are padded to 128 lanes): for consumers that read bytes (the
    Triton kernels on GPUs, where it is a bitcast)."""
    if np.dtype(data.dtype) != np.dtype(jnp.uint4):
        return data
    return jax.lax.bitcast_convert_type(data.reshape(*data.shape[:-1], data.shape[-1] // 2, 2), jnp.uint8)


def dequantize_rows(data, scale, zero, spec: KVQuant):
    """Inverse of `quantize_rows` (float32 out, still rotated)."""
    codes = load_codes(data, spec)
    h = codes.shape[-1]
    g = spec.group(h)
    c = codes.reshape(*codes.shape[:-1], h // g, g)
    x = c * scale.astype(jnp.float32)[..., None]
    if zero is not None:
        x = x + zero.astype(jnp.float32)[..., None]
    return x.reshape(codes.shape)


# -- the page pool ------------------------------------------------------------------
class PagedData:
    """``num_pages`` and ``page_size`` of a paged tensor whose ``data`` is ``[num_pages, page_size, ...]``
    (`QuantizedPages`, `cache.Source`)."""

    @property
    def num_pages(self) -> int:
        return self.data.shape[0]

    @property
    def page_size(self) -> int:
        return self.data.shape[1]


@dataclasses.dataclass(frozen=True)
class QuantizedPages(PagedData):
    """A quantized page pool (a pytree; see the module doc for the layout).

    Logical shape ``[num_pages, page_size, K, H]`` (or ``[num_pages,
    page_size, H]`` for an MLA latent/rope cache). With ``spec.part`` set,
    ``data`` is the whole combined ``[num_pages, page_size, 2, K, H]``
    buffer and this pool is its keys (0) or values (1) half.
    """

    data: Any
    scale: Any
    zero: Any
    signs: Any
    window: Any
    spec: KVQuant
    head_dim: int

    # -- logical view ---------------------------------------------------------
    @property
    def shape(self) -> tuple:
        lead = self.data.shape[:-1]
        if self.spec.part is not None:  # [NP, PS, 2, K, H']: drop the keys/values axis
            lead = (*lead[:2], *lead[3:])
        return (*lead, self.head_dim)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        """The stored code dtype (int8 / float8_e4m3fn / uint4 / uint8)."""
        return self.data.dtype

    @property
    def has_heads(self) -> bool:
        return self.ndim == 4

    def with_heads(self) -> "QuantizedPages":
        """The same pool with a unit head axis (MLA latents → ``[.., 1, H]``)."""
        if self.has_heads:
            return self
        add = lambda a, axis: None if a is None else jnp.expand_dims(a, axis)
        scale = self.scale if self.spec.group_axis == "tensor" else add(self.scale, 2)
        return dataclasses.replace(self, data=add(self.data, 2), scale=scale,
                                   zero=add(self.zero, 2), window=add(self.window, 2))

    def without_heads(self) -> "QuantizedPages":
        if not self.has_heads:
            return self
        sq = lambda a, axis: None if a is None else jnp.squeeze(a, axis)
        scale = self.scale if self.spec.group_axis == "tensor" else sq(self.scale, 2)
        return dataclasses.replace(self, data=sq(self.data, 2), scale=scale,
                                   zero=sq(self.zero, 2), window=sq(self.window, 2))

    @property
    def rotation_kind(self) -> str | None:
        """``"hadamard"`` (signs ``[H]``), ``"calibrated"`` (matrices) or None."""
        if self.signs is None:
            return None
        return "hadamard" if self.signs.ndim == 1 else "calibrated"

    def nbytes(self) -> int:
        """Bytes of the codes, scales, zero points and windows (uint4 codes: half a byte each)."""
        return sum(int(np.prod(a.shape)) * jax.dtypes.itemsize_bits(a.dtype) // 8
                   for a in (self.data, self.scale, self.zero, self.window) if a is not None)

    def __repr__(self) -> str:
        group = "tensor" if self.spec.group_axis == "tensor" else self.spec.group(self.head_dim)
        return (f"QuantizedPages({self.spec.format}, shape={self.shape}, group={group}"
                f"/{self.spec.group_axis}, part={self.spec.part}, rotation={self.spec.rotation}, windows="
                f"{self.spec.sink_tokens}+{self.spec.recent_tokens})")


jax.tree_util.register_dataclass(
    QuantizedPages, data_fields=["data", "scale", "zero", "signs", "window"], meta_fields=["spec", "head_dim"])


def is_quantized(pages) -> bool:
    return isinstance(pages, QuantizedPages)


def init_quantized_pages(num_pages: int, page_size: int, num_heads: int | None, head_dim: int,
                         spec: KVQuant, *, max_seqs: int | None = None, rotation=None) -> QuantizedPages:
    """An empty (all-zero) quantized page pool. ``num_heads=None`` gives the
    head-less MLA layout. ``max_seqs`` rows of windows when the spec has them.
    ``rotation``: calibrated orthogonal matrices ``[num_heads, H, H]`` (or
    ``[H, H]``) that rows are rotated with before quantization (instead of
    the spec's random Hadamard rotation; see `rotate`).
    A per-tensor (``"tensor"``) scale starts at 1.0. Pools of a combined
    buffer (``spec.part``): `combined_quantized_pages`."""
    if spec.part is not None:
        raise ValueError("spec: a pool with KVQuant.part views a combined buffer; build the key and value pools "
                         "with combined_quantized_pages")
    spec.check_shape(page_size, head_dim)
    heads = () if num_heads is None else (num_heads,)
    data = jnp.zeros((num_pages, page_size, *heads, head_dim // spec.per_element), spec.storage_dtype)
    if spec.group_axis == "tensor":
        return QuantizedPages(data, jnp.ones((), jnp.float32), None, None, None, spec, head_dim)
    g = spec.group(head_dim)
    if spec.group_axis == "head_dim":
        sshape = (num_pages, page_size, *heads, head_dim // g)
    else:
        sshape = (num_pages, page_size // g, *heads, head_dim)
    scale = jnp.zeros(sshape, spec.scale_dtype)
    zero = None if spec.symmetric else jnp.zeros(sshape, spec.scale_dtype)
    spec, signs = pool_rotation(spec, rotation, num_heads, head_dim)
    window = None
    if spec.window:
        if max_seqs is None:
            raise ValueError("max_seqs: a cache with sink/recent windows needs the number of sequence rows")
        window = jnp.zeros((max_seqs, spec.window, *heads, head_dim), spec.window_dtype)
    return QuantizedPages(data, scale, zero, signs, window, spec, head_dim)


def quantize_pages(pages, spec: KVQuant | str, *, max_seqs: int | None = None, block_tables=None,
                   lengths=None, rotation=None) -> QuantizedPages:
    """Quantize a dense page pool ``[num_pages, page_size, (K,) H]``.

    ``rotation``: calibrated orthogonal matrices ``[K, H, H]`` (or ``[H,
    H]``) to rotate with before quantizing (see `init_quantized_pages`).

    With windows, ``block_tables`` and ``lengths`` (one row per sequence) say
    which positions the windows hold; they are filled from ``pages``.
    """
    if isinstance(spec, str):
        spec = KVQuant(spec)
    pages = jnp.asarray(pages)
    page_size, head_dim = pages.shape[1], pages.shape[-1]
    spec.check_shape(page_size, head_dim)
    spec, signs = pool_rotation(spec, rotation, pages.shape[2] if pages.ndim == 4 else None, head_dim)
    x = pages.astype(jnp.float32)
    if signs is not None:
        x = rotate(x, signs)
    if spec.part is not None:
        raise ValueError("spec: quantize_pages quantizes one pool; for a combined buffer use "
                         "combined_quantized_pages")
    if spec.group_axis == "tensor":
        scale = (jnp.max(jnp.abs(x)) / spec.qmax).astype(jnp.float32)
        data, zero = quantize_with_scale(x, jnp.where(scale > 0, scale, 1.0), spec), None
        scale = jnp.where(scale > 0, scale, 1.0)
    elif spec.group_axis == "head_dim":
        data, scale, zero = quantize_rows(x, spec)
    else:
        data, scale, zero = quantize_token_groups(x, spec)
    window = None
    if spec.window:
        if block_tables is None or lengths is None:
            raise ValueError("quantize_pages: windows need block_tables and lengths to know the sequences")
        rows = block_tables.shape[0] if max_seqs is None else max_seqs
        window = _fill_windows(x, spec, block_tables, lengths, rows)
    return QuantizedPages(data, scale, zero, signs, window, spec, head_dim)


def quantize_token_groups(x, spec: KVQuant):
    """Per-channel quantization of pages ``x [NP, PS, (K,) H]`` with groups of
    ``g`` tokens of a page → ``(data, scale [NP, PS/g, (K,) H], zero)``."""
    g = spec.group(x.shape[-1])
    np_, ps = x.shape[:2]
    y = x.reshape(np_, ps // g, g, *x.shape[2:])
    codes, scale, zero = _quantize_groups(y, spec, axis=2)
    codes = codes.reshape(x.shape)
    return store_codes(codes, spec), scale[:, :, 0], None if zero is None else zero[:, :, 0]


def quantize_with_scale(x, scale, spec: KVQuant):
    """Codes of float ``x [...]`` for a given per-tensor ``scale`` (a float32
    scalar): ``x / scale`` clipped to ``±qmax``, rounded to the nearest
    integer (int8) or the nearest float8 value (fp8, round-to-nearest-even),
    in the spec's storage dtype. (vLLM's CPU backend truncates fp8
    mantissas instead: ``stellax.integrations.vllm.fp8`` writes its codes.)"""
    if spec.group_axis != "tensor":
        raise ValueError(f"spec: quantize_with_scale is for per-tensor scales (group_axis='tensor'), got "
                         f"{spec.group_axis!r}")
    y = jnp.clip(x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32), -spec.qmax, spec.qmax)
    return store_codes(jnp.round(y) if spec.format == "int8" else y, spec)


def combined_quantized_pages(kv_codes, k_scale, v_scale, spec: KVQuant | str = "fp8"):
    """The key and value pools of a combined quantized buffer, without a copy.

    Args:
      kv_codes: ``[num_pages, page_size, 2, K, H]`` codes in the spec's
        storage dtype (int8, float8_e4m3fn or float8_e5m2): keys at
        ``[:, :, 0]``, values at ``[:, :, 1]`` (vLLM's page contents).
      k_scale, v_scale: float32 scalars: ``key ≈ code · k_scale``,
        ``value ≈ code · v_scale``.
      spec: a format name or a `KVQuant` with ``group_axis="tensor"`` (its
        ``part`` is set here).

    Returns ``(k_pages, v_pages)``: two `QuantizedPages` sharing ``kv_codes``
    (logical shape ``[num_pages, page_size, K, H]`` each)."""
    if isinstance(spec, str):
        spec = KVQuant(spec, group_axis="tensor")
    if spec.group_axis != "tensor":
        raise ValueError(f"spec: a combined quantized buffer has per-tensor scales (group_axis='tensor'), got "
                         f"{spec.group_axis!r}")
    if kv_codes.ndim != 5 or kv_codes.shape[2] != 2:
        raise ValueError(f"kv_codes: expected [num_pages, page_size, 2, K, H], got shape {tuple(kv_codes.shape)}")
    if np.dtype(kv_codes.dtype) != spec.storage_dtype:
        raise TypeError(f"kv_codes: expected dtype {spec.storage_dtype.name} ({spec.format} codes), got "
                        f"{np.dtype(kv_codes.dtype).name}")
    pools = []
    for part, (name, scale) in enumerate((("k_scale", k_scale), ("v_scale", v_scale))):
        if tuple(np.shape(scale)) != () or not jnp.issubdtype(getattr(scale, "dtype", np.float32), jnp.floating):
            raise ValueError(f"{name}: expected a float32 scalar, got shape {tuple(np.shape(scale))}")
        pools.append(QuantizedPages(kv_codes, jnp.asarray(scale, jnp.float32), None, None, None,
                                    dataclasses.replace(spec, part=part), int(kv_codes.shape[-1])))
    return tuple(pools)


def expand_token_groups(a, page_size: int):
    """``[NP, PS/g, ...]`` → ``[NP, PS, ...]`` (repeat each group's row)."""
    g = page_size // a.shape[1]
    return jnp.repeat(a, g, axis=1)


def dequantize_pages(pages: QuantizedPages, *, rotated: bool = False):
    """Dense float32 pages ``[num_pages, page_size, (K,) H]`` of a quantized pool
    (windows not applied). ``rotated=True`` leaves the values in the rotated
    basis (what the kernels multiply the rotated query with)."""
    spec = pages.spec
    scale, zero = pages.scale, pages.zero
    if spec.group_axis == "tensor":
        data = pages.data if spec.part is None else pages.data[:, :, spec.part]
        x = load_codes(data, spec) * jnp.asarray(scale, jnp.float32)
    elif spec.group_axis == "token":
        ps = pages.page_size
        codes = load_codes(pages.data, spec)
        x = codes * expand_token_groups(scale, ps).astype(jnp.float32)
        if zero is not None:
            x = x + expand_token_groups(zero, ps).astype(jnp.float32)
    else:
        x = dequantize_rows(pages.data, scale, zero, spec)
    if pages.signs is not None and not rotated:
        x = unrotate(x, pages.signs)
    return x


# -- windows ------------------------------------------------------------------------
def window_slots(positions, lengths, spec: KVQuant):
    """For query-independent window bookkeeping: the window slot holding each
    position, or -1 when the position is read from the quantized pages.

    ``positions [..., T]``, ``lengths [...]`` (the sequence lengths)."""
    sink, recent = spec.sink_tokens, spec.recent_tokens
    lengths = jnp.asarray(lengths)[..., None]
    in_sink = positions < sink
    in_recent = (positions >= lengths - recent) & (positions >= sink) & (recent > 0)
    ring = sink + (positions % max(recent, 1))
    return jnp.where(in_sink, positions, jnp.where(in_recent, ring, -1))


def _fill_windows(x, spec: KVQuant, block_tables, lengths, rows: int):
    """Windows ``[rows, W, (K,) H]`` read from (rotated) dense pages ``x``."""
    sink, recent, page_size = spec.sink_tokens, spec.recent_tokens, x.shape[1]
    w = spec.window
    slots = jnp.arange(w)
    lengths = jnp.asarray(lengths, jnp.int32)
    # Position held by each slot of each sequence.
    pos_sink = jnp.broadcast_to(slots[None, :], (lengths.shape[0], w))
    r = slots - sink
    last = lengths[:, None] - 1
    pos_recent = last - jnp.mod(last - r[None, :], max(recent, 1))
    pos = jnp.where(slots[None, :] < sink, pos_sink, pos_recent)
    pos = jnp.clip(pos, 0, block_tables.shape[1] * page_size - 1)
    page = jnp.take_along_axis(block_tables, pos // page_size, axis=1)
    page = jnp.clip(page, 0, x.shape[0] - 1)
    vals = x[page, pos % page_size].astype(spec.window_dtype)
    out = jnp.zeros((rows, w, *x.shape[2:]), spec.window_dtype)
    return out.at[: lengths.shape[0]].set(vals)
