"""Bad metadata of the paged ops under jit (issue 43): the rows (paged, MLA) or query tokens
(ragged) whose lengths, live block-table entries or ragged offsets are invalid are NaN, every
other row exact; in checked mode the same conditions raise naming the argument, eagerly and under
checkify. update_kv_cache: a slot written by several tokens keeps the last write (dense, combined
and quantized pools, eager and under jit), slots past the pool are dropped, and checked mode names
the first repeated slot."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import stellax
from stellax.ops.paged_attention import mla_decode, paged_inputs, ragged_inputs, ragged_paged_attention

Q, KP, VP, TABLES, LENGTHS = paged_inputs(0, lengths=[3, 20, 9], page_size=16, kv_heads=1, q_heads=2, head_dim=16,
                                          dtype=jnp.float32)
NUM_PAGES = KP.shape[0]


def _paged(t, l):
    return stellax.paged_attention(Q, KP, VP, t, l, implementation="xla")


def _jitted(f):
    return jax.jit(lambda *a: f(*a))   # fresh: checked mode is read when the op is traced


PAGED_CASES = [   # (tables, lengths, NaN rows, message)
    (TABLES, LENGTHS.at[1].set(33), [1], r"lengths: expected values in \[0, 32\].*lengths\[1\] = 33"),
    (TABLES, LENGTHS.at[2].set(-1), [2], r"lengths\[2\] = -1"),
    (TABLES.at[1, 1].set(NUM_PAGES), LENGTHS, [1], rf"block_tables\[1, 1\] = {NUM_PAGES}"),
    (TABLES.at[0, 0].set(-5), LENGTHS, [0], r"block_tables\[0, 0\] = -5"),
]


@pytest.mark.parametrize("tables,lengths,nan_rows,message", PAGED_CASES)
def test_paged_bad_metadata_poisons_its_rows(tables, lengths, nan_rows, message):
    want = np.asarray(_jitted(_paged)(TABLES, LENGTHS))
    out = np.asarray(_jitted(_paged)(tables, lengths))
    rows = np.isnan(out).any(axis=(1, 2))
    assert np.nonzero(rows)[0].tolist() == nan_rows and np.isnan(out[rows]).all()
    np.testing.assert_array_equal(out[~rows], want[~rows])
    ref = np.asarray(stellax.ops.paged_attention.paged_attention_op.reference(Q, KP, VP, tables, lengths))
    assert np.isnan(ref).any(axis=(1, 2)).tolist() == rows.tolist()   # the golden agrees
    with stellax.checked():
        with pytest.raises(Exception, match=message):
            _paged(tables, lengths)
        err, _ = checkify.checkify(_jitted(_paged))(tables, lengths)
        assert err.get() is not None and re.search(message, err.get()), err.get()
        err, _ = checkify.checkify(_jitted(_paged))(TABLES, LENGTHS)
        assert err.get() is None


def test_unread_table_entries_may_hold_anything():
    tables = TABLES.at[0, 1].set(-1)        # length 3: only page 0 is live
    np.testing.assert_array_equal(np.asarray(_jitted(_paged)(tables, LENGTHS)),
                                  np.asarray(_jitted(_paged)(TABLES, LENGTHS)))


def test_no_check_in_the_program_when_off():
    for f, args in ((_paged, (TABLES, LENGTHS)),):
        text = str(jax.make_jaxpr(f)(*args))
        assert "check" not in text and "assert" not in text


def test_mla_bad_length_poisons_its_row():
    rng = np.random.default_rng(1)
    qn = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
    qp = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    lat = jnp.asarray(rng.standard_normal((NUM_PAGES, 16, 16)), jnp.float32)
    pe = jnp.asarray(rng.standard_normal((NUM_PAGES, 16, 8)), jnp.float32)
    f = lambda t, l: mla_decode(qn, qp, lat, pe, t, l, scale=0.2, implementation="xla")
    out = np.asarray(_jitted(f)(TABLES, LENGTHS.at[0].set(100)))
    assert np.isnan(out).any(axis=(1, 2)).tolist() == [True, False, False]
    np.testing.assert_array_equal(out[1:], np.asarray(_jitted(f)(TABLES, LENGTHS))[1:])
    with stellax.checked():
        err, _ = checkify.checkify(_jitted(f))(TABLES, LENGTHS.at[0].set(100))
        assert "lengths[0] = 100" in err.get()


# -- ragged ---------------------------------------------------------------------------------
RQ, RK, RV, KV_LENS, RTABLES, CU, NUM = ragged_inputs(0, q_lens=[2, 1, 3], kv_lens=[5, 17, 3], page_size=8,
                                                      kv_heads=1, q_heads=2, head_dim=16, dtype=jnp.float32,
                                                      padding_seqs=1, padding_tokens=2)
# cu = [0, 2, 3, 6, 7], 8 query tokens (6, 7 padding), num_seqs 3


def _ragged(kv_lens, tables, cu, num):
    return ragged_paged_attention(RQ, RK, RV, kv_lens, tables, cu, num, implementation="xla")


RAGGED_CASES = [   # (kv_lens, tables, cu_q_lens, num_seqs, NaN tokens, message)
    (KV_LENS.at[1].set(-2), RTABLES, CU, NUM, [2], r"kv_lens: expected values in .*kv_lens\[1\] = -2"),
    (KV_LENS.at[2].set(2), RTABLES, CU, NUM, [3, 4, 5], r"sequence 2 with 3 new tokens and kv_lens = 2"),
    (KV_LENS, RTABLES.at[1, 2].set(999), CU, NUM, [2], r"block_tables\[1, 2\] = 999"),
    (KV_LENS, RTABLES, CU.at[0].set(1), NUM, list(range(8)), r"cu_q_lens\[0\]: expected 0, got 1"),
    (KV_LENS, RTABLES, CU.at[2].set(1), NUM, [2, 3, 4, 5, 6, 7], r"cu_q_lens\[2\] = 1 below"),
    (KV_LENS, RTABLES, CU.at[3].set(9), NUM, [3, 4, 5, 6, 7],
     r"cu_q_lens\[num_seqs\]: expected <= 8 \(q.shape\[0\]\), got 9"),
    (KV_LENS, RTABLES, CU, jnp.array([5]), list(range(8)), r"num_seqs: expected a value in \[0, 4\].*got 5"),
]


@pytest.mark.parametrize("kv_lens,tables,cu,num,nan_tokens,message", RAGGED_CASES)
def test_ragged_bad_metadata_poisons_its_tokens(kv_lens, tables, cu, num, nan_tokens, message):
    want = np.asarray(_jitted(_ragged)(KV_LENS, RTABLES, CU, NUM))
    out = np.asarray(_jitted(_ragged)(kv_lens, tables, cu, num))
    rows = np.isnan(out).any(axis=(1, 2))
    assert np.nonzero(rows)[0].tolist() == nan_tokens and np.isnan(out[rows]).all()
    np.testing.assert_array_equal(out[~rows], want[~rows])
    with stellax.checked():
        err, _ = checkify.checkify(_jitted(_ragged))(kv_lens, tables, cu, num)
        assert err.get() is not None and re.search(message, err.get()), err.get()
        with pytest.raises(Exception, match=message):
            _ragged(kv_lens, tables, cu, num)


def test_ragged_valid_data_unchanged_and_dead_sequences_ignored():
    assert np.asarray(CU).tolist() == [0, 2, 3, 6, 7] and int(np.asarray(NUM).reshape(-1)[0]) == 3
    out = np.asarray(_jitted(_ragged)(KV_LENS, RTABLES, CU, NUM))
    ref = np.asarray(stellax.ops.paged_attention.ragged_paged_attention_op.reference(
        RQ, RK, RV, KV_LENS, RTABLES, CU, NUM))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert (out[6:] == 0).all() and np.isfinite(out).all()
    # a dead sequence (past num_seqs) may hold anything
    dead = _jitted(_ragged)(KV_LENS.at[3].set(-7), RTABLES.at[3].set(-1), CU.at[4].set(1), NUM)
    np.testing.assert_array_equal(np.asarray(dead), out)
    with stellax.checked():
        err, _ = checkify.checkify(_jitted(_ragged))(KV_LENS, RTABLES, CU, NUM)
        assert err.get() is None
    text = str(jax.make_jaxpr(_ragged)(KV_LENS, RTABLES, CU, NUM))
    assert "check" not in text and "assert" not in text


# -- update_kv_cache ----------------------------------------------------------------------------
def _sequential_writes(pool, rows, slots):
    """numpy: the pool after writing ``rows[t]`` to ``slots[t]`` one token after the other (padding and
    slots past the pool skipped): the meaning of "the last write of a slot wins"."""
    flat = np.array(pool, copy=True).reshape(pool.shape[0] * pool.shape[1], *pool.shape[2:])
    for t, slot in enumerate(np.asarray(slots).tolist()):
        if 0 <= slot < flat.shape[0]:
            flat[slot] = rows[t]
    return flat.reshape(pool.shape)


def _only_last_writes(slots):
    """The slot mapping with every write that a later token overwrites turned into padding."""
    slots = np.asarray(slots).copy()
    for t in range(len(slots)):
        if slots[t] >= 0 and (slots[t + 1:] == slots[t]).any():
            slots[t] = -1
    return jnp.asarray(slots)


# slot 5 three times, 2 twice, padding, and 40 past the pool (4 pages x 4 slots)
DUPLICATE_SLOTS = jnp.array([5, 2, 5, -1, 2, 40, 5, 11], jnp.int32)


@pytest.mark.parametrize("how", ["eager", "jit", "jit_donated"])
def test_update_repeated_slots_last_write_wins(how):
    rng = np.random.default_rng(0)
    kp, vp = stellax.init_kv_cache(4, 4, 2, 8, dtype=jnp.float32)
    kp = kp + 7.0   # old contents: an untouched slot stays 7
    new_k = jnp.asarray(rng.standard_normal((8, 2, 8)), jnp.float32)
    new_v = jnp.asarray(rng.standard_normal((8, 2, 8)), jnp.float32)
    f = {"eager": stellax.update_kv_cache, "jit": jax.jit(stellax.update_kv_cache),
         "jit_donated": jax.jit(stellax.update_kv_cache, donate_argnums=(0, 1))}[how]
    want_k = _sequential_writes(np.asarray(kp), np.asarray(new_k), DUPLICATE_SLOTS)
    want_v = _sequential_writes(np.asarray(vp), np.asarray(new_v), DUPLICATE_SLOTS)
    k2, v2 = f(kp + 0, vp + 0, new_k, new_v, DUPLICATE_SLOTS)
    np.testing.assert_array_equal(np.asarray(k2), want_k)
    np.testing.assert_array_equal(np.asarray(v2), want_v)
    flat = np.asarray(k2).reshape(16, 2, 8)
    np.testing.assert_array_equal(flat[5], np.asarray(new_k)[6])   # token 6, the last of slot 5's three
    np.testing.assert_array_equal(flat[2], np.asarray(new_k)[4])


def test_update_scatters_unique_rows_only():
    """Why the result is deterministic on every backend: the scatter gets each in-range row at most
    once (XLA leaves the order of repeated scatter indices unspecified; the CPU happens to apply
    them in order, GPUs and TPUs need not)."""
    from stellax.ops.paged_attention.cache import _flat_index
    index, valid = jax.jit(_flat_index, static_argnums=1)(DUPLICATE_SLOTS, 16)
    index, valid = np.asarray(index), np.asarray(valid)
    assert valid.tolist() == [False, False, False, False, True, False, True, True]   # tokens 4, 6, 7 write
    assert index[valid].tolist() == [2, 5, 11] and (index[~valid] == 16).all()


def test_update_repeated_slots_random_mappings_match_sequential_writes():
    rng = np.random.default_rng(1)
    kp, vp = stellax.init_kv_cache(3, 4, 1, 4, dtype=jnp.float32)
    f = jax.jit(stellax.update_kv_cache)
    for _ in range(5):
        slots = jnp.asarray(rng.integers(-2, 14, size=24), jnp.int32)   # 12 slots: many repeats, padding, past
        new = jnp.asarray(rng.standard_normal((24, 1, 4)), jnp.float32)
        k2, _ = f(kp, vp, new, new, slots)
        np.testing.assert_array_equal(np.asarray(k2), _sequential_writes(np.asarray(kp), np.asarray(new), slots))


def test_update_repeated_slots_combined_layout():
    kv, _ = stellax.init_kv_cache(4, 4, 1, 8, dtype=jnp.float32, combined=True)
    new_k = jnp.arange(8 * 8, dtype=jnp.float32).reshape(8, 1, 8)
    kv2, none = jax.jit(lambda kv, k, v, s: stellax.update_kv_cache(kv, None, k, v, s))(
        kv, new_k, -new_k, DUPLICATE_SLOTS)
    assert none is None
    want = _sequential_writes(np.asarray(kv), np.stack([np.asarray(new_k), -np.asarray(new_k)], axis=1),
                              DUPLICATE_SLOTS)
    np.testing.assert_array_equal(np.asarray(kv2), want)


@pytest.mark.parametrize("spec", [stellax.KVQuant("int8"), stellax.KVQuant("int4", group_size=8),
                                  stellax.KVQuant("int4", group_axis="token", group_size=4),
                                  stellax.KVQuant("int8", sink_tokens=2, recent_tokens=2)],
                         ids=["int8", "int4_channel_groups", "int4_token_groups_kivi", "int8_windows"])
def test_update_repeated_slots_quantized_pools_keep_only_the_last_write(spec):
    """A quantized pool written with repeated slots is bit for bit the pool written with only each
    slot's last write (the earlier ones dropped like padding): codes, scales, zeros and windows."""
    rng = np.random.default_rng(2)
    windows = spec.sink_tokens or spec.recent_tokens
    kp, vp = stellax.init_kv_cache(4, 4, 2, 16, quant=spec, max_seqs=2 if windows else None)
    new = jnp.asarray(rng.standard_normal((8, 2, 16)), jnp.float32)
    extra = {}
    if windows:
        extra = dict(positions=jnp.array([0, 1, 0, 0, 1, 3, 0, 2], jnp.int32),
                     seq_ids=jnp.array([0, 1, 0, 0, 1, 1, 0, 1], jnp.int32))
    f = jax.jit(lambda kp, vp, new, s: stellax.update_kv_cache(kp, vp, new, new, s, **extra))
    got, _ = f(kp, vp, new, DUPLICATE_SLOTS)
    want, _ = f(kp, vp, new, _only_last_writes(DUPLICATE_SLOTS))
    for field in ("data", "scale", "zero", "window"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None), field
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                          err_msg=field)
    assert not np.array_equal(np.asarray(got.data.astype(jnp.float32)), np.asarray(kp.data.astype(jnp.float32)))


