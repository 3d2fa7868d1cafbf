"""Several heads per grid step in the Mosaic TPU chunked kernels (`TpuLinearAttentionConfig.heads_per_step`,
issue 39): the forward and backward kernels take ``hb`` heads per step, unrolled in one basic block.

* interpret mode against the float32 golden: GDN (dense batch of two with initial states, and
  packed sequences with an empty one, float32 and bfloat16 inputs), KDA and SSD (packed),
  forward, final state and every gradient; the backward op directly with ``hb`` heads;
* Mosaic ``tpu`` lowering and libtpu compile for v5e of ``hb = 4`` (forward and gradient);
* the config checks (``hb`` must divide the heads) and the cost model's choice; the backward
  ops' default (the most heads per step that fit, at the largest chunk);
* grouped ``q, k`` (fewer key heads than value heads) read by the forward kernel as they are,
  and its ``o`` in the op's dtype.
"""

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.core import Call, lowering_target
from stellax.core.precision import HIGHEST
from stellax.ops.linear_attention import (chunk_gated_delta_rule_op, chunk_kda_op, gated_recurrence_backward_op,
                                          ssd_op)
from stellax.ops.linear_attention.configs import (TpuLinearAttentionConfig, linear_attention_tpu_backward_heuristic,
                                                 linear_attention_tpu_backward_space, linear_attention_tpu_heuristic,
                                                 linear_attention_tpu_space, tpu_forward_seconds)
from stellax.ops.linear_attention.examples import make_inputs, make_ssd_inputs
from stellax.ops.linear_attention.mosaic_tpu import Specs, recurrence_forward
from stellax.ops.linear_attention.mxu import BF16_POLICIES
from stellax.ops.linear_attention.tpu_costs import kernel_seconds
from stellax.testing import assert_close
from stellax.testing.lowering import lower_config
from stellax.testing.tpu_compile import compile_config, libtpu_available

from la_helpers import check_against_golden

F32, BF16 = jnp.float32, jnp.bfloat16
TWO = TpuLinearAttentionConfig(chunk=64, block_v=128, heads_per_step=2)


def _run_against_golden(op, diff, static, config, dtype=F32, gradients=True):
    arrays = {n: x for n, x in static.items() if hasattr(x, "shape")}
    flags = {n: x for n, x in static.items() if n not in arrays}

    def run(d, s):
        with stellax.use_configs({(op.name, "mosaic_tpu"): config}):
            return op(**d, **s, **flags, implementation="mosaic_tpu")

    with stellax.interpret_mode():
        check_against_golden(run, lambda d, s: op.reference(**d, **s, **flags), diff, arrays, dtype=dtype,
                             gradients=gradients)


def _delta(per_channel, *, B=1, T, HV, packed, dtype=F32, K=32, V=16, decay=20.0, seed=0, H=None):
    n = 3 if packed else B
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(seed), B, T, H or HV, HV, K, V, per_channel=per_channel,
                                       decay=decay, n_states=n)
    cast = lambda x: x.astype(dtype)
    diff = {"q": cast(q), "k": cast(k), "v": cast(v), "g": g, "beta": beta, "initial_state": h0}
    static = {"output_final_state": True}
    if packed:
        static["cu_seqlens"] = jnp.array([0, 20, 20, T], jnp.int32)
    return diff, static


def test_gdn_dense_batch_two_heads_per_step():
    """Two batch rows of four heads, two heads per step: the state blocks of each step
    read and write the right rows of ``initial_state`` / the final state."""
    diff, static = _delta(False, B=2, T=70, HV=4, H=2, packed=False, decay=1.0)
    _run_against_golden(chunk_gated_delta_rule_op, diff, static, TWO)


def test_gdn_packed_heads_per_step_strong_decay():
    diff, static = _delta(False, T=90, HV=4, packed=True)
    _run_against_golden(chunk_gated_delta_rule_op, diff, static, TpuLinearAttentionConfig(64, 128, 4))


