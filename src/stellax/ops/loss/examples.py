"""Built-in calls of the linear cross-entropy ops: examples for `stellax check`
and the tests, benchmark shapes for `stellax bench loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example
from .reference import logits, token_stats


def random_case(seed, lead, d, v, dtype, *, transpose_w=False, ignored=0.25, ignore_index=-100):
    """``(x [*lead, d], w [d, v] or [v, d], labels [*lead])`` with about ``ignored`` of the
    labels set to ``ignore_index``; logits of order 1."""
    kx, kw, ky, ki = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(kx, (*lead, d), jnp.float32).astype(dtype)
    w = (2.0 * jax.random.normal(kw, (v, d) if transpose_w else (d, v), jnp.float32) / np.sqrt(d)).astype(dtype)
    labels = jax.random.randint(ky, lead, 0, v, jnp.int32)
    labels = jnp.where(jax.random.uniform(ki, lead) < ignored, ignore_index, labels)
    return x, w, labels


#: (lead, D, V, transpose_w, options)
_CASES = (
    ((13,), 24, 50, False, {}),
    ((2, 5), 32, 77, True, {"label_smoothing": 0.1, "reduction": "sum"}),
    ((9,), 16, 40, False, {"z_loss": 1e-2, "reduction": "none", "return_lse": True, "return_z_loss": True}),
    ((20,), 40, 33, False, {"logit_soft_cap": 3.0, "label_smoothing": 0.2, "z_loss": 1e-3}),
)


def forward_examples(dtype):
    """Small calls: odd sizes, leading axes, ignored labels, transposed weights, every option."""
    out = []
    for i, (lead, d, v, transpose_w, options) in enumerate(_CASES):
        x, w, labels = random_case(i, lead, d, v, dtype, transpose_w=transpose_w)
        label = f"x={lead + (d,)} V={v}" + (" w=[V,D]" if transpose_w else "") + "".join(
            f" {k}={val}" for k, val in options.items())
        out.append(Example(label, (x, w, labels), {"transpose_w": transpose_w, **options}))
    return out


def backward_examples(dtype):
    """`linear_cross_entropy_backward` calls: coefficients of a mean loss with smoothing, a soft cap."""
    out = []
    for i, (tokens, d, v, transpose_w, cap) in enumerate(((11, 24, 50, False, None), (7, 16, 37, True, 4.0))):
        x, w, labels = random_case(50 + i, (tokens,), d, v, dtype, transpose_w=transpose_w)
        c = logits(x, w, transpose_w=transpose_w, logit_soft_cap=cap)
        lse, _, _ = token_stats(c, labels)
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(60 + i), 3)
        a = jax.random.uniform(k1, (tokens,), jnp.float32, 0.1, 1.0)
        b = -jax.random.uniform(k2, (tokens,), jnp.float32, 0.1, 1.0)
        e = -0.01 * jax.random.uniform(k3, (tokens,), jnp.float32)
        out.append(Example(f"T={tokens} D={d} V={v}" + (" w=[V,D]" if transpose_w else "")
                           + (f" cap={cap}" if cap else ""), (x, w, labels, lse, a, b, e),
                           {"transpose_w": transpose_w, "logit_soft_cap": cap}))
    return out


def benchmarks(platform):
    """A language-model head: T=4096, D=1024, V=32768 float32 on a CPU (the docs' numbers);
    Llama-3-like heads in bfloat16 on accelerators."""
    if platform.backend == "cpu":
        cases = ((4096, 1024, 32768, jnp.float32),)
    else:
        cases = ((8192, 4096, 128256, jnp.bfloat16), (16384, 2048, 151936, jnp.bfloat16))
    out = []
    for tokens, d, v, dtype in cases:
        x, w, labels = random_case(200, (tokens,), d, v, dtype, transpose_w=True)
        out.append(Example(f"T={tokens} D={d} V={v} {np.dtype(dtype).name}", (x, w, labels), {"transpose_w": True}))
    return out
