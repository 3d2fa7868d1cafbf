"""Load-balancing layouts, the log-sum-exp merge and the ring's skip predicate (cheap, no meshes)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.parallel import (LocalAttention, load_balance_permutation, merge_partials, reorder_for_load_balance,
                              restore_from_load_balance, shard_positions)
from stellax.testing import assert_close


def test_zigzag_and_striped_permutations():
    # T = 8 over 2 shards: zigzag chunks of 2 → shard 0 {0, 3}, shard 1 {1, 2}.
    np.testing.assert_array_equal(load_balance_permutation(8, 2, "zigzag"), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(load_balance_permutation(8, 2, "striped"), [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(load_balance_permutation(8, 2, None), np.arange(8))
    np.testing.assert_array_equal(shard_positions(12, 3, "striped"), [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]])


@pytest.mark.parametrize("strategy", [None, "zigzag", "striped"])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_reorder_roundtrip(strategy, size):
    x = jnp.arange(2 * 32 * 3).reshape(2, 32, 3)
    y = reorder_for_load_balance(x, size, strategy)
    perm = load_balance_permutation(32, size, strategy)
    assert sorted(perm.tolist()) == list(range(32))
    np.testing.assert_array_equal(y[:, 5], x[:, perm[5]])
    np.testing.assert_array_equal(restore_from_load_balance(y, size, strategy), x)
    z = reorder_for_load_balance(jnp.moveaxis(x, 1, 0), size, strategy, axis=0)
    np.testing.assert_array_equal(jnp.moveaxis(z, 0, 1), y)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_zigzag_balances_causal_work(size):
    t = 64
    pos = shard_positions(t, size, "zigzag")
    full = np.arange(t)
    work = [(full[None, :] <= p[:, None]).sum() for p in pos]  # visible (q, k) pairs per shard
    assert len(set(work)) == 1
    contiguous = [(full[None, :] <= p[:, None]).sum() for p in shard_positions(t, size, None)]
    assert contiguous[-1] > contiguous[0]


def test_layout_errors():
    with pytest.raises(ValueError, match="divisible by 8"):
        load_balance_permutation(12, 4, "zigzag")
    with pytest.raises(ValueError, match="divisible by 4"):
        reorder_for_load_balance(jnp.zeros((1, 6)), 4, "striped")
    with pytest.raises(ValueError, match="load_balance"):
        load_balance_permutation(8, 2, "round_robin")


def test_merge_partials_is_exact():
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, 6, 4, 8))
    k = jax.random.normal(keys[1], (2, 10, 2, 8))
    v = jax.random.normal(keys[2], (2, 10, 2, 8))
    ref, ref_lse = stellax.dot_product_attention(q, k, v, implementation="xla", return_residuals=True)
    a = stellax.dot_product_attention(q, k[:, :4], v[:, :4], implementation="xla", return_residuals=True)
    b = stellax.dot_product_attention(q, k[:, 4:], v[:, 4:], implementation="xla", return_residuals=True)
    out, lse = merge_partials(a[0], a[1], b[0], b[1])
    assert_close(out, ref)
    assert_close(lse, ref_lse)
    # Fully masked on one side, and on both: (0, -inf) never NaN.
    empty = (jnp.zeros_like(ref), jnp.full_like(ref_lse, -jnp.inf))
    out2, lse2 = merge_partials(*empty, ref, ref_lse)
    assert_close(out2, ref)
    out3, lse3 = merge_partials(*empty, *empty)
    assert not jnp.any(jnp.isnan(out3)) and jnp.all(out3 == 0) and jnp.all(jnp.isneginf(lse3))


def test_any_visible_skips_future_blocks():
    local = LocalAttention(is_causal=True)
    pos = shard_positions(16, 4, None)
    q_pos, early, late = pos[1][None], pos[0][None], pos[2][None]
    assert bool(local.any_visible(q_pos, early))
    assert not bool(local.any_visible(q_pos, late))
    zig = shard_positions(16, 4, "zigzag")
    assert all(bool(local.any_visible(zig[i][None], zig[j][None])) for i in range(4) for j in range(4))
    window = LocalAttention(window=(2, 2))
    assert not bool(window.any_visible(pos[0][None], pos[3][None]))
    assert LocalAttention().any_visible(q_pos, late) is None


def test_reorder_divisibility_error_names_x():
    import jax.numpy as jnp
    import pytest

    from stellax.parallel import reorder_for_load_balance, restore_from_load_balance

    for fn in (reorder_for_load_balance, restore_from_load_balance):
        with pytest.raises(ValueError, match=r"x: sequence length \(axis 1\) \(10\) must be divisible by 8"):
            fn(jnp.ones((1, 10, 2)), 4, "zigzag")
