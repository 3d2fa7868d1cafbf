"""The attention mask description, shared by every implementation.

A mask is described once, as a small static `MaskSpec` plus a few per-token
integer arrays:

* ``q_positions [Bp, T]`` / ``kv_positions [Bp, S]``: the position of every
  query and key token (``Bp`` is the batch or 1). The default is bottom-right
  alignment: query ``i`` sits at ``i + S - T`` and key ``j`` at ``j``, so a
  query sees keys up to its own position (FlashAttention's convention; the
  same as `jax.nn.dot_product_attention` when ``T == S``). Packed sequences
  (varlen) restart positions per sequence; a context-parallel shard offsets
  them.
* ``q_segment_ids [Bs, T]`` / ``kv_segment_ids [Bs, S]``: a query sees only
  keys of its own segment. Sequence lengths are folded into segments: a query
  past its length gets segment ``-1`` and a key past its length ``-2``, so
  padded rows are fully masked (zeros out) and padded keys invisible.

Query ``i`` may see key ``j`` (``qp = q_positions[i]``, ``kp = kv_positions[j]``) iff

    causal:   kp <= qp
    window:   qp - left <= kp <= qp + right        (either side may be unbounded)
    chunk:    qp // C == kp // C                   (Llama-4 chunked attention)
    segments: q_segment_ids[i] == kv_segment_ids[j]

all combined by AND (a dense boolean mask, if any, is ANDed on top by the
implementations). `mask_fn` evaluates this elementwise with plain ``jnp``
operations, so the same function runs in the golden, in the chunked XLA path
and inside Pallas kernels on tiles.

`classify_blocks` turns the description into per-(q-block, k-block) classes —
``EMPTY`` (no visible pair: skipped), ``FULL`` (every pair visible: no mask
evaluation) or ``PARTIAL`` — from per-block min/max of positions and segments
(cheap on device: O(B·(T+S) + B·nq·nk)). With ``sides=True`` a partial block
that only one edge of the position band cuts gets a class of its own:
``UPPER_EDGE`` (only the causal / right-window comparisons can hide a pair)
or ``LOWER_EDGE`` (only the left-window one), so a kernel evaluates just that
comparison there (`edge_parts`); a sliding window's band at block-sized
windows is all such blocks. The bounds are conservative: a block
called EMPTY or FULL is exactly that; a PARTIAL block may turn out empty or
full. `visit_schedule` compresses a row of classes into the loop bounds the
kernels use: ``[lo, full_lo)`` masked, ``[full_lo, full_hi)`` unmasked,
``[full_hi, hi)`` masked; blocks outside ``[lo, hi)`` are never visited.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2
#: Partial blocks cut by one side of the position band only (`classify_blocks` with ``sides``):
#: the upper edge (``kp <= qp`` causal, ``kp <= qp + right``) or the lower one (``kp >= qp - left``).
UPPER_EDGE, LOWER_EDGE = 3, 4

#: Segment ids given to query rows / keys past their sequence length.
PAD_Q_SEGMENT, PAD_KV_SEGMENT = -1, -2

_BIG = np.int32(2**30)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static part of an attention mask (hashable; a jit static argument).

    Attributes:
      causal: keys at positions after the query's are masked.
      window_left / window_right: the sliding window ``[qp - left, qp + right]``;
        ``None`` means unbounded on that side.
      chunk_size: queries see only keys of their own chunk of positions.
      segments: segment ids are present (``q_segment_ids``/``kv_segment_ids``).
      default_positions: the positions are the default bottom-right ones (no
        explicit ``q_positions``/``kv_positions``), so the position part of the
        block classes is known statically (`static_block_counts`): kernels
        size their grids by it.
    """

    causal: bool = False
    window_left: int | None = None
    window_right: int | None = None
    chunk_size: int | None = None
    segments: bool = False
    default_positions: bool = False

    def __post_init__(self):
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, np.integer)) or value < 0):
                raise ValueError(f"MaskSpec.{name}: expected None or an int >= 0, got {value!r}")
        if self.chunk_size is not None and (not isinstance(self.chunk_size, (int, np.integer))
                                            or self.chunk_size <= 0):
            raise ValueError(f"MaskSpec.chunk_size: expected None or a positive int, got {self.chunk_size!r}")

    @property
    def has_position_mask(self) -> bool:
        return (self.causal or self.window_left is not None or self.window_right is not None
                or self.chunk_size is not None)

    @property
    def is_trivial(self) -> bool:
        """No mask at all (every query sees every key)."""
        return not (self.has_position_mask or self.segments)


