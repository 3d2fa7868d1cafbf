"""Shared helpers: compare an op (forward and the gradients of every float
input) against the float32 golden."""

import jax
import jax.numpy as jnp

from stellax.testing import assert_close, random_array


def upcast(tree):
    return jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float32) if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _value_and_vjp(f, cots):
    """jit(d, s) → (outputs, gradients of Σ output·cotangent w.r.t. every leaf of d): one compile."""
    def inner(d, s):
        out, vjp = jax.vjp(lambda d_: f(d_, s), d)
        leaves, tree = jax.tree_util.tree_flatten(out)
        ct = [c.astype(l.dtype) for c, l in zip(cots, leaves)]
        return out, vjp(jax.tree_util.tree_unflatten(tree, ct))[0]
    return jax.jit(inner)


def check_against_golden(run, golden, diff, static=None, *, dtype, gradients=True, grad_rel_l2=None):
    """``run(diff, static)`` vs ``golden(upcast(diff), static)``: outputs and, with
    ``gradients``, the VJP of every leaf of ``diff`` (a dict of float arrays)
    for a random cotangent."""
    static = static or {}
    shapes = jax.eval_shape(run, diff, static)
    leaves = jax.tree_util.tree_leaves(shapes)
    keys = jax.random.split(jax.random.PRNGKey(11), len(leaves))
    cots = [random_array(k, l.shape, jnp.float32) for k, l in zip(keys, leaves)]
    if gradients:
        out, grads = _value_and_vjp(run, cots)(diff, static)
        ref, ref_grads = _value_and_vjp(golden, cots)(upcast(diff), static)
    else:
        out, ref = jax.jit(run)(diff, static), jax.jit(golden)(upcast(diff), static)
    out_leaves, ref_leaves = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
    assert len(out_leaves) == len(ref_leaves)
    for i, (o, r) in enumerate(zip(out_leaves, ref_leaves)):
        # Outputs in the input dtype get its tolerance; float32 states computed
        # from low-precision inputs are compared at that dtype's tolerance too.
        assert_close(o, r, dtype=dtype, name=f"output[{i}]")
    if gradients:
        for name in diff:
            assert_close(grads[name], ref_grads[name], dtype=dtype, gradient=True, name=f"d{name}",
                         rel_l2_tolerance=grad_rel_l2)
    return out


def correlated_a(chunk, cosine, key_k, key_beta):
    """``(A, rows, cols)``: ``A = β ⊙ strictly_lower(K Kᵀ)`` ``[chunk, chunk]`` of unit keys at about
    ``cosine`` to each other (from ``key_k``), β in [0.8, 1] (from ``key_beta``), and the iotas."""
    import numpy as np

    from stellax.core.pallas import square_iota

    shared = np.sqrt(cosine / (1 - cosine))
    k = jax.random.normal(key_k, (chunk, 128), jnp.float32) / np.sqrt(128) + shared * jnp.eye(128)[0]
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = 0.8 + 0.2 * jax.random.uniform(key_beta, (chunk, 1))
    rows, cols = square_iota(chunk)
    return jnp.where(rows > cols, k @ k.T, 0.0) * beta, rows, cols
