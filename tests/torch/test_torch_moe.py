"""MoE front ends: ragged_dot / ragged_dot_general / ragged_dot_tgmm vs torch
loops, routing, permute / unpermute, the router losses, the MoE MLP and the
MoE module converted from an HF Mixtral block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402

import stellax  # noqa: E402
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
    torch.library.opcheck(st_moe.ragged_dot_op.op, (lhs, rhs, sizes.to(torch.int32), None, None, None, None, None))


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


# -- ragged_dot_general / tgmm ----------------------------------------------------------------
def _tgmm_loop(a, b, group_sizes):
    """a [M, K], b [M, N] -> [G, K, N]: out[g] = a[rows of g]^T b[rows of g]."""
    out, start = [], 0
    for size in group_sizes.tolist():
        out.append(a[start:start + size].t() @ b[start:start + size])
        start += size
    return torch.stack(out)


def _check_grads(out, ref, inputs, atol=5e-5):
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, inputs, g, retain_graph=True),
                    torch.autograd.grad(ref, inputs, g, retain_graph=True)):
        torch.testing.assert_close(a, b, atol=atol, rtol=atol)


SIZES = torch.tensor([3, 0, 5, 3])  # an empty group and 2 trailing rows in no group (M = 13)


@pytest.mark.parametrize("layout", ["forward", "transpose_rhs", "tgmm", "tgmm_transpose_lhs"])
def test_ragged_dot_general_layouts_match_torch_loops(layout):
    torch.manual_seed(5)
    m, k, n, g = 13, 8, 6, 4
    if layout == "forward":
        lhs, rhs = torch.randn(m, k), torch.randn(g, k, n)
        ref_fn = lambda a, b: _ragged_dot_loop(a, b, SIZES)
    elif layout == "transpose_rhs":
        lhs, rhs = torch.randn(m, k), torch.randn(g, n, k)
        ref_fn = lambda a, b: _ragged_dot_loop(a, b.transpose(1, 2), SIZES)
    elif layout == "tgmm":
        lhs, rhs = torch.randn(k, m), torch.randn(m, n)
        ref_fn = lambda a, b: _tgmm_loop(a.t(), b, SIZES)
    else:
        lhs, rhs = torch.randn(m, k), torch.randn(m, n)
        ref_fn = lambda a, b: _tgmm_loop(a, b, SIZES)
    lhs.requires_grad_(), rhs.requires_grad_()
    out = st.ragged_dot_general(lhs, rhs, SIZES, layout)
    ref = ref_fn(lhs, rhs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    _check_grads(out, ref, (lhs, rhs))
    # The same call through a jax.lax.RaggedDotDimensionNumbers, and the JAX op itself.
    dims = st_moe._dimension_numbers(layout)
    torch.testing.assert_close(st.ragged_dot_general(lhs, rhs, SIZES, dims), out, atol=0, rtol=0)
    jax_out = stellax.ragged_dot_general(jnp.asarray(lhs.detach().numpy()), jnp.asarray(rhs.detach().numpy()),
                                         jnp.asarray(SIZES.numpy(), jnp.int32), dims)
    np.testing.assert_allclose(out.detach().numpy(), np.asarray(jax_out), atol=1e-6, rtol=1e-6)


def test_ragged_dot_general_opcheck_and_bad_layout():
    torch.manual_seed(6)
    lhs, rhs = torch.randn(13, 8, requires_grad=True), torch.randn(4, 8, 6, requires_grad=True)
    sizes = SIZES.to(torch.int32)
    torch.library.opcheck(st_moe.ragged_dot_general_op.op, (lhs, rhs, sizes, None, "forward", None, None, None, None))
    a, b = torch.randn(8, 13, requires_grad=True), torch.randn(13, 6, requires_grad=True)
    torch.library.opcheck(st_moe.ragged_dot_general_op.op, (a, b, sizes, None, "tgmm", None, None, None, None))
    with pytest.raises(ValueError, match="ragged_dot_dimension_numbers: expected one of"):
        st.ragged_dot_general(lhs, rhs, SIZES, "backward")
    bad = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                            lhs_ragged_dimensions=[1], rhs_group_dimensions=[0])
    with pytest.raises(ValueError, match="ragged_dot_dimension_numbers"):
        st.ragged_dot_general(lhs, rhs, SIZES, bad)


def test_ragged_dot_tgmm_group_offset_matches_jax_and_loop():
    torch.manual_seed(7)
    a = torch.randn(13, 8, requires_grad=True)   # [M, K] with transpose_lhs
    b = torch.randn(13, 6, requires_grad=True)
    out = st.ragged_dot_tgmm(a, b, SIZES, transpose_lhs=True)
    ref = _tgmm_loop(a, b, SIZES)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    _check_grads(out, ref, (a, b))
    # Groups [1, 3) of an expert shard: only those are computed.
    local = st.ragged_dot_tgmm(a, b, SIZES, transpose_lhs=True, group_offset=1, num_local_groups=2)
    torch.testing.assert_close(local, ref[1:3], atol=2e-5, rtol=2e-5)
    jax_local = stellax.ragged_dot_tgmm(jnp.asarray(a.detach().numpy()), jnp.asarray(b.detach().numpy()),
                                        jnp.asarray(SIZES.numpy(), jnp.int32), group_offset=1, num_local_groups=2,
                                        transpose_lhs=True)
    np.testing.assert_allclose(local.detach().numpy(), np.asarray(jax_local), atol=1e-6, rtol=1e-6)
    _check_grads(local, ref[1:3], (a, b))
    torch.library.opcheck(st_moe.ragged_dot_tgmm_op.op,
                          (a, b, SIZES.to(torch.int32), torch.tensor([1], dtype=torch.int32), None, None, 2, True,
                           None))


def test_ragged_dot_group_offset_and_out_dtype():
    torch.manual_seed(8)
    lhs = torch.randn(13, 8, requires_grad=True)
    full = torch.randn(4, 8, 6)
    local = full[2:].clone().requires_grad_()  # this shard holds groups 2 and 3
    out = st.ragged_dot(lhs, local, SIZES, group_offset=2)
    # Rows of groups 0 (3 rows) and 1 (empty) are not this shard's: zeros.
    ref = torch.cat([torch.zeros(3, 6), _ragged_dot_loop(lhs[3:], local, torch.tensor([5, 3]))])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    _check_grads(out, ref, (lhs, local))
    y = st.ragged_dot(lhs.detach().bfloat16(), full.bfloat16(), SIZES, preferred_element_type=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, _ragged_dot_loop(lhs.detach().bfloat16().float(), full.bfloat16().float(), SIZES),
                               atol=1e-4, rtol=1e-4)


def test_ragged_dot_quantized_experts():
    torch.manual_seed(9)
    lhs = torch.randn(13, 64, requires_grad=True)
    w = torch.randn(4, 64, 6)
    qw = st.quantize(w, "int8", axis=1)
    out = st.ragged_dot(lhs, qw, SIZES)
    wd = st.dequantize(qw)
    ref = _ragged_dot_loop(lhs, wd, SIZES)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    _check_grads(out, ref, (lhs,), atol=1e-4)
    from stellax.torch import quant as st_quant
    torch.library.opcheck(st_moe.ragged_dot_quantized_op.op,
                          (lhs, *st_quant._q_args(qw)[:4], SIZES.to(torch.int32), None, *st_quant._q_args(qw)[4:],
                           None, None, None, None))


# -- permute / unpermute -----------------------------------------------------------------------
def _permute_reference(x, ids, num_experts, capacity_factor=None):
    """A plain torch permute: stable sort of the copies by expert, first copies in token order kept."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity_factor is None:
        return x[order // k], counts, order, torch.zeros_like(counts)
    cap = int(np.ceil(capacity_factor * t * k / num_experts))
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(t * k) - starts[flat[order]]
    key = torch.where(rank < cap, flat[order], num_experts)
    order = order[torch.sort(key, stable=True).indices]
    kept = counts.clamp(max=cap)
    rows = x[order // k] * (torch.arange(t * k) < kept.sum())[:, None]
    return rows, kept, order, counts - kept


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_permute_unpermute_match_torch_and_gradients(capacity_factor):
    torch.manual_seed(10)
    t, k, e, d = 9, 2, 4, 5
    x = torch.randn(t, d, requires_grad=True)
    logits = torch.randn(t, e)
    logits[:, 1] += 3  # expert 1 is popular: with a capacity it drops copies
    weights, ids = st.route(logits, k)
    out = st.permute(x, ids, e, capacity_factor=capacity_factor)
    ref = _permute_reference(x, ids, e, capacity_factor)
    assert len(out) == (3 if capacity_factor is None else 4)
    rows, sizes, order = out[:3]
    assert sizes.dtype == torch.int32 and order.dtype == torch.int32
    torch.testing.assert_close(rows, ref[0], atol=0, rtol=0)
    assert torch.equal(sizes.long(), ref[1]) and torch.equal(order.long(), ref[2])
    if capacity_factor is not None:
        assert torch.equal(out[3].long(), ref[3]) and int(out[3].sum()) > 0
    # Per-expert work on the rows, then the weighted combine.
    scale = torch.arange(1.0, t * k + 1)[:, None]
    y = rows * scale
    w = weights.detach().clone().requires_grad_()
    combined = st.unpermute(y, order, w)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, dtype=order.dtype)).long()
    ref_combined = ((ref[0] * scale)[inverse].reshape(t, k, d) * w[..., None]).sum(1)
    torch.testing.assert_close(combined, ref_combined, atol=2e-5, rtol=2e-5)
    _check_grads(combined, ref_combined, (x, w))


