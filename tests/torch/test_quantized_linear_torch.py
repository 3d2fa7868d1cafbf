"""Torch front end of `quantized_linear`: the ``stellax::quantized_linear``
custom op (opcheck), equality with the JAX op (forward and gradients) and the
`QuantizedLinear` module."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # optional dependency: stellax[torch]

import stellax  # noqa: E402
import stellax.torch as st  # noqa: E402
st_ql = importlib.import_module("stellax.torch.quantized_linear")  # the module (the package exports the function)


def _np(t):
    return t.detach().float().numpy()


def test_quantized_linear_opcheck():
    torch.manual_seed(0)
    x = torch.randn(32, 32, requires_grad=True)
    w = (torch.randn(32, 32) * 0.1).requires_grad_()
    seed = torch.tensor(5, dtype=torch.int32)
    torch.library.opcheck(st_ql.quantized_linear_op.op, (x, w, seed, "nvfp4", True, True, None))
    torch.library.opcheck(st_ql.quantized_linear_op.op, (x.detach(), w.detach(), None, "mxfp8", True, True, None),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8"])
def test_matches_jax_forward_and_gradients(recipe):
    torch.manual_seed(1)
    x = torch.randn(2, 16, 64, requires_grad=True)
    w = (torch.randn(64, 32) * 0.1).requires_grad_()
    dy = torch.randn(2, 16, 32)
    y = st.quantized_linear(x, w, recipe, seed=7)
    y.backward(dy)
    key = jax.random.key(7)
    f = lambda a, b: stellax.quantized_linear(a, b, recipe, key=key)
    yj, vjp = jax.vjp(f, jnp.asarray(_np(x)), jnp.asarray(_np(w)))
    dxj, dwj = vjp(jnp.asarray(_np(dy)))
    np.testing.assert_allclose(_np(y), np.asarray(yj), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(x.grad), np.asarray(dxj), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(w.grad), np.asarray(dwj), rtol=1e-5, atol=1e-5)


def test_ablation_flags_and_errors():
    torch.manual_seed(2)
    x = torch.randn(32, 32)
    w = torch.randn(32, 32) * 0.1
    a = st.quantized_linear(x, w, "nvfp4", seed=1, hadamard=False, stochastic_rounding=False)
    b = st.quantized_linear(x, w, "nvfp4", seed=1)
    torch.testing.assert_close(a, b)  # the forward never uses Hadamard / SR
    with pytest.raises(ValueError, match="recipe: expected one of"):
        st.quantized_linear(x, w, "fp4")
    with pytest.raises(ValueError, match="recipe"):
        st.QuantizedLinear(32, 32, recipe="int4")


def test_module_trains_and_converts():
    torch.manual_seed(3)
    lin = torch.nn.Linear(64, 32)
    q = st.QuantizedLinear.from_module(lin, recipe="nvfp4")
    assert q.weight is lin.weight and q.bias is lin.bias
    x = torch.randn(64, 32)
    target = torch.tanh(x @ torch.randn(32, 32) * 0.3)
    model = torch.nn.Sequential(st.QuantizedLinear(32, 64, recipe="nvfp4"), torch.nn.GELU(), q)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = torch.mean((model(x) - target) ** 2)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert out.shape == (64, 32) and torch.isfinite(out).all()
