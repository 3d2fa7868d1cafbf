"""Bad ``cu_seqlens`` of `dot_product_attention_varlen` under jit (issue 43): the rows of the
sequences from the first bad offset on are NaN, the others exact; in checked mode the same
conditions raise naming the argument, eagerly and under checkify."""

import jax
import numpy as np
import pytest
from jax.experimental import checkify

import stellax

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((6, 2, 8)).astype(np.float32)
K = RNG.standard_normal((6, 2, 8)).astype(np.float32)
GOOD = np.array([0, 2, 6], np.int32)


def _varlen(cu_q, cu_k):
    return stellax.dot_product_attention_varlen(Q, K, K, cu_q, cu_k, 4, 4, implementation="xla")


def _jitted():
    return jax.jit(lambda cu_q, cu_k: _varlen(cu_q, cu_k))  # fresh: checked mode is read at trace time


# (cu_seqlens_q, cu_seqlens_k, NaN rows, argument named, message)
CASES = [
    ([1, 2, 6], GOOD, [0, 1, 2, 3, 4, 5], "cu_seqlens_q", r"cu_seqlens_q\[0\]: expected 0, got 1"),
    ([0, 4, 2], GOOD, [4, 5], "cu_seqlens_q", r"cu_seqlens_q: expected non-decreasing .*cu_seqlens_q\[2\] = 2"),
    ([0, 2, 7], GOOD, [2, 3, 4, 5], "cu_seqlens_q", r"cu_seqlens_q\[-1\]: expected <= 6 \(q.shape\[0\]\), got 7"),
    (GOOD, [0, 2, 7], [2, 3, 4, 5], "cu_seqlens_k", r"cu_seqlens_k\[-1\]: expected <= 6 \(k.shape\[0\]\), got 7"),
    (GOOD, [0, -1, 6], [0, 1, 2, 3, 4, 5], "cu_seqlens_k", r"cu_seqlens_k: expected non-decreasing"),
    ([0, 2, 4], [0, 5, 3], [2, 3], "cu_seqlens_k", r"cu_seqlens_k: expected non-decreasing"),
]


@pytest.mark.parametrize("cu_q,cu_k,nan_rows,name,message", CASES)
def test_bad_offsets_under_jit_poison_exactly_the_affected_rows(cu_q, cu_k, nan_rows, name, message):
    cu_q, cu_k = np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32)
    out = np.asarray(_jitted()(cu_q, cu_k))
    rows = np.isnan(out).any(axis=(1, 2))
    assert np.nonzero(rows)[0].tolist() == nan_rows
    assert np.isnan(out[rows]).all()
    keep = ~rows
    if keep.any():   # the sequences before the first bad offset are exact
        want = np.asarray(_jitted()(np.minimum(np.maximum.accumulate(np.clip(cu_q, 0, 6)), 6),
                                  np.minimum(np.maximum.accumulate(np.clip(cu_k, 0, 6)), 6)))
        np.testing.assert_array_equal(out[keep], want[keep])


@pytest.mark.parametrize("cu_q,cu_k,nan_rows,name,message", CASES)
def test_checked_mode_names_the_argument(cu_q, cu_k, nan_rows, name, message):
    cu_q, cu_k = np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32)
    with stellax.checked():
        with pytest.raises(Exception, match=name):
            _varlen(cu_q, cu_k)                       # eager
        err, _ = checkify.checkify(_jitted())(cu_q, cu_k)
        assert err.get() is not None and __import__("re").search(message, err.get()), err.get()
        err, _ = checkify.checkify(_jitted())(GOOD, GOOD)
        assert err.get() is None


def test_valid_offsets_unchanged_and_no_check_when_off():
    cu = np.array([0, 2, 5], np.int32)               # one padding row
    out = np.asarray(_jitted()(cu, cu))
    want = np.concatenate([np.asarray(stellax.dot_product_attention(Q[None, a:e], K[None, a:e], K[None, a:e],
                                                                    implementation="xla"))[0]
                           for a, e in ((0, 2), (2, 5))])
    np.testing.assert_allclose(out[:5], want, rtol=1e-5, atol=1e-6)
    assert (out[5] == 0).all()
    jaxpr = str(jax.make_jaxpr(_varlen)(cu, cu))
    assert "check" not in jaxpr and "assert" not in jaxpr


def test_residuals_are_poisoned_too():
    f = jax.jit(lambda cq, ck: stellax.dot_product_attention_varlen(Q, K, K, cq, ck, 4, 4, return_residuals=True,
                                                                    implementation="xla"))
    out, lse = f(np.array([0, 2, 7], np.int32), GOOD)
    assert np.isnan(np.asarray(lse)[:, 2:]).all() and np.isfinite(np.asarray(lse)[:, :2]).all()
