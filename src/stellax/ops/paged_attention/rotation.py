"""Calibrated KV-cache rotations (the OSCAR class): chosen from attention
statistics instead of at random.

A rotated cache stores ``y = R x`` for every key or value row ``x [H]`` of KV
head ``k`` (``R = R[k]``, orthogonal ``[H, H]``) and quantizes ``y``.
Attention never un-rotates the cache: logits use ``(R q)·(R k) = q·k``
(the key rotation is folded into the query), and the output is
``Rᵀ Σ_t p_t (R v_t)`` (one inverse value rotation per output row).

What a rotation changes is *where* the quantization error lands. For a key
error ``e`` the logit error is ``q·e``, whose mean square over queries is
``eᵀ C_Q e`` with the query second moment ``C_Q = E[q qᵀ]``; for values the
output error is ``Σ_t p_t e_t``, weighed by the attention outputs' second
moment ``C_O = E[o oᵀ]``, ``o = Σ_t p_t v_t`` (``= Vᵀ Sᵀ S V`` summed over
calibration rows, ``S`` the attention probabilities). `calibrate_kv_rotation`
builds, per (layer, KV head), from the target ``C`` (``C_Q`` for keys,
``C_O`` for values):

1. the eigenbasis ``C = U Λ Uᵀ``, ``λ_0 ≥ λ_1 ≥ …`` (the directions
   attention consumes, strongest first);
2. a bit-reversal reordering of the eigen-coordinates: stored channel ``c``
   takes eigen-coordinate ``rev(c)`` (``log2 H`` bits reversed). With
   quantization groups of ``g`` consecutive channels, group ``j`` then holds
   the coordinates ``rev(t)·(H/g) + rev(j)``, ``t < g``: exactly one from
   each of the ``g`` *levels* (blocks of ``H/g`` consecutive eigenvalues),
   so every group sees the same spectrum and no group holds all strong
   directions;
3. a Walsh–Hadamard transform inside each group (block-diagonal, size
   ``g``), which spreads each group's energy evenly over its channels
   (a group's range, and so its step, is set by its largest channel).

``R = B_g · P_rev · Uᵀ`` (``y = R x``). ``g`` is the cache's head-axis
quantization group (``KVQuant.group_size``; ``H`` for per-token-per-head
scales or token-axis groups, where step 3 is a full Hadamard transform).

OSCAR also calibrates clip thresholds: `calibrate_kv_clip` (or
``calibrate_kv_rotation(..., clip_spec=)``) fits, per layer and for keys and
values separately, the range ratio `KVQuant.clip` that minimizes the
calibration attention's output error when that tensor is quantized (each
head-axis group's range shrunk about its midpoint; the saturated extremes
cost less than the coarser step of the full range at 2 bits).

Rotations are plain float32 arrays ``[L, K, H, H]`` (or ``[K, H, H]`` for one
layer), passed to `init_kv_cache` (``key_rotation=``, ``value_rotation=``) or
`quantize_pages` (``rotation=``), saved with `save_kv_rotation` (``.npz``,
no pickle, with a checksum) and read back with `load_kv_rotation`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from typing import NamedTuple

import jax
import numpy as np

from .quant_cache import (ORTHOGONALITY_TOLERANCE, KVQuant, check_rotation, dequantize_pages, orthogonality_error,
                          quantize_pages)

_FORMAT = "stellax.kv_rotation/1"


class KVRotation(NamedTuple):
    """Calibrated rotations of a model's KV cache.

    Attributes:
      keys: float32 ``[L, K, H, H]`` (or ``[K, H, H]``): ``R_K[l, k]``, the
        key rotation of layer ``l``, KV head ``k`` (``y = R x``).
      values: float32, same shape: the value rotations ``R_V``.
      key_clip, value_clip: ``None``, or float32 ``[L]`` (``[]`` for one
        layer): the clip thresholds fitted with the rotations for one cache
        format (`KVQuant.clip` of layer ``l``'s key / value pool; see
        `calibrate_kv_clip`).
    """

    keys: np.ndarray
    values: np.ndarray
    key_clip: np.ndarray | None = None
    value_clip: np.ndarray | None = None


class KVClip(NamedTuple):
    """Fitted clip thresholds: float32 ``[L]`` (``[]`` for one layer), the
    `KVQuant.clip` of each layer's key pool (``keys``) and value pool
    (``values``)."""

    keys: np.ndarray
    values: np.ndarray


#: The range ratios `calibrate_kv_clip` tries (1.0 is the plain min/max range).
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


# -- the building blocks ----------------------------------------------------------
def bit_reversal_permutation(n: int) -> np.ndarray:
    """``perm [n]`` int: ``perm[c]`` = ``c`` with its ``log2 n`` bits reversed
    (``n`` a power of two). An involution (``perm[perm] = arange(n)``)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n: the bit-reversal permutation needs a power of two, got {n}")
    bits = n.bit_length() - 1
    c = np.arange(n)
    out = np.zeros(n, np.int64)
    for b in range(bits):
        out |= ((c >> b) & 1) << (bits - 1 - b)
    return out


