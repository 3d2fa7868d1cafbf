"""Shared helpers of the MoE tests: a numpy grouped-matmul loop (float64) and inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stellax.ops.moe import GroupedMatmulConfig
from stellax.testing import random_array

#: Small Triton tiles so that test shapes are not multiples of the blocks.
SMALL = GroupedMatmulConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)

ACTS = {
    None: lambda z: z,
    "silu": lambda z: z / (1 + np.exp(-z)),
    "relu": lambda z: np.maximum(z, 0),
    "sigmoid": lambda z: 1 / (1 + np.exp(-z)),
    "gelu_tanh": lambda z: 0.5 * z * (1 + np.tanh(0.7978845608028654 * (z + 0.044715 * z ** 3))),
}


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def group_rows(sizes, offset=0, count=None):
    """Row ranges ``[(start, end)]`` of groups ``offset .. offset + count``."""
    sizes = np.asarray(sizes)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    count = len(sizes) - offset if count is None else count
    return [(int(starts[g]), int(ends[g])) for g in range(offset, offset + count)]


def numpy_ragged_dot(lhs, rhs, sizes, *, offset=0, activation=None, transpose_rhs=False):
    """The plain loop: each group's rows times its matrix; other rows zero."""
    lhs, rhs = f64(lhs), f64(rhs)
    if transpose_rhs:
        rhs = np.swapaxes(rhs, 1, 2)
    act = ACTS[activation]
    n = rhs.shape[-1]
    out = np.zeros((lhs.shape[0], n))
    for g, (s, e) in enumerate(group_rows(sizes, offset, rhs.shape[0])):
        if rhs.ndim == 4:
            out[s:e] = act(lhs[s:e] @ rhs[g, :, 0]) * (lhs[s:e] @ rhs[g, :, 1])
        else:
            out[s:e] = act(lhs[s:e] @ rhs[g])
    return out


def numpy_tgmm(lhs_mk, rhs, sizes, *, offset=0, count=None):
    lhs_mk, rhs = f64(lhs_mk), f64(rhs)
    rows = group_rows(sizes, offset, count)
    return np.stack([lhs_mk[s:e].T @ rhs[s:e] for s, e in rows])


def inputs(seed, shapes, dtype=jnp.float32, scale=1.0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [random_array(k, s, dtype, scale=scale) for k, s in zip(keys, shapes)]


def sizes(values):
    return jnp.asarray(values, jnp.int32)