def default_positions(t: int, s: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Bottom-right aligned positions: ``([1, T], [1, S])`` int32."""
    q = jnp.arange(t, dtype=jnp.int32)[None, :] + jnp.int32(s - t)
    k = jnp.arange(s, dtype=jnp.int32)[None, :]
    return q, k


def mask_fn(spec: MaskSpec, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """Elementwise visibility (True = attend) from broadcastable int arrays,
    e.g. ``q_pos[..., :, None]`` against ``kv_pos[..., None, :]``. Returns
    ``None`` when nothing is masked. Plain ``jnp``: works on tiles in kernels."""
    ok = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if spec.causal:
        ok = both(ok, kv_pos <= q_pos)
    if spec.window_left is not None:
        ok = both(ok, kv_pos >= q_pos - spec.window_left)
    if spec.window_right is not None:
        ok = both(ok, kv_pos <= q_pos + spec.window_right)
    if spec.chunk_size is not None:
        ok = both(ok, _chunk_of(q_pos, spec.chunk_size) == _chunk_of(kv_pos, spec.chunk_size))
    if spec.segments:
        ok = both(ok, q_seg == kv_seg)
    return ok


def _chunk_of(pos, chunk: int):
    # Floor division that also holds for negative positions (queries with
    # T > S sit at negative positions), written with truncating integer ops
    # only so it lowers everywhere.
    shifted = pos + jnp.int32(chunk * (_BIG // chunk))
    return jax.lax.div(shifted, jnp.int32(chunk))  # shifted >= 0: truncation is floor


def dense_mask(spec: MaskSpec, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """``[Bm, T, S]`` bool visibility from ``[Bp, T]``/``[Bp, S]`` arrays (``None`` if trivial)."""
    qs = None if q_seg is None else q_seg[:, :, None]
    ks = None if kv_seg is None else kv_seg[:, None, :]
    return mask_fn(spec, q_pos[:, :, None], kv_pos[:, None, :], qs, ks)


# -- block classification ---------------------------------------------------------
def _pad_to(x, length: int, value):
    extra = length - x.shape[-1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)], constant_values=value)


def _block_min_max(x, valid, block: int):
    """Per-block min/max over valid entries: ``x [B, L]`` → ``([B, nb], [B, nb])``."""
    b, length = x.shape
    nb = -(-length // block)
    x = _pad_to(x, nb * block, 0).reshape(b, nb, block)
    valid = _pad_to(valid, nb * block, False).reshape(valid.shape[0], nb, block)
    lo = jnp.min(jnp.where(valid, x, _BIG), axis=-1)
    hi = jnp.max(jnp.where(valid, x, -_BIG), axis=-1)
    return lo, hi


def _upper_spec(spec: MaskSpec) -> MaskSpec:
    return MaskSpec(causal=spec.causal, window_right=spec.window_right)


def _lower_spec(spec: MaskSpec) -> MaskSpec:
    return MaskSpec(window_left=spec.window_left)


def edge_parts(spec: MaskSpec) -> dict:
    """The masked block classes ``classify_blocks(spec, ..., sides=True)`` can give, each with
    the part of ``spec`` a kernel must evaluate on such a block: ``{PARTIAL: spec,
    UPPER_EDGE: causal/right-window terms, LOWER_EDGE: left-window term}``. A side class is
    present only when ``spec`` has that side's terms and some other term besides (with the
    upper terms alone, say plain causal, every partial block is an upper-edge one and stays
    ``PARTIAL``). The parts carry no segments and no key-padding test: a kernel hides keys
    past the sequence itself (as on every masked block)."""
    upper = spec.causal or spec.window_right is not None
    lower = spec.window_left is not None
    others = spec.chunk_size is not None or spec.segments
    parts = {PARTIAL: spec}
    if upper and (lower or others):
        parts[UPPER_EDGE] = _upper_spec(spec)
    if lower and (upper or others):
        parts[LOWER_EDGE] = _lower_spec(spec)
    return parts


def classify_blocks(spec: MaskSpec, q_pos, kv_pos, q_seg=None, kv_seg=None, *, block_q: int,
                    block_k: int, kv_len: int | None = None, sides: bool = False):
    """``[Bc, nq, nk]`` int32 block classes (`EMPTY`/`PARTIAL`/`FULL`; with ``sides`` also
    `UPPER_EDGE`/`LOWER_EDGE`).

    ``q_pos [Bp, T]``, ``kv_pos [Bp, S]``, segments ``[Bs, T]``/``[Bs, S]`` or
    ``None``; ``Bc`` is the larger of ``Bp``/``Bs``. Keys at index ≥ ``kv_len``
    (default ``S``) are padding: a block of only padding is EMPTY and a block
    with some is never FULL. Query rows past ``T`` are padding and ignored.

    ``sides``: a non-FULL, non-EMPTY block where every pair passes every term but
    the upper ones (causal, ``window_right``) is `UPPER_EDGE`; where every pair
    passes every term but the lower one (``window_left``), `LOWER_EDGE`; each only
    when `edge_parts` lists it. Key padding does not count against a side class
    (the kernel hides padded keys on every masked block).
    """
    t, s = q_pos.shape[-1], kv_pos.shape[-1]
    kv_len = s if kv_len is None else kv_len
    nq, nk = -(-t // block_q), -(-s // block_k)
    q_valid = jnp.ones((1, t), bool)
    k_valid = (jnp.arange(s) < kv_len)[None, :]
    qmin, qmax = _block_min_max(q_pos.astype(jnp.int32), q_valid, block_q)  # [Bp, nq]
    kmin, kmax = _block_min_max(kv_pos.astype(jnp.int32), k_valid, block_k)  # [Bp, nk]
    kcount = jnp.sum(_pad_to(k_valid, nk * block_k, False).reshape(nk, block_k), axis=-1)  # [nk]
    qmin, qmax = qmin[:, :, None], qmax[:, :, None]
    kmin, kmax = kmin[:, None, :], kmax[:, None, :]

    some = (kcount > 0)[None, None, :]
    # every pair passes: the upper terms, the lower term, the others (chunks, segments)
    upper = lower = others = jnp.ones((), bool)
    if spec.causal:
        some = some & (kmin <= qmax)
        upper = upper & (kmax <= qmin)
    if spec.window_left is not None:
        some = some & (kmax >= qmin - spec.window_left)
        lower = lower & (kmin >= qmax - spec.window_left)
    if spec.window_right is not None:
        some = some & (kmin <= qmax + spec.window_right)
        upper = upper & (kmax <= qmin + spec.window_right)
    if spec.chunk_size is not None:
        c = spec.chunk_size
        cqmin, cqmax, ckmin, ckmax = (_chunk_of(x, c) for x in (qmin, qmax, kmin, kmax))
        some = some & (ckmax >= cqmin) & (ckmin <= cqmax)
        others = others & (cqmin == cqmax) & (ckmin == ckmax) & (cqmin == ckmin)
    if spec.segments:
        sqmin, sqmax = _block_min_max(q_seg.astype(jnp.int32), q_valid, block_q)
        skmin, skmax = _block_min_max(kv_seg.astype(jnp.int32), k_valid, block_k)
        sqmin, sqmax = sqmin[:, :, None], sqmax[:, :, None]
        skmin, skmax = skmin[:, None, :], skmax[:, None, :]
        some = some & (skmax >= sqmin) & (skmin <= sqmax)
        others = others & (sqmin == sqmax) & (skmin == skmax) & (sqmin == skmin)
    every = (kcount == block_k)[None, None, :] & upper & lower & others
    partial = jnp.full((), PARTIAL, jnp.int32)
    if sides:
        parts = edge_parts(spec)
        if LOWER_EDGE in parts:
            partial = jnp.where(upper & others, LOWER_EDGE, partial)
        if UPPER_EDGE in parts:
            partial = jnp.where(lower & others, UPPER_EDGE, partial)
    classes = jnp.where(every, FULL, jnp.where(some, partial, EMPTY)).astype(jnp.int32)
    return jnp.broadcast_to(classes, (classes.shape[0], nq, nk))


def static_block_counts(spec: MaskSpec, t: int, s: int, *, block_q: int, block_k: int) -> tuple[int, int]:
    """``(per_row, per_col)``: the most non-EMPTY blocks of a query-block row and of
    a key-block column under the default (bottom-right) positions, from the
    position part of ``spec`` alone (numpy, static; at least 1 each).

    `classify_blocks` on the default positions never finds more: segments and
    sequence lengths only remove visible pairs. A kernel whose grid walks a
    row's compacted block list (`mosaic_tpu.block_table`) needs only
    ``per_row`` steps per row instead of ``ceil(S / block_k)``: what makes a
    sliding window or chunked mask cost its band, not the whole row.
    """
    nq, nk = -(-t // block_q), -(-s // block_k)
    q_idx = np.arange(nq, dtype=np.int64)
    k_idx = np.arange(nk, dtype=np.int64)
    qmin = (q_idx * block_q + (s - t))[:, None]
    qmax = (np.minimum((q_idx + 1) * block_q, t) - 1 + (s - t))[:, None]
    kmin = (k_idx * block_k)[None, :]
    kmax = (np.minimum((k_idx + 1) * block_k, s) - 1)[None, :]
    some = np.ones((nq, nk), bool)
    if spec.causal:
        some &= kmin <= qmax
    if spec.window_left is not None:
        some &= kmax >= qmin - spec.window_left
    if spec.window_right is not None:
        some &= kmin <= qmax + spec.window_right
    if spec.chunk_size is not None:
        c = spec.chunk_size
        cq0, cq1, ck0, ck1 = (np.floor_divide(x, c) for x in (qmin, qmax, kmin, kmax))
        some &= (ck1 >= cq0) & (ck0 <= cq1)
    return max(1, int(some.sum(axis=1).max())), max(1, int(some.sum(axis=0).max()))


def visit_schedule(classes):
    """Loop bounds per row of block classes: ``[..., n]`` → ``[..., 4]`` int32
    ``(lo, full_lo, full_hi, hi)``.

    The kernel visits blocks ``[lo, hi)``: ``[lo, full_lo)`` and
    ``[full_hi, hi)`` with the mask, ``[full_lo, full_hi)`` without. ``lo`` is
    the first non-empty block and ``hi`` one past the last; ``[full_lo,
    full_hi)`` is the first run of FULL blocks (empty when there is none:
    ``full_lo == full_hi == hi``). A row with no visible block has ``lo == hi``.
    """
    n = classes.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    nonempty = classes != EMPTY
    full = classes == FULL
    any_nonempty = jnp.any(nonempty, axis=-1)
    lo = jnp.where(any_nonempty, jnp.argmax(nonempty, axis=-1), 0).astype(jnp.int32)
    hi = jnp.where(any_nonempty, n - jnp.argmax(nonempty[..., ::-1], axis=-1), 0).astype(jnp.int32)
    any_full = jnp.any(full, axis=-1)
    full_lo = jnp.argmax(full, axis=-1).astype(jnp.int32)
    # Length of the run of FULL blocks starting at full_lo.
    after = (idx >= full_lo[..., None]) & ~full
    run_end = jnp.where(jnp.any(after, axis=-1), jnp.argmax(after, axis=-1), n).astype(jnp.int32)
    full_lo = jnp.where(any_full, full_lo, hi)
    full_hi = jnp.where(any_full, run_end, hi)
    return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


def schedule_counts(schedule):
    """``(visited, masked, unmasked)`` block counts of a `visit_schedule` result."""
    lo, flo, fhi, hi = (schedule[..., i] for i in range(4))
    visited = hi - lo
    unmasked = fhi - flo
    return visited, visited - unmasked, unmasked


def visible_fraction(spec: MaskSpec, t: int, s: int) -> float:
    """Fraction of the ``T×S`` logits the mask keeps, for the default
    (bottom-right) positions and no segments; computed with numpy in
    row-bands (used by the FLOP model)."""
    if not spec.has_position_mask:
        return 1.0
    spec = dataclasses.replace(spec, segments=False)
    kp = np.arange(s, dtype=np.int64)[None, :]
    total = 0
    step = max(1, (1 << 22) // max(s, 1))
    for start in range(0, t, step):
        qp = np.arange(start, min(t, start + step), dtype=np.int64)[:, None] + (s - t)
        ok = np.ones((qp.shape[0], s), bool)
        if spec.causal:
            ok &= kp <= qp
        if spec.window_left is not None:
            ok &= kp >= qp - spec.window_left
        if spec.window_right is not None:
            ok &= kp <= qp + spec.window_right
        if spec.chunk_size is not None:
            ok &= np.floor_divide(qp, spec.chunk_size) == np.floor_divide(kp, spec.chunk_size)
        total += int(ok.sum())
    return total / float(max(t * s, 1))


def mask_spec_of(call) -> MaskSpec:
    """The `MaskSpec` of a checked forward attention call (a `stellax.core.Call`). ``chunk_size`` implies
    causal attention inside each chunk (Llama-4)."""
    window = call.local_window_size
    segments = any(call.arrays[n] is not None for n in
                   ("q_segment_ids", "query_seq_lengths", "key_value_seq_lengths"))
    return MaskSpec(
        causal=call.is_causal or call.chunk_size is not None,
        window_left=None if window is None else window[0],
        window_right=None if window is None else window[1],
        chunk_size=call.chunk_size,
        segments=segments,
        default_positions=call.q_positions is None,
    )
