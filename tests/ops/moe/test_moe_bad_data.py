"""Bad data under jit (issue 43): the MoE family's data-dependent preconditions give their documented
result without checks (clamped group sizes, NaN for a bad group_offset, dropped copies for bad expert
ids, NaN tokens for a bad permutation), and in checked mode (`stellax.checked`) raise eagerly or
through `checkify` naming the argument and the bad value. Valid data is unchanged, and with checks
off no check enters the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import stellax
from stellax.ops.moe import load_balancing_loss, permute, ragged_dot, ragged_dot_tgmm, unpermute

M, K, N = 8, 4, 3
SIZES = [2, 3, 1, 2]  # 4 groups over 8 rows


def _inputs():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return jax.random.normal(k1, (M, K)), jax.random.normal(k2, (2, K, N))


def _numpy_groups(lhs, rhs, sizes, offset):
    """float64 rows of local groups [offset, offset + 2); zeros elsewhere."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((M, N))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for local in range(rhs.shape[0]):
        g = offset + local
        rows = slice(min(starts[g], M), min(starts[g + 1], M))
        out[rows] = lhs[rows] @ rhs[local]
    return out


def _offset_fn(impl="xla"):
    return jax.jit(lambda l, r, g, o: ragged_dot(l, r, g, precision="highest", group_offset=o, implementation=impl))


# Functions are fresh lambdas wherever checked mode matters: jax caches a jitted function's trace
# by the function and its arguments, not by whether checks were on when it was traced.
def _no_checks_in(jaxpr) -> bool:
    text = str(jaxpr)
    return "check" not in text and "assert" not in text


# -- ragged_dot / tgmm: group_offset ------------------------------------------------------------
def test_valid_offset_unchanged_and_no_check_in_the_program():
    lhs, rhs = _inputs()
    gs = jnp.array(SIZES, jnp.int32)
    out = _offset_fn()(lhs, rhs, gs, jnp.int32(1))
    np.testing.assert_allclose(out, _numpy_groups(lhs, rhs, SIZES, 1), rtol=1e-5, atol=1e-5)
    assert jnp.array_equal(out, ragged_dot(lhs, rhs, gs, precision="highest", group_offset=1))  # eager = jit
    assert _no_checks_in(jax.make_jaxpr(_offset_fn())(lhs, rhs, gs, jnp.int32(1)))
    with stellax.checked(False):
        off = str(jax.make_jaxpr(_offset_fn())(lhs, rhs, gs, jnp.int32(1)))
    assert str(jax.make_jaxpr(_offset_fn())(lhs, rhs, gs, jnp.int32(1))) == off


@pytest.mark.parametrize("offset", [-1, 3, 100])
def test_bad_offset_under_jit_is_nan_everywhere(offset):
    lhs, rhs = _inputs()
    out = _offset_fn()(lhs, rhs, jnp.array(SIZES, jnp.int32), jnp.int32(offset))
    assert out.shape == (M, N) and bool(jnp.all(jnp.isnan(out)))
    tg = jax.jit(lambda a, b, g, o: ragged_dot_tgmm(a, b, g, group_offset=o, num_local_groups=2))(
        lhs.T, jnp.ones((M, N)), jnp.array(SIZES, jnp.int32), jnp.int32(offset))
    assert tg.shape == (2, K, N) and bool(jnp.all(jnp.isnan(tg)))


@pytest.mark.parametrize("impl", ["triton", "mosaic_tpu"])
def test_bad_offset_kernels_in_interpret_mode_match_xla(impl):
    lhs, rhs = _inputs()
    gs = jnp.array(SIZES, jnp.int32)
    with stellax.interpret_mode():
        bad = _offset_fn(impl)(lhs, rhs, gs, jnp.int32(-1))
        good = _offset_fn(impl)(lhs, rhs, gs, jnp.int32(2))
    assert bool(jnp.all(jnp.isnan(bad)))
    np.testing.assert_allclose(good, _numpy_groups(lhs, rhs, SIZES, 2), rtol=2e-2, atol=2e-2)


def test_bad_offset_checked_eager_and_checkify():
    lhs, rhs = _inputs()
    gs = jnp.array(SIZES, jnp.int32)
    with stellax.checked():
        with pytest.raises(Exception, match=r"group_offset: expected a value in \[0, 2\].*got -1"):
            ragged_dot(lhs, rhs, gs, group_offset=-1)
        f = checkify.checkify(jax.jit(lambda l, r, g, o: ragged_dot(l, r, g, group_offset=o)))
        err, _ = f(lhs, rhs, gs, jnp.int32(-1))
        assert "group_offset" in err.get() and "got -1" in err.get()
        err, out = f(lhs, rhs, gs, jnp.int32(1))
        assert err.get() is None and not bool(jnp.any(jnp.isnan(out)))
        t = checkify.checkify(jax.jit(lambda a, b, g, o: ragged_dot_tgmm(a, b, g, group_offset=o,
                                                                         num_local_groups=2)))
        err, _ = t(lhs.T, jnp.ones((M, N)), gs, jnp.int32(3))
        assert "group_offset" in err.get() and "got 3" in err.get()


