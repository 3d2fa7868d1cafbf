"""The Mosaic TPU decode kernels (`mosaic_tpu_decode`): `fused_recurrent_gated_delta_rule`,
`fused_recurrent_kda` and `ssd_step`, interpreted on the CPU, against the
naive float32 recurrences of `reference.py`, forward and gradients.

Small heads (K = 16, V = 32), token counts that span several 8-token chunks,
strong decays (``−20·softplus(N(0, 1))`` per step), grouped value heads, packed
sequences with an empty one, initial and final states, l2-normalized q/k,
KDA's fused gate and β sigmoid, ``ssd_step`` in both shape conventions,
bfloat16, value and row tiles. Interpreted kernels with gradients cost
20–90 s each on the shared CPU, so the default tier keeps one case per
feature not already covered by the registry tiers (`tests/test_registry_tiers.py`
runs the ops' first two examples, dense GQA and packed, with gradients): KDA
dense with −20 decays over two chunks, GDN packed, KDA's fused gate,
``ssd_step`` tied, and the configs; the rest (and longer sequences, K = V = 256,
the packed layout compiled with libtpu at real head sizes) run under ``slow``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import interpret_mode, use_configs
from stellax.ops.linear_attention.api import fused_recurrent_gated_delta_rule_op, fused_recurrent_kda_op
from stellax.ops.linear_attention.examples import make_inputs, make_ssd_inputs
from stellax.ops.linear_attention.ssd import ssd_step_op
from stellax.ops.linear_attention.configs import (FusedRecurrentTpuConfig, SsdStepTpuConfig,
                                                 fused_recurrent_tpu_heuristic, fused_recurrent_tpu_space,
                                                 ssd_step_tpu_heuristic, ssd_step_tpu_space)

from la_helpers import check_against_golden

OPS = {False: fused_recurrent_gated_delta_rule_op, True: fused_recurrent_kda_op}


def _check_recurrent(per_channel, *, B, T, H, HV, K, V, cu=None, config=None, dtype=jnp.float32, decay=20.0,
                     gradients=True, **options):
    """The kernel (interpreted, ``config``) vs the op's golden, forward and the VJP of every float input."""
    op = OPS[per_channel]
    n = B if cu is None else len(cu) - 1
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(T + K), B, T, H, HV, K, V, dtype=dtype,
                                       per_channel=per_channel, decay=decay, n_states=n,
                                       normalized_keys=not options.get("use_qk_l2norm", False))
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    extra = {}
    if options.pop("fused_gate", False):
        keys = jax.random.split(jax.random.PRNGKey(5), 2)
        diff["g"] = -g  # raw gate input
        diff["A_log"] = 0.3 * jax.random.normal(keys[0], (HV,))
        diff["dt_bias"] = 0.3 * jax.random.normal(keys[1], (HV * K,))
        extra = {"use_gate_in_kernel": True}
    static = {"cu_seqlens": None if cu is None else jnp.array(cu, jnp.int32)}
    kwargs = {"output_final_state": True, **options, **extra}

    def run(d, s):
        with use_configs({} if config is None else {(op.name, "mosaic_tpu"): config}):
            return op(*(d[x] for x in ("q", "k", "v", "g", "beta")), implementation="mosaic_tpu",
                      **{x: d[x] for x in d if x not in ("q", "k", "v", "g", "beta")}, **s, **kwargs)

    def golden(d, s):
        return op.reference(*(d[x] for x in ("q", "k", "v", "g", "beta")),
                            **{x: d[x] for x in d if x not in ("q", "k", "v", "g", "beta")}, **s, **kwargs)

    with interpret_mode(True):
        return check_against_golden(run, golden, diff, static, dtype=dtype, gradients=gradients)


# -- fused recurrence: forward and gradients ---------------------------------------------
@pytest.mark.parametrize("per_channel", [pytest.param(False, marks=pytest.mark.slow), True], ids=["gdn", "kda"])
def test_dense_batch_several_chunks_strong_decay(per_channel):
    """T = 11 over two 8-token chunks, GQA (HV = 2H), decays ~ −20 per step, l2-normalized q/k."""
    _check_recurrent(per_channel, B=2, T=11, H=1, HV=2, K=16, V=32, config=FusedRecurrentTpuConfig(128, 8),
                     use_qk_l2norm=True)


@pytest.mark.parametrize("per_channel", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["gdn", "kda"])
def test_packed_sequences_with_empty_one(per_channel):
    """Packed sequences of 5, 0, 9 and 1 tokens (one spans two chunks), each with its
    own initial and final state."""
    _check_recurrent(per_channel, B=1, T=15, H=2, HV=2, K=16, V=32, cu=(0, 5, 5, 14, 15),
                     config=FusedRecurrentTpuConfig(128, 8), decay=3.0)


