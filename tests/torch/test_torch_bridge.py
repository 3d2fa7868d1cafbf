"""DLPack bridge and custom-op machinery of stellax.torch."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")

import stellax.torch as st  # noqa: E402
from stellax.torch import bridge, registry  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8, torch.bool])
def test_round_trip_is_zero_copy(dtype):
    t = (torch.randn(6, 10) * 4).to(dtype)
    a = st.to_jax(t)
    assert a.dtype == bridge.jax_dtype(dtype)
    assert a.unsafe_buffer_pointer() == t.data_ptr()  # torch -> jax shares memory
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.to(torch.float32).numpy())
    b = st.to_torch(a)
    assert b.dtype == dtype and b.data_ptr() == a.unsafe_buffer_pointer()  # jax -> torch shares memory
    out = jax.jit(lambda x: x + x)(a.astype(jnp.float32))
    back = st.to_torch(out)
    assert back.data_ptr() == out.unsafe_buffer_pointer()
    torch.testing.assert_close(back, t.to(torch.float32) * 2)


def test_non_contiguous_grad_and_int64_inputs():
    base = torch.randn(8, 6, requires_grad=True)
    view = base.t()  # non-contiguous, requires grad
    a = st.to_jax(view)
    np.testing.assert_array_equal(np.asarray(a), view.detach().numpy())
    ids = torch.arange(10, dtype=torch.int64)
    assert st.to_jax(ids).dtype == jnp.int32


@pytest.mark.parametrize("fmt", ["int4", "uint4", "float4_e2m1fn", "int2", "float8_e4m3", "float8_e3m4"])
@pytest.mark.parametrize("shape", [(3, 7), (2, 2, 8), (5,)])
def test_packed_formats_cross_bit_exactly(fmt, shape):
    dt = getattr(ml_dtypes, fmt)
    info = ml_dtypes.iinfo(dt) if "int" in fmt else None
    rng = np.random.default_rng(0)
    if info is not None:
        values = rng.integers(int(info.min), int(info.max) + 1, size=shape).astype(dt)
    else:
        values = rng.normal(size=shape).astype(np.float32).astype(dt)
    a = jnp.asarray(values)
    packed = st.to_torch(a)
    assert isinstance(packed, st.PackedTensor)
    assert packed.format == fmt and packed.shape == shape and packed.data.dtype == torch.uint8
    bits = packed.bits
    assert packed.data.shape == (*shape[:-1], -(-shape[-1] * bits // 8))
    # The first element sits in the low bits of the first byte.
    raw0 = int(np.asarray(values.reshape(-1)[:1]).view(np.uint8)[0]) & ((1 << bits) - 1)
    assert int(packed.data.reshape(-1)[0]) & ((1 << bits) - 1) == raw0
    back = st.to_jax(packed)
    assert back.dtype == a.dtype and back.shape == a.shape
    np.testing.assert_array_equal(np.asarray(back).view(np.uint8) if bits == 8 else np.asarray(back).astype(np.float32),
                                  values.view(np.uint8) if bits == 8 else values.astype(np.float32))


def test_compiled_function_cache_hits_and_keys():
    x = torch.randn(4, 32)
    w = torch.randn(32)
    st.rms_norm(x, w)
    before = st.cache_info()
    st.rms_norm(torch.randn(4, 32), w)
    after = st.cache_info()
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"]
    st.rms_norm(x, w, eps=1e-3)  # a new option -> a new compiled function
    st.rms_norm(torch.randn(5, 32), w)  # a new shape -> a new compiled function
    assert st.cache_info()["misses"] == after["misses"] + 2


def test_custom_op_schema_and_outputs_never_alias_inputs():
    op = registry.define_op("test_identity", lambda x, *, k: x, tensors=("x",), options={"k": "int"})
    assert str(torch.ops.stellax.test_identity.default._schema) == "stellax::test_identity(Tensor x, int k) -> Tensor"
    assert str(torch.ops.stellax.layer_norm.default._schema).startswith(
        "stellax::layer_norm(Tensor x, Tensor? scale, Tensor? offset, float epsilon, bool subtract_mean")
    x = torch.randn(3, 4)
    y = op(x, 1)
    torch.testing.assert_close(y, x)
    assert y.data_ptr() != x.data_ptr()
    torch.library.opcheck(op.op, (x, 1))


def test_bad_input_types():
    with pytest.raises(TypeError, match="torch.Tensor"):
        st.to_jax(np.zeros(3))
    with pytest.raises(TypeError, match="no torch equivalent"):
        bridge.torch_dtype(jnp.int4)


#: Every stellax:: custom op and the test that runs torch.library.opcheck on it.
OPCHECKED = {
    "layer_norm": "test_torch_ops", "layer_norm_residual": "test_torch_ops", "gated_linear_unit": "test_torch_ops",
    "dot_product_attention": "test_torch_ops", "dot_product_attention_varlen": "test_torch_ops",
    "ragged_dot": "test_torch_moe", "route": "test_torch_moe", "moe_mlp": "test_torch_moe",
    "ragged_dot_quantized": "test_torch_moe", "ragged_dot_general": "test_torch_moe",
    "ragged_dot_tgmm": "test_torch_moe", "permute": "test_torch_moe", "unpermute": "test_torch_moe",
    "load_balancing_loss": "test_torch_moe", "router_z_loss": "test_torch_moe",
    "chunk_gated_delta_rule": "test_torch_linear_attention",
    "fused_recurrent_gated_delta_rule": "test_torch_linear_attention",
    "chunk_kda": "test_torch_linear_attention", "fused_recurrent_kda": "test_torch_linear_attention",
    "ssd": "test_torch_linear_attention", "ssd_step": "test_torch_linear_attention",
    "quantize": "test_torch_quant", "dequantize": "test_torch_quant",
    "quantized_matmul": "test_torch_quant", "hadamard_transform": "test_torch_quant",
    "paged_attention": "test_torch_paged_attention", "ragged_paged_attention": "test_torch_paged_attention",
    "mla_decode": "test_torch_paged_attention", "quantize_pages": "test_torch_paged_attention",
    "dequantize_pages": "test_torch_paged_attention", "update_kv_cache": "test_torch_paged_attention",
    "moe_mlp_expert_parallel": "test_torch_parallel", "context_parallel_attention": "test_torch_parallel",
    "context_parallel_gated_delta_rule": "test_torch_parallel", "context_parallel_kda": "test_torch_parallel",
    "dot_product_attention_fp8": "test_torch_ops", "quantize_for_attention": "test_torch_ops",
    "linear_cross_entropy": "test_torch_loss",
    "quantized_linear": "test_quantized_linear_torch",
    "test_identity": "test_torch_bridge",
}


def test_every_custom_op_is_opchecked():
    """A new front end must get an opcheck test (and an entry here)."""
    import pathlib

    ops = set(registry.registered_torch_ops())
    assert ops - set(OPCHECKED) == set(), "custom ops without an opcheck test"
    here = pathlib.Path(__file__).parent
    for name, module in OPCHECKED.items():
        if name in ops:
            text = (here / f"{module}.py").read_text()
            assert "opcheck" in text and f"{name}_op" in text or name == "test_identity", (name, module)
