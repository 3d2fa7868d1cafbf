"""Token movement: sort token copies by expert (`permute`) and combine the
expert outputs back per token (`unpermute`).

``permute(x [T, D], expert_ids [T, k], E)``: copy ``i = t·k + j`` of token
``t`` goes to expert ``expert_ids[t, j]``. The copies are sorted by expert
with a *stable* sort (ties keep token order), so

    rows[p]         = x[permutation[p] // k]
    group_sizes[e]  = number of copies routed to e

With ``capacity_factor`` each expert keeps at most
``C = ceil(capacity_factor · T·k / E)`` copies (the first in token order);
dropped copies are moved behind all kept rows (``rows`` there are zero, and
past ``sum(group_sizes)`` a grouped matmul gives zeros), and
``dropped[e]`` counts them.

``unpermute(y [T·k, D], permutation, weights [T, k])``:

    out[t] = Σ_j weights[t, j] · y[p(t, j)]   where permutation[p(t, j)] = t·k + j

Bad data. Eagerly, expert ids outside ``[0, E)`` and permutations that are
not a permutation of ``[0, T·k)`` raise `ValueError`. Under ``jit`` (values
unknown on the host), in checked mode (`stellax.checked`) both are
``checkify`` checks naming the argument and the first bad value; without
checks:

* `permute`: a copy with an expert id outside ``[0, E)`` (e.g. ``E`` or
  ``-1``) is *dropped*: sorted behind every kept row, its row zero, counted in
  no group (nor in ``dropped``), so through a grouped matmul and `unpermute`
  it contributes zero, like a copy dropped by the capacity;
* `unpermute`: an entry outside ``[0, T·k)`` (negative entries are not
  wrapped) or repeated leaves some copy with zero or several rows; every
  token with such a copy gets NaN in its whole output row (the other tokens
  are exact). `permute` always returns a valid permutation.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ...core import checks
from ...core.runtime_checks import require
from .checks import reject_expert_ids


def _check_ids(expert_ids, tokens: int, num_experts):
    expert_ids = checks.require_int("expert_ids", expert_ids)
    checks.require_ndim("expert_ids", expert_ids, 2)
    checks.require_shape("expert_ids", expert_ids, (tokens, None), "x.shape[0], k")
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise TypeError(f"num_experts: expected a positive int, got {type(num_experts).__name__} {num_experts!r}")
    if num_experts < 1:
        raise ValueError(f"num_experts: expected a positive int, got {num_experts!r}")
    reject_expert_ids(expert_ids, num_experts, "num_experts")
    return expert_ids


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Copies an expert keeps: ``ceil(capacity_factor · tokens · top_k / num_experts)``."""
    return int(math.ceil(capacity_factor * tokens * top_k / num_experts))


def sort_by_expert(flat_ids, num_experts: int, cap: int | None):
    """``(order, group_sizes, dropped)`` of token copies with expert ids ``flat_ids``."""
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat_ids].add(1, mode="drop")
    order = jnp.argsort(flat_ids, stable=True).astype(jnp.int32)
    if cap is None:
        return order, counts, jnp.zeros_like(counts)
    sorted_ids = flat_ids[order]
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(flat_ids.shape[0], dtype=jnp.int32) - starts[sorted_ids]
    # Kept copies first (by expert), dropped copies after them (stable again).
    key = jnp.where(rank < cap, sorted_ids, num_experts)
    order = order[jnp.argsort(key, stable=True)]
    kept = jnp.minimum(counts, cap)
    return order, kept, counts - kept