# -- ragged_dot: group_sizes ---------------------------------------------------------------------
def test_bad_group_sizes_under_jit_are_clamped():
    lhs, rhs = _inputs()
    f = jax.jit(lambda l, r, g: ragged_dot(l, r, g, precision="highest"))
    # negative: counts as 0 (group 1 then covers rows 0..2)
    np.testing.assert_allclose(f(lhs, rhs, jnp.array([-1, 3])), _numpy_groups(lhs, rhs, [0, 3], 0),
                               rtol=1e-5, atol=1e-5)
    # summing past M: the last group is cut at row M
    np.testing.assert_allclose(f(lhs, rhs, jnp.array([5, 7])), _numpy_groups(lhs, rhs, [5, 3], 0),
                               rtol=1e-5, atol=1e-5)


def test_bad_group_sizes_checked():
    lhs, rhs = _inputs()
    f = checkify.checkify(jax.jit(lambda l, r, g: ragged_dot(l, r, g)))
    with stellax.checked():
        err, _ = f(lhs, rhs, jnp.array([3, -2]))
        assert "group_sizes: expected non-negative sizes, got -2 at index 1" in err.get()
        err, _ = f(lhs, rhs, jnp.array([5, 7]))
        assert f"group_sizes: expected sum(group_sizes) <= {M} (lhs.shape[0]), got 12" in err.get()
        err, _ = f(lhs, rhs, jnp.array([5, 3]))
        assert err.get() is None
        with pytest.raises(Exception, match="group_sizes"):
            ragged_dot(lhs, rhs, jnp.array([5, 7]))


# -- permute -------------------------------------------------------------------------------------
X = jnp.arange(12.0).reshape(4, 3)
IDS = jnp.array([[0, 1], [2, 1], [1, 0], [2, 0]], jnp.int32)


@pytest.mark.parametrize("bad_id", [3, -1])
def test_permute_bad_id_under_jit_drops_the_copy(bad_id):
    p = jax.jit(lambda x, i: permute(x, i, 3))
    rows, sizes, perm = p(X, IDS.at[1, 0].set(bad_id))
    # copy 2 (token 1, slot 0) is in no group, sorted last, its row zero
    assert sizes.tolist() == [3, 3, 1]
    assert int(perm[-1]) == 2 and sorted(perm.tolist()) == list(range(8))
    assert jnp.array_equal(rows[-1], jnp.zeros(3))
    # end to end: its contribution is zero
    y = ragged_dot(rows, jnp.stack([jnp.eye(3)] * 3), sizes)
    out = unpermute(y, perm, jnp.ones((4, 2)))
    expected = np.asarray(X) * 2
    expected[1] = np.asarray(X[1])  # only the valid copy of token 1
    np.testing.assert_array_equal(out, expected)


