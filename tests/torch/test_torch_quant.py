"""Quantization front ends: QTensor components equal the JAX QArray's, dequantize,
weight-only quantized matmul (with gradients) and the Hadamard transform."""

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
    torch.library.opcheck(st_quant.quantize_op.op, (x, "nvfp4", 1, "16", None, None))
    q = st.quantize(x, "int4_asym", block_size=32)
    torch.library.opcheck(st_quant.dequantize_op.op, (*st_quant._q_args(q), "float32"))
    qw = st.quantize(torch.randn(64, 8), "int8", axis=0)
    torch.library.opcheck(st_quant.quantized_matmul_op.op,
                          (x.clone().requires_grad_(), *st_quant._q_args(qw), "float32", None))
    torch.library.opcheck(st_quant.hadamard_transform_op.op, (x.clone().requires_grad_(), 32, False, None, None))
