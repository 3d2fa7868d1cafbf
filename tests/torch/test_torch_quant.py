"""Quantization front ends: QTensor components equal the JAX QArray's, dequantize,
weight-only quantized matmul (with gradients) and the Hadamard transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")

import stellax.torch as st  # noqa: E402
from stellax.ops import quant as jquant  # noqa: E402
from stellax.torch import quant as st_quant  # noqa: E402


def _np(t):
    return t.view(torch.uint8).numpy() if t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else t.numpy()


@pytest.mark.parametrize("fmt,block", [("int8", "channel"), ("int4_asym", 32), ("fp8_e4m3", (4, 32)),
                                       ("mxfp4", 32), ("nvfp4", 16)])
def test_quantize_matches_jax_qarray_bit_for_bit(fmt, block):
    torch.manual_seed(0)
    x = torch.randn(8, 96)
    q = st.quantize(x, fmt, block_size=block)
    ref = jquant.quantize(jnp.asarray(x.numpy()), fmt, block_size=block)
    assert (q.format, q.shape, q.block_shape, q.axis) == (ref.format, ref.shape, ref.block_shape, ref.axis)
    for name in ("values", "scales", "zero_points", "tensor_scale"):
        a, b = getattr(q, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(_np(a), np.asarray(b).view(np.uint8) if b.dtype.itemsize == 1 and
                                          b.dtype.kind == "V" else np.asarray(b), err_msg=name)
    d = st.dequantize(q)
    np.testing.assert_array_equal(d.numpy(), np.asarray(jquant.dequantize(ref)))
    assert ((d - x).norm() / x.norm()).item() < 0.2  # it is a quantization of x
    # The JAX view of the QTensor is the same QArray.
    np.testing.assert_array_equal(np.asarray(jquant.dequantize(q.to_qarray())), d.numpy())


def test_quantized_matmul_forward_and_gradient():
    torch.manual_seed(1)
    w = torch.randn(64, 24)
    qw = st.quantize(w, "int4", axis=0, block_size=32)
    x = torch.randn(5, 64, requires_grad=True)
    y = st.quantized_matmul(x, qw)
    wd = st.dequantize(qw)
    ref = x @ wd
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], g @ wd.t(), atol=1e-4, rtol=1e-4)
    y16 = st.quantized_matmul(x.detach().bfloat16(), qw)
    assert y16.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="QTensor"):
        st.quantized_matmul(x, w)


def _hadamard(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def test_hadamard_transform_matches_matrix_and_is_differentiable():
    torch.manual_seed(2)
    x = torch.randn(3, 64, requires_grad=True)
    y = st.hadamard_transform(x, block_size=16)
    h = _hadamard(16).float()
    ref = (x.view(3, 4, 16) @ h.t()).view(3, 64)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0],
                               atol=1e-5, rtol=1e-5)
    signed = st.hadamard_transform(x.detach(), seed=3)
    torch.testing.assert_close(st.hadamard_transform(signed, seed=3, inverse=True), x.detach(), atol=1e-5, rtol=1e-5)


def test_quant_opcheck():
    torch.manual_seed(3)
    x = torch.randn(4, 64)
    torch.library.opcheck(st_quant.quantize_op.op, (x, "nvfp4", 1, "16", None, None, None, None))
    # With grad: opcheck's aot_dispatch check sums the outputs into one accumulator starting from the
    # first output, an int8 code tensor (Long) that a float sum cannot be added to in place; that
    # check runs above without grad, and the gradient is tested against JAX below.
    torch.library.opcheck(st_quant.quantize_op.op, (x.clone().requires_grad_(), "int8", 1, "32", None, None, None,
                                                    None),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    q = st.quantize(x, "int4_asym", block_size=32)
    torch.library.opcheck(st_quant.dequantize_op.op, (*st_quant._q_args(q), "float32", None))
    values, scales, zp, ts, *opts = st_quant._q_args(q)
    torch.library.opcheck(st_quant.dequantize_op.op, (values, scales.clone().requires_grad_(), zp, ts, *opts,
                                                      "float32", None))
    qw = st.quantize(torch.randn(64, 8), "int8", axis=0)
    torch.library.opcheck(st_quant.quantized_matmul_op.op,
                          (x.clone().requires_grad_(), *st_quant._q_args(qw), "float32", None, None))
    torch.library.opcheck(st_quant.hadamard_transform_op.op,
                          (x.clone().requires_grad_(), 32, False, None, None, None))


def _jax_qarray(q, scales=None, tensor_scale=None):
    conv = lambda t: None if t is None else jnp.asarray(_np(t.detach())).view(
        jnp.float8_e4m3fn if t.dtype == torch.float8_e4m3fn else
        jnp.float8_e8m0fnu if t.dtype == torch.float8_e8m0fnu else _np(t).dtype)
    return jquant.QArray(conv(q.values), conv(q.scales) if scales is None else scales, conv(q.zero_points),
                         conv(q.tensor_scale) if tensor_scale is None else tensor_scale, format=q.format,
                         shape=q.shape, block_shape=q.block_shape, axis=q.axis, rotation=q.rotation)


def test_dequantize_gradient_wrt_scales_matches_formula_and_jax():
    torch.manual_seed(4)
    x = torch.randn(6, 64)
    q = st.quantize(x, "int4_asym", block_size=32)
    scales = q.scales.clone().requires_grad_()
    qs = st_quant.QTensor(q.values, scales, q.zero_points, None, q.format, q.shape, q.block_shape, q.axis)
    y = st.dequantize(qs)
    g = torch.randn_like(y)
    (gs,) = torch.autograd.grad(y, scales, g)
    # y = (code - zero) * scale per block of 32 along the last axis, linear in the scale:
    # dscale = Σ_block (code - zero) · g = Σ_block (y / scale) · g.
    centered = y.detach() / q.scales.repeat_interleave(32, 1)
    torch.testing.assert_close(gs, (centered * g).reshape(6, 2, 32).sum(-1), atol=1e-4, rtol=1e-5)
    ref = jax.grad(lambda s: jnp.sum(jquant.dequantize(_jax_qarray(q, scales=s)) * jnp.asarray(g.numpy())))(
        jnp.asarray(q.scales.numpy()))
    np.testing.assert_allclose(gs.numpy(), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_dequantize_nvfp4_gradient_flows_to_tensor_scale_only():
    torch.manual_seed(5)
    q = st.quantize(torch.randn(4, 32), "nvfp4")
    ts = q.tensor_scale.clone().requires_grad_()
    qs = st_quant.QTensor(q.values, q.scales, None, ts, q.format, q.shape, q.block_shape, q.axis)
    y = st.dequantize(qs)
    (gt,) = torch.autograd.grad(y.sum(), ts)
    # y is linear in the tensor scale: dy/dts summed = Σ y / ts.
    torch.testing.assert_close(gt, (y.detach().sum() / ts.detach()).reshape(gt.shape), atol=1e-4, rtol=1e-5)
    assert q.scales.dtype == torch.float8_e4m3fn  # E4M3 block scales are data: no gradient is offered


def test_quantize_gradient_through_scales_matches_jax():
    torch.manual_seed(6)
    x = torch.randn(5, 64, requires_grad=True)
    q = st.quantize(x, "int8", block_size=32)
    assert q.scales.requires_grad and not q.values.requires_grad
    g = torch.randn_like(q.scales)
    (gx,) = torch.autograd.grad(q.scales, x, g)
    ref = jax.vjp(lambda a: jquant.quantize(a, "int8", block_size=32).scales, jnp.asarray(x.detach().numpy()))[1](
        jnp.asarray(g.numpy()))[0]
    np.testing.assert_allclose(gx.numpy(), np.asarray(ref), atol=1e-7, rtol=1e-6)
    # scale = amax / 127 per block: the gradient sits on each block's largest |x| only.
    assert int((gx != 0).sum()) == 10
    # MX scales (E8M0) are data: no gradient path from them to x.
    qm = st.quantize(x, "mxfp8_e4m3")
    assert not qm.scales.requires_grad


def test_quantize_stochastic_rounding_seed():
    torch.manual_seed(7)
    x = torch.randn(4, 64)
    a = st.quantize(x, "int8", stochastic_rounding_seed=1)
    b = st.quantize(x, "int8", stochastic_rounding_seed=1)
    c = st.quantize(x, "int8")
    ref = jquant.quantize(jnp.asarray(x.numpy()), "int8", stochastic_rounding_key=jax.random.PRNGKey(1))
    assert torch.equal(a.values, b.values)
    np.testing.assert_array_equal(a.values.numpy(), np.asarray(ref.values))
    assert not torch.equal(a.values, c.values)