@pytest.mark.slow
def test_decode_one_token_per_sequence():
    """The serving step: one token per sequence (heuristic config: 8-token chunks)."""
    _check_recurrent(False, B=3, T=1, H=1, HV=2, K=32, V=16, decay=1.0)


def test_kda_fused_gate_and_beta_sigmoid():
    """KDA's gate on raw inputs (A_log, dt_bias, lower_bound) and β from logits, prepared
    outside the kernel as in the XLA path; gradients reach A_log and dt_bias."""
    _check_recurrent(True, B=1, T=9, H=1, HV=2, K=16, V=32, decay=1.0, lower_bound=-5.0,
                     use_beta_sigmoid_in_kernel=True, fused_gate=True)


@pytest.mark.slow
def test_value_tiles():
    """V = 256 in two value tiles of 128 (the state columns are independent)."""
    _check_recurrent(True, B=1, T=3, H=1, HV=1, K=16, V=256, config=FusedRecurrentTpuConfig(128, 8), decay=2.0)


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_bfloat16_inputs(per_channel):
    _check_recurrent(per_channel, B=1, T=10, H=1, HV=2, K=16, V=32, cu=(0, 4, 10), dtype=jnp.bfloat16, decay=2.0)


@pytest.mark.slow
def test_without_final_state_or_initial_state():
    """``output_final_state=False`` returns None; no initial state means zeros."""
    q, k, v, g, beta, _ = make_inputs(jax.random.PRNGKey(2), 1, 5, 1, 1, 16, 32)
    with interpret_mode(True):
        o, final = stellax.fused_recurrent_gated_delta_rule(q, k, v, g, beta, implementation="mosaic_tpu")
    ref, _ = fused_recurrent_gated_delta_rule_op.reference(q, k, v, g, beta)
    assert final is None
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_long_packed_sequences_slow(per_channel):
    """T = 150 packed as 70 + 80 tokens through 32-token chunks, decays ~ −20."""
    _check_recurrent(per_channel, B=1, T=150, H=1, HV=2, K=32, V=32, cu=(0, 70, 150),
                     config=FusedRecurrentTpuConfig(128, 32), use_qk_l2norm=True)


@pytest.mark.slow
def test_head_size_256_slow():
    """K = V = 256 with 128-wide value tiles, 128-token chunks."""
    _check_recurrent(False, B=1, T=20, H=1, HV=1, K=256, V=256, config=FusedRecurrentTpuConfig(128, 128),
                     decay=2.0)


# -- ssd_step -------------------------------------------------------------------------------
def _ssd_step_inputs(tied: bool, dtype=jnp.float32):
    batch, H, P, G, N = 2, 4, 16, 2, 32
    x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(4), batch, 1, H, P, G, N)
    diff = {"state": h0.astype(dtype), "x": x[:, 0].astype(dtype), "dt": dt[:, 0], "A": A, "B": B[:, 0],
            "C": C[:, 0], "D": D, "z": z[:, 0].astype(dtype), "dt_bias": dt_bias}
    if tied:  # mamba_ssm's decode shapes, values differing per head dim / state dim
        keys = jax.random.split(jax.random.PRNGKey(6), 3)
        diff["dt"] = diff["dt"][..., None] + 0.3 * jax.random.normal(keys[0], (batch, H, P))
        diff["A"] = A[:, None, None] * jnp.exp(0.2 * jax.random.normal(keys[1], (H, P, N)))
        diff["dt_bias"] = dt_bias[:, None] + 0.1 * jax.random.normal(keys[2], (H, P))
        diff["D"] = jnp.broadcast_to(D[:, None], (H, P))
    return diff


def _check_ssd_step(tied, *, config=None, dtype=jnp.float32):
    diff = _ssd_step_inputs(tied, dtype)
    names = ("state", "x", "dt", "A", "B", "C")

    def run(d, s):
        with use_configs({} if config is None else {("ssd_step", "mosaic_tpu"): config}):
            return ssd_step_op(*(d[n] for n in names), D=d["D"], z=d["z"], dt_bias=d["dt_bias"], dt_softplus=True,
                               dt_limit=(0.0, 5.0), implementation="mosaic_tpu")

    def golden(d, s):
        return ssd_step_op.reference(*(d[n] for n in names), D=d["D"], z=d["z"], dt_bias=d["dt_bias"],
                                     dt_softplus=True, dt_limit=(0.0, 5.0))

    with interpret_mode(True):
        check_against_golden(run, golden, diff, dtype=dtype)


