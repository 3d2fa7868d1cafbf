"""The Mosaic TPU chunked kernels (`mosaic_tpu`, `mosaic_tpu_backward`) of
`chunk_gated_delta_rule`, `chunk_kda` and `ssd` and of the backward ops, in
interpret mode against the naive float32 recurrence (the ops' golden):
forward and gradients, T not a multiple of the chunk, decays of −20 per step,
packed sequences (an empty one included) with initial and final states, both
chunk lengths, split value blocks; and the layout checks. The real-compiler
tier runs in `tests/test_registry_tiers.py` (heuristic configs, v5e and v6e)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.linear_attention import (chunk_gated_delta_rule_op, chunk_kda_op, gated_recurrence_backward_op,
                                          kda_recurrence_backward_op, ssd_op)
from stellax.ops.linear_attention.configs import (TRITON_CHUNK, TpuLinearAttentionConfig,
                                                 linear_attention_tpu_heuristic, linear_attention_tpu_requirements,
                                                 linear_attention_tpu_space)
from stellax.ops.linear_attention.examples import make_inputs, make_ssd_inputs
from stellax.ops.linear_attention.mosaic_tpu import recurrence_forward, scalar_spans
from stellax.core import Call
from stellax.testing import assert_close
from stellax.testing.numerics import compare, golden

from la_helpers import check_against_golden

F32 = jnp.float32
#: Chunks of 128 and V split into blocks of 128 (V = 160 pads to 256: two value blocks).
LONG_SPLIT = TpuLinearAttentionConfig(chunk=128, block_v=128)


def _delta_case(per_channel, *, T, K, V, decay, packed, HV=2, H=1, seed=0):
    cu = [0, 20, 20, T] if packed else None
    n = 3 if packed else 1
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(seed), 1, T, H, HV, K, V, per_channel=per_channel,
                                       decay=decay, n_states=n)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    static = {"output_final_state": True}
    if packed:
        static["cu_seqlens"] = jnp.array(cu, jnp.int32)
    return diff, static


def _check_delta(op, diff, static, *, config=None, gradients=True):
    """``op`` with its Mosaic TPU kernels (interpreted) against its golden; ``static``
    holds the arrays that are not differentiated and the flags (closed over)."""
    table = {} if config is None else {(op.name, "mosaic_tpu"): config}
    arrays = {n: x for n, x in static.items() if hasattr(x, "shape")}
    flags = {n: x for n, x in static.items() if n not in arrays}

    def run(d, s):
        with stellax.use_configs(table):
            return op(**d, **s, **flags, implementation="mosaic_tpu")

    with stellax.interpret_mode():
        check_against_golden(run, lambda d, s: op.reference(**d, **s, **flags), diff, arrays, dtype=F32,
                             gradients=gradients)


# -- forward (one chunk, small heads; KDA and SSD under slow: the registry tiers run their
# -- examples, forward and gradients, in the default tier) ----------------------------------
@pytest.mark.parametrize("op,per_channel", [(chunk_gated_delta_rule_op, False),
                                            pytest.param(chunk_kda_op, True, marks=pytest.mark.slow)],
                         ids=["gdn", "kda"])
def test_forward_strong_decay_partial_chunk(op, per_channel):
    diff, static = _delta_case(per_channel, T=40, K=16, V=16, decay=20.0, packed=False, HV=1)
    _check_delta(op, diff, static, gradients=False)


@pytest.mark.slow
def test_ssd_forward_partial_chunk():
    x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(2), 1, 40, 1, 16, 1, 16)
    args = (x, dt, A, B, C)
    kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True, initial_states=h0, return_final_states=True)
    with stellax.interpret_mode():
        y, final = ssd_op(*args, **kw, implementation="mosaic_tpu")
    ry, rfinal = ssd_op.reference(*args, **kw)
    assert_close(y, ry, dtype=F32, name="y")
    assert_close(final, rfinal, dtype=F32, name="final")


def test_scalar_spans_are_direct_sums():
    """``D``, ``G``, ``tail`` of −20-per-step decays equal float64 direct sums
    to float32 rounding (never a difference of prefix sums)."""
    chunk = 64
    g = -20.0 * jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(3), (chunk,), F32))
    spans, prefix, tail, total = scalar_spans(g[:, None], g[None, :], chunk)
    g64 = np.asarray(g, np.float64)
    idx = np.arange(chunk)
    want = np.array([[g64[j + 1:i + 1].sum() if i >= j else 0.0 for j in idx] for i in idx])
    np.testing.assert_allclose(np.asarray(spans), want, rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(np.asarray(prefix)[:, 0], np.cumsum(g64), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(tail)[:, 0], [g64[j + 1:].sum() for j in idx], rtol=1e-6, atol=1e-4)
    np.testing.assert_allclose(float(total[0, 0]), g64.sum(), rtol=1e-6)


def test_layout_errors_name_the_argument():
    k = jnp.zeros((1, 64, 32), F32)
    v = jnp.zeros((1, 64, 128), F32)
    with pytest.raises(ValueError, match="k: expected a head size padded to a multiple of 128, got 32"):
        recurrence_forward(k, k, v, jnp.zeros((1, 64)), None, jnp.zeros((1, 32, 128)), None, heads=1,
                           per_channel=False, config=TpuLinearAttentionConfig())
    k = jnp.zeros((1, 70, 128), F32)
    with pytest.raises(ValueError, match="k: expected a padded length that is a multiple of 64, got 70"):
        recurrence_forward(k, k, jnp.zeros((1, 70, 128)), jnp.zeros((1, 70)), None, jnp.zeros((1, 128, 128)),
                           None, heads=1, per_channel=False, config=TpuLinearAttentionConfig())


def test_configs():
    with pytest.raises(ValueError, match="chunk"):
        TpuLinearAttentionConfig(chunk=32)
    with pytest.raises(ValueError, match="block_v"):
        TpuLinearAttentionConfig(block_v=64)
    call = Call({"k": jnp.zeros((1, 8, 2, 160)), "v": jnp.zeros((1, 8, 2, 200)), "g": jnp.zeros((1, 8, 2))}, {})
    # Two heads per step: half the grid steps (`tpu_costs`); V = 200 whole in one block.
    assert linear_attention_tpu_heuristic(call) == TpuLinearAttentionConfig(chunk=64, block_v=256, heads_per_step=2)
    assert TpuLinearAttentionConfig(chunk=128, block_v=128) in linear_attention_tpu_space(call)
    big = Call({"k": jnp.zeros((1, 8, 2, 512)), "v": jnp.zeros((1, 8, 2, 64)), "g": jnp.zeros((1, 8, 2))}, {})
    assert "K=512" in linear_attention_tpu_requirements(big)


# -- forward and gradients (slow: interpreted, several chunks) --------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("op,per_channel", [(chunk_gated_delta_rule_op, False), (chunk_kda_op, True)],
                         ids=["gdn", "kda"])
def test_gradients_packed_strong_decay(op, per_channel):
    """Packed sequences (one empty) with initial and final states, −20 per step,
    the last sequence ending inside a chunk: forward and every gradient."""
    diff, static = _delta_case(per_channel, T=90, K=32, V=16, decay=20.0, packed=True)
    _check_delta(op, diff, static)


@pytest.mark.slow
@pytest.mark.parametrize("op,per_channel", [(chunk_gated_delta_rule_op, False), (chunk_kda_op, True)],
                         ids=["gdn", "kda"])
def test_long_chunks_and_split_value_blocks(op, per_channel):
    """Chunks of 128 and two value blocks (V = 160): the forward's regrouped
    packed metadata, the partial sums of dq/dk/dg/dβ over value blocks."""
    diff, static = _delta_case(per_channel, T=150, K=16, V=160, decay=1.0, packed=True, HV=1)
    _check_delta(op, diff, static, config=LONG_SPLIT)


@pytest.mark.slow
def test_ssd_gradients_packed():
    x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(4), 1, 90, 2, 16, 1, 32, n_states=3)
    diff = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias, "initial_states": h0}
    static = {"cu_seqlens": jnp.array([0, 20, 20, 90], jnp.int32), "dt_softplus": True,
              "return_final_states": True}
    _check_delta(ssd_op, diff, static)


# -- the backward ops directly ---------------------------------------------------------------
def _backward_args(per_channel, *, nt, packed, delta=True, kdim=32, vdim=16, hv=2):
    """Backward-op arguments on the kernels' layout, decays of −20 per step."""
    keys = jax.random.split(jax.random.PRNGKey(7), 8)
    tp = nt * TRITON_CHUNK
    q = 0.3 * jax.random.normal(keys[0], (1, hv, tp, kdim))
    k = jax.random.normal(keys[1], (1, hv, tp, kdim)) / np.sqrt(kdim)
    v = jax.random.normal(keys[2], (1, hv, tp, vdim))
    g = -20.0 * jax.nn.sigmoid(jax.random.normal(keys[3], (1, hv, tp) + ((kdim,) if per_channel else ())))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, hv, tp))) if delta else None
    n = 3 if packed else 1
    h0 = jax.random.normal(keys[5], (n, hv, kdim, vdim))
    do = jax.random.normal(keys[6], v.shape)
    dfinal = jax.random.normal(keys[7], h0.shape)
    meta = (None, None, None)
    if packed:  # sequence 0: chunk 0; sequence 1: empty; sequence 2: chunks 1..nt-1
        first = np.zeros(nt, np.int32)
        first[[0, 1]] = 1
        seq = np.full(nt, 2, np.int32)
        seq[0] = 0
        last = np.zeros(nt, np.int32)
        last[[0, nt - 1]] = 1
        meta = tuple(jnp.asarray(x) for x in (first, seq, last))
    return (q, k, v, g, beta, h0, do, dfinal) + meta


