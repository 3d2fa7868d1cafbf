"""The Mosaic TPU chunked kernels' products per precision (`mxu.Products`): bfloat16
inputs run the input-like products as one bfloat16 pass, the sums of log decays exactly
and the unit-lower inverse at `mxu.BF16_SOLVE`; float32 inputs every product at the call's
precision.

* tiles: the exact sums (`mxu.exact_matmul`, forward and transposes) equal float64 sums
  where one bfloat16 pass does not; the merged-block inverse (`solve.merge_inverse`) stays
  accurate with correlated keys, at float32 and at `BF16_SOLVE`, where the nilpotent product
  loses every digit;
* the kernels, interpreted, on bfloat16 inputs (GDN with grouped heads, qk l2-norm and packed
  sequences; KDA; SSD packed): forward, final state and every gradient against the float32
  golden within the documented bound (bfloat16's rel-L2 1e-2, gradients 2e-2), and
  bit-identical to `emulate.emulated_call` (the long-T error measurements run that);
* float32 inputs with correlated keys (cosine 0.8) through the kernel: float32-accurate;
* the cost model's pass counts and the heuristic it drives.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import Call, lowering_target
from stellax.core.pallas import square_iota
from stellax.core.precision import DEFAULT, HIGH, HIGHEST
from stellax.ops.linear_attention import chunk_gated_delta_rule_op, chunk_kda_op, ssd_op
from stellax.ops.linear_attention.configs import TpuLinearAttentionConfig, linear_attention_tpu_heuristic
from stellax.ops.linear_attention.emulate import emulated_call
from stellax.ops.linear_attention.examples import make_inputs, make_ssd_inputs
from stellax.ops.linear_attention.mosaic_tpu import scalar_spans
from stellax.ops.linear_attention.mxu import (BF16_POLICIES, BF16_PRODUCTS, BF16_SOLVE, EXACT, Products, chunk_products,
                                              exact_matmul, mxu_matmul)
from stellax.ops.linear_attention.solve import merge_inverse
from stellax.ops.linear_attention.tpu_costs import chunk_pass_flops
from stellax.testing.numerics import compare

from la_helpers import check_against_golden, correlated_a

F32, BF16 = jnp.float32, jnp.bfloat16


# -- tiles -------------------------------------------------------------------------------------
def _decays(shape, key=0):
    """float32 log decays of up to −20 per step that bfloat16 cannot hold."""
    return -20.0 * jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(key), shape, F32)) - 1e-3


def test_exact_sums_are_float32_sums_where_one_pass_is_not():
    """Prefix sums of −20-per-step decays by a 0/1-mask matmul: `EXACT` (three bfloat16
    pieces) equals the float64 sums to float32 rounding, forward and transposed (the
    gradient of the decays); one bfloat16 pass is off by up to 2⁻⁹ of each decay."""
    c, k = 64, 128
    rows, cols = square_iota(c)
    mask = (rows >= cols).astype(F32)
    g = _decays((c, k))
    want = np.cumsum(np.asarray(g, np.float64), axis=0)
    got, vjp = jax.vjp(lambda x: exact_matmul(mask, x, "nn"), g)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-7)
    one_pass = np.asarray(mxu_matmul(mask, g, "nn", DEFAULT))
    assert np.max(np.abs(one_pass - want) / np.abs(want)) > 1e-3
    dc = jax.random.normal(jax.random.PRNGKey(1), (c, k), F32) * 100.0
    np.testing.assert_allclose(np.asarray(vjp(dc)[0]), np.asarray(mask, np.float64).T @ np.asarray(dc, np.float64),
                               rtol=1e-6, atol=1e-4)
    # The chunk totals as a column (the mask second, "tn"): Σ_t g_tk for every channel k.
    total, vjp = jax.vjp(lambda x: exact_matmul(x, jnp.ones((c, 128), F32), "tn", "b"), g)
    np.testing.assert_allclose(np.asarray(total[:, 0]), want[-1], rtol=2e-7)
    np.testing.assert_allclose(np.asarray(vjp(jnp.ones((k, 128), F32))[0]), np.full((c, k), 128.0))


def test_scalar_spans_exact():
    """The GDN/SSD decay spans ``D_ij = Σ_{j<t≤i} g_t`` at `EXACT` are float64 direct sums."""
    chunk = 64
    g = _decays((chunk,), key=3)
    spans = np.asarray(scalar_spans(g[:, None], g[None, :], chunk, EXACT)[0])
    g64 = np.asarray(g, np.float64)
    want = np.array([[g64[j + 1:i + 1].sum() if i >= j else 0.0 for j in range(chunk)] for i in range(chunk)])
    np.testing.assert_allclose(spans, want, rtol=1e-6, atol=1e-4)


def _correlated_a(chunk=64, cosine=0.8, seed=0):
    """``A = β ⊙ strictly_lower(K Kᵀ)`` of unit keys at about ``cosine`` to each other, β ≈ 0.9."""
    return correlated_a(chunk, cosine, *jax.random.split(jax.random.PRNGKey(seed), 2))


def _nilpotent_inverse(a, chunk):
    """``(I − A)(I + A²)(I + A⁴)…`` in float32 (numpy): the product the kernels inverted by
    before `solve.merge_inverse`."""
    a = np.asarray(a, np.float32)
    inv, power, span = np.eye(chunk, dtype=np.float32) - a, a, 2
    while span < chunk:
        power = power @ power
        inv = inv + inv @ power
        span *= 2
    return inv


@pytest.mark.parametrize("chunk", [64, 128])
def test_merge_inverse_is_stable(chunk):
    """The inverse of ``I + A`` with keys at cosine 0.8: merging diagonal blocks is
    float32-accurate at ``HIGHEST`` and at `BF16_SOLVE` (``HIGH``) within 1e-4 of ``|T|``,
    where the nilpotent product ``(I − A)(I + A²)…`` cancels every digit; one bfloat16 pass
    would be off by about 1e-2."""
    a, rows, cols = _correlated_a(chunk)
    want = np.linalg.inv(np.eye(chunk) + np.asarray(a, np.float64))
    scale = np.abs(want).max()
    err = lambda t: np.abs(np.asarray(t, np.float64) - want).max() / scale
    assert err(merge_inverse(a, rows, cols, chunk, precision=HIGHEST)) < 1e-5
    assert err(merge_inverse(a, rows, cols, chunk, precision=BF16_SOLVE, mxu=True)) < 1e-4
    assert err(merge_inverse(a, rows, cols, chunk, precision=DEFAULT, mxu=True)) > 1e-3
    assert not err(_nilpotent_inverse(a, chunk)) < 1e-2


def test_products_per_dtype():
    assert chunk_products(BF16, HIGHEST) == BF16_PRODUCTS == Products(DEFAULT, DEFAULT, EXACT, refine=HIGH)
    for precision in (DEFAULT, HIGH, HIGHEST):
        assert chunk_products(F32, precision) == Products(precision, precision, precision)


# -- the kernels, interpreted, on bfloat16 inputs ----------------------------------------------
def _check_bf16(op, diff, static):
    """``op``'s Mosaic TPU kernels (interpreted) on bfloat16 ``diff`` against the float32
    golden within bfloat16's tolerance (forward, final state, every gradient), and
    bit-identical to the emulated kernels."""
    def run(d, s):  # ``static`` (cu_seqlens too) closed over: concrete offsets, the exact padded length
        return op(**d, **static, implementation="mosaic_tpu")

    with stellax.interpret_mode():
        out = check_against_golden(run, lambda d, s: op.reference(**d, **static), diff, dtype=BF16)
    emulated = jax.jit(lambda d: emulated_call(op, **d, **static))(diff)
    for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(emulated)):
        np.testing.assert_array_equal(np.asarray(got.astype(F32)), np.asarray(want.astype(F32)))


def _gdn_case():
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(0), 1, 70, 1, 2, 16, 16, dtype=BF16, decay=0.1,
                                       n_states=3, normalized_keys=False)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    return diff, {"output_final_state": True, "use_qk_l2norm": True,
                  "cu_seqlens": jnp.array([0, 20, 20, 70], jnp.int32)}


def test_gdn_bf16_forward():
    """The forward alone (the default tier; the gradients are in the extended tier)."""
    diff, static = _gdn_case()  # cu_seqlens closed over: concrete, the exact padded length
    op = chunk_gated_delta_rule_op
    with stellax.interpret_mode():
        o, final = jax.jit(lambda d: op(**d, **static, implementation="mosaic_tpu"))(diff)
    ref, ref_final = jax.jit(lambda d: op.reference(**d, **static))({n: x.astype(F32) for n, x in diff.items()})
    assert compare(o, ref).passed and compare(final, ref_final, dtype=BF16).passed
    assert 1e-4 < compare(final, ref_final).rel_l2  # bfloat16 products ran (float32 ones: ~1e-7)


def test_gdn_bf16_packed_grouped_l2norm():
    _check_bf16(chunk_gated_delta_rule_op, *_gdn_case())


def test_kda_bf16():
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(1), 1, 40, 1, 1, 16, 16, dtype=BF16, decay=0.1,
                                       per_channel=True)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    _check_bf16(chunk_kda_op, diff, {"output_final_state": True})


def test_ssd_bf16_packed():
    x, dt, A, B, C, D, _, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(2), 1, 70, 2, 16, 1, 16, n_states=3,
                                                        dtype=BF16)
    diff = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias, "initial_states": h0}
    _check_bf16(ssd_op, diff, {"dt_softplus": True, "return_final_states": True,
                               "cu_seqlens": jnp.array([0, 20, 20, 70], jnp.int32)})


def test_float32_kernel_with_correlated_keys():
    """Keys at cosine 0.8 with β near 1 (a badly conditioned ``I + A``): the float32 kernel
    stays float32-accurate (the nilpotent inverse it had gave relative errors of 2e+2)."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(4), 1, 64, 1, 1, 16, 16, decay=0.02)
    k = k / 4.0 + jnp.eye(16)[0]
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = 0.8 + 0.2 * beta
    args = (q, k, v, g, beta)
    with stellax.interpret_mode():
        o, final = chunk_gated_delta_rule_op(*args, initial_state=h0, output_final_state=True,
                                             implementation="mosaic_tpu")
    ref, ref_final = chunk_gated_delta_rule_op.reference(*args, initial_state=h0, output_final_state=True)
    assert compare(o, ref).rel_l2 < 1e-5 and compare(final, ref_final).rel_l2 < 1e-5