@pytest.mark.parametrize("tied", [pytest.param(False, marks=pytest.mark.slow), True], ids=["per_head", "tied"])
def test_ssd_step(tied):
    """Both shape conventions, D, z, dt_bias, softplus, dt_limit; forward and gradients."""
    _check_ssd_step(tied)


@pytest.mark.parametrize("block_h", [1, 2])
def test_ssd_step_head_blocks_across_groups(block_h):
    """Tied ``A`` (a ``[heads, rows, N]`` block of it a step) with one and two heads a step; the
    heuristic's four, spanning both groups, run in `test_ssd_step`."""
    _check_ssd_step(True, config=SsdStepTpuConfig(64, block_h))


@pytest.mark.slow
def test_ssd_step_row_tiles_and_bfloat16_state():
    """P = 16 rows in a 64-row tile (a partial block) with a bfloat16 state and inputs."""
    _check_ssd_step(False, config=SsdStepTpuConfig(64), dtype=jnp.bfloat16)


# -- configs --------------------------------------------------------------------------------
def _gdn_call(B, T, K, V, cu=None):
    q, k, v, g, beta, _ = make_inputs(jax.random.PRNGKey(0), B, T, 1, 1, K, V)
    kwargs = {} if cu is None else {"cu_seqlens": jnp.array(cu, jnp.int32)}
    return fused_recurrent_gated_delta_rule_op.check(q, k, v, g, beta, **kwargs)


def test_recurrent_configs():
    """Decode gets 8-token steps and the whole value head; long sequences 128-token steps;
    the space holds only useful tiles and always the heuristic."""
    assert fused_recurrent_tpu_heuristic(_gdn_call(4, 1, 128, 128)) == FusedRecurrentTpuConfig(128, 8)
    assert fused_recurrent_tpu_heuristic(_gdn_call(1, 300, 128, 256)) == FusedRecurrentTpuConfig(256, 128)
    assert fused_recurrent_tpu_heuristic(_gdn_call(1, 12, 16, 32, cu=(0, 4, 8, 12))) == FusedRecurrentTpuConfig(128, 8)
    assert fused_recurrent_tpu_space(_gdn_call(4, 1, 128, 128)) == [FusedRecurrentTpuConfig(128, 8)]
    space = fused_recurrent_tpu_space(_gdn_call(1, 300, 128, 256))
    assert len(space) == 6 and fused_recurrent_tpu_heuristic(_gdn_call(1, 300, 128, 256)) in space
    with pytest.raises(ValueError, match="block_t"):
        FusedRecurrentTpuConfig(128, 16)


def test_ssd_step_configs_and_requirements():
    diff = _ssd_step_inputs(False)
    call = ssd_step_op.check(*(diff[n] for n in ("state", "x", "dt", "A", "B", "C")))
    assert ssd_step_tpu_heuristic(call) == SsdStepTpuConfig(64, 4)  # H=4 heads of a 16x32 state a step
    assert ssd_step_tpu_space(call) == [SsdStepTpuConfig(64, h) for h in (1, 2, 4)]
    # Mamba2's decode shape: 16 heads of 64x128 float32 (512 KB) a step, 80 dividing by 16
    mamba = ssd_step_op.check(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in
                                ((64, 80, 64, 128), (64, 80, 64), (64, 80), (80,), (64, 1, 128), (64, 1, 128))))
    assert ssd_step_tpu_heuristic(mamba) == SsdStepTpuConfig(64, 16)
    assert {c.block_h for c in ssd_step_tpu_space(mamba)} == {1, 2, 4, 8, 16}
    with pytest.raises(ValueError, match="block_h"):
        SsdStepTpuConfig(64, 3)
    big = _gdn_call(1, 2, 512, 128)
    assert "K, V ≤ 256" in fused_recurrent_gated_delta_rule_op.implementations["mosaic_tpu"].requirements(big)


@pytest.mark.slow
def test_packed_decode_compiles_for_tpus_slow():
    """32 packed sequences of 4 tokens at Qwen3-Next head sizes compile (and their gradient)
    with libtpu for v5e and v6e."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    available, reason = libtpu_available()
    if not available:
        pytest.skip(reason)  # the optional tpu-check extra (libtpu)
    args = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in
                 ((1, 128, 16, 128), (1, 128, 16, 128), (1, 128, 32, 128), (1, 128, 32), (1, 128, 32)))
    kwargs = {"initial_state": jax.ShapeDtypeStruct((32, 32, 128, 128), jnp.float32), "output_final_state": True,
              "cu_seqlens": np.arange(0, 129, 4, dtype=np.int32)}
    for generation in ("v5e", "v6e"):
        result = compile_config(fused_recurrent_gated_delta_rule_op, "mosaic_tpu", args, kwargs,
                                generation=generation, grad=True)
        assert result.ok, result.describe()