def test_gdn_bf16_packed_two_heads_per_step():
    diff, static = _delta(False, T=90, HV=2, packed=True, dtype=BF16, decay=1.0)
    _run_against_golden(chunk_gated_delta_rule_op, diff, static, TpuLinearAttentionConfig(128, 128, 2), dtype=BF16)


def test_kda_packed_two_heads_per_step():
    diff, static = _delta(True, T=90, HV=2, packed=True)
    _run_against_golden(chunk_kda_op, diff, static, TWO)


def test_ssd_packed_two_heads_per_step():
    x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(4), 1, 90, 2, 16, 1, 32, n_states=3)
    diff = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias, "initial_states": h0}
    static = {"cu_seqlens": jnp.array([0, 20, 20, 90], jnp.int32), "dt_softplus": True,
              "return_final_states": True}
    _run_against_golden(ssd_op, diff, static, TWO)


def test_backward_op_two_heads_per_step():
    """The backward op's kernel (reverse walk, ``dS`` per head in the scratch) with two heads per
    step and two value blocks (V = 160 pads to 256: the partial sums over value blocks)."""
    keys = jax.random.split(jax.random.PRNGKey(7), 8)
    hv, tp, kdim, vdim = 4, 128, 32, 160
    q = 0.3 * jax.random.normal(keys[0], (1, hv, tp, kdim))
    k = jax.random.normal(keys[1], (1, hv, tp, kdim)) / kdim ** 0.5
    v = jax.random.normal(keys[2], (1, hv, tp, vdim))
    g = -3.0 * jax.nn.sigmoid(jax.random.normal(keys[3], (1, hv, tp)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, hv, tp)))
    h0 = jax.random.normal(keys[5], (1, hv, kdim, vdim))
    do, dfinal = jax.random.normal(keys[6], v.shape), jax.random.normal(keys[7], h0.shape)
    args = (q, k, v, g, beta, h0, do, dfinal, None, None, None)
    config = TpuLinearAttentionConfig(chunk=64, block_v=128, heads_per_step=2)
    with stellax.interpret_mode(), stellax.use_configs({(gated_recurrence_backward_op.name, "mosaic_tpu"): config}):
        got = gated_recurrence_backward_op(*args, implementation="mosaic_tpu")
    want = gated_recurrence_backward_op.reference(*args)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert_close(a, b, dtype=F32, gradient=True, name=name)


# -- Mosaic lowering and the real compiler ----------------------------------------------------
def _gdn_args(hv=8, t=256):
    lead = lambda h, d: jax.ShapeDtypeStruct((1, t, h, d), BF16)
    scalar = jax.ShapeDtypeStruct((1, t, hv), BF16)
    return (lead(hv // 2, 128), lead(hv // 2, 128), lead(hv, 128), scalar, scalar), {"use_qk_l2norm": True}


@pytest.mark.parametrize("chunk", [64, 128])
def test_four_heads_per_step_lower_for_tpu(chunk):
    args, kwargs = _gdn_args()
    config = TpuLinearAttentionConfig(chunk=chunk, block_v=128, heads_per_step=4)
    modules = lower_config(chunk_gated_delta_rule_op, "mosaic_tpu", args, kwargs, config=config, platform="tpu",
                           grad=True)
    assert all("tpu_custom_call" in m.as_text() for m in modules)


@pytest.mark.parametrize("op", ["gdn", "kda", "ssd"])
def test_four_heads_per_step_compile_for_v5e(op):
    """libtpu compiles ``hb = 4`` for a v5e, forward and gradient (the backward op at its own config)."""
    available, reason = libtpu_available()
    if not available:
        pytest.skip(reason)
    config = TpuLinearAttentionConfig(chunk=64, block_v=128, heads_per_step=4)
    if op == "gdn":
        args, kwargs = _gdn_args()
        result = compile_config(chunk_gated_delta_rule_op, "mosaic_tpu", args, kwargs, generation="v5e",
                                config=config, grad=True)
    elif op == "kda":
        lead = jax.ShapeDtypeStruct((1, 128, 4, 128), BF16)
        args = (lead, lead, lead, lead, jax.ShapeDtypeStruct((1, 128, 4), BF16))
        result = compile_config(chunk_kda_op, "mosaic_tpu", args, {}, generation="v5e", config=config, grad=True)
    else:
        x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(0), 1, 256, 4, 64, 2, 128)
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, BF16 if a.ndim == 4 else a.dtype)
        args = tuple(spec(a) for a in (x, dt, A, B, C))
        result = compile_config(ssd_op, "mosaic_tpu", args, {}, generation="v5e", config=config, grad=True)
    assert result.ok, result.describe()


