"""paged_attention: XLA and interpreted Triton kernels vs the golden (which
gathers pages into dense K/V), and the golden vs an independent numpy loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.paged_attention import PagedConfig, paged_attention, paged_attention_op
from stellax.ops.paged_attention import paged_inputs
from stellax.testing import assert_close


def golden(*args, **kw):
    return jax.jit(functools.partial(paged_attention_op.reference, **kw))(*args)


def run(impl, *args, config=None, **kw):
    with stellax.interpret_mode(impl == "triton"):
        return paged_attention(*args, implementation=impl, config=config, **kw)


def numpy_paged_attention(q, k_pages, v_pages, tables, lengths, *, scale, soft_cap=None, window=None, sinks=None):
    """Independent float64 loop: one sequence, one query token, one head at a time."""
    q, kp, vp = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (q, k_pages, v_pages))
    tables, lengths = np.asarray(tables), np.asarray(lengths)
    squeeze = q.ndim == 3
    if squeeze:
        q = q[:, None]
    b, nq, n, _ = q.shape
    ps, kh = kp.shape[1], kp.shape[2]
    out = np.zeros((b, nq, n, vp.shape[-1]))
    for i in range(b):
        length = int(lengths[i])
        keys = np.stack([kp[tables[i, p // ps], p % ps] for p in range(length)]) if length else None
        vals = np.stack([vp[tables[i, p // ps], p % ps] for p in range(length)]) if length else None
        for t in range(nq):
            qp = length - nq + t
            for h in range(n):
                kv = h // (n // kh)
                logits = []
                for p in range(length):
                    if p > qp or (window is not None and p < qp - window):
                        continue
                    s = scale * float(q[i, t, h] @ keys[p, kv])
                    if soft_cap is not None:
                        s = soft_cap * np.tanh(s / soft_cap)
                    logits.append((s, vals[p, kv]))
                terms = [s for s, _ in logits] + ([float(sinks[h])] if sinks is not None else [])
                if not logits:
                    continue
                m = max(terms)
                denom = sum(np.exp(s - m) for s in terms)
                out[i, t, h] = sum(np.exp(s - m) * v for s, v in logits) / denom
    return out[:, 0] if squeeze else out


def test_golden_matches_numpy_loop():
    q, k, v, t, l = paged_inputs(0, lengths=[0, 1, 17, 30], page_size=8, kv_heads=2, q_heads=4, head_dim=16,
                                 dtype=jnp.float32, q_tokens=2, shared_prefix_pages=1)
    sinks = jnp.asarray([0.3, -0.5, 1.0, 0.0])
    ref = golden(q, k, v, t, l, logits_soft_cap=3.0, local_window_size=6, sinks=sinks)
    want = numpy_paged_attention(q, k, v, t, l, scale=0.25, soft_cap=3.0, window=6, sinks=np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(ref), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sizes_lengths_shuffled_shared(impl, page_size):
    # lengths: empty, one token, exactly a page, a page + 1, ragged.
    lengths = [0, 1, page_size, page_size + 1, 3 * page_size - 5 if page_size > 2 else 37]
    q, k, v, t, l = paged_inputs(page_size, lengths=lengths, page_size=page_size, kv_heads=2, q_heads=8,
                                 head_dim=64, dtype=jnp.float32, shared_prefix_pages=1)
    out = run(impl, q, k, v, t, l)
    assert_close(out, golden(q, k, v, t, l))
    assert np.all(np.asarray(out[0]) == 0), "a zero-length sequence must give zeros"


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_multi_token_window_softcap_sinks_splits(impl):
    q, k, v, t, l = paged_inputs(3, lengths=[4, 40, 70, 2], page_size=16, kv_heads=2, q_heads=6, head_dim=32,
                                 dtype=jnp.float32, q_tokens=4)
    kw = dict(sinks=jnp.linspace(-1.0, 2.0, 6), local_window_size=9, logits_soft_cap=4.0, scale=0.3)
    cfg = PagedConfig(pages_per_block=1, num_splits=4) if impl == "triton" else None
    assert_close(run(impl, q, k, v, t, l, config=cfg, **kw), golden(q, k, v, t, l, **kw))


@pytest.mark.parametrize("kv_heads,q_heads", [(4, 4), (1, 8)])
def test_gqa_ratios_triton(kv_heads, q_heads):
    q, k, v, t, l = paged_inputs(4, lengths=[33, 5, 80], page_size=16, kv_heads=kv_heads, q_heads=q_heads,
                                 head_dim=64, dtype=jnp.float32)
    kw = dict(sinks=jnp.full((q_heads,), 0.5)) if kv_heads == 4 else {}
    out = run("triton", q, k, v, t, l, config=PagedConfig(pages_per_block=2, num_splits=2), **kw)
    assert_close(out, golden(q, k, v, t, l, **kw))


def test_combined_kv_pages_triton_and_xla():
    q, k, v, t, l = paged_inputs(5, lengths=[20, 47], page_size=16, kv_heads=2, q_heads=4, head_dim=64,
                                 dtype=jnp.float32)
    kv = jnp.stack([k, v], axis=2)
    want = golden(q, k, v, t, l)
    assert_close(golden(q, kv, None, t, l), want)
    assert_close(run("triton", q, kv, None, t, l), want)
    assert_close(run("xla", q, kv, None, t, l), want)


def test_bfloat16_and_determinism():
    q, k, v, t, l = paged_inputs(6, lengths=[100, 7, 64], page_size=16, kv_heads=2, q_heads=8, head_dim=128,
                                 dtype=jnp.bfloat16, q_tokens=2)
    cfg = PagedConfig(pages_per_block=4, num_splits=2)
    with stellax.interpret_mode():
        f = jax.jit(lambda *a: paged_attention(*a, implementation="triton", config=cfg))
        first = f(q, k, v, t, l)
        second = f(q, k, v, t, l)
    assert first.dtype == jnp.bfloat16
    assert np.asarray(first).tobytes() == np.asarray(second).tobytes()
    assert_close(first, golden(q, k, v, t, l))
    assert_close(run("xla", q, k, v, t, l), golden(q, k, v, t, l))


def test_default_implementation_on_cpu_is_xla():
    q, k, v, t, l = paged_inputs(7, lengths=[3], page_size=16, kv_heads=1, q_heads=2, head_dim=16,
                                 dtype=jnp.float32)
    assert paged_attention_op.select(paged_attention_op.check(q, k, v, t, l)).name == "xla"


def test_value_head_dim_may_differ():
    q, k, v, t, l = paged_inputs(8, lengths=[20, 9], page_size=16, kv_heads=2, q_heads=4, head_dim=32,
                                 dtype=jnp.float32, value_dim=64)
    out = run("triton", q, k, v, t, l)
    assert out.shape == (2, 4, 64)
    assert_close(out, golden(q, k, v, t, l))


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("q_tokens", [None, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sweep_triton(page_size, splits, q_tokens, dtype):
    lengths = [0, 1, page_size, 2 * page_size + 3, 150]
    q, k, v, t, l = paged_inputs(11, lengths=lengths, page_size=page_size, kv_heads=2, q_heads=8, head_dim=64,
                                 dtype=dtype, q_tokens=q_tokens, shared_prefix_pages=2, max_pages=200 // page_size + 2)
    ppb = max(1, 16 // page_size)
    kw = dict(sinks=jnp.linspace(-1, 1, 8).astype(dtype), local_window_size=50)
    out = run("triton", q, k, v, t, l, config=PagedConfig(pages_per_block=ppb, num_splits=splits), **kw)
    assert_close(out, golden(q, k, v, t, l, **kw), dtype=dtype)
