"""Benchmark and tuning inputs: random, never zeros, rotated among sets."""

from __future__ import annotations

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


def randomize_tree(tree, key):
    """Replace every floating array leaf of ``tree`` by fresh random values;
    other leaves are kept as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, max(1, len(leaves)))
    out = [random_like(k, leaf) if is_float(leaf) else leaf for k, leaf in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def input_sets(tree, count: int, *, seed: int = 0, randomize: bool = True) -> list:
    """``count`` versions of ``tree`` with different random float leaves
    (``randomize=False``: the first set is ``tree`` itself, the others are
    random). Rotating among them keeps caches from flattering a benchmark."""
    count = max(1, int(count))
    base = jax.random.PRNGKey(seed)
    sets = []
    for i in range(count):
        if i == 0 and not randomize:
            sets.append(tree)
        else:
            sets.append(randomize_tree(tree, jax.random.fold_in(base, i)))
    return sets


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
        elif name in concrete and concrete[name] is not None:
            out[name] = jnp.asarray(concrete[name])
        else:
            out[name] = fill_like(struct)
    return out