def test_backward_op_two_heads_per_step_compile_for_v5e():
    """libtpu compiles the backward op's kernels (states pass and reverse scan) at two heads per
    step for a v5e (what the stage benchmark's ``--bwd-heads 2`` runs)."""
    available, reason = libtpu_available()
    if not available:
        pytest.skip(reason)
    hv, tp = 4, 256
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, BF16)
    args = (bf16(1, hv, tp, 128), bf16(1, hv, tp, 128), bf16(1, hv, tp, 128), f32(1, hv, tp), f32(1, hv, tp),
            f32(1, hv, 128, 128), f32(1, hv, tp, 128), f32(1, hv, 128, 128), None, None, None)
    config = TpuLinearAttentionConfig(chunk=128, block_v=128, heads_per_step=2)
    result = compile_config(gated_recurrence_backward_op, "mosaic_tpu", args, {}, generation="v5e", config=config)
    assert result.ok, result.describe()


# -- configs and the cost model --------------------------------------------------------------
def test_heads_per_step_must_divide_the_heads():
    with pytest.raises(ValueError, match="heads_per_step"):
        Specs(128, 128, 64, heads=6, chunks=2, hb=4)
    with pytest.raises(ValueError, match="heads_per_step"):
        TpuLinearAttentionConfig(64, 128, heads_per_step=3).validate()
    lead = jax.ShapeDtypeStruct((1, 256, 6, 128), BF16)
    call = Call({"q": lead, "k": lead, "v": lead, "g": jax.ShapeDtypeStruct((1, 256, 6), BF16),
                 "beta": jax.ShapeDtypeStruct((1, 256, 6), BF16)}, {"precision": HIGHEST})
    assert {c.heads_per_step for c in linear_attention_tpu_space(call)} == {1, 2}


def test_model_calibration_and_choice():
    """The model reproduces the calibration point (GDN, T = 16384, HV = 32, bfloat16, chunk 128,
    one head per step: 17.9 ms measured on a v5e with the inverse at three passes, the policy of
    then) and, at that shape, prefers four heads per step (the chains of dependent products overlap)
    and chunks of 128 over 64 at one head."""
    one = kernel_seconds(32, 16384, 128, 128, 128, 128, per_channel=False, delta=True,
                         products=BF16_POLICIES["three_pass"])
    assert abs(one - 17.9e-3) < 0.2e-3, one
    lead = jax.ShapeDtypeStruct((1, 16384, 32, 128), BF16)
    call = Call({"q": lead, "k": lead, "v": lead, "g": jax.ShapeDtypeStruct((1, 16384, 32), BF16),
                 "beta": jax.ShapeDtypeStruct((1, 16384, 32), BF16)}, {"precision": HIGHEST})
    with lowering_target("v5e"):
        best = linear_attention_tpu_heuristic(call)
        assert best.heads_per_step == 4
        seconds = {c: tpu_forward_seconds(call, c) for c in linear_attention_tpu_space(call)}
    assert seconds[TpuLinearAttentionConfig(128, 128, 1)] < seconds[TpuLinearAttentionConfig(64, 128, 1)]
    assert seconds[best] < 0.6 * seconds[TpuLinearAttentionConfig(128, 128, 1)]


