"""The paged KV cache: layout, creation and `update_kv_cache` (`validate` is in `validation`),
and the query layout the paths read it with (`with_query_axis`).

Layout (vLLM / FlashAttention): ``k_pages``, ``v_pages`` ``[num_pages,
page_size, K, H]``, or one combined ``kv_pages [num_pages, page_size, 2, K,
H]`` (keys at index 0, values at 1); MLA caches have no head axis
(``[num_pages, page_size, R]``). A sequence's token at position ``p`` lives
in page ``block_tables[b, p // page_size]`` at offset ``p % page_size``;
``slot = page * page_size + offset`` addresses it in the flattened pool.
Any page pool may be a `QuantizedPages` (see `quant_cache`).

Behaviour on out-of-range metadata under ``jit`` (where values cannot be
checked; call `validate` eagerly, or use checked mode, `stellax.checked`, to
get errors instead; docs/paged_attention.md): the kernels read clamped
metadata (lengths into ``[0, max_pages * page_size]``, table entries into
``[0, num_pages)``, ``cu_q_lens`` into ``[0, total_q]`` made non-decreasing,
``num_seqs`` into ``[0, S]``) and the output rows of the sequences whose
metadata is invalid are then NaN (`validation.bad_batch_rows`,
`validation.bad_ragged_tokens`); update slots outside ``[0, num_pages *
page_size)`` are skipped like padding (negative slots), and of a slot written
by several tokens the last write wins (`_flat_index`).

No kernel reads outside its arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core import checks
from ...core.runtime_checks import require

from .quant_cache import (
    KVQuant, PagedData, QuantizedPages, codes_for_range, init_quantized_pages, load_codes, pool_rotation,
    quantize_rows, rotate, store_codes,
)


# -- sources: one paged tensor as the kernels see it ---------------------------------
@dataclasses.dataclass(frozen=True)
class Source(PagedData):
    """One paged tensor normalized for the kernels: ``data [NP, PS, K, H']``
    (or the combined ``[NP, PS, 2, K, H]`` with ``part`` 0/1), and for a
    quantized pool its scales, zero points, rotation signs and windows (all
    with a head axis)."""

    data: Any
    part: int | None = None
    scale: Any = None
    zero: Any = None
    signs: Any = None
    window: Any = None
    spec: KVQuant | None = None
    head_dim: int = 0

    @property
    def quantized(self) -> bool:
        return self.spec is not None

    @property
    def num_heads(self) -> int:
        return self.data.shape[-2]


def as_source(pages, part: int | None = None) -> Source:
    """Normalize a page pool (dense, combined or quantized, with or without a
    head axis) to a `Source`."""
    if isinstance(pages, QuantizedPages):
        p = pages.with_heads()
        return Source(p.data, None, p.scale, p.zero, p.signs, p.window, p.spec, p.head_dim)
    if part is None and pages.ndim == 3:
        pages = pages[:, :, None, :]
    return Source(pages, part, head_dim=pages.shape[-1])


def pool_entries(prefix: str, pages) -> tuple[dict, dict]:
    """A pool as named `Call` arrays and options (quantized pools are split into
    their arrays; the spec goes to the options)."""
    if isinstance(pages, QuantizedPages):
        arrays = {f"{prefix}_pages": pages.data, f"{prefix}_scale": pages.scale, f"{prefix}_zero": pages.zero,
                  f"{prefix}_signs": pages.signs, f"{prefix}_window": pages.window}
        return arrays, {f"{prefix}_quant": pages.spec, f"{prefix}_head_dim": pages.head_dim}
    return {f"{prefix}_pages": pages}, {f"{prefix}_quant": None}


def pool_from_call(call, prefix: str):
    """Inverse of `pool_entries`: the dense array or `QuantizedPages` (or None)."""
    data = call.arrays.get(f"{prefix}_pages")
    spec = call.options.get(f"{prefix}_quant")
    if data is None or spec is None:
        return data
    a = call.arrays
    return QuantizedPages(data, a[f"{prefix}_scale"], a[f"{prefix}_zero"], a[f"{prefix}_signs"],
                          a[f"{prefix}_window"], spec, call.options[f"{prefix}_head_dim"])


def pages_shape(pages) -> tuple:
    """Logical shape of a page pool (``QuantizedPages`` included)."""
    return tuple(pages.shape)


def pages_dtype(pages):
    """The dtype values of a pool are read as (``None`` for a quantized pool)."""
    return None if isinstance(pages, QuantizedPages) else pages.dtype


# -- queries: the layout every path reads the cache with --------------------------------
def with_query_axis(*queries):
    """``(squeeze, *queries)`` with each query ``[B, Q, N, H]``: decode queries ``[B, N, H]`` (the
    first one's rank decides) get a query axis of one, which ``squeeze`` says to drop from the output
    (`paged_attention` / `mla_decode`: the golden and `plan`)."""
    squeeze = queries[0].ndim == 3
    return (squeeze, *(q[:, None] if squeeze else q for q in queries))


# -- creation -------------------------------------------------------------------------
def _as_spec(name: str, spec) -> KVQuant | None:
    if spec is None or isinstance(spec, KVQuant):
        return spec
    if isinstance(spec, str):
        return KVQuant(spec)
    raise TypeError(f"{name}: expected a KVQuant, a format name or None, got {type(spec).__name__} {spec!r}")


def init_kv_cache(num_pages: int, page_size: int, num_kv_heads: int | None, head_dim: int, *,
                  dtype=jnp.bfloat16, quant: KVQuant | str | None = None,
                  value_quant: KVQuant | str | None = "same", value_head_dim: int | None = None,
                  max_seqs: int | None = None, combined: bool = False, key_rotation=None, value_rotation=None):
    """An empty (zero) paged cache ``(k_pages, v_pages)``.

    Args:
      num_pages, page_size, num_kv_heads, head_dim: the pool's shape
        (``num_kv_heads=None`` gives the head-less MLA layout).
      dtype: the dtype of dense pools.
      quant: a `KVQuant` (or format name) for keys; ``None`` keeps them dense.
      value_quant: the same for values (default ``"same"``: as ``quant``;
        ``None``: dense values).
      value_head_dim: head dim of the values (default ``head_dim``).
      max_seqs: sequence rows of the full-precision windows (when a spec has them).
      combined: one ``kv_pages [num_pages, page_size, 2, K, H]`` array
        (dense only); returns ``(kv_pages, None)``.
      key_rotation, value_rotation: calibrated orthogonal rotations ``[K, H,
        H]`` (one layer of `calibrate_kv_rotation`'s result; ``[H, H]`` for
        the head-less layout) for a quantized key / value pool, used instead
        of the spec's random Hadamard rotation: `update_kv_cache` stores
        ``R x``, attention folds ``R_K`` into the query and applies ``R_Vᵀ``
        to the output.
    """
    num_pages = checks.require_count("num_pages", num_pages)
    page_size = checks.require_count("page_size", page_size)
    if num_kv_heads is not None:
        num_kv_heads = checks.require_count("num_kv_heads", num_kv_heads)
    head_dim = checks.require_count("head_dim", head_dim)
    if value_head_dim is not None:
        value_head_dim = checks.require_count("value_head_dim", value_head_dim)
    if max_seqs is not None:
        max_seqs = checks.require_count("max_seqs", max_seqs)
    try:
        dtype = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"dtype: expected a floating dtype, got {dtype!r}") from e
    if dtype not in tuple(np.dtype(d) for d in checks.FLOAT_DTYPES):
        raise TypeError(f"dtype: expected one of float32, bfloat16, float16, got {dtype.name}")
    quant = _as_spec("quant", quant)
    value_quant = quant if isinstance(value_quant, str) and value_quant == "same" else _as_spec(
        "value_quant", value_quant)
    heads = () if num_kv_heads is None else (num_kv_heads,)
    vdim = head_dim if value_head_dim is None else value_head_dim
    for dim in {head_dim, vdim}:  # before any array is built: huge extents abort XLA
        checks.require_extent("init_kv_cache", (num_pages, page_size, 2, *heads, dim), dtype.itemsize)
    if max_seqs is not None:
        checks.require_extent("max_seqs", (max_seqs, page_size, *heads, max(head_dim, vdim)), 4)
    for name, rotation, spec in (("key_rotation", key_rotation, quant), ("value_rotation", value_rotation,
                                                                            value_quant)):
        if rotation is not None and spec is None:
            raise ValueError(f"{name}: a rotation is for a quantized pool; the "
                             f"{'key' if name == 'key_rotation' else 'value'} pool is dense (its quant is None)")
    if combined:
        if quant is not None or value_quant is not None or vdim != head_dim or num_kv_heads is None:
            raise ValueError("combined: the combined kv_pages layout is for dense caches with equal head dims")
        return jnp.zeros((num_pages, page_size, 2, num_kv_heads, head_dim), dtype), None

    def make(spec, dim, rotation, name):
        if spec is None:
            return jnp.zeros((num_pages, page_size, *heads, dim), dtype)
        if rotation is not None or spec.rotation == "calibrated":
            spec, rotation = pool_rotation(spec, rotation, num_kv_heads, dim, name)
        return init_quantized_pages(num_pages, page_size, num_kv_heads, dim, spec, max_seqs=max_seqs,
                                    rotation=rotation)

    return make(quant, head_dim, key_rotation, "key_rotation"), make(value_quant, vdim, value_rotation,
                                                                     "value_rotation")


# -- update ----------------------------------------------------------------------------
def _written_again(slots):
    """Bool ``[T]``: token ``t``'s slot is written again by a later token (``slots[u] == slots[t]``,
    ``u > t``). A stable sort puts equal slots together in token order; all but the last of a run
    are overwritten."""
    if slots.shape[0] < 2:
        return jnp.zeros(slots.shape, bool)
    order = jnp.argsort(slots, stable=True)
    ordered = slots[order]
    again = jnp.concatenate([ordered[1:] == ordered[:-1], jnp.zeros((1,), bool)])
    return jnp.zeros(slots.shape, bool).at[order].set(again, unique_indices=True)


def _flat_index(slot_mapping, capacity: int):
    """Slots → flat indices; padding (negative) slots, slots past the pool and slots that a later
    token writes again → ``capacity`` (dropped). The in-range indices left are unique, so the scatter
    is deterministic: the last write of a slot wins, on every backend."""
    slots = slot_mapping.astype(jnp.int32)
    valid = (slots >= 0) & (slots < capacity) & ~_written_again(slots)
    return jnp.where(valid, slots, capacity), valid


def _scatter_rows(pages, rows, index):
    """``pages [NP, PS, ...]``: set flattened row ``index[t]`` to ``rows[t]`` (drop index = NP·PS)."""
    flat = pages.reshape(pages.shape[0] * pages.shape[1], *pages.shape[2:])
    flat = flat.at[index].set(rows.astype(pages.dtype), mode="drop", unique_indices=False)
    return flat.reshape(pages.shape)


def _update_dense(pages, new, slot_mapping):
    index, _ = _flat_index(slot_mapping, pages.shape[0] * pages.shape[1])
    return _scatter_rows(pages, new, index)


def _segments(keys):
    """Tokens sharing a key (e.g. a quantization group) → one segment id per
    token in ``[0, T)`` and the tokens' order (for segment reductions)."""
    order = jnp.argsort(keys, stable=True)
    sorted_keys = keys[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_keys[1:] != sorted_keys[:-1]])
    seg_sorted = jnp.cumsum(starts.astype(jnp.int32)) - 1
    seg = jnp.zeros_like(seg_sorted).at[order].set(seg_sorted)
    return seg


