"""SPMD front ends on 8 simulated CPU devices (tests/conftest.py): expert-parallel
MoE and context-parallel attention vs the single-device torch front ends and
torch SDPA, gradients, opcheck and torch.compile(fullgraph=True)."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import stellax.torch as st  # noqa: E402
from stellax.torch import parallel as st_parallel  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "tests/conftest.py sets up 8 simulated CPU devices"
    return Mesh(np.array(jax.devices()[:8]), ("x",))


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _moe_inputs(seed=0, t=16, d=8, e=8, f=6):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, d, generator=gen), torch.randn(t, e, generator=gen),
            0.3 * torch.randn(e, d, 2, f, generator=gen), 0.3 * torch.randn(e, f, d, generator=gen))


@pytest.mark.parametrize("dispatch,capacity_factor", [("all_to_all", None), ("all_gather", 1.0)])
def test_expert_parallel_moe_matches_single_device(mesh, dispatch, capacity_factor):
    args = [_leaf(a) for a in _moe_inputs()]
    out = st.moe_mlp_expert_parallel(*args, mesh=mesh, axis_name="x", top_k=2, dispatch=dispatch,
                                     capacity_factor=capacity_factor)
    ref_args = [_leaf(a) for a in args]
    ref = st.moe_mlp(*ref_args, top_k=2, capacity_factor=capacity_factor)
    assert out.device == args[0].device and out.shape == (16, 8)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, args, g), torch.autograd.grad(ref, ref_args, g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_expert_parallel_opcheck_and_errors(mesh):
    x, logits, wgu, wd = (_leaf(a) for a in _moe_inputs(1))
    name = st_parallel.register_mesh(mesh)
    torch.library.opcheck(st_parallel.moe_mlp_expert_parallel_op.op,
                          (x, logits, wgu, wd, None, name, "x", "cpu", 2, "softmax", None, None, True, 1.0, None,
                           "silu", "all_to_all", "auto", None))
    with pytest.raises(ValueError, match="mesh: no mesh registered under 'nope'"):
        st.moe_mlp_expert_parallel(x, logits, wgu, wd, mesh="nope", axis_name="x", top_k=2)
    with pytest.raises(TypeError, match="mesh: expected a jax.sharding.Mesh"):
        st.moe_mlp_expert_parallel(x, logits, wgu, wd, mesh=object(), axis_name="x", top_k=2)


def _sdpa(q, k, v, causal):
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_context_parallel_attention_matches_sdpa(mesh, strategy):
    gen = torch.Generator().manual_seed(2)
    # ulysses splits heads over the axis: 8 query and 8 kv heads for 8 devices.
    n, kh = (8, 8) if strategy == "ulysses" else (4, 2)
    q = torch.randn(1, 32, n, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 32, kh, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 32, kh, 8, generator=gen, requires_grad=True)
    out, lse = st.context_parallel_attention(q, k, v, mesh=mesh, axis_name="x", strategy=strategy, is_causal=True,
                                             return_residuals=True)
    ref = _sdpa(q, k, v, True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert lse.shape == (1, n, 32) and lse.dtype == torch.float32
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_context_parallel_attention_opcheck_and_compile(mesh):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 16, 2, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 16, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 16, 2, 8, generator=gen, requires_grad=True)
    name = st_parallel.register_mesh(mesh)
    torch.library.opcheck(st_parallel.context_parallel_attention_op.op,
                          (q, k, v, None, None, None, name, "cpu", "x", "all_gather", None, None, None, True, None,
                           None, None, None, None, None))

    def f(q, k, v):
        return st.context_parallel_attention(q, k, v, mesh=name, axis_name="x", strategy="ring", is_causal=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    torch.testing.assert_close(out, _sdpa(q, k, v, True), atol=2e-5, rtol=2e-5)
    gq = torch.autograd.grad(out.sum(), q)[0]
    torch.testing.assert_close(gq, torch.autograd.grad(_sdpa(q, k, v, True).sum(), q)[0], atol=5e-5, rtol=5e-5)
