"""Sequence layouts for context parallelism: which tokens each shard holds.

A sequence of ``T`` tokens is cut into ``P`` shards of ``L = T / P`` tokens.
The *layout* is a permutation ``perm`` of ``range(T)``: global slot ``g``
(shard ``g // L``, local index ``g % L``) holds the token at original
position ``perm[g]``.

* ``None`` (contiguous): ``perm = arange(T)``; shard ``i`` holds
  ``[i·L, (i+1)·L)``. Under a causal mask shard ``i`` does ``i + 1`` blocks
  of work: the last shard does ``P`` times the first one's.
* ``"zigzag"`` (dual chunk swap): the sequence is cut into ``2P`` chunks of
  ``c = T / 2P``; shard ``i`` holds chunks ``i`` and ``2P − 1 − i``, so every
  shard does the same causal work.
* ``"striped"`` (round robin): shard ``i`` holds tokens ``i, i + P, i + 2P, …``.

`reorder_for_load_balance` applies the permutation to a global array before
sharding and `restore_from_load_balance` undoes it. The attention functions
take the layout as ``load_balance`` and give every token its true position,
so the masks (causal, window, chunk) follow the reordering and results equal
the unpermuted computation.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ..core import checks

LOAD_BALANCE_STRATEGIES = (None, "zigzag", "striped")


def check_load_balance(load_balance):
    if load_balance not in LOAD_BALANCE_STRATEGIES:
        raise ValueError(f"load_balance: expected one of {LOAD_BALANCE_STRATEGIES}, got {load_balance!r}")
    return load_balance


def check_divisible(length: int, axis_size: int, load_balance, what: str = "sequence length"):
    """Raise unless ``length`` can be laid out over ``axis_size`` shards."""
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)) or axis_size < 1:
        raise ValueError(f"axis_size: expected a positive int, got {axis_size!r}")
    unit = 2 * axis_size if load_balance == "zigzag" else axis_size
    if length % unit:
        why = f"2 × {axis_size} chunks (zigzag)" if load_balance == "zigzag" else f"{axis_size} shards"
        raise ValueError(f"{what} ({length}) must be divisible by {unit} to split into {why}")


@functools.lru_cache(maxsize=256)
def _permutation(length: int, axis_size: int, load_balance) -> np.ndarray:
    check_load_balance(load_balance)
    check_divisible(length, axis_size, load_balance)
    if load_balance is None:
        perm = np.arange(length)
    elif load_balance == "zigzag":
        chunks = np.arange(length).reshape(2 * axis_size, length // (2 * axis_size))
        order = np.stack([np.arange(axis_size), 2 * axis_size - 1 - np.arange(axis_size)], axis=1).reshape(-1)
        perm = chunks[order].reshape(-1)
    else:  # striped
        perm = np.arange(length).reshape(length // axis_size, axis_size).T.reshape(-1)
    perm = perm.astype(np.int32)
    perm.setflags(write=False)
    return perm


def load_balance_permutation(length: int, axis_size: int, load_balance) -> np.ndarray:
    """``perm [T]`` int32: slot ``g`` of the laid-out sequence holds original token ``perm[g]``."""
    return _permutation(int(length), int(axis_size), check_load_balance(load_balance))


def shard_positions(length: int, axis_size: int, load_balance) -> np.ndarray:
    """``[P, L]`` int32: the original positions of the tokens each shard holds."""
    return load_balance_permutation(length, axis_size, load_balance).reshape(axis_size, -1)


def reorder_for_load_balance(x, axis_size: int, strategy="zigzag", *, axis: int = 1):
    """Lay out a global (unsharded) array for ``axis_size`` shards.

    Args:
      x: an array whose ``axis`` is the sequence (``[B, T, ...]`` by default).
      axis_size: the number of sequence shards ``P`` (for ``usp``: the product
        of the ring and Ulysses axis sizes).
      strategy: ``"zigzag"``, ``"striped"`` or ``None`` (identity).
    Returns ``x`` with the sequence permuted: ``out[..., g, ...] = x[..., perm[g], ...]``.
    """
    x, axis, perm = _checked_permutation(x, axis_size, strategy, axis)
    return x if perm is None else jnp.take(x, jnp.asarray(perm), axis=axis)


def restore_from_load_balance(x, axis_size: int, strategy="zigzag", *, axis: int = 1):
    """The inverse of `reorder_for_load_balance` (same arguments)."""
    x, axis, perm = _checked_permutation(x, axis_size, strategy, axis)
    return x if perm is None else jnp.take(x, jnp.asarray(np.argsort(perm).astype(np.int32)), axis=axis)


def _checked_permutation(x, axis_size: int, strategy, axis: int):
    """``(x as an array, the normalized axis, the load-balance permutation or None for no strategy)``."""
    x = checks.as_array("x", x)
    axis = checks.normalize_axis("axis", axis, x.ndim)
    check_divisible(x.shape[axis], axis_size, check_load_balance(strategy), what=f"x: sequence length (axis {axis})")
    perm = load_balance_permutation(x.shape[axis], axis_size, strategy)
    return x, axis, (None if strategy is None else perm)
