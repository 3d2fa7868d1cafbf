"""The per-chunk building blocks: the affine state map context parallelism
reuses, and the span sums behind the stable decays."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.linear_attention import chunk_intra, state_step, state_transition
from stellax.ops.linear_attention.decay import pair_sums, tail_sums
from stellax.ops.linear_attention.scores import decayed_scores
from stellax.ops.linear_attention.solve import solve_unit_lower
from stellax.ops.linear_attention.examples import make_inputs
from stellax.testing import assert_close

F32 = jnp.float32


def _chunks(per_channel, T=96, C=32, seed=0):
    """One sequence (B = 1, HV = 2) cut into [NT, HV, C, ...] chunks."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(seed), 1, T, 2, 2, 16, 8, per_channel=per_channel)
    cut = lambda x: jnp.moveaxis(x[0].reshape((T // C, C) + x.shape[2:]), 2, 1)
    return cut(q * 16 ** -0.5), cut(k), cut(v), cut(g), cut(beta), h0, (q, k, v, g, beta)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_state_transition_summarizes_a_shard(per_channel):
    """Composing the chunks' maps S' = 𝒜S + ℬ (run from a zero state) reproduces
    the op's final state for any initial state: what a context-parallel shard sends."""
    q, k, v, g, beta, h0, full = _chunks(per_channel)
    parts = chunk_intra(q, k, v, g, beta)
    a, b = state_transition(parts)  # [NT, HV, K, K], [NT, HV, K, V]
    shard_a, shard_b = jnp.broadcast_to(jnp.eye(16), a.shape[1:]), jnp.zeros(b.shape[1:])
    state = h0[0]
    for c in range(a.shape[0]):
        shard_a = jnp.einsum("hij,hjk->hik", a[c], shard_a, precision="highest")
        shard_b = jnp.einsum("hij,hjv->hiv", a[c], shard_b, precision="highest") + b[c]
        stepped, _ = state_step(state, jax.tree_util.tree_map(lambda x: x[c], parts))
        assert_close(stepped, jnp.einsum("hij,hjv->hiv", a[c], state, precision="highest") + b[c], dtype=F32)
        state = stepped
    fn = stellax.chunk_kda if per_channel else stellax.chunk_gated_delta_rule
    _, final = fn(*full, initial_state=h0, output_final_state=True, scale=16 ** -0.5)
    summary = jnp.einsum("hij,hjv->hiv", shard_a, h0[0], precision="highest") + shard_b
    assert_close(summary, final[0], dtype=F32)
    assert_close(state, final[0], dtype=F32)


def test_span_sums_are_direct():
    g = -jnp.array([20.0, 1e-3, 2e-3, 30.0, 4e-3])
    d = pair_sums(g)
    assert float(d[2, 0]) == pytest.approx(-3e-3, rel=1e-6)  # not (−20.003) − (−20.0)
    assert float(d[0, 2]) == 0.0
    assert_close(tail_sums(g), jnp.array([g[1:].sum(), g[2:].sum(), g[3:].sum(), g[4:].sum(), 0.0]), dtype=F32)


def test_decayed_scores_per_channel_equals_dense_formula():
    key = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(key[0], (2, 2, 32, 8))
    y = jax.random.normal(key[1], (2, 32, 8))
    g = -3 * jax.nn.softplus(jax.random.normal(key[2], (2, 32, 8)))
    G = jnp.cumsum(g.astype(jnp.float64) if jax.config.jax_enable_x64 else g, axis=-2)
    causal = np.tril(np.ones((32, 32), bool))
    dense = jnp.einsum("brik,bjk,bijk->brij", x, y, jnp.exp(jnp.where(causal[..., None], G[:, :, None] - G[:, None],
                                                                        -jnp.inf)), precision="highest")
    assert_close(decayed_scores(x, y, g), dense, dtype=F32)


def test_solve_unit_lower():
    key = jax.random.split(jax.random.PRNGKey(4), 2)
    a = jnp.tril(0.3 * jax.random.normal(key[0], (3, 64, 64)), -1)
    r = jax.random.normal(key[1], (3, 64, 5))
    expected = jax.scipy.linalg.solve_triangular(jnp.eye(64) + a, r, lower=True, unit_diagonal=True)
    assert_close(solve_unit_lower(a, r), expected, dtype=F32, rel_l2_tolerance=1e-5)
