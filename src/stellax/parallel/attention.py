"""`context_parallel_attention`: one sequence split over a mesh axis.

Every strategy is a ``jax.shard_map`` over named mesh axes: inputs are global
``[B, T, N, H]`` arrays whose sequence axis is sharded over the axis (each
device holds ``[B, T/P, N, H]``), the output is sharded the same way. Each
device knows the original positions of its tokens (`layout`), so masks hold
across shard boundaries and under load-balancing layouts.

* ``all_gather``: all-gather K/V (and their positions/segments) over the
  axis, attend the local queries to the whole sequence. Simple; K/V memory
  O(T) per device; communication ``(P−1)/P`` of K and V per device.
* ``ulysses`` (DeepSpeed-Ulysses): all-to-all from sequence-sharded to
  head-sharded (``[B, T, N/P, H]``), full-sequence attention on ``N/P``
  heads, all-to-all back. Needs ``N % P == 0``; K/V heads are repeated up to
  a multiple of ``P`` when ``K % P != 0`` (GQA/MQA). Communication per device
  ~ ``(P−1)/P²`` of q, k, v and out: independent of ``P`` in total.
* ``ring``: K/V blocks rotate around the ring (`ring.ring_attention_shard`),
  partials merged with log-sum-exp, masked-out steps skipped. Memory O(T/P).
* ``usp`` (unified sequence parallelism): Ulysses inside groups of the
  ``ulysses_axis`` and ring across the ``ring_axis`` of a 2-D mesh; the
  sequence is sharded over ``(ring_axis, ulysses_axis)`` (ring-major).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ..core import checks
from ..ops.attention.api import normalize_window
from .layout import check_divisible, check_load_balance, load_balance_permutation
from .local import F32, LocalAttention, add_sinks
from .ring import ring_attention_shard

STRATEGIES = ("all_gather", "ulysses", "ring", "usp")


# -- argument checks -------------------------------------------------------------
def _check_axis(mesh, name, what):
    if name is None:
        raise ValueError(f"{what}: required for this strategy (a mesh axis name; the mesh has {mesh.axis_names})")
    if name not in mesh.axis_names:
        raise ValueError(f"{what}: {name!r} is not an axis of the mesh (axes {mesh.axis_names}, "
                         f"shape {dict(mesh.shape)})")
    return name


def _axes(mesh, strategy, axis_name, ulysses_axis, ring_axis):
    """``(sequence axes tuple, ulysses axis | None, ring axis | None)``."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    if strategy == "usp":
        _check_axis(mesh, ulysses_axis, "ulysses_axis")
        _check_axis(mesh, ring_axis, "ring_axis")
        if ulysses_axis == ring_axis:
            raise ValueError(f"ulysses_axis and ring_axis must be different mesh axes, both are {ring_axis!r}")
        if axis_name is not None and tuple(np.atleast_1d(axis_name)) != (ring_axis, ulysses_axis):
            raise ValueError(f"axis_name: for usp pass None or (ring_axis, ulysses_axis) = "
                             f"{(ring_axis, ulysses_axis)!r}, got {axis_name!r}")
        return (ring_axis, ulysses_axis), ulysses_axis, ring_axis
    if ulysses_axis is not None or ring_axis is not None:
        raise ValueError(f"ulysses_axis/ring_axis: only for strategy='usp' (strategy is {strategy!r}; "
                         f"use axis_name)")
    if isinstance(axis_name, (tuple, list)):
        raise ValueError(f"axis_name: expected one mesh axis name for strategy {strategy!r}, got {axis_name!r} "
                         f"(for a 2-D mesh use strategy='usp' with ulysses_axis/ring_axis)")
    _check_axis(mesh, axis_name, "axis_name")
    return (axis_name,), (axis_name if strategy == "ulysses" else None), (axis_name if strategy == "ring" else None)


def _kv_repeat(n_heads: int, kv_heads: int, axis_size: int, strategy: str) -> int:
    """How many times Ulysses repeats each K/V head so that heads split evenly."""
    if n_heads % axis_size:
        raise ValueError(f"query: {strategy} shards heads over the Ulysses axis: the number of query heads "
                         f"({n_heads}) must be divisible by the axis size ({axis_size})")
    lcm = kv_heads * axis_size // math.gcd(kv_heads, axis_size)
    return lcm // kv_heads


def _check_inputs(query, key, value):
    query = checks.require_float("query", query)
    key = checks.require_float("key", key)
    value = checks.require_float("value", value)
    for name, x in (("query", query), ("key", key), ("value", value)):
        checks.require_ndim(name, x, 4)
    b, t, n, h = query.shape
    if key.shape[:2] != (b, t) or value.shape[:3] != key.shape[:3] or key.shape[3] != h:
        raise ValueError(f"key/value: context parallel attention is self-attention over one sharded sequence: "
                         f"expected key [B, T, K, H] = [{b}, {t}, K, {h}] and value [B, T, K, Hv], got key "
                         f"{tuple(key.shape)}, value {tuple(value.shape)}")
    if n % key.shape[2]:
        raise ValueError(f"key: the number of query heads ({n}) must be a multiple of the number of key/value "
                         f"heads ({key.shape[2]})")
    checks.require_same_dtype("key", key, "query", query)
    checks.require_same_dtype("value", value, "query", query)
    return query, key, value


