"""The Triton kernels: numerics in interpret mode (forward and gradients)
against the golden, cuda lowering of every config, and the PTX tier."""

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.ops.linear_attention import LinearAttentionConfig, chunk_gated_delta_rule_op, ssd_op
from stellax.ops.linear_attention.examples import make_inputs, make_ssd_inputs
from stellax.testing import (assert_fits_smem, check_op_lowering, compile_triton_to_ptx, lower_for_gpu,
                             triton_compiler_available)

from la_helpers import check_against_golden

F32, BF16 = jnp.float32, jnp.bfloat16
SMALL = LinearAttentionConfig(block_v=32, num_warps=4, num_stages=1)


def _gdn_run(d, s):
    d = dict(d)
    args = [d.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return stellax.chunk_gated_delta_rule(*args, **d, **s, output_final_state=True, implementation="triton",
                                          config=SMALL)


def _gdn_golden(d, s):
    d = dict(d)
    args = [d.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return chunk_gated_delta_rule_op.reference(*args, **d, **s, output_final_state=True)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gdn_interpret_matches_golden(dtype):
    """T = 70 (two chunks, a partial one), grouped heads, K ≠ V not powers of two."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(0), 1, 70, 1, 2, 24, 40, dtype=dtype, decay=3.0)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    with stellax.interpret_mode():  # the backward runs when the gradient is traced
        check_against_golden(_gdn_run, _gdn_golden, diff, dtype=dtype)


def test_gdn_interpret_varlen_matches_golden():
    cu = jnp.array([0, 65, 65, 90], jnp.int32)
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(1), 1, 90, 1, 1, 16, 16, n_states=3, decay=20.0)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    with stellax.interpret_mode():
        check_against_golden(_gdn_run, _gdn_golden, diff, {"cu_seqlens": cu}, dtype=F32)


def test_ssd_interpret_matches_golden():
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
    diff = dict(zip(names, make_ssd_inputs(jax.random.PRNGKey(2), 1, 70, 2, 16, 1, 32)))

    def run(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("x", "dt", "A", "B", "C")]
        return stellax.ssd(*args, **d, dt_softplus=True, return_final_states=True, implementation="triton",
                           config=SMALL)

    def golden(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("x", "dt", "A", "B", "C")]
        return ssd_op.reference(*args, **d, dt_softplus=True, return_final_states=True)

    with stellax.interpret_mode():
        check_against_golden(run, golden, diff, dtype=F32)


# -- lowering ---------------------------------------------------------------------
def _lowering_cases():
    gdn = make_inputs(jax.random.PRNGKey(0), 1, 130, 2, 4, 128, 128)
    ssd = make_ssd_inputs(jax.random.PRNGKey(0), 1, 130, 4, 64, 1, 128)
    return [
        (chunk_gated_delta_rule_op, gdn[:5], {"initial_state": gdn[5], "output_final_state": True}),
        (chunk_gated_delta_rule_op, gdn[:5], {"cu_seqlens": jnp.array([0, 60, 130], jnp.int32),
                                              "initial_state": jnp.zeros((2, 4, 128, 128)),
                                              "output_final_state": True}),
        (ssd_op, ssd[:5], {"dt_softplus": True, "return_final_states": True}),
    ]


@pytest.mark.parametrize("case", range(3), ids=["gdn", "gdn-varlen", "ssd"])
def test_cuda_lowering_of_every_config(case):
    op, args, kwargs = _lowering_cases()[case]
    configs = op.implementations["triton"].config_space(op.check(*args, **kwargs))
    assert len(configs) >= 6
    # Forward and backward for every config (the default tier lowers the
    # forward of all of them and the backward of the heuristic's).
    assert check_op_lowering(op, "triton", args, kwargs, configs=configs) == len(configs)
    assert check_op_lowering(op, "triton", args, kwargs, configs=[None], grad=True) == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", range(3), ids=["gdn", "gdn-varlen", "ssd"])
def test_cuda_lowering_of_every_config_with_gradients(case):
    op, args, kwargs = _lowering_cases()[case]
    check_op_lowering(op, "triton", args, kwargs, grad=True)


@pytest.mark.parametrize("kdim, vdim", [(256, 256), (64, 32)])
def test_cuda_lowering_head_sizes(kdim, vdim):
    args = make_inputs(jax.random.PRNGKey(0), 1, 64, 1, 1, kdim, vdim)
    assert check_op_lowering(chunk_gated_delta_rule_op, "triton", args[:5], {}, configs=[None]) == 1


# -- PTX tier ---------------------------------------------------------------------
@pytest.mark.ptx
@pytest.mark.parametrize("kdim", [128, 256])
def test_ptx_compiles_and_fits_shared_memory(kdim):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    """Every config's forward kernels, and the backward (its heuristic config),
    compile to PTX within sm_80's shared memory (the space is sized for it)."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(0), 1, 128, 1, 2, kdim, kdim)
    call = chunk_gated_delta_rule_op.check(q, k, v, g, beta)
    for config in chunk_gated_delta_rule_op.implementations["triton"].config_space(call):
        def forward(q, k, v, g, beta):
            with stellax.use_configs({("chunk_gated_delta_rule", "triton"): config}):
                return stellax.chunk_gated_delta_rule(q, k, v, g, beta, implementation="triton")[0]

        kernels = compile_triton_to_ptx(lower_for_gpu(forward, q, k, v, g, beta))
        assert {k_.name for k_ in kernels} == {"stellax_gdn_wy", "stellax_linear_attention_state",
                                               "stellax_linear_attention_output"}
        assert_fits_smem(kernels, "8.0")

    def loss(q, k, v, g, beta):
        return jnp.sum(stellax.chunk_gated_delta_rule(q, k, v, g, beta, implementation="triton")[0])

    kernels = compile_triton_to_ptx(lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, k, v, g, beta))
    assert "stellax_linear_attention_state_bwd" in {k_.name for k_ in kernels}
    assert_fits_smem(kernels, "8.0")
