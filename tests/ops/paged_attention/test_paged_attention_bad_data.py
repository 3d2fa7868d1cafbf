"""Bad metadata of the paged ops under jit (issue 43): the rows (paged, MLA) or query tokens
(ragged) whose lengths, live block-table entries or ragged offsets are invalid are NaN, every
other row exact; in checked mode the same conditions raise naming the argument, eagerly and under
checkify; update_kv_cache's slots are checked in checked mode."""

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
        assert "slot_mapping: slot 5 appears more than once" in err.get()
        err, _ = checkify.checkify(_jitted(f))(jnp.array([-1, 5]))
        assert err.get() is None


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
