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


@pytest.mark.parametrize("dispatch,capacity_factor", [("all_to_all", None),
                                                      pytest.param("all_gather", 1.0, marks=pytest.mark.slow)])
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


@pytest.mark.parametrize("strategy", ["ring", pytest.param("ulysses", marks=pytest.mark.slow)])
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
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g, retain_graph=True),
                    torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
    # The log-sum-exp of the scaled causal logits, and its gradient.
    rep = n // kh
    logits = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(rep, 2)) * 8 ** -0.5
    ref_lse = torch.logsumexp(logits.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf")), -1)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(torch.autograd.grad(lse.sum(), q)[0], torch.autograd.grad(ref_lse.sum(), q)[0],
                               atol=5e-5, rtol=5e-5)


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


def _gdn_inputs(seed, per_channel=False, t=32):
    gen = torch.Generator().manual_seed(seed)
    b, h, kd, vd = 1, 2, 8, 8
    q = torch.randn(b, t, h, kd, generator=gen)
    k = F.normalize(torch.randn(b, t, h, kd, generator=gen), dim=-1)
    v = torch.randn(b, t, h, vd, generator=gen)
    g = -0.1 * torch.rand(b, t, h, kd if per_channel else 1, generator=gen)
    g = g if per_channel else g[..., 0]
    beta = torch.rand(b, t, h, generator=gen)
    s0 = 0.1 * torch.randn(b, h, kd, vd, generator=gen)
    return [_leaf(a) for a in (q, k, v, g, beta, s0)]


@pytest.mark.parametrize("kda", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_context_parallel_linear_attention_matches_single_device(mesh, kda):
    q, k, v, g, beta, s0 = _gdn_inputs(4, per_channel=kda)
    cp = st.context_parallel_kda if kda else st.context_parallel_gated_delta_rule
    single = st.chunk_kda if kda else st.chunk_gated_delta_rule
    o, state = cp(q, k, v, g, beta, mesh=mesh, axis_name="x", initial_state=s0, output_final_state=True,
                  chunk_size=4)
    ref_in = [_leaf(a) for a in (q, k, v, g, beta, s0)]
    ro, rstate = single(*ref_in[:5], initial_state=ref_in[5], output_final_state=True, chunk_size=4)
    torch.testing.assert_close(o, ro, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(state, rstate, atol=5e-5, rtol=5e-5)
    go, gs = torch.randn_like(o), torch.randn_like(state)
    got = torch.autograd.grad((o * go).sum() + (state * gs).sum(), (q, k, v, g, beta, s0))
    want = torch.autograd.grad((ro * go).sum() + (rstate * gs).sum(), ref_in)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_context_parallel_gated_delta_rule_opcheck(mesh):
    q, k, v, g, beta, s0 = _gdn_inputs(5, t=16)
    name = st_parallel.register_mesh(mesh)
    torch.library.opcheck(st_parallel.context_parallel_gated_delta_rule_op.op,
                          (q, k, v, g, beta, s0, None, None, name, "cpu", "x", None, False, 2, None, None))


@pytest.mark.slow
def test_context_parallel_kda_opcheck(mesh):
    name = st_parallel.register_mesh(mesh)
    qk, kk, vk, gk, bk, _ = _gdn_inputs(6, per_channel=True, t=16)
    torch.library.opcheck(st_parallel.context_parallel_kda_op.op,
                          (qk, kk, vk, gk, bk, None, None, None, name, "cpu", "x", None, False, 2, None, None, False,
                           False, None))


def _zigzag_inputs():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 32, 4, 8, generator=gen, requires_grad=True)
    return q, torch.randn(1, 32, 2, 8, generator=gen), torch.randn(1, 32, 2, 8, generator=gen)


@pytest.mark.parametrize("strategy", ["zigzag", "striped"])
def test_load_balance_layout_helpers_match_jax(strategy):
    from stellax import parallel as jparallel
    q, _, _ = _zigzag_inputs()
    zq = st.reorder_for_load_balance(q, 8, strategy)
    np.testing.assert_array_equal(zq.detach().numpy(), np.asarray(jparallel.reorder_for_load_balance(
        q.detach().numpy(), 8, strategy)))
    assert not torch.equal(zq, q)
    torch.testing.assert_close(st.restore_from_load_balance(zq, 8, strategy), q, atol=0, rtol=0)
    assert st.reorder_for_load_balance(q, 8, None) is q


@pytest.mark.slow
def test_zigzag_load_balanced_ring_attention(mesh):
    q, k, v = _zigzag_inputs()
    zq = st.reorder_for_load_balance(q, 8, "zigzag")
    out = st.context_parallel_attention(zq, st.reorder_for_load_balance(k, 8), st.reorder_for_load_balance(v, 8),
                                        mesh=mesh, axis_name="x", strategy="ring", load_balance="zigzag",
                                        is_causal=True)
    out = st.restore_from_load_balance(out, 8, "zigzag")
    ref = _sdpa(q, k, v, True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, q, g)[0], torch.autograd.grad(ref, q, g)[0], atol=5e-5,
                               rtol=5e-5)