def permute(x, expert_ids, num_experts, *, capacity_factor=None):
    """Expert-sorted copies of the tokens.

    Args:
      x: ``[T, D]`` tokens.
      expert_ids: ``[T, k]`` int expert of each copy (from `route`).
      num_experts: ``E``.
      capacity_factor: ``None`` (dropless) or a positive float: each expert
        keeps at most ``ceil(capacity_factor · T·k / E)`` copies.

    Returns:
      ``(rows [T·k, D], group_sizes [E] int32, permutation [T·k] int32)``,
      plus ``dropped [E] int32`` when ``capacity_factor`` is given.
      ``permutation[p]`` is the copy index ``t·k + j`` of row ``p``.

    Data-dependent check: ``expert_ids`` in ``[0, E)`` (eagerly a `ValueError`; under ``jit`` a
    ``checkify`` check in checked mode). Without checks a copy with an id outside ``[0, E)`` is
    dropped: behind all kept rows, its row zero, in no group (its contribution is zero).
    """
    x = checks.as_array("x", x)
    checks.require_ndim("x", x, 2)
    expert_ids = _check_ids(expert_ids, x.shape[0], num_experts)
    top_k = expert_ids.shape[1]
    cap = None
    if capacity_factor is not None:
        capacity_factor = checks.require_positive_float("capacity_factor", capacity_factor)
        cap = capacity(x.shape[0], top_k, num_experts, capacity_factor)
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    bad = lambda: (flat < 0) | (flat >= num_experts)
    first = lambda: jnp.argmax(bad())
    require(lambda: ~jnp.any(bad()),
            f"expert_ids[{{token}}, {{slot}}]: expected an expert in [0, {num_experts}) (num_experts), got {{value}}",
            token=lambda: first() // top_k, slot=lambda: first() % top_k, value=lambda: flat[first()])
    # Traced ids outside [0, E) (eagerly an error): the copy is dropped — sorted
    # behind every kept row, its row zero, counted in no group.
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, int(num_experts))
    order, group_sizes, dropped = sort_by_expert(flat, int(num_experts), cap)
    rows = x[order // top_k]
    kept = jnp.arange(order.shape[0]) < jnp.sum(group_sizes)
    rows = jnp.where(kept[:, None], rows, jnp.zeros((), rows.dtype))
    if cap is not None:
        return rows, group_sizes, order, dropped
    return rows, group_sizes, order


def _in_range(permutation):
    """``permutation`` with entries outside ``[0, n)`` moved to ``n`` (dropped by a scatter; a
    negative entry is *not* wrapped around as a Python index would be)."""
    n = permutation.shape[0]
    return jnp.where((permutation >= 0) & (permutation < n), permutation, n)


def inverse_permutation(permutation):
    """``inverse[permutation[p]] = p``; ``-1`` where no entry points (out-of-range entries, negative
    ones included, are dropped)."""
    return jnp.full_like(permutation, -1).at[_in_range(permutation)].set(
        jnp.arange(permutation.shape[0], dtype=permutation.dtype), mode="drop")


def _require_permutation(permutation, n: int) -> None:
    """Checked mode: every entry in ``[0, n)``, every copy exactly once."""
    outside = lambda: (permutation < 0) | (permutation >= n)
    first = lambda: jnp.argmax(outside())
    require(lambda: ~jnp.any(outside()),
            f"permutation[{{index}}]: expected a copy index in [0, {n}) (y.shape[0]), got {{value}}",
            index=first, value=lambda: permutation[first()])
    counts = lambda: jnp.zeros((n,), jnp.int32).at[_in_range(permutation)].add(1, mode="drop")
    require(lambda: jnp.all(counts() == 1),
            f"permutation: expected a permutation of [0, {n}) (each copy once), got copy {{copy}} {{times}} times",
            copy=lambda: jnp.argmax(counts() != 1), times=lambda: counts()[jnp.argmax(counts() != 1)])


def unpermute(y, permutation, weights):
    """Weighted combine of expert outputs back to tokens → ``[T, D]`` in ``y.dtype``.

    Args:
      y: ``[T·k, D]`` expert outputs in the order of `permute`'s rows.
      permutation: ``[T·k]`` from `permute`.
      weights: ``[T, k]`` routing weights (from `route`).

    Data-dependent check: ``permutation`` is a permutation of ``[0, T·k)`` (eagerly a
    `ValueError`; under ``jit`` two ``checkify`` checks in checked mode: entries in range, each
    copy once). Without checks, every token one of whose copies has no row or several rows (an
    entry out of range, negative included, or repeated) gets a NaN output row; the other tokens
    are exact.
    """
    y = checks.as_array("y", y)
    checks.require_ndim("y", y, 2)
    permutation = checks.require_int("permutation", permutation)
    checks.require_shape("permutation", permutation, (y.shape[0],), "y.shape[0]")
    weights = checks.require_float("weights", weights)
    checks.require_ndim("weights", weights, 2)
    tokens, top_k = weights.shape
    if tokens * top_k != y.shape[0]:
        raise ValueError(f"weights: expected shape (T, k) with T·k = y.shape[0] = {y.shape[0]}, "
                         f"got {tuple(weights.shape)}")
    perm = checks.concrete_values(permutation)
    if perm is not None:
        n = y.shape[0]
        bad = np.nonzero((perm < 0) | (perm >= n))[0]
        if bad.size:
            raise ValueError(f"permutation[{int(bad[0])}]: expected a copy index in [0, {n}) (y.shape[0]), "
                             f"got {int(perm[bad[0]])}")
        if np.unique(perm).size != n:
            raise ValueError(f"permutation: expected a permutation of [0, {n}) (each copy once), got repeated "
                             "entries")
    permutation = permutation.astype(jnp.int32)
    _require_permutation(permutation, y.shape[0])
    inverse = inverse_permutation(permutation)
    copies = jnp.where((inverse >= 0)[:, None], y[jnp.maximum(inverse, 0)], jnp.zeros((), y.dtype))
    copies = copies.reshape(tokens, top_k, y.shape[1])
    # A weighted sum over the k copies, in float32 products and adds (not a dot: it is exact at any
    # `precision`, and a k-long contraction gains nothing from the matrix unit).
    out = jnp.sum(weights.astype(jnp.float32)[:, :, None] * copies.astype(jnp.float32), axis=1)
    if perm is None:
        # Traced: an out-of-range or repeated entry leaves copies with zero or several rows; the
        # tokens of those copies are NaN (a few ops on T·k integers and one select on the output).
        counts = jnp.zeros((y.shape[0],), jnp.int32).at[_in_range(permutation)].add(1, mode="drop")
        whole = jnp.all((counts == 1).reshape(tokens, top_k), axis=1)
        out = jnp.where(whole[:, None], out, jnp.nan)
    return out.astype(y.dtype)
