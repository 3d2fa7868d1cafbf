"""The GDN WY kernel below sm_90 (`triton_intra._gdn_wy_blocked_kernel`, blocks of 32 rows):
numerics in interpret mode against the XLA stage (`wy.chunk_intra`) and the sm_90 kernel, and
its block inverses against a float64 inverse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import current_platform
from stellax.ops.linear_attention import LinearAttentionConfig
from stellax.ops.linear_attention import triton_intra
from stellax.ops.linear_attention.solve import lazy_block_inverse
from stellax.ops.linear_attention.wy import chunk_intra

C = 64
CONFIG = LinearAttentionConfig(block_v=16, num_warps=4, num_stages=1)


def _inputs(key, bh, nt, kdim, vdim, decay):
    ks = jax.random.split(key, 4)
    k = jax.random.normal(ks[0], (bh, nt * C, kdim), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[1], (bh, nt * C, vdim), jnp.float32)
    g = -decay * jax.nn.softplus(jax.random.normal(ks[2], (bh, nt * C), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (bh, nt * C), jnp.float32))
    return k, v, g, beta


def _golden(k, v, g, beta):
    """``(U, W)`` of the XLA stage, chunk by chunk."""
    bh, tp, kdim = k.shape
    split = lambda x: x.reshape(bh, tp // C, C, *x.shape[2:])
    out = chunk_intra(split(k), split(k), split(v), split(g), split(beta))
    return out["U"].reshape(v.shape), out["W"].reshape(k.shape)


def _rel(x, ref):
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


@pytest.mark.parametrize("kdim,vdim,decay", [(16, 32, 1.0), (32, 16, 1.0), (128, 128, 1.0), (64, 32, 20.0)])
def test_blocked_wy_matches_xla_and_sm90_kernel(kdim, vdim, decay):
    k, v, g, beta = _inputs(jax.random.PRNGKey(kdim + vdim), 2, 2, kdim, vdim, decay)
    u_ref, w_ref = _golden(k, v, g, beta)
    outs = {}
    for target in ("a100", "h100"):
        with stellax.lowering_target(target), stellax.interpret_mode():
            assert current_platform().nvidia_below((9, 0)) == (target == "a100")
            outs[target] = triton_intra.gdn_wy_forward(k, v, g, beta, chunk=C, config=CONFIG)
    u, w = outs["a100"]
    assert not (jnp.isnan(u).any() or jnp.isnan(w).any())
    assert _rel(u, u_ref) <= 1e-5 and _rel(w, w_ref) <= 1e-5, (_rel(u, u_ref), _rel(w, w_ref))
    assert _rel(u, outs["h100"][0]) <= 1e-5 and _rel(w, outs["h100"][1]) <= 1e-5


def test_lazy_block_inverse_is_the_inverse():
    """The kernel's form (diagonal blocks by row-by-row substitution, ``A``'s blocks on demand,
    each formed once), on plain arrays against a float64 inverse, 2 and 4 block rows."""
    rng = np.random.default_rng(1)
    a = np.tril(rng.normal(size=(C, C)) * 0.3, -1)
    ref = np.linalg.inv(np.eye(C) + a)
    for s in (32, 16):
        calls = []

        def block(i, j):
            calls.append((i, j))
            return jnp.asarray(a[i * s:(i + 1) * s, j * s:(j + 1) * s], jnp.float32)

        t = lazy_block_inverse(block, C // s, s)
        assert sorted(calls) == sorted(set(calls)) and len(calls) == (C // s) * (C // s + 1) // 2
        full = np.zeros((C, C))
        for i, row in enumerate(t):
            for j, blk in enumerate(row):
                full[i * s:(i + 1) * s, j * s:(j + 1) * s] = np.asarray(blk)
        assert np.linalg.norm(full - ref) / np.linalg.norm(ref) < 1e-5
