"""ragged_paged_attention and mla_decode vs their goldens; ragged batches ==
per-sequence dense attention; padding sequences do not matter; one jit serves
every num_seqs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.paged_attention import (
    MlaConfig, RaggedConfig, mla_decode, mla_decode_op, paged_attention_op, ragged_paged_attention,
    ragged_paged_attention_op,
)
from stellax.ops.paged_attention import mla_inputs, ragged_inputs
from stellax.testing import assert_close

MIXED = dict(q_lens=[1, 7, 1, 20, 3], kv_lens=[9, 7, 40, 35, 3])  # decodes, a prefill, chunked prefills


def ragged_golden(*args, **kw):
    return jax.jit(functools.partial(ragged_paged_attention_op.reference, **kw))(*args)


def run_ragged(impl, *args, config=None, **kw):
    with stellax.interpret_mode(impl == "triton"):
        return ragged_paged_attention(*args, implementation=impl, config=config, **kw)


def test_ragged_golden_equals_per_sequence_dense_attention():
    q, k, v, kv_lens, t, cu, n = ragged_inputs(0, **MIXED, page_size=4, kv_heads=2, q_heads=4, head_dim=16,
                                               dtype=jnp.float32, padding_seqs=2, padding_tokens=5)
    kw = dict(local_window_size=10, logits_soft_cap=6.0, sinks=jnp.asarray([0.1, -0.4, 1.0, 0.3]))
    out = ragged_golden(q, k, v, kv_lens, t, cu, n, **kw)
    paged = jax.jit(functools.partial(paged_attention_op.reference, **kw))
    cu_np = np.asarray(cu)
    for s in range(int(n[0])):
        a, b = cu_np[s], cu_np[s + 1]
        want = paged(q[None, a:b], k, v, t[s:s + 1], kv_lens[s:s + 1])[0]
        assert_close(out[a:b], want, name=f"sequence {s}")
    assert np.all(np.asarray(out[cu_np[int(n[0])]:]) == 0), "tokens past cu_q_lens[num_seqs] must be zeros"


@pytest.mark.parametrize("impl,page_size,config", [
    ("xla", 16, None),
    ("triton", 16, RaggedConfig(block_q=4, pages_per_block=1, num_splits=2)),
    ("triton", 1, RaggedConfig(block_q=8, pages_per_block=16, num_splits=1)),
])
def test_ragged_mixed_batch(impl, page_size, config):
    q, k, v, kv_lens, t, cu, n = ragged_inputs(1, **MIXED, page_size=page_size, kv_heads=2, q_heads=8,
                                               head_dim=64, dtype=jnp.float32, padding_seqs=1, padding_tokens=3)
    kw = dict(local_window_size=12, sinks=jnp.linspace(-1, 1, 8))
    assert_close(run_ragged(impl, q, k, v, kv_lens, t, cu, n, config=config, **kw),
                 ragged_golden(q, k, v, kv_lens, t, cu, n, **kw))


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_padding_sequences_do_not_matter(impl):
    q, k, v, kv_lens, t, cu, n = ragged_inputs(2, **MIXED, page_size=16, kv_heads=2, q_heads=4, head_dim=32,
                                               dtype=jnp.float32, padding_seqs=3, padding_tokens=4)
    live = int(n[0])
    first = run_ragged(impl, q, k, v, kv_lens, t, cu, n)
    # scramble everything past the live sequences: lengths, tables, cu_q_lens, query rows
    kv2 = kv_lens.at[live:].set(10**6)
    t2 = t.at[live:].set(-7)
    cu2 = cu.at[live + 1:].set(jnp.asarray([0, 2, 1], jnp.int32))
    end = int(cu[live])
    q2 = q.at[end:].set(1e4)
    second = run_ragged(impl, q2, k, v, kv2, t2, cu2, n)
    np.testing.assert_array_equal(np.asarray(first[:end]), np.asarray(second[:end]))
    assert np.all(np.asarray(second[end:]) == 0)


def test_ragged_jits_once_for_every_num_seqs():
    q, k, v, kv_lens, t, cu, n = ragged_inputs(3, **MIXED, page_size=16, kv_heads=2, q_heads=4, head_dim=32,
                                               dtype=jnp.float32)
    traces = []

    @jax.jit
    def step(q, kv_lens, t, cu, n):
        traces.append(1)
        return ragged_paged_attention(q, k, v, kv_lens, t, cu, n, implementation="xla")

    for live in (5, 3, 1, 0):
        out = step(q, kv_lens, t, cu, jnp.asarray([live], jnp.int32))
        want = ragged_golden(q, k, v, kv_lens, t, cu, jnp.asarray([live], jnp.int32))
        assert_close(out, want) if live else np.testing.assert_array_equal(np.asarray(out), 0)
    assert len(traces) == 1


# -- MLA -------------------------------------------------------------------------------------
def mla_golden(*args, **kw):
    return jax.jit(functools.partial(mla_decode_op.reference, **kw))(*args)


def test_mla_golden_matches_unabsorbed_formula():
    qn, qp, c, pe, t, l = mla_inputs(0, lengths=[5, 0, 12], page_size=4, heads=3, latent_dim=16, rope_dim=8,
                                     dtype=jnp.float32)
    out = np.asarray(mla_golden(qn, qp, c, pe, t, l, scale=0.2))
    cn, pn, tn = np.asarray(c, np.float64), np.asarray(pe, np.float64), np.asarray(t)
    for b, length in enumerate(np.asarray(l)):
        if length == 0:
            assert np.all(out[b] == 0)
            continue
        lat = np.stack([cn[tn[b, p // 4], p % 4] for p in range(length)])
        rope = np.stack([pn[tn[b, p // 4], p % 4] for p in range(length)])
        s = 0.2 * (np.asarray(qn[b], np.float64) @ lat.T + np.asarray(qp[b], np.float64) @ rope.T)
        w = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(out[b], (w / w.sum(-1, keepdims=True)) @ lat, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl,config", [("xla", None), ("triton", MlaConfig(pages_per_block=1, num_splits=4)),
                                         ("triton", MlaConfig(pages_per_block=2, num_splits=1, block_rows=16))])
def test_mla_decode(impl, config):
    args = mla_inputs(1, lengths=[1, 16, 45, 0], page_size=16, heads=24, latent_dim=128, rope_dim=32,
                      dtype=jnp.float32)
    with stellax.interpret_mode(impl == "triton"):
        out = mla_decode(*args, scale=0.125, implementation=impl, config=config)
    assert out.shape == (4, 24, 128)
    assert_close(out, mla_golden(*args, scale=0.125))


def test_mla_bfloat16_multi_token_triton():
    args = mla_inputs(2, lengths=[30, 64], page_size=16, heads=16, latent_dim=256, rope_dim=64,
                      dtype=jnp.bfloat16, q_tokens=2)
    with stellax.interpret_mode():
        out = mla_decode(*args, scale=0.1, implementation="triton")
    assert_close(out, mla_golden(*args, scale=0.1))


def test_mla_quantized_latent_and_rope_triton():
    from stellax.ops.paged_attention import KVQuant, quantize_pages
    qn, qp, c, pe, t, l = mla_inputs(4, lengths=[1, 20, 64], page_size=16, heads=16, latent_dim=128, rope_dim=32,
                                     dtype=jnp.bfloat16, quant=KVQuant("int8", rotation=True))
    pe = quantize_pages(pe, KVQuant("int4", group_size=32))
    with stellax.interpret_mode():
        out = mla_decode(qn, qp, c, pe, t, l, scale=0.1, implementation="triton")
    assert_close(out, mla_golden(qn, qp, c, pe, t, l, scale=0.1))


def test_mla_needs_scale_and_matching_dims():
    args = mla_inputs(3, lengths=[3], page_size=4, heads=2, latent_dim=16, rope_dim=8, dtype=jnp.float32)
    with pytest.raises(TypeError, match="scale"):
        mla_decode(*args, scale=None)
    qn, qp, c, pe, t, l = args
    with pytest.raises(ValueError, match="pe_pages"):
        mla_decode(qn, qp, c, pe[..., :4], t, l, scale=1.0)
    with pytest.raises(ValueError, match="latent_pages"):
        mla_decode(qn, qp, c[..., :8], pe, t, l, scale=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("block_q", [1, 4, 16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_ragged_sweep_triton(block_q, page_size):
    q, k, v, kv_lens, t, cu, n = ragged_inputs(4, q_lens=[1, 33, 2, 70, 1], kv_lens=[100, 33, 2, 90, 1],
                                               page_size=page_size, kv_heads=2, q_heads=8, head_dim=64,
                                               dtype=jnp.bfloat16, padding_seqs=2, padding_tokens=7)
    cfg = RaggedConfig(block_q=block_q, pages_per_block=max(1, 32 // page_size), num_splits=2)
    kw = dict(local_window_size=40, logits_soft_cap=30.0)
    assert_close(run_ragged("triton", q, k, v, kv_lens, t, cu, n, config=cfg, **kw),
                 ragged_golden(q, k, v, kv_lens, t, cu, n, **kw), dtype=jnp.bfloat16)


def test_mla_heuristic_fits_sm80_shared_memory_at_r512():
    """At R = 512 with 64-token pages, two pipeline stages need 176 KB of shared
    memory (static GPU tier), over an A100's 163 KB: one stage there, two on sm_90."""
    op = stellax.registered_ops()["mla_decode"]
    args = mla_inputs(0, lengths=[128, 64], page_size=64, heads=16, latent_dim=512, rope_dim=64, dtype=jnp.bfloat16)
    call = op.check(*args, scale=0.1)
    impl = op.implementations["triton"]
    with stellax.lowering_target("a100"):
        assert impl.default_config(call).num_stages == 1
        assert {c.num_stages for c in impl.config_space(call)} == {1, 2}
    with stellax.lowering_target("h100"):
        assert impl.default_config(call).num_stages == 2
        assert {c.num_stages for c in impl.config_space(call)} == {2}
