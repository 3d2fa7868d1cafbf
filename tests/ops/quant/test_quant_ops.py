"""The registered quant ops: examples pass `stellax check`'s validation, cost
models are sane, benchmarks build."""

import pytest

import stellax
from stellax.core import LOWERING_TARGETS
from stellax.ops.quant import dequantize_op, hadamard_op, quantize_op, quantized_matmul_op
from stellax.testing import check_op


@pytest.mark.parametrize("op", [quantize_op, dequantize_op, hadamard_op], ids=lambda o: o.name)
def test_check_op_passes_xla(op):
    results = check_op(op, implementations=["xla"])
    failed = [r for r in results if not r.passed]
    assert results and not failed, failed


@pytest.mark.slow
@pytest.mark.parametrize("op", [quantize_op, dequantize_op, hadamard_op], ids=lambda o: o.name)
def test_check_op_passes_all_implementations(op):
    """What `stellax check` runs: every implementation (kernels interpreted)."""
    results = check_op(op)
    failed = [r for r in results if not r.passed]
    assert results and not failed, failed


@pytest.mark.slow
def test_check_quantized_matmul_xla():
    results = check_op(quantized_matmul_op, implementations=["xla"])
    failed = [r for r in results if not r.passed]
    assert results and not failed, failed


def test_registered_and_exported():
    ops = stellax.registered_ops()
    for name in ("quantize", "dequantize", "hadamard_transform", "quantized_matmul"):
        assert name in ops and ops[name].family == "quant"
    for name in ("quantize", "dequantize", "hadamard_transform", "quantized_matmul", "QArray"):
        assert hasattr(stellax, name)


@pytest.mark.parametrize("op", [quantize_op, dequantize_op, hadamard_op, quantized_matmul_op], ids=lambda o: o.name)
def test_benchmarks_and_cost_models(op):
    for platform in (stellax.current_platform(), LOWERING_TARGETS["h200"]):
        examples = op.benchmarks(platform)
        assert examples
        for ex in examples:
            call = op.check(*ex.args, **ex.kwargs)
            assert op.bytes_accessed(call) > 0 and op.flops(call) > 0


def test_matmul_flops_and_bytes():
    ex = quantized_matmul_op.benchmarks(LOWERING_TARGETS["h200"])[0]
    call = quantized_matmul_op.check(*ex.args, **ex.kwargs)
    assert quantized_matmul_op.flops(call) == 2.0 * 4096 * 8192 * 8192
    # int8 weights: about 1 byte per weight plus bf16 activations and output
    expect = 8192 * 8192 + 2 * 4096 * 8192 + 2 * 4096 * 8192
    assert expect <= quantized_matmul_op.bytes_accessed(call) < 1.01 * expect + 4 * 8192
