"""stellax's float32 exp / log / tanh / softplus / logsumexp (`stellax.core.precision`).

A TPU's own float32 transcendental functions are approximations (measured on a v5e:
log 6.5e-6 rms, tanh up to 8e-5, exp up to 5.4e-6); these are written in
arithmetic a TPU computes exactly, so they must hold float32 accuracy here, under
XLA and inside a Pallas kernel, and lower for Mosaic TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from stellax.core.precision import (
    HIGH, HIGHEST, float32_exp, float32_log, float32_logsumexp, float32_softplus, float32_tanh, soft_cap,
    soft_cap_tanh,
)

CASES = {  # name: (function, sample points, float64 truth, max relative error)
    "exp": (float32_exp, np.linspace(-87.0, 88.7, 400_001), np.exp, 2e-7),
    "log": (float32_log, np.exp(np.linspace(-85.0, 85.0, 400_001)), np.log, 2e-7),
    "tanh": (float32_tanh, np.linspace(-12.0, 12.0, 400_001), np.tanh, 3e-7),
    "softplus": (float32_softplus, np.linspace(-85.0, 80.0, 400_001), lambda x: np.logaddexp(x, 0.0), 3e-7),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float32_accurate_against_float64(name):
    fn, points, exact, bound = CASES[name]
    x = points.astype(np.float32)
    want = exact(x.astype(np.float64))
    got = np.asarray(jax.jit(fn)(x), np.float64)
    finite = np.isfinite(want) & (np.abs(want) > 1e-30)
    rel = np.abs(got[finite] - want[finite]) / np.abs(want[finite])
    assert rel.max() < bound, f"{name}: max relative error {rel.max():.2e} at x={x[finite][rel.argmax()]}"


def test_log_absolute_error_near_one():
    x = np.linspace(0.5, 2.0, 300_001, dtype=np.float32)
    err = np.abs(np.asarray(float32_log(x), np.float64) - np.log(x.astype(np.float64)))
    assert err.max() < 1.5e-7


def test_special_values():
    inf, nan = np.inf, np.nan
    np.testing.assert_array_equal(float32_exp(jnp.array([-inf, inf, 0.0, -100.0, 100.0])), [0.0, inf, 1.0, 0.0, inf])
    np.testing.assert_array_equal(float32_log(jnp.array([0.0, inf, 1.0, -1.0]))[:3], [-inf, inf, 0.0])
    assert np.isnan(float32_log(jnp.float32(-1.0))) and np.isnan(float32_log(jnp.float32(nan)))
    np.testing.assert_array_equal(float32_tanh(jnp.array([inf, -inf, 0.0])), [1.0, -1.0, 0.0])
    np.testing.assert_array_equal(float32_softplus(jnp.array([-inf, inf, -200.0, 200.0])), [0.0, inf, 0.0, 200.0])
    for fn in (float32_exp, float32_tanh, float32_softplus):
        assert np.isnan(fn(jnp.float32(nan)))


@pytest.mark.parametrize("fn, derivative", [
    (float32_exp, np.exp), (float32_log, lambda x: 1.0 / x), (float32_tanh, lambda x: 1.0 - np.tanh(x) ** 2),
    (float32_softplus, lambda x: 1.0 / (1.0 + np.exp(-x))),
])
def test_derivatives(fn, derivative):
    x = jnp.array([0.05, 0.3, 1.7, 4.0], jnp.float32)
    got = jax.vmap(jax.grad(fn))(x)
    np.testing.assert_allclose(got, derivative(np.asarray(x, np.float64)), rtol=1e-6)


def test_logsumexp_value_gradient_and_empty_rows():
    c = jax.random.normal(jax.random.PRNGKey(0), (5, 37), jnp.float32) * 4
    c64 = np.asarray(c, np.float64)
    want = np.log(np.sum(np.exp(c64 - c64.max(1, keepdims=True)), 1)) + c64.max(1)
    np.testing.assert_allclose(float32_logsumexp(c), want, rtol=2e-7)
    grad = jax.grad(lambda c: float32_logsumexp(c).sum())(c)
    np.testing.assert_allclose(grad, jax.nn.softmax(c64, axis=-1), rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(float32_logsumexp(jnp.full((2, 3), -jnp.inf)), [-np.inf, -np.inf])


@pytest.mark.parametrize("name, fn, lo, hi, exact", [
    ("exp", float32_exp, -30.0, 0.0, np.exp), ("log", float32_log, 1e-3, 1e3, np.log),
    ("tanh", float32_tanh, -5.0, 5.0, np.tanh),
])
def test_inside_a_pallas_kernel(name, fn, lo, hi, exact):
    """The functions, derivative rules and all, run inside a kernel body (interpreted here) with
    the same accuracy."""
    x = np.linspace(lo, hi, 16 * 128, dtype=np.float32).reshape(16, 128)

    def kernel(x_ref, y_ref):
        y_ref[...] = fn(x_ref[...])

    y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32), interpret=True)(x)
    want = exact(x.astype(np.float64))
    rel = np.abs(np.asarray(y, np.float64) - want) / np.maximum(np.abs(want), 1e-30)
    assert rel.max() < 3e-7, name


def test_functions_lower_for_mosaic_tpu():
    """Bit casts, shifts and masks on float32 vectors are what Mosaic must lower."""
    from stellax.core import lowering_target

    def kernel(x_ref, y_ref):
        x = x_ref[...]
        y_ref[...] = float32_exp(-jnp.abs(x)) + float32_log(jnp.abs(x) + 1.0) + float32_tanh(x)

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32))
    with lowering_target("v5e"):
        text = jax.jit(call).trace(jnp.ones((8, 128), jnp.float32)).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


def test_soft_cap_takes_the_accurate_tanh_only_for_float32_at_highest():
    assert soft_cap_tanh(jnp.float32, HIGHEST) is float32_tanh
    assert soft_cap_tanh(jnp.float32, None) is float32_tanh  # None resolves to HIGHEST
    assert soft_cap_tanh(jnp.float32, HIGH) is jnp.tanh
    assert soft_cap_tanh(jnp.bfloat16, HIGHEST) is jnp.tanh
    s = jnp.linspace(-40.0, 40.0, 101, dtype=jnp.float32)
    assert soft_cap(s, None) is s
    np.testing.assert_array_equal(soft_cap(s, 7.0), 7.0 * float32_tanh(s * (1.0 / 7.0)))
    np.testing.assert_array_equal(soft_cap(s, 7.0, jnp.bfloat16, HIGHEST), 7.0 * jnp.tanh(s * (1.0 / 7.0)))
