"""Built-in calls of the gated linear unit ops: examples for `stellax check` and
the tests, benchmark shapes for `stellax bench glu`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example


def _random_case(seed, m, k, n, dtype, stacked):
    """``(x [m, k], weights, dy [m, n])``: stacked ``[k, 2, n]`` weights or a ``(gate, up)`` pair."""
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, 2, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    weights = w if stacked else (w[:, 0], w[:, 1])
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    return x, weights, dy


_CASES = ((3, 17, 33, "silu", True), (40, 100, 70, "gelu", False), (1, 64, 16, "gelu_tanh", True),
          (20, 9, 130, "relu", True), (17, 48, 5, "sigmoid", False))


def forward_examples(dtype):
    """Small `gated_linear_unit` calls over every activation and both weight forms."""
    out = []
    for i, (m, k, n, act, stacked) in enumerate(_CASES):
        x, weights, _ = _random_case(i, m, k, n, dtype, stacked)
        out.append(Example(f"M={m} K={k} N={n} {act} {'stacked' if stacked else 'pair'}", (x, weights),
                           {"activation": act}))
    return out


def _preactivations(x, weights, dtype):
    """The forward's ``(x @ Wg, x @ Wu)`` in float32 at HIGHEST, rounded to ``dtype``."""
    w = weights if not isinstance(weights, tuple) else jnp.stack(weights, axis=1)
    both = jnp.einsum("mk,kgn->gmn", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    return both[0].astype(dtype), both[1].astype(dtype)


def backward_examples(dtype):
    """`gated_linear_unit_backward` calls: the first three forward cases recomputing ``gate``/``up``,
    then the first two again starting from saved ones (as differentiating the forward does)."""
    recomputed, saved = [], []
    for i, (m, k, n, act, stacked) in enumerate(_CASES[:3]):
        x, weights, dy = _random_case(100 + i, m, k, n, dtype, stacked)
        w_gate, w_up = (weights, None) if stacked else weights
        recomputed.append(Example(f"M={m} K={k} N={n} {act}", (dy, x, w_gate, w_up), {"activation": act}))
        if i < 2:
            gate, up = _preactivations(x, weights, dtype)
            saved.append(Example(f"M={m} K={k} N={n} {act} saved gate/up", (dy, x, w_gate, w_up, gate, up),
                                 {"activation": act}))
    return recomputed + saved


def benchmarks(platform):
    """SwiGLU MLP shapes (Llama-3-8B/70B-like on accelerators, small on a CPU)."""
    shapes = ((256, 512, 1024),) if platform.backend == "cpu" else ((4096, 4096, 14336), (16384, 2048, 8192))
    out = []
    for m, k, n in shapes:
        dtype = jnp.float32 if platform.backend == "cpu" else jnp.bfloat16
        x, w, _ = _random_case(0, m, k, n, dtype, True)
        out.append(Example(f"M={m} K={k} N={n} silu", (x, w), {"activation": "silu"}))
    return out