def place(mesh, args, specs):
    """Put each array on ``mesh`` with its spec (``jax.reshard``: needed on meshes
    with explicit axes, a sharding constraint otherwise)."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    if not explicit:
        return tuple(args)
    return tuple(None if x is None else jax.reshard(x, jax.sharding.NamedSharding(mesh, spec))
                 for x, spec in zip(args, specs))


# -- per-device bodies -------------------------------------------------------------
def _seq_to_heads(x, axis):
    """``[B, L, N, D]`` sequence-sharded → ``[B, P·L, N/P, D]`` head-sharded."""
    return lax.all_to_all(x, axis, 2, 1, tiled=True)


def _heads_to_seq(x, axis):
    return lax.all_to_all(x, axis, 1, 2, tiled=True)


def _gather_seq(x, axis):
    return None if x is None else lax.all_gather(x, axis, axis=1, tiled=True)


def _head_slice(x, axis, count):
    """This device's ``count`` entries of per-head ``x [..., N]`` (heads split over ``axis``)."""
    idx = lax.axis_index(axis)
    return lax.dynamic_slice_in_dim(x, idx * count, count, axis=-1)


def context_parallel_attention_shard(q, k, v, positions, *, local: LocalAttention, strategy: str, axis_name=None,
                                     ulysses_axis=None, ring_axis=None, q_segment_ids=None, kv_segment_ids=None,
                                     sinks=None):
    """One device's part of `context_parallel_attention`, for use inside your own
    ``shard_map`` (the sequence sharded over ``axis_name``, or over
    ``(ring_axis, ulysses_axis)`` for ``usp``).

    Args:
      q, k, v: the local shards ``[B, L, N, H]``, ``[B, L, K, H]``, ``[B, L, K, Hv]``.
      positions: ``[B|1, L]`` int32 original positions of the local tokens
        (``shard_positions(T, P, layout)[shard_index]``).
      local: the per-device attention (`LocalAttention`: mask, scale, soft cap,
        implementation; ``segments=True`` when segment ids are passed).
      q_segment_ids, kv_segment_ids: ``[B, L]`` or ``None``.
      sinks: ``[N]`` sink logits (all heads, replicated) or ``None``.
    Returns ``(out [B, L, N, Hv], lse [B, N, L] float32)``.
    """
    pos, q_seg, kv_seg = positions, q_segment_ids, kv_segment_ids
    if strategy == "all_gather":
        k_all, v_all = _gather_seq(k, axis_name), _gather_seq(v, axis_name)
        return local(q, k_all, v_all, pos, _gather_seq(pos, axis_name), q_seg, _gather_seq(kv_seg, axis_name),
                     sinks)
    if strategy == "ring":
        out, lse = ring_attention_shard(q, k, v, pos, pos, q_seg, kv_seg, local=local, axis_name=axis_name,
                                        axis_size=lax.axis_size(axis_name))
        if sinks is not None:
            out, lse = add_sinks(out.astype(F32), lse, sinks)
        return out.astype(q.dtype), lse
    if strategy not in ("ulysses", "usp"):
        raise ValueError(f"strategy: expected one of {STRATEGIES}, got {strategy!r}")
    uly = axis_name if strategy == "ulysses" else ulysses_axis
    kv_rep = _kv_repeat(q.shape[2], k.shape[2], lax.axis_size(uly), strategy)
    if kv_rep > 1:  # GQA/MQA with fewer kv heads than devices: repeat them
        k, v = jnp.repeat(k, kv_rep, axis=2), jnp.repeat(v, kv_rep, axis=2)
    qh, kh, vh = (_seq_to_heads(x, uly) for x in (q, k, v))
    pos_g = _gather_seq(pos, uly)
    q_seg_g, kv_seg_g = _gather_seq(q_seg, uly), _gather_seq(kv_seg, uly)
    if sinks is not None:
        sinks = _head_slice(sinks, uly, qh.shape[2])
    if strategy == "ulysses":
        out, lse = local(qh, kh, vh, pos_g, pos_g, q_seg_g, kv_seg_g, sinks)
    else:
        out, lse = ring_attention_shard(qh, kh, vh, pos_g, pos_g, q_seg_g, kv_seg_g, local=local,
                                        axis_name=ring_axis, axis_size=lax.axis_size(ring_axis))
        if sinks is not None:
            out, lse = add_sinks(out.astype(F32), lse, sinks)
        out = out.astype(q.dtype)
    out = _heads_to_seq(out, uly)
    lse = lax.all_to_all(lse, uly, 2, 1, tiled=True)  # [B, N/U, U·L] → [B, N, L]
    return out, lse


def _body(strategy, local, axis_name, uly, ring, has_sinks):
    def body(q, k, v, pos, q_seg, kv_seg, sinks):
        return context_parallel_attention_shard(
            q, k, v, pos, local=local, strategy=strategy, axis_name=axis_name, ulysses_axis=uly, ring_axis=ring,
            q_segment_ids=q_seg, kv_segment_ids=kv_seg, sinks=sinks[0] if has_sinks else None)

    return body


