"""Routing (vs a numpy reference), auxiliary losses, permute/unpermute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stellax.ops.moe import load_balancing_loss, permute, route, router_z_loss, unpermute


def numpy_route(logits, k, *, scoring="softmax", bias=None, num_groups=None, top_k_groups=None,
                normalize=True, scaling=1.0):
    """Token by token, ties to the lower index (stable sort of the negated scores)."""
    logits = np.asarray(logits, np.float64)
    tokens, experts = logits.shape
    if scoring == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = z / z.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else np.asarray(bias, np.float64))
    weights = np.zeros((tokens, k))
    ids = np.zeros((tokens, k), np.int64)
    for t in range(tokens):
        c = choice[t].copy()
        if num_groups:
            per = experts // num_groups
            group_score = [np.sort(c[g * per:(g + 1) * per])[::-1][:2].sum() for g in range(num_groups)]
            keep = np.argsort(-np.asarray(group_score), kind="stable")[:top_k_groups]
            for g in range(num_groups):
                if g not in keep:
                    c[g * per:(g + 1) * per] = -np.inf
        ids[t] = np.argsort(-c, kind="stable")[:k]
        w = scores[t, ids[t]]
        weights[t] = (w / w.sum() if normalize else w) * scaling
    return weights, ids


def test_route_softmax_matches_numpy():
    logits = jax.random.normal(jax.random.PRNGKey(0), (50, 12))
    weights, ids = route(logits, 3)
    ref_w, ref_ids = numpy_route(logits, 3)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-5, atol=1e-6)
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    w, _ = route(logits, 3, normalize_weights=False)
    np.testing.assert_allclose(np.asarray(w), numpy_route(logits, 3, normalize=False)[0], rtol=1e-5, atol=1e-7)


def test_route_ties_go_to_the_lower_expert():
    logits = jnp.asarray([[1.0, 2.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0, 3.0], [0.0, 1.0, 0.0, 1.0, 1.0]])
    _, ids = route(logits, 2)
    np.testing.assert_array_equal(np.asarray(ids), [[1, 2], [0, 1], [1, 3]])
    np.testing.assert_array_equal(np.asarray(ids), numpy_route(logits, 2)[1])
    _, again = jax.jit(lambda l: route(l, 2))(logits)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(ids))


def test_route_group_limited_sigmoid_with_bias():
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    logits = jax.random.normal(keys[0], (40, 16))
    bias = 0.5 * jax.random.normal(keys[1], (16,))
    kwargs = dict(scoring="sigmoid", bias=bias, num_groups=4, top_k_groups=2, routed_scaling=2.5)
    weights, ids = route(logits, 4, **kwargs)
    ref_w, ref_ids = numpy_route(logits, 4, scoring="sigmoid", bias=bias, num_groups=4, top_k_groups=2,
                                 scaling=2.5)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-5, atol=1e-6)
    # Selected experts come from at most 2 of the 4 groups.
    assert max(len(set(row // 4)) for row in np.asarray(ids)) <= 2
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 2.5, rtol=1e-5)


def test_bias_changes_selection_not_weights():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    bias = jnp.asarray([0.0, 0.0, 5.0, 0.0])
    w0, ids0 = route(logits, 1, normalize_weights=False)
    w1, ids1 = route(logits, 1, bias=bias, normalize_weights=False)
    assert int(ids0[0, 0]) == 0 and int(ids1[0, 0]) == 2
    probs = jax.nn.softmax(logits)
    np.testing.assert_allclose(float(w1[0, 0]), float(probs[0, 2]), rtol=1e-6)  # unbiased score


def test_route_weights_are_differentiable():
    logits = jax.random.normal(jax.random.PRNGKey(2), (8, 6))
    grad = jax.grad(lambda l: jnp.sum(route(l, 2, normalize_weights=False)[0]))(logits)
    _, ids = route(logits, 2)
    probs = jax.nn.softmax(logits)
    onehot = jax.nn.one_hot(ids, 6).sum(1)
    # d/dl of the selected softmax probabilities.
    expected = probs * (onehot - jnp.sum(probs * onehot, -1, keepdims=True))
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), atol=1e-6)


def test_losses():
    logits = jax.random.normal(jax.random.PRNGKey(3), (64, 8))
    _, ids = route(logits, 2)
    probs = np.asarray(jax.nn.softmax(logits), np.float64)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=8)
    expected = 8 * np.sum(counts / ids.size * probs.mean(0))
    np.testing.assert_allclose(float(load_balancing_loss(logits, ids)), expected, rtol=1e-5)
    uniform = jnp.zeros((16, 4))
    ids_uniform = jnp.asarray(np.arange(32).reshape(16, 2) % 4, jnp.int32)
    np.testing.assert_allclose(float(load_balancing_loss(uniform, ids_uniform)), 1.0, rtol=1e-6)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    np.testing.assert_allclose(float(router_z_loss(logits)), np.mean(lse ** 2), rtol=1e-5)
    assert jnp.all(jnp.isfinite(jax.grad(lambda l: load_balancing_loss(l, ids) + router_z_loss(l))(logits)))


def test_permute_sorted_stable_and_round_trip():
    keys = jax.random.split(jax.random.PRNGKey(4), 3)
    x = jax.random.normal(keys[0], (20, 6))
    ids = jax.random.randint(keys[1], (20, 3), 0, 5)
    rows, group_sizes, perm = permute(x, ids, 5)
    flat = np.asarray(ids).ravel()
    np.testing.assert_array_equal(np.asarray(group_sizes), np.bincount(flat, minlength=5))
    np.testing.assert_array_equal(np.asarray(perm), np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(x)[np.asarray(perm) // 3])
    assert np.all(np.diff(flat[np.asarray(perm)]) >= 0)
    # Identity experts: unpermute with weights w gives x · Σ_j w[t, j].
    weights = jax.random.uniform(keys[2], (20, 3))
    back = unpermute(rows, perm, weights)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x * weights.sum(-1, keepdims=True)), rtol=1e-6)
    # Expert-dependent outputs land on the right copies.
    y = rows * (1.0 + flat[np.asarray(perm)])[:, None]
    expected = np.einsum("tk,tkd->td", np.asarray(weights),
                         np.asarray(x)[:, None, :] * (1.0 + np.asarray(ids))[..., None])
    np.testing.assert_allclose(np.asarray(unpermute(y, perm, weights)), expected, rtol=1e-5)


def test_permute_capacity_drops_later_tokens():
    x = jnp.arange(8, dtype=jnp.float32)[:, None] * jnp.ones((1, 2))
    ids = jnp.asarray([[0], [0], [0], [1], [0], [1], [2], [0]], jnp.int32)
    rows, group_sizes, perm, dropped = permute(x, ids, 4, capacity_factor=1.0)  # capacity ceil(8/4) = 2
    np.testing.assert_array_equal(np.asarray(group_sizes), [2, 2, 1, 0])
    np.testing.assert_array_equal(np.asarray(dropped), [3, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(perm)[:5], [0, 1, 3, 5, 6])   # kept, by expert then token
    np.testing.assert_array_equal(np.asarray(perm)[5:], [2, 4, 7])         # dropped, behind
    assert np.all(np.asarray(rows)[5:] == 0)
    out = unpermute(rows, perm, jnp.ones((8, 1)))
    np.testing.assert_array_equal(np.asarray(out)[:, 0], [0, 1, 0, 3, 0, 5, 6, 0])


@pytest.mark.parametrize("call,match", [
    (lambda: route(jnp.zeros((4, 3)), 4), "top_k"),
    (lambda: route(jnp.zeros((4, 8)), 2, num_groups=3, top_k_groups=1), "num_groups"),
    (lambda: route(jnp.zeros((4, 8)), 5, num_groups=4, top_k_groups=2), "top_k"),
    (lambda: route(jnp.zeros((4, 8)), 2, bias=jnp.zeros(7)), "bias"),
    (lambda: route(jnp.zeros((4, 8)), 2, scoring="relu"), "scoring"),
    (lambda: route(jnp.zeros((4, 8), jnp.int32), 2), "logits"),
    (lambda: permute(jnp.zeros((4, 2)), jnp.zeros((5, 1), jnp.int32), 3), "expert_ids"),
    (lambda: permute(jnp.zeros((4, 2)), jnp.zeros((4, 1)), 3), "expert_ids"),
    (lambda: unpermute(jnp.zeros((6, 2)), jnp.arange(6), jnp.ones((4, 2))), "weights"),
])
def test_bad_inputs(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()