def _update_token_groups(pages: QuantizedPages, x, slot_mapping):
    """Write rotated float rows ``x [T, K, H]`` into a pool with per-channel
    token groups (KIVI). A group's range is the union of its existing range
    and the new tokens' unless the group's first slot is written now (a fresh
    group: tokens are appended in order, so its old contents are stale). The
    group's other codes are re-encoded in the new range."""
    spec = pages.spec
    num_pages, page_size = pages.data.shape[:2]
    g = spec.group(pages.head_dim)
    ngroups = page_size // g
    capacity = num_pages * page_size
    index, valid = _flat_index(slot_mapping, capacity)
    slot = jnp.where(valid, index, 0)
    page, off = slot // page_size, slot % page_size
    gid = jnp.where(valid, page * ngroups + off // g, num_pages * ngroups)
    seg = _segments(gid)
    t = x.shape[0]
    lo_new = jax.ops.segment_min(x, seg, num_segments=t)[seg]
    hi_new = jax.ops.segment_max(x, seg, num_segments=t)[seg]
    first = jax.ops.segment_max(((off % g) == 0).astype(jnp.int32), seg, num_segments=t)[seg] > 0
    gidx = jnp.where(valid, gid, 0)
    gpage, ggrp = gidx // ngroups, gidx % ngroups
    old_scale = pages.scale[gpage, ggrp].astype(jnp.float32)          # [T, K, H]
    fresh = first[:, None, None]
    # Old codes of the whole group [T, g, K, H].
    group_slots = (gpage * page_size + ggrp * g)[:, None] + jnp.arange(g)[None, :]
    flat_data = pages.data.reshape(capacity, *pages.data.shape[2:])
    old_codes = load_codes(flat_data[group_slots], spec)
    if spec.symmetric:
        amax_new = jnp.maximum(jnp.abs(lo_new), jnp.abs(hi_new))
        amax = jnp.where(fresh, amax_new, jnp.maximum(amax_new, old_scale * spec.qmax))
        scale = (amax / spec.qmax).astype(spec.scale_dtype)
        s = scale.astype(jnp.float32)
        safe = jnp.where(s > 0, s, 1.0)
        old_vals = old_codes * old_scale[:, None]

        def encode(v, safe_b):
            q = v / safe_b
            q = jnp.round(q) if spec.format == "int8" else q
            return jnp.clip(q, -spec.qmax, spec.qmax)

        group_codes = encode(old_vals, safe[:, None])
        new_codes = encode(x, safe)
        zero = None
    else:
        old_zero = pages.zero[gpage, ggrp].astype(jnp.float32)
        old_hi = old_zero + old_scale * spec.qmax
        lo = jnp.where(fresh, lo_new, jnp.minimum(lo_new, old_zero))
        hi = jnp.where(fresh, hi_new, jnp.maximum(hi_new, old_hi))
        new_codes, scale, zero = codes_for_range(x, lo, hi, spec)
        s = scale.astype(jnp.float32)
        z = zero.astype(jnp.float32)
        safe = jnp.where(s > 0, s, 1.0)
        old_vals = old_codes * old_scale[:, None] + old_zero[:, None]
        group_codes = jnp.clip(jnp.round((old_vals - z[:, None]) / safe[:, None]), 0, spec.qmax)
    # Re-encoded groups first (tokens of one group write identical values), then the new tokens.
    drop = jnp.where(valid[:, None], group_slots, capacity)
    group_data = store_codes(group_codes, spec)
    flat_data = flat_data.at[drop.reshape(-1)].set(
        group_data.reshape(-1, *group_data.shape[2:]), mode="drop")
    flat_data = flat_data.at[index].set(store_codes(new_codes, spec), mode="drop")
    gdrop = jnp.where(valid, gid, num_pages * ngroups)
    flat_scale = pages.scale.reshape(num_pages * ngroups, *pages.scale.shape[2:])
    flat_scale = flat_scale.at[gdrop].set(scale, mode="drop")
    new_zero = None
    if zero is not None:
        flat_zero = pages.zero.reshape(num_pages * ngroups, *pages.zero.shape[2:])
        new_zero = flat_zero.at[gdrop].set(zero, mode="drop").reshape(pages.zero.shape)
    return dataclasses.replace(pages, data=flat_data.reshape(pages.data.shape),
                               scale=flat_scale.reshape(pages.scale.shape), zero=new_zero)


def _update_windows(window, x, slot_valid, positions, seq_ids, spec: KVQuant):
    """Write rows ``x [T, ...]`` (rotated) into the full-precision windows
    ``[rows, W, ...]``: positions < sink_tokens to their sink slot, and the last
    ``recent_tokens`` positions written per sequence to the recent ring."""
    rows, w = window.shape[:2]
    sink, recent = spec.sink_tokens, spec.recent_tokens
    pos = positions.astype(jnp.int32)
    seq = seq_ids.astype(jnp.int32)
    valid = slot_valid & (pos >= 0) & (seq >= 0) & (seq < rows)
    seq_c = jnp.where(valid, seq, 0)
    flat = window.reshape(rows * w, *window.shape[2:])
    drop = rows * w
    vals = x.astype(window.dtype)
    if sink:
        idx = jnp.where(valid & (pos < sink), seq_c * w + pos, drop)
        flat = flat.at[idx].set(vals, mode="drop")
    if recent:
        last = jax.ops.segment_max(jnp.where(valid, pos, -1), seq_c, num_segments=rows)[seq_c]
        keep = valid & (pos > last - recent)
        idx = jnp.where(keep, seq_c * w + sink + pos % recent, drop)
        flat = flat.at[idx].set(vals, mode="drop")
    return flat.reshape(window.shape)


def _update_quantized(pages: QuantizedPages, new, slot_mapping, positions, seq_ids, name: str):
    spec = pages.spec
    squeeze = not pages.has_heads
    p = pages.with_heads()
    x = new.astype(jnp.float32)
    if squeeze:
        x = x[:, None, :]
    if p.signs is not None:
        x = rotate(x, p.signs)
    capacity = p.data.shape[0] * p.data.shape[1]
    index, valid = _flat_index(slot_mapping, capacity)
    if spec.group_axis == "head_dim":
        data, scale, zero = quantize_rows(x, spec)
        p = dataclasses.replace(
            p, data=_scatter_rows(p.data, data, index), scale=_scatter_rows(p.scale, scale, index),
            zero=None if zero is None else _scatter_rows(p.zero, zero, index))
    else:
        p = _update_token_groups(p, x, slot_mapping)
    if p.window is not None:
        if positions is None or seq_ids is None:
            raise ValueError(f"{name}: a cache with sink/recent windows needs positions and seq_ids "
                             "(the token's position in its sequence and the sequence's window row)")
        p = dataclasses.replace(p, window=_update_windows(p.window, x, valid, positions, seq_ids, spec))
    return p.without_heads() if squeeze else p


def _check_new(name, new, pages, slot_mapping):
    shape = tuple(pages.shape[2:])
    if not hasattr(new, "shape") or tuple(new.shape) != (slot_mapping.shape[0], *shape):
        got = getattr(new, "shape", type(new).__name__)
        raise ValueError(f"{name}: expected shape {(slot_mapping.shape[0], *shape)} "
                         f"([T_new, *pages.shape[2:]]), got {tuple(got) if isinstance(got, tuple) else got}")
    if not jnp.issubdtype(new.dtype, jnp.floating):
        raise TypeError(f"{name}: expected a floating dtype, got {np.dtype(new.dtype).name}")


def _require_slots(slot_mapping, shape) -> None:
    """Checked mode: every slot is padding (negative) or in ``[0, num_pages * page_size)``, and no slot
    is written twice (the first repeat in token order is named, with the token that wrote it first)."""
    capacity = shape[0] * shape[1]
    slots = slot_mapping.astype(jnp.int32)
    past = lambda: slots >= capacity
    require(lambda: ~jnp.any(past()),
            f"slot_mapping[{{index}}] = {{value}}: expected a slot in [0, {capacity}) (num_pages {shape[0]} x "
            f"page_size {shape[1]}) or a negative padding slot",
            index=lambda: jnp.argmax(past()), value=lambda: slots[jnp.argmax(past())])
    if slots.shape[0] < 2:
        return

    def first_repeat():  # (index, earlier index) of the first token whose slot an earlier token wrote
        order = jnp.argsort(slots, stable=True)
        ordered = slots[order]
        repeat = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
        j = jnp.argmin(jnp.where(repeat, order[1:], slots.shape[0]))
        return repeat[j], order[1:][j], order[:-1][j]

    require(lambda: ~first_repeat()[0],
            "slot_mapping[{index}] = {slot}: the slot is already written by slot_mapping[{earlier}]; expected "
            "unique slots (without checks the last write of a slot wins)",
            index=lambda: first_repeat()[1], slot=lambda: slots[first_repeat()[1]],
            earlier=lambda: first_repeat()[2])


def update_kv_cache(k_pages, v_pages, new_k, new_v, slot_mapping, *, positions=None, seq_ids=None):
    """Write new tokens into a paged cache; returns the new ``(k_pages, v_pages)``.

    Functional: the inputs are not modified. Under ``jax.jit`` with the pools
    donated (``donate_argnums``) XLA performs the scatter in place.

    Args:
      k_pages, v_pages: page pools ``[num_pages, page_size, (K,) H]``, dense or
        `QuantizedPages`; or a combined ``kv_pages [num_pages, page_size, 2, K,
        H]`` with ``v_pages=None`` (then ``(kv_pages, None)`` is returned).
      new_k, new_v: ``[T_new, (K,) H]`` rows to write.
      slot_mapping: ``[T_new]`` int: ``slot = page * page_size + offset``;
        a negative slot is padding and skipped (as are slots past the pool).
        Slots should be unique. A repeated slot is well defined: the last
        write wins (the row of the last token in ``slot_mapping`` order with
        that slot; the earlier ones are dropped like padding, in dense and
        quantized pools and their windows alike), deterministically, eagerly
        and under ``jit``, on every backend. Data-dependent checks: in
        checked mode (`stellax.checked`) a slot past the pool or a repeated
        slot is a checkify error naming ``slot_mapping``, the index and the
        slot (for a repeat, the first repeating token and the token that
        wrote the slot before it); without checks the first is dropped, the
        second keeps the last write.
      positions, seq_ids: ``[T_new]`` int, needed only by quantized pools
        with full-precision windows: each token's position in its sequence
        and the sequence's window row.

    Quantized pools quantize on write (after the rotation when on); groups
    along the token axis (KIVI) are re-ranged as tokens arrive.
    """
    k_pages, v_pages, new_k, new_v, slot_mapping, positions, seq_ids = (
        jnp.asarray(a) if isinstance(a, np.ndarray) else a
        for a in (k_pages, v_pages, new_k, new_v, slot_mapping, positions, seq_ids))
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not (pages is None and name == "v_pages") and not isinstance(pages, (QuantizedPages, jax.Array)) \
                and not hasattr(pages, "aval"):
            raise TypeError(f"{name}: expected an array or QuantizedPages, got {type(pages).__name__}")
    if not (hasattr(slot_mapping, "dtype") and jnp.issubdtype(slot_mapping.dtype, jnp.integer)):
        got = np.dtype(slot_mapping.dtype).name if hasattr(slot_mapping, "dtype") else type(slot_mapping).__name__
        raise TypeError(f"slot_mapping: expected an integer array, got {got}")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping: expected rank 1 [T_new], got shape {tuple(slot_mapping.shape)}")
    for name, value in (("positions", positions), ("seq_ids", seq_ids)):
        if value is not None and tuple(value.shape) != tuple(slot_mapping.shape):
            raise ValueError(f"{name}: expected shape {tuple(slot_mapping.shape)} (slot_mapping's), "
                             f"got {tuple(value.shape)}")
    _require_slots(slot_mapping, pages_shape(k_pages))
    if v_pages is None:
        if isinstance(k_pages, QuantizedPages) or k_pages.ndim != 5 or k_pages.shape[2] != 2:
            raise ValueError("v_pages: None is only allowed with a combined kv_pages [num_pages, page_size, 2, K, H]")
        _check_new("new_k", new_k, k_pages[:, :, 0], slot_mapping)
        _check_new("new_v", new_v, k_pages[:, :, 1], slot_mapping)
        rows = jnp.stack([new_k.astype(k_pages.dtype), new_v.astype(k_pages.dtype)], axis=1)
        return _update_dense(k_pages, rows, slot_mapping), None
    out = []
    for name, pages, new in (("k_pages", k_pages, new_k), ("v_pages", v_pages, new_v)):
        _check_new("new_k" if name == "k_pages" else "new_v", new, pages, slot_mapping)
        if isinstance(pages, QuantizedPages):
            out.append(_update_quantized(pages, new, slot_mapping, positions, seq_ids, name))
        else:
            out.append(_update_dense(pages, new, slot_mapping))
    return tuple(out)