# -- the cost model ------------------------------------------------------------------------------
def test_pass_counts():
    """bfloat16-pass FLOPs of one GDN chunk step at chunk 64, K = V = 128 (`tpu_costs`): float32
    at ``HIGHEST`` six passes everywhere; bfloat16 inputs one pass for the input-like products,
    three for the decay sums; the inverse at three passes (``three_pass``, the default before) or
    at one with a refined ``Δ`` (the default: ten [64, 64] × [64, 128] doubling products at one pass
    instead of three, the refinement's residual product ``A X₀`` at three: 2·2²¹ × (−20 + 3))."""
    count = lambda products, backward=False: chunk_pass_flops(64, 128, 128, per_channel=False, delta=True,
                                                              products=products, backward=backward)
    highest = Products.uniform(HIGHEST)
    assert count(highest) == 6 * count(Products.uniform(DEFAULT)) == 251_658_240
    three = BF16_POLICIES["three_pass"]
    assert count(three) == 88_080_384
    assert count(highest, backward=True) == 1_031_798_784 and count(three, backward=True) == 352_321_536
    assert count(BF16_PRODUCTS) == 88_080_384 - 17 * 2 ** 21 == 52_428_800
    assert count(BF16_PRODUCTS, backward=True) == 163_577_856  # the inverse is not differentiated


def test_heuristic_follows_the_pass_count():
    """On a v5e at 16k tokens × 32 heads (bfloat16, K = V = 128) the grid steps saved by
    chunks of 128 outweigh their larger inverse for GDN; KDA's per-channel sums grow with
    the chunk, so 64; both with four heads per step (`tpu_costs`: their chains overlap)."""
    lead = jax.ShapeDtypeStruct((1, 16384, 32, 128), BF16)
    gdn = Call({"q": lead, "k": lead, "v": lead, "g": jax.ShapeDtypeStruct((1, 16384, 32), BF16),
                "beta": jax.ShapeDtypeStruct((1, 16384, 32), BF16)}, {"precision": HIGHEST})
    kda = Call(dict(gdn.arrays, g=lead), {"precision": HIGHEST})
    with lowering_target("v5e"):
        # Four heads per step overlap their chains of dependent products (`tpu_costs`).
        assert linear_attention_tpu_heuristic(gdn) == TpuLinearAttentionConfig(chunk=128, block_v=128, heads_per_step=4)
        assert linear_attention_tpu_heuristic(kda) == TpuLinearAttentionConfig(chunk=64, block_v=128, heads_per_step=4)
