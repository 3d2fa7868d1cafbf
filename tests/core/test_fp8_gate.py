"""Triton kernels refuse float8 operands below sm_89 (Triton has no float8
conversions there and its compile aborts the process), so dispatch falls back
to XLA on an A100; sm_89+ keep them. The static GPU tier skips such calls at
sm_80 instead of crashing."""

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.core.platform import LOWERING_TARGETS


def _fp8_and_int8_calls():
    op = stellax.registered_ops()["quantized_matmul"]
    calls = {}
    for example in op.examples(jnp.float32):
        call = op.check(*example.args, **example.kwargs)
        dtypes = {str(getattr(leaf, "dtype", "")) for v in call.arrays.values()
                  for leaf in jax.tree_util.tree_leaves(v)}
        calls["fp8" if any(d.startswith("float8") for d in dtypes) else "other"] = call
    return op, calls


def test_triton_refuses_float8_operands_below_sm89_only():
    op, calls = _fp8_and_int8_calls()
    assert {"fp8", "other"} <= set(calls), "quantized_matmul examples: expected an fp8 and a non-fp8 one"
    triton = op.implementations["triton"]
    refused = triton.supported(calls["fp8"], LOWERING_TARGETS["a100"])
    assert not refused and "sm_89" in refused.reason and "A100" in refused.reason, refused
    assert triton.supported(calls["fp8"], LOWERING_TARGETS["h100"])
    assert triton.supported(calls["other"], LOWERING_TARGETS["a100"])


def test_static_tier_refuses_to_compile_float8_kernels_for_sm80(monkeypatch):
    pytest.importorskip("jax._src.lib.triton", reason="needs jaxlib's Triton bindings (cuda-check extra)")
    import stellax.testing.ptx_analysis as pa

    source = pa.TritonSource("k", b"", 4, 1, (1, 1, 1))
    monkeypatch.setattr(pa, "ir_text", lambda s: "%0 = tt.fp_to_fp %x : tensor<16xf8E4M3FN> -> tensor<16xbf16>")
    with pytest.raises(ValueError, match="sm_89"):
        pa.analyze(source, "8.0", use_ptxas=False)


def test_triton_quantize_to_float8_is_refused_below_sm89_only():
    """Float operands, float8 output: the quantize kernel declares it writes float8."""
    op = stellax.registered_ops()["quantize"]
    triton = op.implementations["triton"]
    x = jnp.ones((8, 128), jnp.float32)
    to_fp8 = op.check(x, format="fp8_e4m3", axis=-1, block_shape=(1, 32))
    to_int8 = op.check(x, format="int8", axis=-1, block_shape=(1, 32))
    refused = triton.supported(to_fp8, LOWERING_TARGETS["a100"])
    assert not refused and "float8 outputs" in refused.reason and "A100" in refused.reason, refused
    assert triton.supported(to_fp8, LOWERING_TARGETS["h100"])
    assert triton.supported(to_int8, LOWERING_TARGETS["a100"])