def hadamard_matrix(n: int) -> np.ndarray:
    """The orthonormal Sylvester–Hadamard matrix ``[n, n]`` float64 (``n`` a
    power of two): entries ``±1/√n``, symmetric, its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n: the Hadamard matrix needs a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotation_from_covariance(cov, group_size: int | None = None) -> np.ndarray:
    """The calibrated rotation of target second moments ``cov [..., H, H]``
    (symmetric PSD): ``R = B_g · P_rev · Uᵀ`` (see the module doc), float64
    ``[..., H, H]``, orthogonal. ``group_size`` ``g`` (default ``H``) must be a
    power of two dividing ``H``."""
    cov = np.asarray(cov, np.float64)
    h = cov.shape[-1]
    g = h if group_size is None else int(group_size)
    if h & (h - 1):
        raise ValueError(f"head_dim: the calibrated rotation (a Hadamard transform per group) needs a power of "
                         f"two, got {h}")
    if g < 1 or g & (g - 1) or h % g:
        raise ValueError(f"group_size: expected a power of two dividing head_dim {h}, got {group_size}")
    sym = (cov + np.swapaxes(cov, -1, -2)) / 2
    _, vecs = np.linalg.eigh(sym)                      # ascending eigenvalues, columns
    ut = np.swapaxes(vecs[..., ::-1], -1, -2)          # rows: eigenvectors, strongest first
    permuted = ut[..., bit_reversal_permutation(h), :]
    block = np.kron(np.eye(h // g), hadamard_matrix(g))
    return np.einsum("ij,...jk->...ik", block, permuted)


# -- checks -------------------------------------------------------------------------
def _as_calibration(name, x, rank):
    a = np.asarray(jax.device_get(x)) if hasattr(x, "shape") else None
    if a is None:
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if not np.issubdtype(a.dtype, np.floating) and a.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected a floating dtype, got {a.dtype.name}")
    if a.ndim not in (4, 5):
        raise ValueError(f"{name}: expected rank 4 [S, T, heads, head_dim] or rank 5 [L, S, T, heads, head_dim], "
                         f"got shape {a.shape}")
    if rank is not None and a.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} (as queries), got shape {a.shape}")
    a = a.astype(np.float64)
    return a[None] if a.ndim == 4 else a


# -- calibration --------------------------------------------------------------------
def _attention_blocks(q, k, v, scale: float, causal: bool, block: int = 256):
    """The attention outputs of one sequence, ``q [T, K, G, H]``, ``k, v [T,
    K, H]``: ``o = softmax(scale · q kᵀ) v`` (causal or not), yielded per
    block of ``block`` query rows as float64 ``[K, G, rows, H]`` (memory
    ``K·G·block·T``)."""
    t = q.shape[0]
    for lo in range(0, t, block):
        qb = q[lo:lo + block]
        logits = scale * np.einsum("qkgh,tkh->kgqt", qb, k)
        if causal:
            rows = np.arange(lo, lo + qb.shape[0])
            logits = np.where(np.arange(t)[None, :] <= rows[:, None], logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))                  # row max is finite: key 0 is visible
        yield np.einsum("kgqt,tkh->kgqh", p / p.sum(-1, keepdims=True), v)


def _output_moment(q, k, v, scale: float, causal: bool):
    """``Σ_rows o oᵀ`` per KV head of one sequence (`_attention_blocks`) →
    float64 ``[K, H, H]``."""
    out = np.zeros((k.shape[1], k.shape[2], k.shape[2]))
    for o in _attention_blocks(q, k, v, scale, causal):
        out += np.einsum("kgqi,kgqj->kij", o, o)
    return out


def _output_error(q, k, v, k_hat, v_hat, scale: float, causal: bool) -> float:
    """``Σ ‖o(q, k̂, v̂) - o(q, k, v)‖²`` over the query rows of one sequence."""
    pairs = zip(_attention_blocks(q, k, v, scale, causal), _attention_blocks(q, k_hat, v_hat, scale, causal))
    return float(sum(np.sum((a - b) ** 2) for a, b in pairs))


def _calibration_inputs(queries, keys, values, lengths, scale):
    """Validated calibration data: ``(q [L, S, T, N, H], k, v [L, S, T, K, H]``
    float64, ``lengths [S]``, softmax scale, whether the inputs were one layer)``."""
    single = hasattr(queries, "ndim") and queries.ndim == 4
    q = _as_calibration("queries", queries, None)
    rank = 4 if single else 5
    k = _as_calibration("keys", keys, rank)
    v = _as_calibration("values", values, rank)
    nl, s, t, n, h = q.shape
    if k.shape[:3] != (nl, s, t) or k.shape[-1] != h:
        raise ValueError(f"keys: expected shape {(nl, s, t, 'K', h)[1 if single else 0:]} (queries' layers, "
                         f"sequences, tokens and head dim), got {tuple(keys.shape)}")
    kh = k.shape[3]
    if n % kh:
        raise ValueError(f"keys: the {kh} KV heads must divide the {n} query heads of queries")
    if v.shape != k.shape:
        raise ValueError(f"values: expected the shape of keys {tuple(keys.shape)}, got {tuple(values.shape)}")
    if lengths is None:
        lens = np.full((s,), t, np.int64)
    else:
        lens = np.asarray(jax.device_get(lengths)).astype(np.int64).reshape(-1)
        if lens.shape != (s,) or (lens < 0).any() or (lens > t).any():
            raise ValueError(f"lengths: expected {s} values in [0, {t}] (one per calibration sequence), got "
                             f"{np.asarray(lengths).tolist()}")
    tokens = int(lens.sum())
    if tokens < h:
        raise ValueError(f"queries: calibration needs at least head_dim = {h} valid tokens (the second moments "
                         f"are [{h}, {h}]; fewer tokens leave them rank-deficient), got {tokens}")
    sc = 1.0 / np.sqrt(h) if scale is None else float(scale)
    return q, k, v, lens, sc, single


def _check_group_size(group_size, h):
    g = h if group_size is None else group_size
    if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1 or g & (g - 1) or h % g:
        raise ValueError(f"group_size: expected a power of two dividing head_dim {h}, got {group_size!r}")
    return int(g)


def calibrate_kv_rotation(queries, keys, values, *, lengths=None, causal: bool = True, scale: float | None = None,
                          group_size: int | None = None, clip_spec=None) -> KVRotation:
    """Calibrated key and value rotations per (layer, KV head) from captured
    activations (OSCAR class; the math is in the module doc).

    Args:
      queries: ``[L, S, T, N, H]`` (or ``[S, T, N, H]`` for one layer): the
        attention queries of ``S`` calibration sequences of ``T`` tokens
        (after any positional rotation, as the kernel sees them), ``N = K·G``
        query heads (GQA: query head ``n`` reads KV head ``n // G``).
      keys, values: ``[L, S, T, K, H]`` (or ``[S, T, K, H]``).
      lengths: ``[S]`` int, the valid tokens of each sequence (the rest is
        padding and ignored); default ``T``.
      causal: whether the calibration attention (which weighs the value
        target) is causal (decoders) or bidirectional (encoders).
      scale: softmax scale of the logits (default ``1/√H``).
      group_size: the cache's head-axis quantization group ``g`` (a power of
        two dividing ``H``; default ``H``).
      clip_spec: ``None``, or the cache format (a `KVQuant` with head-axis
        groups of ``g``, or a format name such as ``"int2"``) to also fit
        clip thresholds for, with these rotations (`calibrate_kv_clip`).

    Returns:
      `KVRotation` of float32 orthogonal matrices ``[L, K, H, H]`` (``[K, H,
      H]`` for rank-4 inputs): keys from the query second moment ``Σ q qᵀ``
      (all query heads of the KV group, all valid tokens), values from the
      attention-output second moment ``Σ o oᵀ``, ``o = softmax(scale·q kᵀ)
      v`` per query head. Computed on the host in float64. With
      ``clip_spec``, ``key_clip`` / ``value_clip`` hold the fitted
      thresholds (float32 ``[L]``).

    Raises ValueError naming the argument for mismatched shapes, a head dim
    that is not a power of two, or fewer valid tokens than ``H`` (the second
    moments would be rank-deficient and their eigenbases arbitrary).
    """
    q, k, v, lens, sc, single = _calibration_inputs(queries, keys, values, lengths, scale)
    nl, s, t, n, h = q.shape
    if h & (h - 1):
        raise ValueError(f"queries: the calibrated rotation needs a power-of-two head_dim, got {h}")
    g = _check_group_size(group_size, h)
    kh = k.shape[3]
    grp = n // kh
    valid = np.arange(t)[None, :] < lens[:, None]                                   # [S, T]
    cq = np.zeros((nl, kh, h, h))
    co = np.zeros((nl, kh, h, h))
    for layer in range(nl):
        ql = q[layer].reshape(s, t, kh, grp, h)                                      # [S, T, K, G, H]
        qv = ql[valid]                                                               # [M, K, G, H]
        cq[layer] = np.einsum("mkgi,mkgj->kij", qv, qv)
        for b in range(s):
            co[layer] += _output_moment(ql[b, :lens[b]], k[layer, b, :lens[b]], v[layer, b, :lens[b]], sc, causal)
    out = KVRotation(rotation_from_covariance(cq, g).astype(np.float32),
                     rotation_from_covariance(co, g).astype(np.float32))
    if clip_spec is not None:
        spec = _clip_spec(clip_spec, h, g)
        clip = calibrate_kv_clip(q, k, v, spec, key_rotation=out.keys, value_rotation=out.values, lengths=lens,
                                 causal=causal, scale=sc)
        out = out._replace(key_clip=clip.keys, value_clip=clip.values)
    if single:
        return KVRotation(out.keys[0], out.values[0], *(None if c is None else c[0] for c in out[2:]))
    return out


def _clip_spec(spec, head_dim: int, group_size: int | None):

    if isinstance(spec, str):
        spec = KVQuant(spec, group_size=group_size)
    if not isinstance(spec, KVQuant):
        raise TypeError(f"clip_spec: expected a KVQuant or a format name, got {type(spec).__name__}")
    if spec.group_axis != "head_dim":
        raise ValueError(f"clip_spec: clip thresholds are for head-axis groups, got group_axis={spec.group_axis!r}")
    if group_size is not None and spec.group(head_dim) != group_size:
        raise ValueError(f"clip_spec: its head-axis group {spec.group(head_dim)} must be the rotations' "
                         f"group_size {group_size}")
    return dataclasses.replace(spec, sink_tokens=0, recent_tokens=0, clip=1.0)


def calibrate_kv_clip(queries, keys, values, spec, *, key_rotation=None, value_rotation=None, lengths=None,
                      causal: bool = True, scale: float | None = None, grid=CLIP_GRID) -> KVClip:
    """Fit `KVQuant.clip` per layer for keys and for values (OSCAR's clip
    thresholds): for each ratio ``τ`` of ``grid``, the calibration tokens'
    keys (then values) are quantized exactly as a pool of ``spec`` with
    ``clip=τ`` stores them (rotation included) and dequantized, and the
    attention of the calibration queries over them, the other tensor exact,
    is compared with the exact attention; the ``τ`` with the smallest
    ``Σ ‖Δo‖²`` wins (the earlier grid entry on a tie).

    Args:
      queries, keys, values, lengths, causal, scale: as `calibrate_kv_rotation`.
      spec: the cache format, a `KVQuant` with head-axis groups (or a format
        name, per-token-per-head groups). Its rotation is applied: the
        Hadamard one (``rotation=True``), or ``key_rotation`` /
        ``value_rotation`` (``[L, K, H, H]``, ``[K, H, H]`` for one layer) when
        given. Windows are ignored (their tokens are not quantized).
      grid: the ratios to try, each in ``(0, 1]``.

    Returns:
      `KVClip` of float32 ``[L]`` (``[]`` for rank-4 inputs).
    """

    q, k, v, lens, sc, single = _calibration_inputs(queries, keys, values, lengths, scale)
    nl, s, t, n, h = q.shape
    spec = _clip_spec(spec, h, None)
    grid = tuple(float(c) for c in grid)
    if not grid or not all(0 < c <= 1 for c in grid):
        raise ValueError(f"grid: expected range ratios in (0, 1], got {grid}")
    kh = k.shape[3]
    rotations = []
    for name, r in (("key_rotation", key_rotation), ("value_rotation", value_rotation)):
        if r is not None:
            r = np.asarray(jax.device_get(r), np.float32)
            want = (kh, h, h) if single else (nl, kh, h, h)
            if r.shape != want:
                raise ValueError(f"{name}: expected shape {want} (layers, KV heads, head dim of keys), got {r.shape}")
            r = r[None] if single else r
        rotations.append(r)
    valid = np.arange(t)[None, :] < lens[:, None]
    best = np.ones((2, nl), np.float32)
    for layer in range(nl):
        ql = q[layer].reshape(s, t, kh, n // kh, h)
        exact = (k[layer], v[layer])
        for which in (0, 1):
            rot = None if rotations[which] is None else rotations[which][layer]
            tokens = exact[which][valid][:, None]                                    # pages of one token
            errors = []
            for ratio in grid:
                pool = quantize_pages(tokens, dataclasses.replace(spec, clip=ratio), rotation=rot)
                approx = np.zeros_like(exact[which])
                approx[valid] = np.asarray(dequantize_pages(pool), np.float64)[:, 0]
                kv = [exact[0], exact[1]]
                kv[which] = approx
                errors.append(sum(_output_error(ql[b, :lens[b]], k[layer, b, :lens[b]], v[layer, b, :lens[b]],
                                                kv[0][b, :lens[b]], kv[1][b, :lens[b]], sc, causal)
                                  for b in range(s)))
            best[which, layer] = grid[int(np.argmin(errors))]
    return KVClip(best[0, 0], best[1, 0]) if single else KVClip(best[0], best[1])


# -- saving and loading -------------------------------------------------------------
def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(json.dumps([a.dtype.str, list(a.shape)]).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def save_kv_rotation(path, rotation: KVRotation) -> None:
    """Write rotations to ``path`` (an ``.npz`` of plain arrays, no pickled
    objects): float32 ``keys``/``values`` (and ``key_clip``/``value_clip``
    when the rotation carries clip thresholds), a format tag and the SHA-256
    of the arrays, which `load_kv_rotation` verifies."""
    keys = np.asarray(jax.device_get(rotation.keys), np.float32)
    values = np.asarray(jax.device_get(rotation.values), np.float32)
    if keys.shape != values.shape or keys.ndim not in (3, 4) or keys.shape[-1] != keys.shape[-2]:
        raise ValueError(f"rotation: expected keys and values of one shape [L, K, H, H] or [K, H, H], got "
                         f"{keys.shape} and {values.shape}")
    for name, a in (("rotation.keys", keys), ("rotation.values", values)):
        err = orthogonality_error(a)
        if not err <= ORTHOGONALITY_TOLERANCE:
            raise ValueError(f"{name}: expected orthogonal matrices, got max |R Rᵀ - I| = {err:.3g}")
    arrays = {"keys": keys, "values": values}
    if (rotation.key_clip is None) != (rotation.value_clip is None):
        raise ValueError("rotation: key_clip and value_clip must be given together")
    if rotation.key_clip is not None:
        for name in ("key_clip", "value_clip"):
            arrays[name] = _check_clip(f"rotation.{name}", np.asarray(getattr(rotation, name), np.float32),
                                       keys.shape[:-3])
    with open(path, "wb") as f:
        np.savez(f, **arrays, format=np.array(_FORMAT), sha256=np.array(_digest(*arrays.values())))


def _check_clip(name: str, clip: np.ndarray, layers: tuple) -> np.ndarray:
    if clip.shape != layers or not np.all((clip > 0) & (clip <= 1)):
        raise ValueError(f"{name}: expected ratios in (0, 1] of shape {layers} (one per layer), got "
                         f"{clip.dtype} {clip.shape} {clip.tolist()}")
    return clip


def load_kv_rotation(path, *, num_layers: int | None = None, num_kv_heads: int | None = None,
                     head_dim: int | None = None) -> KVRotation:
    """Read rotations (and clip thresholds, when saved) written by
    `save_kv_rotation` (``allow_pickle=False``).

    Refuses (ValueError naming the file) a file with other or missing
    entries, another format tag, non-float32 or mismatched arrays, a checksum
    that does not match (a modified file), non-orthogonal matrices, or shapes
    other than the expected ``num_layers`` / ``num_kv_heads`` / ``head_dim``
    (each checked when given).
    """
    base = {"keys", "values", "format", "sha256"}
    with_clip = base | {"key_clip", "value_clip"}
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:   # pickled content is a ValueError
        raise ValueError(f"{path}: not a readable .npz rotation file without pickled objects ({e})") from e
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: expected an .npz archive of rotations, got a single {type(z).__name__}")
    with z:
        names = set(z.files)
        if names not in (base, with_clip):
            raise ValueError(f"{path}: expected the entries {sorted(base)} (and optionally key_clip, value_clip), "
                             f"got {sorted(names)}")
        try:
            entries = {name: z[name] for name in names}
        except ValueError as e:                                          # an object (pickled) entry
            raise ValueError(f"{path}: refused an entry with pickled objects ({e})") from e
    fmt, digest = entries["format"], entries["sha256"]
    if fmt.shape != () or str(fmt) != _FORMAT:
        raise ValueError(f"{path}: expected format {_FORMAT!r}, got {fmt!r}")
    keys, values = entries["keys"], entries["values"]
    for name, a in (("keys", keys), ("values", values)):
        if a.dtype != np.float32 or a.ndim not in (3, 4) or a.shape[-1] != a.shape[-2]:
            raise ValueError(f"{path}: {name} must be float32 [L, K, H, H] or [K, H, H], got {a.dtype} {a.shape}")
    if keys.shape != values.shape:
        raise ValueError(f"{path}: keys {keys.shape} and values {values.shape} differ in shape")
    clips = [entries[name] for name in ("key_clip", "value_clip") if name in entries]
    if digest.shape != () or str(digest) != _digest(keys, values, *clips):
        raise ValueError(f"{path}: the checksum does not match the arrays (the file was modified or corrupted)")
    for name, a in (("keys", keys), ("values", values)):
        err = orthogonality_error(a)
        if not err <= ORTHOGONALITY_TOLERANCE:
            raise ValueError(f"{path}: {name} are not orthogonal (max |R Rᵀ - I| = {err:.3g})")
    got = dict(zip(("num_layers", "num_kv_heads", "head_dim"),
                   (keys.shape[0] if keys.ndim == 4 else None, keys.shape[-3], keys.shape[-1])))
    for name, want in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if want is not None and got[name] != want:
            raise ValueError(f"{path}: {name}: expected {want}, the file holds {got[name]} (shape {keys.shape})")
    for name, clip in zip(("key_clip", "value_clip"), clips):
        if clip.dtype != np.float32:
            raise ValueError(f"{path}: {name} must be float32, got {clip.dtype}")
        _check_clip(f"{path}: {name}", clip, keys.shape[:-3])
    return KVRotation(keys, values, *clips)
