"""The Triton kernels get through the cuda lowering (every config of the
autotuning spaces) and, in the ptx tier, compile to PTX within shared memory."""

import jax.numpy as jnp
import pytest

from stellax.core import use_configs
from stellax.ops.paged_attention import (
    KVQuant, mla_decode_op, paged_attention_op, ragged_paged_attention_op,
)
from stellax.ops.paged_attention import mla_inputs, paged_inputs, ragged_inputs
from stellax.testing import (
    TRITON_CUSTOM_CALL, assert_custom_call, assert_fits_smem, check_op_lowering, compile_triton_to_ptx,
    lower_for_gpu, triton_compiler_available,
)

QUANTS = [None, KVQuant("int8"), KVQuant("fp8"), KVQuant("int4", group_size=32),
          KVQuant("int2", group_size=64, rotation=True), KVQuant("int4", group_axis="token", group_size=8),
          KVQuant("int2", group_size=32, sink_tokens=4, recent_tokens=32)]


def _paged_args(quant=None, q_tokens=None):
    return paged_inputs(0, lengths=[70, 3, 300], page_size=16, kv_heads=2, q_heads=8, head_dim=128,
                        dtype=jnp.bfloat16, quant=quant, q_tokens=q_tokens)


def _ragged_args():
    return ragged_inputs(0, q_lens=[1, 40, 1], kv_lens=[200, 40, 9], page_size=16, kv_heads=2, q_heads=8,
                         head_dim=128, dtype=jnp.bfloat16, padding_seqs=1, padding_tokens=3)


def _mla_args():
    return mla_inputs(0, lengths=[100, 7], page_size=64, heads=16, latent_dim=512, rope_dim=64, dtype=jnp.bfloat16)


def test_paged_every_config_lowers():
    args = _paged_args()
    call = paged_attention_op.check(*args)
    space = paged_attention_op.implementations["triton"].config_space(call)
    assert len(space) >= 8
    assert check_op_lowering(paged_attention_op, "triton", args) == len(space)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda s: "bf16" if s is None else f"{s.format}-{s.group_axis}-w{s.window}")
def test_paged_quantized_and_multi_token_lower(quant):
    args = _paged_args(quant, q_tokens=3 if quant is None else None)
    lowered = lower_for_gpu(lambda *a: paged_attention_op(*a, implementation="triton", sinks=jnp.zeros(8)), *args)
    assert_custom_call(lowered, TRITON_CUSTOM_CALL)


def test_ragged_and_mla_heuristic_configs_lower():
    assert check_op_lowering(ragged_paged_attention_op, "triton", _ragged_args(),
                             configs=[ragged_paged_attention_op.implementations["triton"].default_config(
                                 ragged_paged_attention_op.check(*_ragged_args()))]) == 1
    mla_call = mla_decode_op.check(*_mla_args(), scale=0.1)
    assert check_op_lowering(mla_decode_op, "triton", _mla_args(), {"scale": 0.1},
                             configs=[mla_decode_op.implementations["triton"].default_config(mla_call)]) == 1


@pytest.mark.slow
def test_ragged_and_mla_every_config_lowers():
    assert check_op_lowering(ragged_paged_attention_op, "triton", _ragged_args()) >= 8
    assert check_op_lowering(mla_decode_op, "triton", _mla_args(), {"scale": 0.1}) >= 4


def _ptx(op, args, kwargs=None, config=None):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)

    def f(*a):
        with use_configs({} if config is None else {(op.name, "triton"): config}):
            return op(*a, implementation="triton", **(kwargs or {}))

    kernels = compile_triton_to_ptx(lower_for_gpu(f, *args))
    assert_fits_smem(kernels)
    return kernels


@pytest.mark.ptx
@pytest.mark.parametrize("quant", QUANTS, ids=lambda s: "bf16" if s is None else f"{s.format}-{s.group_axis}-w{s.window}")
def test_paged_compiles_to_ptx(quant):
    kernels = _ptx(paged_attention_op, _paged_args(quant))
    assert kernels[0].name == "stellax_paged_attention"


@pytest.mark.ptx
def test_every_paged_config_compiles_to_ptx():
    args = _paged_args()
    for config in paged_attention_op.implementations["triton"].config_space(paged_attention_op.check(*args)):
        _ptx(paged_attention_op, args, config=config)


@pytest.mark.ptx
def test_ragged_and_mla_compile_to_ptx():
    _ptx(ragged_paged_attention_op, _ragged_args())
    for config in mla_decode_op.implementations["triton"].config_space(mla_decode_op.check(*_mla_args(), scale=0.1)):
        _ptx(mla_decode_op, _mla_args(), {"scale": 0.1}, config=config)
