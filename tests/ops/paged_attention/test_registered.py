"""The registered ops: built-in examples pass `check_op` (what `stellax check`
runs), benchmarks exist, and the byte/flop models count what a decode step reads."""

import jax.numpy as jnp
import pytest

import stellax
from stellax.core import host_platform
from stellax.ops.paged_attention import KVQuant, mla_decode_op, paged_attention_op, ragged_paged_attention_op
from stellax.ops.paged_attention import paged_inputs
from stellax.testing import check_op

OPS = [paged_attention_op, ragged_paged_attention_op, mla_decode_op]


@pytest.mark.parametrize("op", [pytest.param(paged_attention_op, marks=pytest.mark.slow),
                                pytest.param(ragged_paged_attention_op, marks=pytest.mark.slow), mla_decode_op],
                         ids=lambda op: op.name)
def test_examples_pass_check_op_xla(op):
    assert op.name in stellax.registered_ops()
    results = check_op(op, implementations=["xla"], dtypes=(jnp.float32,))
    assert results and all(r.passed for r in results), [str(r) for r in results if not r.passed]
    assert op.benchmarks(host_platform())


def test_bytes_model_counts_live_tokens_and_formats():
    lengths = [100, 28]
    args = paged_inputs(0, lengths=lengths, page_size=16, kv_heads=2, q_heads=8, head_dim=64, dtype=jnp.bfloat16)
    call = paged_attention_op.check(*args)
    kv_bytes = sum(lengths) * 2 * 2 * 64 * 2  # tokens x (K and V) x heads x head_dim x bf16
    small = 2 * args[0].size * 2 + args[3].size * 4 + 2 * 4
    assert paged_attention_op.bytes_accessed(call) == kv_bytes + small
    assert paged_attention_op.flops(call) == 2 * 8 * (64 + 64) * sum(lengths)
    q4 = paged_inputs(0, lengths=lengths, page_size=16, kv_heads=2, q_heads=8, head_dim=64, dtype=jnp.bfloat16,
                      quant=KVQuant("int4", group_size=32))
    int4 = paged_attention_op.bytes_accessed(paged_attention_op.check(*q4))
    assert int4 - small == sum(lengths) * 2 * 2 * (32 + 2 * 2 * 2)