def test_permute_valid_unchanged():
    rows, sizes, perm = jax.jit(lambda x, i: permute(x, i, 3))(X, IDS)
    assert sizes.tolist() == [3, 3, 2] and perm.tolist() == [0, 5, 7, 1, 3, 4, 2, 6]
    np.testing.assert_array_equal(rows, np.asarray(X)[np.asarray(perm) // 2])
    np.testing.assert_array_equal(unpermute(rows, perm, jnp.ones((4, 2))), np.asarray(X) * 2)
    assert _no_checks_in(jax.make_jaxpr(lambda x, i: permute(x, i, 3))(X, IDS))


@pytest.mark.parametrize("bad_id", [3, -1])
def test_permute_bad_id_checked(bad_id):
    with stellax.checked():
        with pytest.raises(ValueError, match=rf"expert_ids\[1, 0\]: expected an expert in \[0, 3\).*got {bad_id}"):
            permute(X, IDS.at[1, 0].set(bad_id), 3)
        err, _ = checkify.checkify(jax.jit(lambda x, i: permute(x, i, 3)))(X, IDS.at[2, 1].set(bad_id))
        assert f"expert_ids[2, 1]: expected an expert in [0, 3) (num_experts), got {bad_id}" in err.get()
        err, _ = checkify.checkify(jax.jit(lambda x, i: permute(x, i, 3)))(X, IDS)
        assert err.get() is None


# -- unpermute -----------------------------------------------------------------------------------
PERM = jnp.array([0, 5, 7, 1, 3, 4, 2, 6], jnp.int32)
ROWS = jnp.asarray(np.asarray(X)[np.asarray(PERM) // 2])
BAD_PERMS = {  # the bad permutation and the tokens whose output is NaN
    "99": (PERM.at[2].set(99), [3]),          # copy 7 (token 3) has no row
    "-1": (PERM.at[0].set(-1), [0]),          # copy 0 (token 0) has no row; -1 is not wrapped to 7
    "duplicate": (PERM.at[2].set(1), [0, 3]),  # copy 1 twice (token 0), copy 7 (token 3) missing
}


@pytest.mark.parametrize("case", sorted(BAD_PERMS))
def test_unpermute_bad_permutation_under_jit_nan_rows(case):
    perm, nan_tokens = BAD_PERMS[case]
    out = jax.jit(unpermute)(ROWS, perm, jnp.ones((4, 2)))
    expected = np.asarray(X) * 2
    for t in range(4):
        if t in nan_tokens:
            assert bool(jnp.all(jnp.isnan(out[t]))), (case, t)
        else:
            np.testing.assert_array_equal(out[t], expected[t])


@pytest.mark.parametrize("case", sorted(BAD_PERMS))
def test_unpermute_bad_permutation_checked(case):
    perm, _ = BAD_PERMS[case]
    f = checkify.checkify(jax.jit(lambda *a: unpermute(*a)))
    with stellax.checked():
        with pytest.raises(ValueError, match="permutation"):
            unpermute(ROWS, perm, jnp.ones((4, 2)))
        err, _ = f(ROWS, perm, jnp.ones((4, 2)))
        message = err.get()
    if case == "duplicate":
        assert "permutation: expected a permutation of [0, 8) (each copy once), got copy 1 2 times" in message
    else:
        value = int(perm[2] if case == "99" else perm[0])
        index = 2 if case == "99" else 0
        assert f"permutation[{index}]: expected a copy index in [0, 8) (y.shape[0]), got {value}" in message


def test_unpermute_valid_unchanged_and_no_check_in_the_program():
    out = jax.jit(unpermute)(ROWS, PERM, jnp.full((4, 2), 0.5))
    np.testing.assert_array_equal(out, np.asarray(X))
    assert _no_checks_in(jax.make_jaxpr(unpermute)(ROWS, PERM, jnp.ones((4, 2))))
    with stellax.checked():
        err, _ = checkify.checkify(jax.jit(lambda *a: unpermute(*a)))(ROWS, PERM, jnp.ones((4, 2)))
        assert err.get() is None


# -- load_balancing_loss -------------------------------------------------------------------------
def test_load_balancing_loss_bad_id():
    logits = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    f = jax.jit(lambda *a: load_balancing_loss(*a))
    valid = f(logits, IDS)
    # -1 is not counted on expert 2: the copy counts for no expert, same as id 3
    dropped = f(logits, IDS.at[1, 0].set(-1))
    assert float(dropped) == float(f(logits, IDS.at[1, 0].set(3)))
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64).mean(axis=0)
    counts = np.bincount(np.asarray(IDS).reshape(-1), minlength=3).astype(np.float64)
    np.testing.assert_allclose(valid, 3 * np.sum(counts / 8 * probs), rtol=1e-6)
    counts[2] -= 1  # the copy of token 1, slot 0 (expert 2) counts for no expert
    np.testing.assert_allclose(dropped, 3 * np.sum(counts / 8 * probs), rtol=1e-6)
    with pytest.raises(ValueError, match=r"expert_ids\[1, 0\].*got -1"):
        load_balancing_loss(logits, IDS.at[1, 0].set(-1))
    with stellax.checked():
        err, _ = checkify.checkify(jax.jit(lambda *a: load_balancing_loss(*a)))(logits, IDS.at[1, 0].set(-1))
        assert "expert_ids[1, 0]: expected an expert in [0, 3) (router_logits.shape[1]), got -1" in err.get()


def test_quantized_ragged_dot_bad_offset_is_nan_and_checked():
    lhs, rhs = _inputs()
    q = stellax.quantize(rhs, "int8", axis=1, block_size=K)
    gs = jnp.array(SIZES, jnp.int32)
    f = jax.jit(lambda l, w, g, o: ragged_dot(l, w, g, group_offset=o))
    assert bool(jnp.all(jnp.isnan(f(lhs, q, gs, jnp.int32(-1)))))
    good = f(lhs, q, gs, jnp.int32(1))
    assert not bool(jnp.any(jnp.isnan(good)))
    np.testing.assert_allclose(good, _numpy_groups(lhs, stellax.dequantize(q, jnp.float32), SIZES, 1),
                               rtol=1e-4, atol=1e-4)
    with stellax.checked():
        err, _ = checkify.checkify(jax.jit(lambda l, w, g, o: ragged_dot(l, w, g, group_offset=o)))(
            lhs, q, gs, jnp.int32(-1))
        assert "group_offset: expected a value in [0, 2]" in err.get() and "got -1" in err.get()