def test_update_slots_checked_mode():
    kp, vp = stellax.init_kv_cache(2, 4, 1, 8, dtype=jnp.float32)
    new = jnp.ones((2, 1, 8), jnp.float32)
    f = lambda s: stellax.update_kv_cache(kp, vp, new, new, s)
    # unchecked: slots past the pool are dropped, like negative (padding) slots
    k2, _ = _jitted(f)(jnp.array([3, 8]))
    assert np.asarray(k2).reshape(8, 8)[3].tolist() == [1.0] * 8 and np.asarray(k2).sum() == 8
    with stellax.checked():
        err, _ = checkify.checkify(_jitted(f))(jnp.array([3, 8]))
        assert "slot_mapping[1] = 8: expected a slot in [0, 8)" in err.get()
        err, _ = checkify.checkify(_jitted(f))(jnp.array([5, 5]))
        assert "slot_mapping[1] = 5: the slot is already written by slot_mapping[0]" in err.get()
        err, _ = checkify.checkify(_jitted(f))(jnp.array([-1, 5]))
        assert err.get() is None
        err, _ = checkify.checkify(_jitted(f))(jnp.array([-1, -1]))   # repeated padding is no repeat
        assert err.get() is None


def test_update_checked_mode_names_the_first_repeat_in_token_order():
    kp, vp = stellax.init_kv_cache(2, 4, 1, 8, dtype=jnp.float32)
    new = jnp.ones((5, 1, 8), jnp.float32)
    # slot 4 (tokens 0, 4) is the smaller slot; slot 7 repeats first (token 3 after token 1)
    slots = jnp.array([4, 7, 2, 7, 4], jnp.int32)
    f = lambda s: stellax.update_kv_cache(kp, vp, new, new, s)
    message = r"slot_mapping\[3\] = 7: the slot is already written by slot_mapping\[1\]; expected unique slots"
    with stellax.checked():
        err, _ = checkify.checkify(_jitted(f))(slots)
        assert err.get() is not None and re.search(message, err.get()), err.get()
        with pytest.raises(Exception, match=message):   # eager
            f(slots)
    with pytest.raises(ValueError, match=message):   # the eager validate says the same
        stellax.ops.paged_attention.validate(k_pages=kp, slot_mapping=slots)


