"""The Triton grouped-matmul kernels lower for cuda for every config of their
autotuning spaces (forward, gated, transposed rhs, tgmm), with gradients for
the defaults; the PTX tier compiles them and checks shared memory."""

import jax
import jax.numpy as jnp
import pytest

from stellax.ops.moe import moe_mlp, ragged_dot, ragged_dot_op, ragged_dot_tgmm_op
from stellax.testing import (TRITON_CUSTOM_CALL, assert_custom_call, assert_fits_smem, check_op_lowering,
                             compile_triton_to_ptx, lower_for_gpu, triton_compiler_available)

M, K, N, G = 256, 128, 256, 4


def _s(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


GS = _s((G,), jnp.int32)
FORWARD_CASES = {
    "plain": ((_s((M, K)), _s((G, K, N)), GS), {}),
    "gated silu": ((_s((M, K)), _s((G, K, 2, N)), GS), {"activation": "silu"}),
    "transpose_rhs": ((_s((M, K)), _s((G, N, K)), GS), {"transpose_rhs": True}),
    "float32 gelu": ((_s((M, K), jnp.float32), _s((G, K, N), jnp.float32), GS), {"activation": "gelu"}),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_ragged_dot_every_config_lowers(case):
    args, kwargs = FORWARD_CASES[case]
    space = ragged_dot_op.implementations["triton"].config_space(ragged_dot_op.check(*args, **kwargs))
    assert len(space) >= 8
    assert check_op_lowering(ragged_dot_op, "triton", args, kwargs) == len(space)


@pytest.mark.parametrize("transpose_lhs", [True, False])
def test_tgmm_every_config_lowers(transpose_lhs):
    lhs = _s((M, K)) if transpose_lhs else _s((K, M))
    args = (lhs, _s((M, N)), GS)
    kwargs = {"transpose_lhs": transpose_lhs}
    space = ragged_dot_tgmm_op.implementations["triton"].config_space(ragged_dot_tgmm_op.check(*args, **kwargs))
    assert check_op_lowering(ragged_dot_tgmm_op, "triton", args, kwargs) == len(space)


@pytest.mark.parametrize("case", ["plain", "gated silu"])
def test_gradients_lower_to_triton_kernels(case):
    args, kwargs = FORWARD_CASES[case]
    config = ragged_dot_op.implementations["triton"].default_config(ragged_dot_op.check(*args, **kwargs))
    assert check_op_lowering(ragged_dot_op, "triton", args, kwargs, configs=[config], grad=True) == 1

    def loss(lhs, rhs, group_sizes):
        return jnp.sum(ragged_dot(lhs, rhs, group_sizes, implementation="triton", **kwargs).astype(jnp.float32))

    lowered = lower_for_gpu(jax.grad(loss, (0, 1)), *args)
    # forward (with the saved pre-activation), dlhs (transposed rhs) and drhs (tgmm)
    assert_custom_call(lowered, TRITON_CUSTOM_CALL, count=3)


def test_moe_mlp_lowers_to_triton():
    args = (_s((64, 128)), _s((64, 8), jnp.float32), _s((8, 128, 2, 64)), _s((8, 64, 128)))
    lowered = lower_for_gpu(lambda *a: moe_mlp(*a, top_k=2), *args)
    assert_custom_call(lowered, TRITON_CUSTOM_CALL, count=2)


@pytest.mark.ptx
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_ptx_compile_and_shared_memory(dtype):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    for case in ("plain", "gated silu"):
        args, kwargs = FORWARD_CASES[case]
        args = tuple(_s(a.shape, dtype if a.dtype != jnp.int32 else jnp.int32) for a in args)
        call = ragged_dot_op.check(*args, **kwargs)
        for config in ragged_dot_op.implementations["triton"].config_space(call):
            lowered = lower_for_gpu(
                lambda *a: ragged_dot(*a, implementation="triton", config=config, **kwargs), *args)
            assert_fits_smem(compile_triton_to_ptx(lowered, "9.0"), "9.0")
    tgmm_args = (_s((M, K), dtype), _s((M, N), dtype), GS)
    call = ragged_dot_tgmm_op.check(*tgmm_args, transpose_lhs=True)
    for config in ragged_dot_tgmm_op.implementations["triton"].config_space(call):
        lowered = lower_for_gpu(lambda *a: ragged_dot_tgmm_op(*a, transpose_lhs=True, implementation="triton",
                                                              config=config), *tgmm_args)
        assert_fits_smem(compile_triton_to_ptx(lowered, "9.0"), "9.0")
