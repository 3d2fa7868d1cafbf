"""g is a log decay (<= 0): a positive value raises eagerly (naming g and its
index); under jit its (sequence, head) is NaN (issue 43; more in test_linear_attention_bad_data.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax


def _inputs(t=6):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, t, 2, 8)) / 3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, t, 2, 8)), jnp.float32)
    g = -jnp.asarray(rng.random((1, t, 2)), jnp.float32)
    beta = jnp.asarray(rng.random((1, t, 2)), jnp.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("op", [stellax.chunk_gated_delta_rule, stellax.fused_recurrent_gated_delta_rule])
def test_positive_log_decay_is_an_eager_error(op):
    q, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match=r"g\[0, 3, 1\]: expected a log-space decay <= 0"):
        op(q, k, v, g.at[0, 3, 1].set(0.25), beta)
    with pytest.raises(ValueError, match=r"^g\["):
        op(q, k, v, g.at[0, 0, 0].set(jnp.nan), beta)


def test_kda_positive_decay_error_and_raw_gate_allowed():
    q, k, v, g, beta = _inputs()
    gk = jnp.broadcast_to(g[..., None], q.shape)
    with pytest.raises(ValueError, match=r"^g\[0, 1, 0, 2\]"):
        stellax.chunk_kda(q, k, v, gk.at[0, 1, 0, 2].set(1.0), beta)
    out, _ = stellax.chunk_kda(q, k, v, jnp.abs(gk), beta, use_gate_in_kernel=True)  # raw gate input: no check
    assert np.isfinite(np.asarray(out)).all()


def test_under_jit_positive_decay_is_nan_not_finite_and_wrong():
    q, k, v, g, beta = _inputs()
    pos = jnp.abs(g) + 30.0  # exp(30) per step would overflow within a chunk
    out = jax.jit(lambda *a: stellax.chunk_gated_delta_rule(*a)[0])(q, k, v, pos, beta)
    assert np.isnan(np.asarray(out)).all()


def test_ssd_positive_A_is_an_eager_error_naming_the_index():
    import jax.numpy as jnp
    import pytest

    import stellax

    b, t, h, p, n = 1, 8, 2, 4, 4
    x = jnp.ones((b, t, h, p))
    dt = jnp.full((b, t, h), 0.1)
    bc = jnp.ones((b, t, 1, n))
    with pytest.raises(ValueError, match=r"A\[1\]: expected a decay rate <= 0"):
        stellax.ssd(x, dt, jnp.array([-1.0, 0.5]), bc, bc)
    with pytest.raises(ValueError, match=r"A\[0, 0, 0\]: expected a decay rate <= 0"):
        stellax.ssd_step(jnp.zeros((b, h, p, n)), x[:, 0], jnp.full((b, h, p), 0.1), jnp.ones((h, p, n)),
                         bc[:, 0], bc[:, 0])
    assert stellax.ssd(x, dt, jnp.array([-1.0, 0.0]), bc, bc).shape == x.shape