@pytest.mark.slow
@pytest.mark.parametrize("op,per_channel,delta", [(gated_recurrence_backward_op, False, True),
                                                  (gated_recurrence_backward_op, False, False),
                                                  (kda_recurrence_backward_op, True, True)],
                         ids=["gdn", "ssd", "kda"])
def test_backward_op_packed(op, per_channel, delta):
    args = _backward_args(per_channel, nt=3, packed=True, delta=delta)
    with stellax.interpret_mode():
        got = op(*args, implementation="mosaic_tpu")
    want = op.reference(*args)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        if b is None:
            assert a is None
            continue
        assert_close(a, b, dtype=F32, gradient=True, name=name)


@pytest.mark.slow
@pytest.mark.parametrize("op,per_channel", [(gated_recurrence_backward_op, False), (kda_recurrence_backward_op, True)],
                         ids=["gdn", "kda"])
def test_backward_op_dense_chunks_of_128(op, per_channel):
    """The backward ops' heuristic takes chunks of 128 on a dense batch whose
    padded length allows it (half the stored states)."""
    args = _backward_args(per_channel, nt=4, packed=False)
    call = op.check(*args)
    assert op.implementations["mosaic_tpu"].default_config(call).chunk == 128
    with stellax.interpret_mode():
        got = op(*args, implementation="mosaic_tpu")
    want = op.reference(*args)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, dtype=F32, gradient=True, name=name)


# -- the float32 contract (`stellax.core.precision`) reaches the kernel ------------------------
def test_precision_reaches_the_kernel():
    """float32 GDN on the Mosaic TPU kernel (interpreted): ``precision="default"``
    runs its matmuls as one bfloat16 pass (a bfloat16-sized error against the
    golden), ``"high"`` as three (float32-like)."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(5), 1, 40, 1, 1, 16, 16)
    args = (q, k, v, g, beta)
    ref, ref_final = golden(chunk_gated_delta_rule_op.reference, *args, initial_state=h0, output_final_state=True)
    errors = {}
    with stellax.interpret_mode():
        for precision in ("default", "high"):
            o, final = chunk_gated_delta_rule_op(*args, initial_state=h0, output_final_state=True,
                                                 implementation="mosaic_tpu", precision=precision)
            errors[precision] = max(compare(o, ref).rel_l2, compare(final, ref_final).rel_l2)
    assert 1e-4 < errors["default"] < 3e-2, errors
    assert errors["high"] < 1e-4, errors
