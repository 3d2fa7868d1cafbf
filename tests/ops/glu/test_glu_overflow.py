"""Overflow in `gated_linear_unit` (issue 43): the output is the float32 result rounded once to the
input dtype, ±inf/nan exactly where that value is, in every implementation, eager and under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax


def _float32_math(x, w, activation):
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    gate = jnp.dot(x32, w32[:, 0], precision="highest")
    up = jnp.dot(x32, w32[:, 1], precision="highest")
    act = {"silu": jax.nn.silu, "gelu": lambda a: jax.nn.gelu(a, approximate=False), "relu": jax.nn.relu}[activation]
    return (act(gate) * up).astype(x.dtype)


def _huge_float32():
    x = jax.random.normal(jax.random.key(0), (16, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (32, 2, 128), jnp.float32) * 1e37  # products beyond float32
    return x, w


def _float16_past_its_range():
    """Half the columns: a gate of 96000 (past float16's 65504) times an up of 1e-3 — back in range;
    the other half times an up of 3200: past the range in the output too."""
    k = 32
    x = jnp.ones((16, k), jnp.float16)
    w_gate = jnp.full((k, 128), 3000.0, jnp.float16)
    w_up = jnp.full((k, 128), 1e-3 / k, jnp.float16).at[:, :64].set(100.0)
    return x, jnp.stack([w_gate, w_up], axis=1)


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic_tpu"])
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
def test_huge_weights_overflow_where_the_float32_result_does(implementation, activation):
    x, w = _huge_float32()
    want = np.asarray(_float32_math(x, w, activation))
    assert not np.isfinite(want).all() and np.isfinite(want).any()  # the case overflows somewhere
    run = lambda x, w: stellax.gated_linear_unit(x, w, activation=activation, implementation=implementation)
    with stellax.interpret_mode():
        for got in (run(x, w), jax.jit(run)(x, w)):
            got = np.asarray(got)
            np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
            np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-30)


@pytest.mark.parametrize("implementation", ["xla", "triton"])  # the Mosaic TPU kernels take no float16
def test_float16_rounds_once_at_the_output(implementation):
    x, w = _float16_past_its_range()
    want = np.asarray(_float32_math(x, w, "silu"), np.float32)
    assert np.isinf(want[:, :64]).all() and np.isfinite(want[:, 64:]).all()
    with stellax.interpret_mode():
        got = np.asarray(jax.jit(lambda x, w: stellax.gated_linear_unit(x, w, implementation=implementation))(x, w),
                         np.float32)
    np.testing.assert_array_equal(got, want)
