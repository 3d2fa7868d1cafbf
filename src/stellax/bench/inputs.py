"""Benchmark and tuning inputs: random, never zeros, rotated among sets."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..testing.numerics import random_array


def is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (type, np.dtype))


def is_float(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def random_like(key, x, *, scale: float = 1.0):
    """A random array of ``x``'s shape and dtype (floats only; see `random_array`)."""
    return random_array(key, tuple(x.shape), x.dtype, scale=scale)


def fill_like(x):
    """A safe placeholder for a non-float operand whose values are unknown:
    zeros for integers (always in-bounds indices), ones for booleans."""
    if jnp.issubdtype(x.dtype, jnp.bool_):
        return jnp.ones(tuple(x.shape), x.dtype)
    return jnp.zeros(tuple(x.shape), x.dtype)


def materialize(struct, key):
    """A concrete array for a `jax.ShapeDtypeStruct` operand: random floats;
    random codes over the whole range for 8-bit (and narrower) integers
    (quantized data); `fill_like` for wider integers (indices) and booleans."""
    dtype = jnp.dtype(struct.dtype)
    shape = tuple(struct.shape)
    if jnp.issubdtype(dtype, jnp.inexact):
        return random_array(key, shape, dtype)
    if jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize == 1:
        info = jnp.iinfo(dtype)
        return jax.random.randint(key, shape, int(info.min), int(info.max) + 1, jnp.int32).astype(dtype)
    return fill_like(struct)


def randomize_tree(tree, key, *, randomize: bool = True):
    """Replace every floating array leaf of ``tree`` by fresh random values
    and every `jax.ShapeDtypeStruct` by a concrete array (`materialize`);
    other leaves are kept as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, max(1, len(leaves)))
    out = []
    for k, leaf in zip(keys, leaves):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            out.append(materialize(leaf, k))
        elif randomize and is_float(leaf):
            out.append(random_like(k, leaf))
        else:
            out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def input_sets(tree, count: int, *, seed: int = 0, randomize: bool = True) -> list:
    """``count`` versions of ``tree`` with different float leaves. Rotating among them keeps
    caches from flattering a benchmark.

    ``randomize=True``: every float leaf is fresh random values. ``randomize=False`` (an op's
    benchmark builder made values in the op's domain: log-decays below zero, SSD's ``A < 0``):
    the first set is ``tree`` itself and set ``i`` has each float leaf's values cyclically
    shifted (`shifted_leaf`): the same values at other positions, so still in the domain.
    `jax.ShapeDtypeStruct` leaves are made concrete (`materialize`) either way."""
    count = max(1, int(count))
    base = jax.random.PRNGKey(seed)
    if randomize:
        return [randomize_tree(tree, jax.random.fold_in(base, i)) for i in range(count)]
    first = randomize_tree(tree, base, randomize=False)
    return [first] + [jax.tree_util.tree_map(lambda x, i=i: shifted_leaf(x, i, count), first)
                      for i in range(1, count)]


def tree_bytes(tree) -> int:
    """Bytes of the array leaves of ``tree`` (`jax.ShapeDtypeStruct` leaves counted as arrays)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree) if is_array(x))


def sets_that_fit(tree, count: int, free_bytes: int | None, *, randomize: bool = True, share: float = 0.5) -> int:
    """How many of ``count`` input sets (`input_sets`) to make so that the sets made beyond
    ``tree`` itself take at most ``share`` of ``free_bytes`` of device memory; at least one.
    Rotating sets keeps caches from flattering a benchmark, but a MoE layer's 5.6 GB of weights
    three times over does not fit a 16 GiB TPU v5e beside its program. With ``randomize=False``
    the first set is ``tree`` (already on the device); otherwise every set is new."""
    size = tree_bytes(tree)
    if free_bytes is None or size == 0:
        return max(1, int(count))
    new_sets = int(share * free_bytes // size)
    return max(1, min(int(count), new_sets + (0 if randomize else 1)))


def shifted_leaf(x, index: int, count: int):
    """A float array's values moved ``index / count`` of the way round its flattened order
    (plus ``index``, so small arrays move too); other leaves as they are."""
    if not is_float(x) or x.size < 2:
        return x
    shift = (x.size * index // count + index) % x.size
    return jnp.roll(jnp.ravel(x), shift).reshape(x.shape)


def arrays_from_abstract(abstract: Mapping[str, Any], key, concrete: Mapping[str, Any] | None = None) -> dict:
    """Concrete operands for a call known only by shapes and dtypes: random
    floats; non-float operands from ``concrete`` when known, else `fill_like`."""
    concrete = dict(concrete or {})
    names = [n for n, v in abstract.items() if v is not None]
    keys = jax.random.split(key, max(1, len(names)))
    out = {}
    for k, name in zip(keys, names):
        struct = abstract[name]
        if jnp.issubdtype(struct.dtype, jnp.inexact):
            out[name] = random_like(k, struct)
        elif name in concrete and concrete[name] is not None and not isinstance(concrete[name], jax.ShapeDtypeStruct):
            out[name] = jnp.asarray(concrete[name])
        else:
            out[name] = materialize(struct, k)
    return out


def materialize_example(example, seed: int = 0):
    """The example with every `jax.ShapeDtypeStruct` operand made concrete
    (benchmark examples may give operands by shape and dtype only)."""

    args, kwargs = randomize_tree((example.args, example.kwargs), jax.random.PRNGKey(seed), randomize=False)
    return dataclasses.replace(example, args=tuple(args), kwargs=dict(kwargs))
