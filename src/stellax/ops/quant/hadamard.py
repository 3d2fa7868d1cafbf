"""Fast Walsh–Hadamard transform (XLA path) and its golden.

For a block of ``n = 2^k`` values ``v`` the normalized transform is
``H_n v / sqrt(n)`` with Sylvester's ``H_1 = [1]``, ``H_2n = [[H_n, H_n],
[H_n, -H_n]]``; ``H_n / sqrt(n)`` is symmetric and orthogonal, so it is its own
inverse. With random signs ``d ∈ {±1}^n`` (the randomized Hadamard transform
of QuaRot / NVFP4 training) the forward map is ``v → H (d ⊙ v) / sqrt(n)`` and
the inverse ``w → d ⊙ (H w) / sqrt(n)``.

The fast transform runs ``k`` butterfly stages: at stage ``j`` pairs ``(a, b)``
at distance ``2^j`` become ``(a + b, a - b)``; O(n log n) work.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def hadamard_matrix(n: int, dtype=np.float64) -> np.ndarray:
    """Dense normalized Sylvester Hadamard matrix ``H_n / sqrt(n)`` (numpy)."""
    h = np.ones((1, 1), dtype)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def random_signs(key, n: int):
    """``n`` random ±1 (float32) from ``key``."""
    return jnp.where(jax.random.bernoulli(key, 0.5, (n,)), 1.0, -1.0).astype(jnp.float32)


def fwht_blocks(x, block: int):
    """Unnormalized fast WHT over consecutive blocks of ``block`` along the
    last axis (float32 in, float32 out)."""
    shape = x.shape
    y = x.reshape(-1, block)
    h = 1
    while h < block:
        y = y.reshape(-1, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = jnp.stack([a + b, a - b], axis=2)
        h *= 2
    return y.reshape(shape)


def hadamard_xla(x, *, block: int, signs=None, inverse: bool = False):
    """Normalized (randomized) WHT over blocks of the last axis, in float32,
    returned in ``x.dtype``."""
    y = x.astype(jnp.float32)
    lead = y.shape[:-1]
    n = y.shape[-1]
    if signs is not None and not inverse:
        y = (y.reshape(*lead, n // block, block) * signs).reshape(y.shape)
    y = fwht_blocks(y, block) * jnp.float32(1.0 / math.sqrt(block))
    if signs is not None and inverse:
        y = (y.reshape(*lead, n // block, block) * signs).reshape(y.shape)
    return y.astype(x.dtype)


def hadamard_reference(x, *, block: int, signs=None, inverse: bool = False):
    """Golden: a dense matrix product per block (float32, highest precision)."""
    h = jnp.asarray(hadamard_matrix(block, np.float32))
    lead = x.shape[:-1]
    n = x.shape[-1]
    y = x.astype(jnp.float32).reshape(*lead, n // block, block)
    if signs is not None and not inverse:
        y = y * signs
    y = jnp.einsum("...j,kj->...k", y, h, precision=jax.lax.Precision.HIGHEST)
    if signs is not None and inverse:
        y = y * signs
    return y.reshape(x.shape).astype(x.dtype)
