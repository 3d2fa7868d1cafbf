"""Pallas Triton attention in interpret mode against the golden: forward and
every gradient, block skipping, determinism, lowering for cuda and PTX.

The default tier runs a representative subset (interpreted kernels are slow
on a CPU); ``-m slow`` runs the full sweep of the issue."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import use_configs
from stellax.ops.attention import attention_backward_op, attention_op, base
from stellax.ops.attention import triton as triton_fwd
from stellax.ops.attention.configs import FlashBackwardConfig, FlashConfig
from stellax.ops.attention.masks import MaskSpec, classify_blocks, default_positions, schedule_counts, visit_schedule
from stellax.testing import assert_deterministic, lowering

from .attention_cases import OPTIONS, check_against_golden, make_inputs

SMALL = {("attention", "triton"): FlashConfig(block_q=16, block_k=32),
         ("attention_backward", "triton"): FlashBackwardConfig(block_q=32, block_k=16)}


# -- default tier: a representative subset -------------------------------------------------
@pytest.mark.parametrize("dtype,t,s,n,kh,h,hv,opt", [
    (jnp.bfloat16, 33, 70, 8, 2, 80, 80, "window_causal"),  # T != S, GQA 4, non-power-of-two head dim
    pytest.param(jnp.float32, 17, 17, 4, 1, 32, 32, "causal", marks=pytest.mark.slow),  # MQA
    pytest.param(jnp.float16, 70, 33, 4, 4, 64, 48, "chunk", marks=pytest.mark.slow),   # T > S, Hv != H
    pytest.param(jnp.float32, 1, 40, 8, 1, 16, 16, "softcap", marks=pytest.mark.slow),  # one query row, GQA 8
])
def test_forward_and_gradients(dtype, t, s, n, kh, h, hv, opt):
    args, kwargs = make_inputs(t * 7 + s, 2, t, s, n, kh, h, hv, dtype)
    check_against_golden("triton", args, {**kwargs, **OPTIONS[opt]}, configs=SMALL)


def test_bias_mask_sinks_segments_lengths_combined():
    args, kwargs = make_inputs(5, 2, 40, 50, 4, 2, 32, 32, jnp.float32, bias=(2, 1, 40, 50), mask=(1, 4, 40, 50),
                               sinks=True, segments=True, lengths=True)
    # Also deterministic: a second run of the same compiled forward+backward is bitwise equal.
    check_against_golden("triton", args, {**kwargs, "is_causal": True, "local_window_size": (20, 3),
                                          "logits_soft_cap": 4.0}, configs=SMALL, repeat=True)


@pytest.mark.slow
def test_bias_broadcast_gradients():
    """Bias broadcast over batch, heads, rows: dbias is reduced to its shape."""
    args, kwargs = make_inputs(6, 2, 24, 36, 4, 2, 16, 16, jnp.float32, bias=(1, 4, 1, 36))
    check_against_golden("triton", args, {**kwargs, "is_causal": True}, configs=SMALL)


def test_fully_masked_rows():
    args, kwargs = make_inputs(7, 1, 20, 20, 2, 2, 16, 16, jnp.float32)
    mask = jnp.ones((1, 1, 20, 20), bool).at[:, :, 5].set(False)
    kwargs.update(query_seq_lengths=jnp.array([15], jnp.int32))
    args = args[:4] + (mask,)
    out, grads = check_against_golden("triton", args, kwargs, configs=SMALL)
    np.testing.assert_array_equal(np.asarray(out[:, 5]), 0)
    np.testing.assert_array_equal(np.asarray(out[:, 15:]), 0)
    np.testing.assert_array_equal(np.asarray(grads[0][:, 5]), 0)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.slow
def test_varlen_matches_per_sequence():
    lens = [9, 30, 1]
    cu = jnp.array(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(0), (sum(lens), 4, 32))
    k = jax.random.normal(jax.random.PRNGKey(1), (sum(lens), 2, 32))
    v = jax.random.normal(jax.random.PRNGKey(2), (sum(lens), 2, 32))
    with stellax.interpret_mode(), use_configs(SMALL):
        out = jax.jit(lambda q, k, v: stellax.dot_product_attention_varlen(
            q, k, v, cu, cu, 30, 30, is_causal=True, implementation="triton"))(q, k, v)
    for i in range(len(lens)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        ref = stellax.dot_product_attention(q[None, sl], k[None, sl], v[None, sl], is_causal=True,
                                            implementation="xla")
        np.testing.assert_allclose(np.asarray(out[sl]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_deterministic():
    args, kwargs = make_inputs(8, 1, 40, 40, 4, 1, 32, 32, jnp.bfloat16, bias=(1, 4, 40, 40), sinks=True)
    q, k, v, bias, _ = args

    def grads(q, k, v, bias, sinks):
        return jax.grad(lambda *a: jnp.sum(stellax.dot_product_attention(
            a[0], a[1], a[2], a[3], sinks=a[4], is_causal=True, implementation="triton").astype(jnp.float32) ** 2),
            argnums=(0, 1, 2, 3, 4))(q, k, v, bias, sinks)

    with stellax.interpret_mode(), use_configs(SMALL):
        fn = jax.jit(grads)
        assert_deterministic(fn, q, k, v, bias, kwargs["sinks"])


# -- block skipping is real --------------------------------------------------------------
def _kernel_visits(spec_kwargs, t, s, block_q, block_k):
    q = jax.random.normal(jax.random.PRNGKey(0), (1, t, 1, 16))
    k = jax.random.normal(jax.random.PRNGKey(1), (1, s, 1, 16))
    call = attention_op.check(q, k, k, **spec_kwargs)
    c = base.canonicalize(call)
    with stellax.interpret_mode():
        _, _, counts = triton_fwd.forward(c, FlashConfig(block_q=block_q, block_k=block_k), debug=True)
    counts = np.asarray(counts[0, 0])  # per query row
    rows = counts[::block_q]            # one entry per q block
    return rows // 65536, rows % 65536, c


@pytest.mark.parametrize("kwargs,t,s", [
    ({"is_causal": True}, 256, 256),
    ({"is_causal": True}, 100, 300),
    ({"local_window_size": (20, 20)}, 200, 256),
    pytest.param({"local_window_size": (40, 0)}, 256, 256, marks=pytest.mark.slow),
    pytest.param({"chunk_size": 64}, 256, 256, marks=pytest.mark.slow),
])
def test_block_skipping_matches_mask_sparsity(kwargs, t, s):
    bq = bk = 16
    visited, unmasked, c = _kernel_visits(kwargs, t, s, bq, bk)
    # The kernel's own loop counter equals the schedule the mask description gives...
    sched = visit_schedule(classify_blocks(c.spec, c.q_pos, c.kv_pos, block_q=bq, block_k=bk))[0]
    expect_visited, _, expect_unmasked = (np.asarray(x) for x in schedule_counts(sched))
    np.testing.assert_array_equal(visited, expect_visited)
    np.testing.assert_array_equal(unmasked, expect_unmasked)
    # ...and that schedule visits exactly the blocks holding a visible pair.
    dense = np.asarray(_dense_visibility(c.spec, t, s))
    nq, nk = -(-t // bq), -(-s // bk)
    visible = np.zeros((nq * bq, nk * bk), bool)  # padded keys are never visible
    visible[:t, :s] = dense
    rows_valid = np.arange(nq * bq) < t
    blocks = visible.reshape(nq, bq, nk, bk)
    nonempty = blocks.any(axis=(1, 3))
    # FULL: every valid query row sees every key of the block (padded rows do not count).
    full = (blocks | ~rows_valid.reshape(nq, bq)[:, :, None, None]).all(axis=(1, 3))
    assert visited.sum() == nonempty.sum(), (visited.sum(), nonempty.sum())
    assert unmasked.sum() == full.sum()
    skipped_fraction = 1 - visited.sum() / (nq * nk)
    assert skipped_fraction == pytest.approx(1 - nonempty.mean())
    assert skipped_fraction > 0.1  # a real saving in every case here


def _dense_visibility(spec, t, s):
    from stellax.ops.attention.masks import dense_mask
    q_pos, kv_pos = default_positions(t, s)
    return dense_mask(spec, q_pos, kv_pos)[0]


def test_block_skipping_segments():
    """Packed documents: blocks of different documents are never visited."""
    seg = jnp.asarray(np.repeat(np.arange(4), 64)[None], jnp.int32)
    visited, unmasked, _ = _kernel_visits({"q_segment_ids": seg, "kv_segment_ids": seg}, 256, 256, 32, 32)
    assert visited.tolist() == [2] * 8 and unmasked.tolist() == [2] * 8  # 16 of 64 blocks, all full


# -- lowering for cuda: every config of the autotuning spaces ------------------------------
def _lowering_args(dtype=jnp.bfloat16, h=64):
    q = jax.ShapeDtypeStruct((1, 256, 4, h), dtype)
    k = jax.ShapeDtypeStruct((1, 256, 2, h), dtype)
    return q, k


def test_lowering_every_forward_config():
    q, k = _lowering_args()
    args = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(k.shape, k.dtype))
    n = lowering.check_op_lowering(attention_op, "triton", args, {"is_causal": True})
    assert n == len(attention_op.implementations["triton"].config_space(attention_op.check(*args)))
    assert n >= 8


def test_lowering_every_backward_config():
    args = attention_backward_op.examples(jnp.bfloat16)[0]
    call = attention_backward_op.check(*args.args, **args.kwargs)
    space = attention_backward_op.implementations["triton"].config_space(call)
    assert len(space) >= 8
    for config in space:
        def fn(*a):
            return attention_backward_op(*a, implementation="triton", config=config, **args.kwargs)
        low = lowering.lower_for_gpu(fn, *args.args)
        lowering.assert_custom_call(low, count=3)  # preprocess, dq, dk/dv


def test_lowering_with_every_option_and_grad():
    args, kwargs = make_inputs(0, 2, 96, 160, 8, 2, 80, 64, jnp.bfloat16, bias=(2, 1, 96, 160),
                               mask=(1, 8, 96, 160), sinks=True, segments=True, lengths=True)
    kwargs.update(is_causal=True, local_window_size=(64, 8), chunk_size=64, logits_soft_cap=30.0)
    config = FlashConfig(block_q=64, block_k=32)
    lowering.check_op_lowering(attention_op, "triton", args, kwargs, configs=[config], grad=True)


@pytest.mark.ptx
@pytest.mark.parametrize("dtype,h", [(jnp.bfloat16, 64), (jnp.bfloat16, 128), (jnp.float16, 256), (jnp.float32, 80)])
def test_ptx_compiles_and_fits_smem(dtype, h):
    ok, reason = lowering.triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    args, kwargs = make_inputs(0, 1, 256, 256, 4, 2, h, h, dtype, bias=(1, 1, 256, 256), sinks=True)

    def loss(q, k, v, bias, sinks):
        out, lse = stellax.dot_product_attention(q, k, v, bias, sinks=sinks, is_causal=True, return_residuals=True,
                                                 implementation="triton")
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    low = lowering.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *args[:4], kwargs["sinks"])
    kernels = lowering.compile_triton_to_ptx(low, "9.0")
    assert len(kernels) == 4
    lowering.assert_fits_smem(kernels, "9.0")


@pytest.mark.ptx
@pytest.mark.parametrize("h", [64, 128, 256])
def test_ptx_every_config_fits_smem(h):
    """Every config of both autotuning spaces compiles to PTX (sm_90) within shared memory."""
    ok, reason = lowering.triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    q = jnp.zeros((1, 512, 4, h), jnp.bfloat16)
    k = jnp.zeros((1, 512, 2, h), jnp.bfloat16)
    call = attention_op.check(q, k, k)
    for config in attention_op.implementations["triton"].config_space(call):
        low = lowering.lower_for_gpu(
            lambda q, k, v, config=config: stellax.dot_product_attention(q, k, v, implementation="triton",
                                                                         config=config), q, k, k)
        lowering.assert_fits_smem(lowering.compile_triton_to_ptx(low, "9.0"), "9.0")
    out, lse = stellax.dot_product_attention(q, k, k, return_residuals=True, implementation="xla")
    args = (q, k, k, None, None, None, out, lse, out, None) + default_positions(512, 512)
    statics = dict(spec=MaskSpec(causal=True), scale=0.125)
    bcall = attention_backward_op.check(*args, **statics)
    for config in attention_backward_op.implementations["triton"].config_space(bcall):
        low = lowering.lower_for_gpu(
            lambda *a, config=config: attention_backward_op(*a, implementation="triton", config=config, **statics),
            *args)
        lowering.assert_fits_smem(lowering.compile_triton_to_ptx(low, "9.0"), "9.0")


# -- the full sweep (slow) ------------------------------------------------------------------
SWEEP_SHAPES = [(1, 17), (17, 17), (128, 128), (129, 128), (333, 129), (17, 333)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t,s", SWEEP_SHAPES)
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_sweep_shapes_masks_dtypes(dtype, t, s, opt):
    args, kwargs = make_inputs(t + s, 1, t, s, 4, 2, 64, 64, dtype)
    check_against_golden("triton", args, {**kwargs, **OPTIONS[opt]})


@pytest.mark.slow
@pytest.mark.parametrize("h", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8, "mqa"])
def test_sweep_head_dims_and_groups(h, group):
    n = 8
    kh = 1 if group == "mqa" else n // group
    args, kwargs = make_inputs(h, 1, 129, 77, n, kh, h, h, jnp.bfloat16)
    check_against_golden("triton", args, {**kwargs, "is_causal": True})


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["bias", "mask", "sinks", "segments", "lengths", "all"])
@pytest.mark.parametrize("t,s", [(128, 128), (129, 333)])
def test_sweep_features(feature, t, s):
    every = feature == "all"
    args, kwargs = make_inputs(3, 2, t, s, 4, 2, 64, 64, jnp.float32,
                               bias=(2, 4, t, s) if feature == "bias" or every else None,
                               mask=(2, 1, t, s) if feature == "mask" or every else None,
                               sinks=feature == "sinks" or every, segments=feature == "segments" or every,
                               lengths=feature == "lengths" or every)
    check_against_golden("triton", args, {**kwargs, "is_causal": every})


@pytest.mark.slow
@pytest.mark.parametrize("opts", [dict(is_causal=True, chunk_size=32), dict(local_window_size=(16, 16), chunk_size=64),
                                  dict(is_causal=True, local_window_size=(30, None), logits_soft_cap=5.0)])
def test_sweep_combined_masks(opts):
    args, kwargs = make_inputs(4, 2, 150, 150, 4, 1, 32, 32, jnp.float32, sinks=True, segments=True)
    check_against_golden("triton", args, {**kwargs, **opts})
