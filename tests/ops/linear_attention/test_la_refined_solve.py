"""The delta rule's residuals by a one-pass inverse and one refinement step
(`mosaic_tpu.refined_solve`, `mxu.Products.refine`; issue 39):

* tiles: with keys at cosine 0.8 (a badly conditioned ``I + A``) the refined solve and its gradient
  are about as accurate as its three-pass residual product, where the one-pass inverse applied
  alone is off by about 1e-2;
* the static schedule of the compiled kernels (libtpu, v5e; `stellax.testing.llo_schedule`, no TPU):
  the refined policy (the default for bfloat16 operands) against the inverse at three passes (the
  default before) — fewer cycles per grid step on the GDN and KDA forwards and the GDN backward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stellax.core.pallas import square_iota
from stellax.core.precision import DEFAULT
from stellax.ops.linear_attention.mosaic_tpu import refined_solve
from stellax.ops.linear_attention.mxu import BF16_POLICIES, BF16_PRODUCTS, mxu_matmul
from stellax.ops.linear_attention.solve import merge_inverse

from la_helpers import correlated_a

F32 = jnp.float32


def _system(chunk=64, cosine=0.8, n=128, seed=0):
    """``(A, R)``: ``A = β ⊙ strictly_lower(K Kᵀ)`` of unit keys at about ``cosine`` to each other,
    β in [0.8, 1], and a right-hand side ``R [chunk, n]``."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    a, _, _ = correlated_a(chunk, cosine, keys[0], keys[1])
    return a, jax.random.normal(keys[2], (chunk, n), F32)


def _rel(got, want):
    got = np.asarray(got, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.mark.parametrize("chunk", [64, 128])
def test_refined_solve_is_accurate_where_one_pass_is_not(chunk):
    a, r = _system(chunk)
    m = np.eye(chunk) + np.asarray(a, np.float64)
    want = np.linalg.solve(m, np.asarray(r, np.float64))
    rows, cols = square_iota(chunk)
    t = merge_inverse(a, rows, cols, chunk, precision=DEFAULT, mxu=True)
    one_pass = _rel(mxu_matmul(t, r, "nn", DEFAULT), want)
    refined = _rel(refined_solve(a, r, chunk, BF16_PRODUCTS), want)
    assert one_pass > 1e-3 and refined < 2e-4 and refined < one_pass / 20, (one_pass, refined)


def test_refined_solve_gradient_is_the_exact_solves():
    """``R̄ = (I + A)⁻ᵀ X̄`` and ``Ā = −R̄ Xᵀ`` (strictly lower after the caller's mask) against float64."""
    chunk = 64
    a, r = _system(chunk)
    xbar = jax.random.normal(jax.random.PRNGKey(7), r.shape, F32)
    x, vjp = jax.vjp(lambda a_, r_: refined_solve(a_, r_, chunk, BF16_PRODUCTS), a, r)
    abar, rbar = vjp(xbar)
    m = np.eye(chunk) + np.asarray(a, np.float64)
    x64 = np.linalg.solve(m, np.asarray(r, np.float64))
    lam = np.linalg.solve(m.T, np.asarray(xbar, np.float64))
    lower = np.tril(np.ones((chunk, chunk)), -1)
    assert _rel(rbar, lam) < 2e-4
    assert _rel(np.asarray(abar) * lower, -(lam @ x64.T) * lower) < 2e-4


def test_policies_differ_only_where_named():
    three, refined = BF16_POLICIES["three_pass"], BF16_POLICIES["refined"]
    assert BF16_PRODUCTS == refined and three.refine is None and refined.refine is not None
    assert (three.operands, three.sums) == (refined.operands, refined.sums)


# -- the static schedule (libtpu compile for a v5e, no TPU) ------------------------------------------
def _bound(kind, chunk, heads_per_step, policy, backward=False):
    from stellax.testing.llo_schedule import kernel_schedules

    schedules = kernel_schedules("stellax.ops.linear_attention.tpu_cases:kernel_case", "v5e", kind=kind,
                                 chunk=chunk, heads_per_step=heads_per_step, heads=heads_per_step,
                                 tokens=2 * chunk, backward=backward, policy=policy)
    (schedule,) = [s for n, s in schedules.items() if n.startswith("linear_attention")]
    return schedule


def _libtpu():
    from stellax.testing.tpu_compile import libtpu_available

    ok, why = libtpu_available()
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("kind, chunk, heads, backward, gain", [
    ("gdn", 128, 4, False, 1.3),   # 8475 → 5877 cycles (libtpu 0.0.42)
    ("gdn", 128, 4, True, 1.8),    # 20308 → 9240
    ("kda", 64, 4, False, 1.05),   # 11074 → 10058
])
def test_refined_policy_shortens_the_step(kind, chunk, heads, backward, gain):
    """max(bundles, critical path) of one grid step, and the register spills, fall by the refined
    policy (the inverse at one pass) against the inverse at three passes."""
    _libtpu()
    three = _bound(kind, chunk, heads, "three_pass", backward)
    refined = _bound(kind, chunk, heads, "refined", backward)
    assert refined.bound * gain < three.bound, (three.describe(), refined.describe())
    assert refined.spills < three.spills, (three.spills, refined.spills)
