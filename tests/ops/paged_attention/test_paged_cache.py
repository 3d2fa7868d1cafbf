"""The paged cache: update_kv_cache round trips (dense, combined, quantized,
windows), validate() errors, and bad metadata under jit (NaN rows)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stellax.ops.paged_attention import (
    KVQuant, dequantize_pages, init_kv_cache, paged_attention, paged_attention_op, quantize_pages,
    update_kv_cache, validate,
)
from stellax.ops.paged_attention import paged_inputs, ragged_inputs
from stellax.testing import assert_close


def _slots(rng, num_pages, page_size, count, padding):
    slots = rng.choice(num_pages * page_size, size=count, replace=False).astype(np.int32)
    slots[rng.choice(count, size=padding, replace=False)] = -1
    return jnp.asarray(slots)


def test_dense_update_round_trip_and_padding_untouched():
    rng = np.random.default_rng(0)
    k, v = init_kv_cache(6, 4, 2, 8, dtype=jnp.float32)
    k = k + 7.0  # recognizable old contents
    slots = _slots(rng, 6, 4, 10, padding=3)
    new_k = jnp.asarray(rng.normal(size=(10, 2, 8)), jnp.float32)
    new_v = jnp.asarray(rng.normal(size=(10, 2, 8)), jnp.float32)
    f = jax.jit(update_kv_cache, donate_argnums=(0, 1))
    k2, v2 = f(k + 0, v + 0, new_k, new_v, slots)
    flat_k, flat_v = np.asarray(k2).reshape(24, 2, 8), np.asarray(v2).reshape(24, 2, 8)
    s = np.asarray(slots)
    live = s >= 0
    np.testing.assert_array_equal(flat_k[s[live]], np.asarray(new_k)[live])
    np.testing.assert_array_equal(flat_v[s[live]], np.asarray(new_v)[live])
    untouched = np.setdiff1d(np.arange(24), s[live])
    np.testing.assert_array_equal(flat_k[untouched], 7.0)
    np.testing.assert_array_equal(flat_v[untouched], 0.0)


def test_combined_update_and_out_of_range_slots_dropped():
    kv, none = init_kv_cache(3, 2, 1, 4, dtype=jnp.float32, combined=True)
    assert none is None
    new_k, new_v = jnp.ones((3, 1, 4)), 2 * jnp.ones((3, 1, 4))
    kv2, none = update_kv_cache(kv, None, new_k, new_v, jnp.asarray([5, -1, 6], jnp.int32))
    assert none is None
    flat = np.asarray(kv2).reshape(6, 2, 1, 4)
    np.testing.assert_array_equal(flat[5, 0], 1.0)
    np.testing.assert_array_equal(flat[5, 1], 2.0)
    assert np.count_nonzero(flat) == 8  # slot 6 is past the pool: skipped like padding


@pytest.mark.parametrize("spec", [KVQuant("int8"), KVQuant("fp8"), KVQuant("int4", group_size=16),
                                  KVQuant("int2", group_size=8, rotation=True)])
def test_quantized_update_equals_quantizing_the_dense_pool(spec):
    rng = np.random.default_rng(1)
    dense = jnp.asarray(rng.normal(size=(5, 4, 2, 32)), jnp.float32)
    pool = init_kv_cache(5, 4, 2, 32, quant=spec)[0]
    slots = jnp.arange(20, dtype=jnp.int32)
    rows = dense.reshape(20, 2, 32)
    pool, _ = update_kv_cache(pool, pool, rows, rows, slots)
    want = quantize_pages(dense, spec)
    np.testing.assert_array_equal(np.asarray(pool.data.astype(jnp.float32)), np.asarray(want.data.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(pool.scale), np.asarray(want.scale))
    # and the dequantized pool is close to the original (bound per bit width)
    err = float(jnp.linalg.norm(dequantize_pages(pool) - dense) / jnp.linalg.norm(dense))
    assert err < {"int8": 0.01, "fp8": 0.05, "int4": 0.12, "int2": 0.5}[spec.format], err


def test_token_axis_groups_decode_appends_track_the_values():
    # KIVI keys: per-channel groups of 4 tokens; tokens arrive one at a time.
    spec = KVQuant("int4", group_axis="token", group_size=4)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(8, 1, 16)) + 5.0 * (np.arange(16) == 3), jnp.float32)
    pool = init_kv_cache(2, 8, 1, 16, quant=spec)[0]
    pool = pool.__class__(pool.data, pool.scale + 3.0, pool.zero - 9.0, None, None, spec, 16)  # stale contents
    update = jax.jit(update_kv_cache)
    for i in range(8):
        pool, _ = update(pool, pool, x[i:i + 1], x[i:i + 1], jnp.asarray([8 + i], jnp.int32))
    got = dequantize_pages(pool)[1]
    rng_per_group = jnp.ptp(x.reshape(2, 4, 1, 16), axis=1)
    err = jnp.abs(got - x).reshape(2, 4, 1, 16).max(axis=1)
    # appends re-range a group as it grows: still within ~1.5 steps of the final range
    assert bool(jnp.all(err <= 1.5 * rng_per_group / 15 + 1e-3)), (err, rng_per_group)
    # prefill of whole groups is exactly quantize_pages
    pool2 = init_kv_cache(2, 8, 1, 16, quant=spec)[0]
    pool2, _ = update_kv_cache(pool2, pool2, x, x, jnp.arange(8, 16, dtype=jnp.int32))
    want = quantize_pages(jnp.concatenate([jnp.zeros_like(x), x])[None].reshape(2, 8, 1, 16), spec)
    np.testing.assert_array_equal(np.asarray(pool2.data[1]), np.asarray(want.data[1]))


def test_windows_follow_appends_and_attention_reads_them():
    spec = KVQuant("int2", group_size=16, sink_tokens=2, recent_tokens=3)
    rng = np.random.default_rng(3)
    page_size, kv_heads, h = 4, 1, 32
    k, v = init_kv_cache(8, page_size, kv_heads, h, dtype=jnp.float32, quant=spec, max_seqs=2)
    lengths = [9, 6]
    tables = jnp.asarray([[3, 0, 5, 1], [2, 7, 4, 6]], jnp.int32)
    dense_k = np.zeros((8, page_size, kv_heads, h), np.float32)
    dense_v = np.zeros_like(dense_k)
    update = jax.jit(update_kv_cache)
    # prefill the first 5 tokens of sequence 0 in one call, then decode both sequences token by token
    steps = [[(0, p) for p in range(5)]] + [[(0, 5 + i), (1, i)] for i in range(6)]
    for step in steps:
        step = [(s, p) for s, p in step if p < lengths[s]]
        slots = [int(tables[s, p // page_size]) * page_size + p % page_size for s, p in step]
        pos = [p for _, p in step]
        seqs = [s for s, _ in step]
        vals_k = rng.normal(size=(len(slots), kv_heads, h)).astype(np.float32)
        vals_v = rng.normal(size=(len(slots), kv_heads, h)).astype(np.float32)
        for i, slot in enumerate(slots):
            dense_k[slot // page_size, slot % page_size] = vals_k[i]
            dense_v[slot // page_size, slot % page_size] = vals_v[i]
        junk = np.full((1, kv_heads, h), 99.0, np.float32)  # one padding row per step
        k, v = update(k, v, jnp.asarray(np.concatenate([vals_k, junk])),
                               jnp.asarray(np.concatenate([vals_v, junk])), jnp.asarray(slots + [-1], jnp.int32),
                               positions=jnp.asarray(pos + [0], jnp.int32), seq_ids=jnp.asarray(seqs + [0], jnp.int32))
    lens = jnp.asarray(lengths, jnp.int32)
    window = np.asarray(k.window.astype(jnp.float32))
    for s, length in enumerate(lengths):
        for p in list(range(2)) + list(range(length - 3, length)):
            slot = p if p < 2 else 2 + p % 3
            page = int(tables[s, p // page_size])
            np.testing.assert_allclose(window[s, slot], dense_k[page, p % page_size], rtol=1e-2, atol=1e-2)
    q = jnp.asarray(rng.normal(size=(2, 2, h)), jnp.float32)
    out = paged_attention(q, k, v, tables, lens, implementation="xla")
    ref = jax.jit(paged_attention_op.reference)(q, k, v, tables, lens)
    assert_close(out, ref)
    exact = jax.jit(paged_attention_op.reference)(q, jnp.asarray(dense_k), jnp.asarray(dense_v), tables, lens)
    # int2 everywhere but the windows: close to the exact cache, and much closer than without windows
    no_win = jax.jit(paged_attention_op.reference)(
        q, quantize_pages(jnp.asarray(dense_k), KVQuant("int2", group_size=16)),
        quantize_pages(jnp.asarray(dense_v), KVQuant("int2", group_size=16)), tables, lens)
    assert float(jnp.linalg.norm(out - exact)) < 0.8 * float(jnp.linalg.norm(no_win - exact))


def test_mla_latent_update_quantized_and_dense():
    rng = np.random.default_rng(4)
    latent, pe = init_kv_cache(3, 4, None, 32, quant=KVQuant("int8"), value_quant=None, value_head_dim=8,
                               dtype=jnp.float32)
    assert latent.shape == (3, 4, 32) and latent.spec.format == "int8" and pe.shape == (3, 4, 8)
    latent, pe = init_kv_cache(3, 4, None, 32, dtype=jnp.float32, value_head_dim=8)
    q_latent = quantize_pages(latent, "int8")
    new_c = jnp.asarray(rng.normal(size=(5, 32)), jnp.float32)
    new_pe = jnp.asarray(rng.normal(size=(5, 8)), jnp.float32)
    slots = jnp.asarray([0, 5, -1, 11, 2], jnp.int32)
    q_latent, pe = update_kv_cache(q_latent, pe, new_c, new_pe, slots)
    dense = np.asarray(dequantize_pages(q_latent)).reshape(12, 32)
    live = np.asarray(slots) >= 0
    np.testing.assert_allclose(dense[np.asarray(slots)[live]], np.asarray(new_c)[live], atol=0.02)
    np.testing.assert_array_equal(np.asarray(pe).reshape(12, 8)[np.asarray(slots)[live]], np.asarray(new_pe)[live])


def test_update_needs_positions_for_windows_and_checks_shapes():
    k, v = init_kv_cache(2, 4, 1, 16, quant=KVQuant("int4", group_size=16, recent_tokens=2), max_seqs=1)
    with pytest.raises(ValueError, match="positions and seq_ids"):
        update_kv_cache(k, v, jnp.ones((1, 1, 16)), jnp.ones((1, 1, 16)), jnp.asarray([0], jnp.int32))
    with pytest.raises(ValueError, match="new_k"):
        update_kv_cache(k, v, jnp.ones((1, 2, 16)), jnp.ones((1, 1, 16)), jnp.asarray([0], jnp.int32))
    with pytest.raises(TypeError, match="slot_mapping"):
        update_kv_cache(k, v, jnp.ones((1, 1, 16)), jnp.ones((1, 1, 16)), jnp.asarray([0.0]))


# -- validate -------------------------------------------------------------------------------
def _case():
    return paged_inputs(0, lengths=[20, 5], page_size=8, kv_heads=2, q_heads=4, head_dim=16, dtype=jnp.float32,
                        max_pages=4)


def test_validate_accepts_good_inputs():
    validate(*_case())


@pytest.mark.parametrize("mutate,match", [
    (lambda t, l, n: (t.at[0, 1].set(n), l), r"block_tables\[0, 1\] = \d+: expected a page index in \[0, \d+\)"),
    (lambda t, l, n: (t.at[1, 0].set(-1), l), r"block_tables\[1, 0\] = -1"),
    (lambda t, l, n: (t, l.at[1].set(33)), r"lengths\[1\] = 33: expected a value in \[0, 32\]"),
    (lambda t, l, n: (t, l.at[0].set(-2)), r"lengths\[0\] = -2"),
])
def test_validate_errors(mutate, match):
    q, k, v, t, l = _case()
    t2, l2 = mutate(t, l, k.shape[0])
    with pytest.raises(ValueError, match=match):
        validate(q, k, v, t2, l2)


def test_validate_ignores_entries_past_the_live_pages():
    q, k, v, t, l = _case()
    validate(q, k, v, t.at[1, 3].set(10**6), l)  # sequence 1 has one live page


def test_shape_errors_name_the_argument():
    q, k, v, t, l = _case()
    with pytest.raises(ValueError, match="k_pages: expected head_dim 16"):
        paged_attention(q, k[..., :8], v, t, l)
    with pytest.raises(ValueError, match="v_pages"):
        paged_attention(q, k, v[:, :4], t, l)
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        paged_attention(q[:, :3], k, v, t, l)
    with pytest.raises(TypeError, match="k_pages: expected dtype float32"):
        paged_attention(q, k.astype(jnp.bfloat16), v, t, l)
    with pytest.raises(ValueError, match="lengths"):
        paged_attention(q, k, v, t, l[:1])
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(q, k, v, t, l, sinks=jnp.zeros(3))
    with pytest.raises(ValueError, match="local_window_size"):
        paged_attention(q, k, v, t, l, local_window_size=(4, 2))


def test_validate_ragged_and_slots():
    q, k, v, kv_lens, t, cu, n = ragged_inputs(0, q_lens=[2, 3], kv_lens=[5, 3], page_size=4, kv_heads=1,
                                               q_heads=2, head_dim=16, dtype=jnp.float32, padding_seqs=1)
    validate(q, k, v, t, kv_lens, cu_q_lens=cu, num_seqs=n)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        validate(q, k, v, t, kv_lens.at[1].set(2), cu_q_lens=cu, num_seqs=n)
    with pytest.raises(ValueError, match=r"cu_q_lens\[2\] = 1: expected >= cu_q_lens\[1\]"):
        validate(q, k, v, t, kv_lens, cu_q_lens=cu.at[2].set(1), num_seqs=n)
    with pytest.raises(ValueError, match="num_seqs"):
        validate(q, k, v, t, kv_lens, cu_q_lens=cu, num_seqs=jnp.asarray([4]))
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 999"):
        validate(k_pages=k, slot_mapping=jnp.asarray([0, 999], jnp.int32))
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 3: the slot is already written by slot_mapping\[0\]"):
        validate(k_pages=k, slot_mapping=jnp.asarray([3, -1, 3], jnp.int32))


def test_jit_bad_metadata_gives_nan_rows_and_never_reads_out_of_bounds():
    """Issue 43: the kernels read clamped metadata (no out-of-bounds read); the row of a sequence
    with a bad live table entry or length is NaN, the other rows exact (tests/ops/paged_attention/
    test_paged_attention_bad_data.py covers every op and checked mode)."""
    q, k, v, t, l = _case()
    f = jax.jit(functools.partial(paged_attention, implementation="xla"))
    good = np.asarray(f(q, k, v, t, l))
    for bad_t, bad_l, row in ((t.at[0, 1].set(10**6), l, 0), (t.at[1, 0].set(-5), l, 1),
                              (t, l.at[1].set(10**6), 1)):
        out = np.asarray(f(q, k, v, bad_t, bad_l))
        nan = np.isnan(out).reshape(out.shape[0], -1)
        assert nan.any(axis=1).tolist() == [b == row for b in range(out.shape[0])] and nan[row].all()
        np.testing.assert_array_equal(out[1 - row], good[1 - row])
