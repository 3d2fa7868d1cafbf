"""Built-in calls of the normalization ops: examples for `stellax check` and
the tests, benchmark shapes for `stellax bench norm`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example
from .reference import normalize_rows


def forward_examples(dtype):
    """Small `layer_norm` calls: D=1, odd D, RMSNorm, a leading axis, a fused residual."""
    shapes = (((4, 1), -1, True, False), ((3, 127), -1, True, False), ((2, 3, 1000), -1, False, False),
              ((64, 6), 0, True, False), ((5, 333), -1, True, True))
    out = []
    for i, (shape, axis, subtract_mean, with_residual) in enumerate(shapes):
        kx, ks, ko, kr = jax.random.split(jax.random.PRNGKey(i), 4)
        features = shape[axis]
        x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
        scale = (1 + 0.1 * jax.random.normal(ks, (features,))).astype(dtype)
        offset = (0.1 * jax.random.normal(ko, (features,))).astype(dtype) if subtract_mean else None
        kwargs = {"axis": axis, "subtract_mean": subtract_mean}
        if with_residual:
            kwargs["residual"] = jax.random.normal(kr, shape, jnp.float32).astype(dtype)
        label = f"{'layer' if subtract_mean else 'rms'} x={shape} axis={axis}" + (" +residual" if with_residual else "")
        out.append(Example(label, (x, scale, offset), kwargs))
    return out


def benchmarks(platform):
    """Benchmark calls: small on a CPU; transformer hidden sizes on accelerators."""
    if platform.backend == "cpu":
        cases = (((512, 1024), jnp.float32, True, False), ((512, 1024), jnp.float32, False, True))
    else:
        cases = (((16384, 4096), jnp.bfloat16, True, False), ((16384, 8192), jnp.bfloat16, False, True),
                 ((8192, 2048), jnp.float32, True, False), ((4096, 16384), jnp.bfloat16, False, False),
                 ((65536, 4096), jnp.bfloat16, True, True))
    out = []
    for i, (shape, dtype, subtract_mean, with_residual) in enumerate(cases):
        kx, ks, ko, kr = jax.random.split(jax.random.PRNGKey(100 + i), 4)
        features = shape[-1]
        x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
        scale = (1 + 0.1 * jax.random.normal(ks, (features,))).astype(dtype)
        offset = (0.1 * jax.random.normal(ko, (features,))).astype(dtype) if subtract_mean else None
        kwargs = {"subtract_mean": subtract_mean}
        if with_residual:
            kwargs["residual"] = jax.random.normal(kr, shape, jnp.float32).astype(dtype)
        label = (f"{'layer' if subtract_mean else 'rms'} {np.dtype(dtype).name} {shape[0]}x{shape[1]}"
                 + (" +residual" if with_residual else ""))
        out.append(Example(label, (x, scale, offset), kwargs))
    return out


def backward_examples(dtype):
    """`layer_norm_backward` calls: LayerNorm, and RMSNorm with a residual cotangent ``dh``."""
    out = []
    for rows, features, subtract_mean, with_dh in ((5, 127, True, False), (3, 1000, False, True)):
        key = jax.random.PRNGKey(rows * features)
        kx, ks, ko, kd, kh = jax.random.split(key, 5)
        x = jax.random.normal(kx, (rows, features), jnp.float32).astype(dtype)
        scale = (1 + 0.1 * jax.random.normal(ks, (features,))).astype(dtype)
        offset = (0.1 * jax.random.normal(ko, (features,))).astype(dtype)
        _, mean, rstd = normalize_rows(x, None, None, epsilon=1e-6, subtract_mean=subtract_mean)
        dy = jax.random.normal(kd, (rows, features), jnp.float32).astype(dtype)
        dh = jax.random.normal(kh, (rows, features), jnp.float32).astype(dtype) if with_dh else None
        out.append(Example(f"rows={rows} D={features}", (dy, x, scale, offset, mean, rstd, dh),
                           {"subtract_mean": subtract_mean}))
    return out
