"""Gated DeltaNet front ends vs a plain torch recurrence, and the mixer module."""

import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402

import stellax.torch as st  # noqa: E402
from stellax.torch import linear_attention as st_la  # noqa: E402


def gdn_recurrence(q, k, v, g, beta, scale=None, initial_state=None, use_qk_l2norm=False):
    """Token-by-token Gated DeltaNet in float64 torch (the fla contract)."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    q, k, v, g, beta = (a.double() for a in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q.repeat_interleave(hv // h, dim=2)
    k = k.repeat_interleave(hv // h, dim=2)
    scale = kd ** -0.5 if scale is None else scale
    state = torch.zeros(b, hv, kd, vd, dtype=torch.float64) if initial_state is None else initial_state.double()
    outs = []
    for i in range(t):
        decay = g[:, i].exp()
        state = state * (decay[..., None] if decay.ndim == 3 else decay[..., None, None])  # KDA: per channel
        kv_old = torch.einsum("bhkv,bhk->bhv", state, k[:, i])
        delta = beta[:, i][..., None] * (v[:, i] - kv_old)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], delta)
        outs.append(torch.einsum("bhkv,bhk->bhv", state, scale * q[:, i]))
    return torch.stack(outs, 1), state


def _inputs(b=2, t=13, h=2, hv=4, kd=8, vd=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, kd, generator=gen)
    k = torch.randn(b, t, h, kd, generator=gen)
    v = torch.randn(b, t, hv, vd, generator=gen)
    g = -F.softplus(torch.randn(b, t, hv, generator=gen))
    beta = torch.rand(b, t, hv, generator=gen)
    s0 = torch.randn(b, hv, kd, vd, generator=gen) * 0.1
    return [a.requires_grad_() for a in (q, k, v, g, beta, s0)]


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_gated_delta_rule_matches_torch_recurrence_forward_and_backward(fn):
    q, k, v, g, beta, s0 = _inputs()
    op = st.chunk_gated_delta_rule if fn == "chunk" else st.fused_recurrent_gated_delta_rule
    kwargs = {"chunk_size": 8} if fn == "chunk" else {}
    o, state = op(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True, **kwargs)
    ro, rstate = gdn_recurrence(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True)
    torch.testing.assert_close(o.double(), ro, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.double(), rstate, atol=1e-4, rtol=1e-4)
    go, gs = torch.randn_like(o), torch.randn_like(state)
    args = (q, k, v, g, beta, s0)
    got = torch.autograd.grad((o * go).sum() + (state * gs).sum(), args)
    want = torch.autograd.grad((ro * go.double()).sum() + (rstate * gs.double()).sum(), args)
    for name, a, b in zip("q k v g beta s0".split(), got, want):
        rel = ((a.double() - b).norm() / b.norm()).item()
        assert rel < 1e-4, (name, rel)


def test_packed_sequences_and_decode_continuation():
    q, k, v, g, beta, _ = _inputs(b=1, t=12, seed=1)
    cu = torch.tensor([0, 5, 12])
    o, states = st.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    for n, (lo, hi) in enumerate([(0, 5), (5, 12)]):
        ro, rs = gdn_recurrence(*(a[:, lo:hi] for a in (q, k, v, g, beta)))
        torch.testing.assert_close(o[:, lo:hi].double(), ro, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(states[n:n + 1].double(), rs, atol=1e-4, rtol=1e-4)
    # prefill 9 tokens with the chunked kernel, then decode 3 steps with the recurrent one
    _, s = st.chunk_gated_delta_rule(*(a[:, :9] for a in (q, k, v, g, beta)), output_final_state=True)
    steps = []
    for i in range(9, 12):
        oi, s = st.fused_recurrent_gated_delta_rule(*(a[:, i:i + 1] for a in (q, k, v, g, beta)),
                                                    initial_state=s, output_final_state=True)
        steps.append(oi)
    full, _ = gdn_recurrence(q, k, v, g, beta)
    torch.testing.assert_close(torch.cat(steps, 1).double(), full[:, 9:], atol=1e-4, rtol=1e-4)


def test_gated_delta_rule_opcheck():
    q, k, v, g, beta, s0 = _inputs(b=1, t=6, h=1, hv=2, kd=4, vd=4)
    torch.library.opcheck(st_la.chunk_gated_delta_rule_op.op, (q, k, v, g, beta, s0, None, None, False, 4, None, None))
    torch.library.opcheck(st_la.fused_recurrent_gated_delta_rule_op.op,
                          (q, k, v, g, beta, None, None, 0.5, True, 64, None, "high"))


def test_gated_delta_net_module_matches_a_torch_recurrence_mixer():
    torch.manual_seed(2)
    mixer = st.GatedDeltaNet(32, num_heads=2, head_k_dim=8, head_v_dim=8, num_v_heads=4)
    x = torch.randn(2, 10, 32, requires_grad=True)
    y, state = mixer(x, output_final_state=True)
    q, k, v, g, beta = mixer.project(x)
    ro, rstate = gdn_recurrence(q, k, v, g, beta, use_qk_l2norm=True)
    gate = mixer.g_proj(x).view(2, 10, 4, 8)
    ref = mixer.o_proj((F.rms_norm(ro.float(), (8,), mixer.o_norm_weight, 1e-6) * F.silu(gate)).reshape(2, 10, -1))
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.double(), rstate, atol=1e-4, rtol=1e-4)
    g_out = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, mixer.A_log, mixer.q_proj.weight), g_out)
    want = torch.autograd.grad(ref, (x, mixer.A_log, mixer.q_proj.weight), g_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_kda_matches_torch_recurrence_and_opcheck():
    q, k, v, _, beta, s0 = _inputs(b=1, t=9, seed=3)
    g = (-F.softplus(torch.randn(1, 9, 4, 8, generator=torch.Generator().manual_seed(4)))).requires_grad_()
    o, state = st.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=4)
    ro, rstate = gdn_recurrence(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o.double(), ro, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.double(), rstate, atol=1e-4, rtol=1e-4)
    go = torch.randn_like(o)
    got = torch.autograd.grad((o * go).sum(), (q, g, s0))
    want = torch.autograd.grad((ro * go.double()).sum(), (q, g, s0))
    for a, b in zip(got, want):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4
    o1, _ = st.fused_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o1.double(), ro, atol=1e-4, rtol=1e-4)
    for op in (st_la.chunk_kda_op, st_la.fused_recurrent_kda_op):
        torch.library.opcheck(op.op, (q, k, v, g, beta, s0, None, None, None, None, False, 4, None, None, False,
                                      False, None))


def ssd_recurrence(x, dt, A, B, C, D):
    b, t, h, p = x.shape
    rep = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, 2).double(), C.repeat_interleave(rep, 2).double()
    x, dt, A, D = x.double(), dt.double(), A.double(), D.double()
    state = torch.zeros(b, h, p, B.shape[3], dtype=torch.float64)
    ys = []
    for i in range(t):
        state = state * (dt[:, i] * A).exp()[..., None, None] + \
            (dt[:, i][..., None, None] * x[:, i][..., None]) * Bh[:, i][:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, i]) + D[None, :, None] * x[:, i])
    return torch.stack(ys, 1), state


def test_ssd_matches_torch_recurrence_and_opcheck():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 10, 4, 8, generator=gen, requires_grad=True)
    dt = (0.5 * torch.rand(1, 10, 4, generator=gen)).requires_grad_()
    A = (-torch.rand(4, generator=gen) - 0.1).requires_grad_()
    B = torch.randn(1, 10, 2, 6, generator=gen, requires_grad=True)
    C = torch.randn(1, 10, 2, 6, generator=gen, requires_grad=True)
    D = torch.randn(4, generator=gen, requires_grad=True)
    y, state = st.ssd(x, dt, A, B, C, D=D, chunk_size=4, return_final_states=True)
    ry, rstate = ssd_recurrence(x, dt, A, B, C, D)
    torch.testing.assert_close(y.double(), ry, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state.double(), rstate, atol=1e-4, rtol=1e-4)
    gy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad((y * gy).sum(), (x, dt, A, B)),
                    torch.autograd.grad((ry * gy.double()).sum(), (x, dt, A, B))):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-4
    torch.library.opcheck(st_la.ssd_op.op, (x, dt, A, B, C, D, None, None, None, None, 4, False,
                                            [0.0, float("inf")], None, None))


def test_ssd_step_continues_the_scan():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 6, 4, 8, generator=gen)
    dt = 0.5 * torch.rand(1, 6, 4, generator=gen)
    A = -torch.rand(4, generator=gen) - 0.1
    B, C = torch.randn(1, 6, 2, 6, generator=gen), torch.randn(1, 6, 2, 6, generator=gen)
    D = torch.randn(4, generator=gen)
    _, state = st.ssd(x[:, :5], dt[:, :5], A, B[:, :5], C[:, :5], D=D, chunk_size=4, return_final_states=True)
    y, new_state = st.ssd_step(state, x[:, 5], dt[:, 5], A, B[:, 5], C[:, 5], D=D)
    ry, rstate = ssd_recurrence(x, dt, A, B, C, D)
    torch.testing.assert_close(y.double(), ry[:, 5], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new_state.double(), rstate, atol=1e-4, rtol=1e-4)
    torch.library.opcheck(st_la.ssd_step_op.op, (state, x[:, 5], dt[:, 5], A, B[:, 5], C[:, 5], D, None, None, False,
                                                 [0.0, float("inf")], None, None))