def context_parallel_attention(query, key, value, *, mesh, axis_name=None, strategy="all_gather",
                               ulysses_axis=None, ring_axis=None, load_balance=None, is_causal=False,
                               local_window_size=None, chunk_size=None, segment_ids=None, q_segment_ids=None,
                               kv_segment_ids=None, scale=None, logits_soft_cap=None, sinks=None,
                               precision=None, return_residuals=False, implementation=None):
    """Self-attention over a sequence sharded across mesh axes (context parallelism).

    Args:
      query: ``[B, T, N, H]``; key, value: ``[B, T, K, H]`` / ``[B, T, K, Hv]``
        (GQA: ``N % K == 0``). Global arrays; the sequence axis is (re)sharded
        over the sequence axes, so each device computes on ``[B, T/P, ·, ·]``.
      mesh: a `jax.sharding.Mesh`.
      axis_name: the mesh axis the sequence is split over (``all_gather``,
        ``ulysses``, ``ring``).
      strategy: ``"all_gather" | "ulysses" | "ring" | "usp"``.
      ulysses_axis, ring_axis: the two mesh axes of ``usp``; the sequence is
        sharded over ``(ring_axis, ulysses_axis)``, ring-major.
      load_balance: the layout of the inputs' sequence axis: ``None``
        (contiguous), ``"zigzag"`` or ``"striped"``. The inputs (and segment
        ids) must already be laid out with `reorder_for_load_balance` for the
        total number of shards ``P``; the output comes in the same layout
        (undo with `restore_from_load_balance`).
      is_causal, local_window_size, chunk_size, scale, logits_soft_cap,
        precision: as in `stellax.dot_product_attention` (positions are the
        tokens' original positions, so they hold across shards).
      segment_ids: ``[B, T]`` ints for both queries and keys, or
        ``q_segment_ids``/``kv_segment_ids`` separately (same layout as the inputs).
      sinks: ``[N]`` per-head sink logits (counted once in each row's denominator).
      return_residuals: also return ``lse [B, N, T]`` float32 (same layout).
      implementation: the local attention implementation (see
        `stellax.dot_product_attention`).

    Returns ``out [B, T, N, Hv]`` sharded like ``query`` (or ``(out, lse)``),
    differentiable in query, key, value and sinks.
    """
    query, key, value = _check_inputs(query, key, value)
    seq_axes, uly, ring = _axes(mesh, strategy, axis_name, ulysses_axis, ring_axis)
    load_balance = check_load_balance(load_balance)
    sizes = dict(mesh.shape)
    shards = int(np.prod([sizes[a] for a in seq_axes]))
    b, t, n, _ = query.shape
    check_divisible(t, shards, load_balance, what="query: sequence length T")
    if uly is not None:
        _kv_repeat(n, key.shape[2], sizes[uly], strategy)  # raises when the heads do not split
    if segment_ids is not None:
        if q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError("segment_ids: pass either segment_ids or q_segment_ids/kv_segment_ids, not both")
        q_segment_ids = kv_segment_ids = segment_ids
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids/kv_segment_ids: pass both or neither")
    segments = q_segment_ids is not None
    if segments:
        for name, s in (("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
            checks.require_int(name, s)
            checks.require_shape(name, s, (b, t), "[B, T]")
        q_segment_ids = jnp.asarray(q_segment_ids, jnp.int32)
        kv_segment_ids = jnp.asarray(kv_segment_ids, jnp.int32)
    if sinks is not None:
        sinks = checks.require_float("sinks", sinks)
        checks.require_shape("sinks", sinks, (n,), "[N], one logit per query head")
    if scale is not None:
        scale = float(scale)
    if logits_soft_cap is not None:
        logits_soft_cap = checks.require_positive_float("logits_soft_cap", logits_soft_cap)
    if isinstance(implementation, list):
        implementation = tuple(implementation)
    local = LocalAttention(is_causal=bool(is_causal), window=normalize_window(local_window_size),
                           chunk_size=chunk_size, scale=scale, logits_soft_cap=logits_soft_cap,
                           precision=precision, implementation=implementation, segments=segments)

    seq = seq_axes if len(seq_axes) > 1 else seq_axes[0]
    pos = jnp.asarray(load_balance_permutation(t, shards, load_balance))[None, :]
    x_spec, s_spec = P(None, seq, None, None), P(None, seq)
    tiled_sinks = None if sinks is None else jnp.broadcast_to(sinks[None], (shards, n))
    body = _body(strategy, local, seq_axes[0] if strategy != "usp" else None, uly, ring, sinks is not None)
    fn_specs = (x_spec, x_spec, x_spec, s_spec, s_spec, s_spec, P(seq, None))
    fn = jax.shard_map(body, mesh=mesh, in_specs=fn_specs, out_specs=(x_spec, P(None, None, seq)), check_vma=False)
    args = (query, key, value, pos, q_segment_ids, kv_segment_ids, tiled_sinks)
    out, lse = fn(*place(mesh, args, fn_specs))
    return (out, lse) if return_residuals else out