def test_update_no_check_in_the_program_when_off():
    kp, vp = stellax.init_kv_cache(2, 4, 1, 8, dtype=jnp.float32)
    new = jnp.ones((3, 1, 8), jnp.float32)
    f = lambda s: stellax.update_kv_cache(kp, vp, new, new, s)
    slots = jnp.array([1, 1, 2])
    text = str(jax.make_jaxpr(f)(slots))
    assert "check" not in text and "assert" not in text
    off = str(jax.make_jaxpr(checkify.checkify(f))(slots))
    with stellax.checked():
        assert str(jax.make_jaxpr(checkify.checkify(f))(slots)) != off   # on, the checks are there


def test_mosaic_tpu_interpreted_gives_the_same_nan_rows():
    """The kernels read clamped metadata; the NaN rows are applied outside them, so the Mosaic TPU
    kernel (interpreted) gives the XLA path's rows."""
    from stellax.ops.paged_attention.configs import TpuPagedConfig
    q, k, v, t, lengths = paged_inputs(2, lengths=[5, 37, 9], page_size=8, kv_heads=1, q_heads=2, head_dim=32,
                                       dtype=jnp.float32)
    t_bad, l_bad = t.at[2, 0].set(k.shape[0] + 3), lengths.at[0].set(-4)
    with stellax.interpret_mode():
        out = np.asarray(stellax.paged_attention(q, k, v, t_bad, l_bad, implementation="mosaic_tpu",
                                                 config=TpuPagedConfig(pages_per_block=2)))
    want = np.asarray(stellax.paged_attention(q, k, v, t_bad, l_bad, implementation="xla"))
    assert np.isnan(out).any(axis=(1, 2)).tolist() == [True, False, True]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)   # NaN where the XLA path has NaN
