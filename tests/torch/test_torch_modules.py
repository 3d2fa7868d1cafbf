"""nn.Module drop-ins, from_module conversions and torch.compile(fullgraph=True)."""

import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
from torch import nn  # noqa: E402

import stellax.torch as st  # noqa: E402


def test_layer_norm_from_torch_module_shares_parameters():
    torch.manual_seed(0)
    ref = nn.LayerNorm(24, eps=1e-5)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    mod = st.LayerNorm.from_module(ref)
    assert mod.weight is ref.weight and mod.bias is ref.bias
    x = torch.randn(3, 4, 24)
    torch.testing.assert_close(mod(x), ref(x), atol=2e-5, rtol=2e-5)
    mod(x).square().sum().backward()
    assert ref.weight.grad is not None and ref.weight.grad.abs().sum() > 0


def test_rms_norm_from_torch_and_hf_modules():
    torch.manual_seed(1)
    x = torch.randn(5, 32)
    ref = nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    torch.testing.assert_close(st.RMSNorm.from_module(ref)(x), ref(x), atol=2e-5, rtol=2e-5)
    ref_default_eps = nn.RMSNorm(32)  # eps=None: torch uses finfo(dtype).eps
    torch.testing.assert_close(st.RMSNorm.from_module(ref_default_eps)(x), ref_default_eps(x), atol=2e-5, rtol=2e-5)
    llama = pytest.importorskip("transformers.models.llama.modeling_llama",
                                reason="HF conversions need transformers (pip install transformers)")
    hf = llama.LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
    torch.testing.assert_close(st.RMSNorm.from_module(hf)(x), hf(x), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(st.LayerNorm.from_module(hf)(x), hf(x), atol=2e-5, rtol=2e-5)
    with pytest.raises(TypeError, match="RMSNorm"):
        st.RMSNorm.from_module(nn.Linear(3, 3))


def test_gated_mlp_from_hf_llama_mlp_forward_and_backward():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama",
                                reason="HF conversions need transformers (pip install transformers)")
    from transformers import LlamaConfig

    torch.manual_seed(2)
    ref = llama.LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=80, num_attention_heads=4, hidden_act="silu"))
    mod = st.GatedMLP.from_module(ref)
    assert mod.down_proj is ref.down_proj and mod.activation == "silu"
    x = torch.randn(2, 6, 32, requires_grad=True)
    y, want = mod(x), ref(x)
    torch.testing.assert_close(y, want, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g, retain_graph=True)
    (wx,) = torch.autograd.grad(want, x, g, retain_graph=True)
    torch.testing.assert_close(gx, wx, atol=5e-5, rtol=5e-5)
    dgate_up = torch.autograd.grad(y, mod.gate_up, g)[0]
    dgate, dup = torch.autograd.grad(want, (ref.gate_proj.weight, ref.up_proj.weight), g)
    torch.testing.assert_close(dgate_up[:, 0], dgate.t(), atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(dgate_up[:, 1], dup.t(), atol=5e-5, rtol=5e-5)
    biased = llama.LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, mlp_bias=True))
    with pytest.raises(ValueError, match="bias"):
        st.GatedMLP.from_module(biased)


class _Block(nn.Module):
    """A pre-norm transformer block built only from stellax.torch pieces."""

    def __init__(self, d=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1 = st.RMSNorm(d)
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.norm2 = st.LayerNorm(d)
        self.mlp = st.GatedMLP(d, 48)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        a = st.dot_product_attention(q.view(b, t, self.heads, self.hd), k.view(b, t, self.kv_heads, self.hd),
                                     v.view(b, t, self.kv_heads, self.hd), is_causal=True)
        x = x + self.out(a.reshape(b, t, -1))
        return x + self.mlp(self.norm2(x))


def test_torch_compile_fullgraph_small_model():
    torch.manual_seed(3)
    block = _Block()
    x = torch.randn(2, 7, 32, requires_grad=True)
    eager = block(x)
    (g_eager,) = torch.autograd.grad(eager.square().sum(), x)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    (g_comp,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(g_comp, g_eager, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_torch_compile_inductor_fullgraph():
    torch.manual_seed(4)
    block = _Block()
    x = torch.randn(2, 7, 32)
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x), block(x), atol=1e-5, rtol=1e-5)