def test_permute_unpermute_opcheck():
    torch.manual_seed(11)
    x = torch.randn(6, 4, requires_grad=True)
    ids = torch.randint(0, 3, (6, 2), dtype=torch.int32)
    torch.library.opcheck(st_moe.permute_op.op, (x, ids, 3, None))
    torch.library.opcheck(st_moe.permute_op.op, (x, ids, 3, 1.0))
    rows, _, order = st.permute(x.detach(), ids, 3)
    torch.library.opcheck(st_moe.unpermute_op.op, (rows.requires_grad_(), order, torch.rand(6, 2, requires_grad=True)))


# -- router losses ------------------------------------------------------------------------------
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_losses_match_torch_formulas(scoring):
    torch.manual_seed(12)
    logits = torch.randn(10, 6, requires_grad=True)
    _, ids = st.route(logits.detach(), 2, scoring=scoring)
    loss = st.load_balancing_loss(logits, ids, scoring=scoring)
    if scoring == "softmax":
        p = torch.softmax(logits, -1)
    else:
        p = torch.sigmoid(logits)
        p = p / p.sum(-1, keepdim=True)
    f = torch.bincount(ids.reshape(-1).long(), minlength=6).float() / ids.numel()
    ref = 6 * (f * p.mean(0)).sum()
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0],
                               atol=1e-6, rtol=1e-5)
    z = st.router_z_loss(logits)
    zref = (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(z, zref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(z, logits)[0], torch.autograd.grad(zref, logits)[0],
                               atol=1e-6, rtol=1e-5)
    jz = stellax.router_z_loss(jnp.asarray(logits.detach().numpy()))
    np.testing.assert_allclose(z.item(), float(jz), rtol=1e-6)


def test_router_losses_opcheck():
    logits = torch.randn(5, 4, requires_grad=True)
    ids = torch.randint(0, 4, (5, 2), dtype=torch.int32)
    torch.library.opcheck(st_moe.load_balancing_loss_op.op, (logits, ids, "softmax"))
    torch.library.opcheck(st_moe.router_z_loss_op.op, (logits,))


def test_moe_pipeline_compiles_fullgraph():
    """route -> permute -> ragged_dot -> unpermute + both losses under torch.compile(fullgraph=True)."""
    torch.manual_seed(13)
    t, d, e, f = 8, 6, 4, 5
    x = torch.randn(t, d, requires_grad=True)
    router = torch.randn(d, e, requires_grad=True)
    w1 = (0.3 * torch.randn(e, d, f)).requires_grad_()
    w2 = (0.3 * torch.randn(e, f, d)).requires_grad_()

    def layer(x, router, w1, w2):
        logits = x @ router
        weights, ids = st.route(logits, 2)
        rows, sizes, order, dropped = st.permute(x, ids, e, capacity_factor=2.0)
        h = st.ragged_dot(rows, w1, sizes, activation="silu")
        y = st.ragged_dot_general(h, w2, sizes, "forward")
        out = st.unpermute(y, order, weights)
        return out, st.load_balancing_loss(logits, ids) + 1e-3 * st.router_z_loss(logits)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out, aux = compiled(x, router, w1, w2)
    ref, ref_aux = layer(x, router, w1, w2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux, ref_aux)
    grads = torch.autograd.grad(out.sum() + aux, (x, router, w1, w2))
    ref_grads = torch.autograd.grad(ref.sum() + ref_aux, (x, router, w1, w2))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