def _backward_call(hv, tp=256, per_channel=False, packed=False):
    hm = jax.ShapeDtypeStruct((1, hv, tp, 128), BF16)
    f = jax.ShapeDtypeStruct((1, hv, tp), F32)
    first = jax.ShapeDtypeStruct((tp // 64,), jnp.int32) if packed else None
    return Call({"q": hm, "k": hm, "v": hm, "g": hm if per_channel else f, "beta": f, "do": hm, "first": first},
                {"precision": HIGHEST})


def test_backward_default_batches_heads():
    """The backward ops' default takes the largest chunk, then the most heads per step that divide
    ``HV`` and fit the VMEM budget (static schedule: fewer cycles per head at 2 and 4 heads for
    GDN, KDA and SSD): GDN 4 heads; KDA at chunk 128 two on v5e (51.6 MiB of 64), one on v5p (32)."""
    with lowering_target("v5e"):
        gdn = linear_attention_tpu_backward_heuristic(_backward_call(32))
        assert (gdn.chunk, gdn.block_v, gdn.heads_per_step) == (128, 128, 4)
        assert linear_attention_tpu_backward_heuristic(_backward_call(6)).heads_per_step == 2
        assert linear_attention_tpu_backward_heuristic(_backward_call(3)).heads_per_step == 1
        packed = linear_attention_tpu_backward_heuristic(_backward_call(32, packed=True))
        assert (packed.chunk, packed.heads_per_step) == (64, 4)
        kda = linear_attention_tpu_backward_heuristic(_backward_call(32, per_channel=True))
        assert (kda.chunk, kda.heads_per_step) == (128, 2)
        space = linear_attention_tpu_backward_space(_backward_call(32, per_channel=True))
        assert TpuLinearAttentionConfig(128, 128, 4) not in space  # 103 MiB estimated
    with lowering_target("v5p"):
        kda = linear_attention_tpu_backward_heuristic(_backward_call(32, per_channel=True))
        assert (kda.chunk, kda.heads_per_step) == (128, 1)


@pytest.mark.parametrize("group,hb", [(2, 4), (4, 2)])
def test_grouped_keys_read_as_they_are(group, hb):
    """The forward kernel reads grouped ``q, k`` (one key head per ``group`` value heads, as
    GDN's H < HV and SSD's groups) without an expanded copy: the same output and final state as
    on expanded ``q, k``; a bfloat16 ``o`` (``out_dtype``) is the float32 one rounded once."""
    hv, tp = 8, 128
    keys = jax.random.split(jax.random.PRNGKey(3), 6)
    q = (0.1 * jax.random.normal(keys[0], (hv // group, tp, 128))).astype(BF16)
    k = (jax.random.normal(keys[1], (hv // group, tp, 128)) / 12).astype(BF16)
    v = jax.random.normal(keys[2], (hv, tp, 128)).astype(BF16)
    g = -0.1 * jax.nn.sigmoid(jax.random.normal(keys[3], (hv, tp)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (hv, tp)))
    h0 = jax.random.normal(keys[5], (hv, 128, 128))
    config = TpuLinearAttentionConfig(64, 128, hb)
    run = lambda q_, k_, dtype=F32: recurrence_forward(q_, k_, v, g, beta, h0, None, heads=hv, per_channel=False,
                                                       config=config, out_dtype=dtype)
    with stellax.interpret_mode():
        got_o, got_final = run(q, k)
        want_o, want_final = run(jnp.repeat(q, group, axis=0), jnp.repeat(k, group, axis=0))
        typed_o, _ = run(q, k, BF16)
    assert jnp.array_equal(got_o, want_o) and jnp.array_equal(got_final, want_final)
    assert typed_o.dtype == BF16 and jnp.array_equal(typed_o, want_o.astype(BF16))


def test_grouped_keys_must_fit_the_step():
    q = jnp.zeros((2, 64, 128), BF16)
    v = jnp.zeros((6, 64, 128), BF16)
    with pytest.raises(ValueError, match="heads_per_step: expected a divisor or a multiple of the 3"):
        recurrence_forward(q, q, v, jnp.zeros((6, 64)), jnp.zeros((6, 64)), jnp.zeros((6, 128, 128)), None, heads=6,
                           per_channel=False, config=TpuLinearAttentionConfig(64, 128, 2))
