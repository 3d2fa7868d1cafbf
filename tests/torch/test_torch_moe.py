"""MoE front ends: ragged_dot vs a torch loop, routing, the MoE MLP and the
MoE module converted from an HF Mixtral block."""

import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402

import stellax.torch as st  # noqa: E402
from stellax.torch import moe as st_moe  # noqa: E402


def _ragged_dot_loop(lhs, rhs, group_sizes):
    out, start = [], 0
    for g, size in enumerate(group_sizes.tolist()):
        out.append(lhs[start:start + size] @ rhs[g])
        start += size
    out.append(lhs.new_zeros(lhs.shape[0] - start, rhs.shape[-1]))
    return torch.cat(out)


def test_ragged_dot_matches_torch_loop_forward_and_backward():
    torch.manual_seed(0)
    lhs = torch.randn(13, 8, requires_grad=True)
    rhs = torch.randn(4, 8, 6, requires_grad=True)
    sizes = torch.tensor([3, 0, 5, 3])  # an empty group and 2 trailing rows in no group
    out = st.ragged_dot(lhs, rhs, sizes)
    ref = _ragged_dot_loop(lhs, rhs, sizes)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (lhs, rhs), g), torch.autograd.grad(ref, (lhs, rhs), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
    torch.library.opcheck(st_moe.ragged_dot_op.op, (lhs, rhs, sizes.to(torch.int32), None, None))


def test_fused_gated_ragged_dot():
    torch.manual_seed(1)
    lhs = torch.randn(7, 8)
    rhs = torch.randn(2, 8, 2, 5)
    sizes = torch.tensor([4, 3])
    out = st.ragged_dot(lhs, rhs, sizes, activation="silu")
    ref = F.silu(_ragged_dot_loop(lhs, rhs[:, :, 0], sizes)) * _ragged_dot_loop(lhs, rhs[:, :, 1], sizes)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_route_matches_torch_topk_and_gradient():
    torch.manual_seed(2)
    logits = torch.randn(9, 6, requires_grad=True)
    weights, ids = st.route(logits, 2)
    probs = F.softmax(logits, -1)
    top, top_ids = probs.topk(2, -1)
    ref = top / top.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), top_ids)
    torch.testing.assert_close(weights, ref, atol=2e-6, rtol=2e-6)
    g = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(weights, logits, g)[0], torch.autograd.grad(ref, logits, g)[0],
                               atol=2e-6, rtol=2e-5)
    torch.library.opcheck(st_moe.route_op.op, (logits, None, 2, "softmax", None, None, True, 1.0))


def test_moe_mlp_opcheck():
    torch.manual_seed(3)
    x, logits = torch.randn(6, 8, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    wgu = (0.3 * torch.randn(4, 8, 2, 5)).requires_grad_()
    wd = (0.3 * torch.randn(4, 5, 8)).requires_grad_()
    torch.library.opcheck(st_moe.moe_mlp_op.op, (x, logits, wgu, wd, None, 2, "softmax", None, None, True, 1.0,
                                                  None, "silu", None))


def test_moe_module_from_hf_mixtral_block():
    pytest.importorskip("transformers", reason="HF conversions need transformers (pip install transformers)")
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    torch.manual_seed(4)
    block = MixtralSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = st.MoE.from_module(block)
    assert ours.router.weight is block.gate.weight and ours.top_k == 2
    x = torch.randn(2, 5, 16, requires_grad=True)
    y, ref = ours(x), block(x)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(y)
    gx, gr = torch.autograd.grad(y, (x, block.gate.weight), g)
    rx, rr = torch.autograd.grad(ref, (x, block.gate.weight), g, retain_graph=True)
    torch.testing.assert_close(gx, rx, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(gr, rr, atol=5e-5, rtol=5e-5)
    (rgu,) = torch.autograd.grad(ref, block.experts.gate_up_proj, g)
    ours_gu = torch.autograd.grad(ours(x), ours.w_gate_up, g)[0]  # [E, D, 2, F] vs HF [E, 2F, D]
    torch.testing.assert_close(ours_gu.permute(0, 2, 3, 1).reshape(rgu.shape), rgu, atol=5e-5, rtol=5e-5)
