"""stellax.torch.linear_cross_entropy vs torch.nn.functional.cross_entropy on the
materialized logits: values, gradients, options, torch.compile."""

import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402

import stellax.torch as st  # noqa: E402


def _rel(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b).clamp_min(1e-30))


def _inputs(tokens=24, d=16, v=45, dtype=torch.float32, seed=0, transpose_w=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g).to(dtype).requires_grad_(True)
    shape = (v, d) if transpose_w else (d, v)
    w = (2 * torch.randn(*shape, generator=g) / d**0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, v, (tokens,), generator=g)
    labels[::5] = -100
    return x, w, labels


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_torch_cross_entropy(reduction, label_smoothing):
    x, w, labels = _inputs(seed=int(label_smoothing * 10))
    out = st.linear_cross_entropy(x, w, labels, transpose_w=True, reduction=reduction,
                                  label_smoothing=label_smoothing)
    ref = F.cross_entropy(x @ w.T, labels, reduction=reduction, label_smoothing=label_smoothing)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel(out, ref) <= 1e-5
    cot = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (x, w), cot)
    ref_grads = torch.autograd.grad(ref, (x, w), cot)
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape and _rel(g, r) <= 2e-5


def test_w_in_d_by_v_layout_soft_cap_and_z_loss():
    x, w, labels = _inputs(transpose_w=False, seed=3)
    cap, lam = 3.0, 1e-3
    out = st.linear_cross_entropy(x, w, labels, logit_soft_cap=cap, z_loss=lam)
    logits = cap * torch.tanh((x @ w) / cap)
    valid = labels != -100
    lse = torch.logsumexp(logits, dim=-1)
    ref = F.cross_entropy(logits, labels) + lam * (lse[valid] ** 2).mean()
    assert _rel(out, ref) <= 1e-5
    grads = torch.autograd.grad(out, (x, w))
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w))):
        assert _rel(g, r) <= 2e-5


def test_bfloat16():
    x, w, labels = _inputs(dtype=torch.bfloat16, seed=4)
    out = st.linear_cross_entropy(x, w, labels, transpose_w=True)
    ref = F.cross_entropy(x.float() @ w.float().T, labels)
    assert out.dtype == torch.float32 and _rel(out, ref) <= 1e-2
    dx, dw = torch.autograd.grad(out, (x, w))
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.bfloat16


def test_torch_compile_fullgraph():
    x, w, labels = _inputs(tokens=8, d=16, v=20, seed=5)
    compiled = torch.compile(lambda x, w, y: st.linear_cross_entropy(x, w, y, transpose_w=True), fullgraph=True)
    out = compiled(x, w, labels)
    ref = F.cross_entropy(x @ w.T, labels)
    assert _rel(out, ref) <= 1e-5
    out.backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref.backward()
    assert _rel(gx, x.grad) <= 2e-5 and _rel(gw, w.grad) <= 2e-5


def test_bad_label_raises():
    x, w, labels = _inputs(seed=6)
    labels[0] = 45
    with pytest.raises(ValueError, match=r"labels: expected values in \[0, 45\)"):
        st.linear_cross_entropy(x, w, labels, transpose_w=True)


def test_linear_cross_entropy_opcheck():
    """The custom op's schema, fake (meta) function, autograd and AOT dispatch."""
    from stellax.torch.loss import linear_cross_entropy_op

    x, w, labels = _inputs(tokens=8, d=16, v=24)
    x.requires_grad_(True)
    w.requires_grad_(True)
    for reduction in ("mean", "none"):
        torch.library.opcheck(linear_cross_entropy_op.op, (x, w, labels, -100, 0.1, 1e-4, None, reduction, True, None,
                                                                None))
