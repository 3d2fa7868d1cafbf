"""stellax.torch on torchax tensors (`stellax.torch.torchax`): the torch 2.13
compatibility shim, ops on the wrapped JAX arrays (no DLPack), gradients
through torchax's functional path, and tiny transformers Llama / Qwen3-MoE
models under torchax with stellax kernels against eager PyTorch (f32 logits
within 1e-5 relative, training-step gradients within 1e-4, one compilation of
the jitted training step)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pip install 'torch==2.13.0'")
import importlib.util  # noqa: E402

# Not importorskip: torchax must not be imported before stellax's shim (it fails on torch 2.13).
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed: pip install 'stellax[torchax]' (torchax==0.0.13)", allow_module_level=True)

import jax  # noqa: E402
import stellax.torch as st  # noqa: E402
import stellax.torch.torchax as stx  # noqa: E402

torchax = stx.import_torchax()
from torchax import interop  # noqa: E402


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _np(t):
    return np.asarray(t.jax()) if stx.is_torchax_tensor(t) else t.detach().numpy()


# -- the compatibility shim ---------------------------------------------------------------------
def test_shim_makes_every_aten_overload_torchax_names_resolve():
    """Every ``aten.<op>.<overload>`` in torchax's sources resolves after the
    shim, and the ones torch 2.13 removed are the inert placeholders."""
    root = Path(torchax.__file__).parent
    names = set()
    for f in root.rglob("*.py"):
        names |= set(re.findall(r"\baten\.([A-Za-z_0-9]+)\.([A-Za-z_0-9]+)\b", f.read_text()))
    placeholders = []
    for op, overload in sorted(names):
        packet = getattr(torch.ops.aten, op)
        value = getattr(packet, overload)  # raises AttributeError if the shim missed one
        if isinstance(value, stx.RemovedOverload):
            placeholders.append((op, overload))
    assert set(placeholders) <= set(stx.MISSING_OVERLOADS)
    assert ("prod", "dim_Dimname") in placeholders  # removed in torch 2.13: the reason for the shim
    with pytest.raises(RuntimeError, match="aten.prod.dim_Dimname does not exist"):
        torch.ops.aten.prod.dim_Dimname(torch.ones(2))
    assert stx.install_compat() == []  # idempotent


# -- ops on torchax tensors ------------------------------------------------------------------------
@pytest.fixture
def env():
    return torchax.default_env()


def _qkv():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 8, 4, 16, generator=g), torch.randn(2, 8, 2, 16, generator=g),
            torch.randn(2, 8, 2, 16, generator=g))


def test_ops_run_the_jax_function_on_the_wrapped_arrays(env, monkeypatch):
    q, k, v = _qkv()
    w = torch.rand(16) + 0.5
    ref_attn = st.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=5.0)
    ref_norm = st.rms_norm(q, w, eps=1e-6)
    ref_plain = st.dot_product_attention(q, k, v, is_causal=True)
    # No DLPack crossing (and no custom op) on the torchax path.
    from stellax.torch import bridge
    monkeypatch.setattr(bridge, "to_jax", lambda *a, **k: pytest.fail("bridge.to_jax called on the torchax path"))
    with env:
        qx, kx, vx, wx = (t.to("jax") for t in (q, k, v, w))
        out = st.dot_product_attention(qx, kx, vx, is_causal=True, logits_soft_cap=5.0)
        norm = st.rms_norm(qx, wx, eps=1e-6)
        assert stx.is_torchax_tensor(out) and stx.is_torchax_tensor(norm)
        assert isinstance(out.jax(), jax.Array)
        np.testing.assert_allclose(_np(out), ref_attn.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(_np(norm), ref_norm.numpy(), rtol=1e-6, atol=1e-6)
        # traceable under torchax's jit: the op is plain JAX inside the traced program
        jitted = interop.jax_jit(lambda a, b, c: st.dot_product_attention(a, b, c, is_causal=True) * 2)
        np.testing.assert_allclose(_np(jitted(qx, kx, vx)), 2 * ref_plain.numpy(), rtol=1e-6, atol=1e-6)


def test_gradients_through_jax_value_and_grad(env):
    q, k, v = _qkv()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    st.dot_product_attention(*leaves, is_causal=True).square().sum().backward()

    def loss(a, b, c):
        return st.dot_product_attention(a, b, c, is_causal=True).square().sum()
    with env:
        grad_fn = interop.jax_jit(interop.jax_value_and_grad(loss, {"argnums": (0, 1, 2)}))
        _, grads = grad_fn(*(t.to("jax") for t in (q, k, v)))
    for g, leaf in zip(grads, leaves):
        assert _rel(_np(g), leaf.grad.numpy()) < 1e-5


def test_torchax_tensor_mixed_with_a_cpu_tensor_names_the_argument(env):
    q, k, v = _qkv()
    with env:
        qx, vx = q.to("jax"), v.to("jax")
        with pytest.raises(TypeError, match=r"argument 'key' is a torch tensor on cpu.*'query', 'value' are "
                                            r"torchax tensors"):
            st.dot_product_attention(qx, k, vx)


# -- transformers models under torchax -----------------------------------------------------------
VOCAB = 64


def _kernelize(model):
    """stellax kernels in ``model``: `st.apply_kernels` when it exists, else the
    attention backend plus `st.MoE` for sparse MoE blocks (weights shared or,
    for experts, converted once)."""
    if hasattr(st, "apply_kernels"):
        st.apply_kernels(model)
        return model
    st.register_transformers_attention("stellax")
    model.set_attn_implementation("stellax")
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp = st.MoE.from_module(layer.mlp)
    return model


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]))


def _eager_grads(model, ids):
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    return float(loss), {k: p.grad.numpy().copy() for k, p in model.named_parameters()}


def _as_patched(name, grad, patched_names):
    """An eager parameter gradient in the patched model's layout (MoE experts
    are stored as ``w_gate_up [E, D, 2, F]`` / ``w_down [E, F, D]``)."""
    if name in patched_names:
        return name, grad
    if name.endswith("experts.gate_up_proj"):
        e, two_f, d = grad.shape
        return name.replace("experts.gate_up_proj", "w_gate_up"), grad.reshape(e, 2, two_f // 2, d).transpose(0, 3, 1, 2)
    if name.endswith("experts.down_proj"):
        return name.replace("experts.down_proj", "w_down"), grad.transpose(0, 2, 1)
    if name.endswith("gate.weight"):
        return name.replace("gate.weight", "router.weight"), grad
    raise KeyError(name)


@pytest.mark.parametrize("build", [_llama, pytest.param(_qwen3_moe, marks=pytest.mark.slow)],
                         ids=["llama", "qwen3_moe"])
def test_hf_model_under_torchax_matches_eager(build, env):
    torch.manual_seed(0)
    eager = build().eval()
    eager.set_attn_implementation("eager")
    model = build().eval()
    model.load_state_dict(eager.state_dict())
    _kernelize(model)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(3)]
    with torch.no_grad():
        ref_logits = eager(batches[0]).logits.numpy()
    ref_loss, ref_grads = _eager_grads(eager.train(), batches[0])

    calls = []
    real_call = stx.call
    import stellax.torch.torchax as module

    def counting_call(op, flat):
        out = real_call(op, flat)
        if out is not NotImplemented:
            calls.append(op.name)
        return out

    with env:
        module.call = counting_call
        try:
            model.to("jax")
            params = {k: p.detach().to("jax") for k, p in model.named_parameters()}
            buffers = {k: b.to("jax") for k, b in model.named_buffers()}

            def logits_fn(params, ids):
                return torch.func.functional_call(model, {**params, **buffers}, (ids,)).logits

            def loss_fn(params, ids):
                logits = logits_fn(params, ids)
                return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

            logits = interop.jax_jit(logits_fn)(params, batches[0].to("jax"))
            assert "dot_product_attention" in calls  # the stellax kernel ran, not transformers' attention
            if build is _qwen3_moe:
                assert any("moe" in c or "ragged" in c for c in calls), calls  # and stellax's experts
            assert _rel(_np(logits), ref_logits) < 1e-5

            # One SGD step as one jitted JAX program: value_and_grad + update.
            value_and_grad = interop.jax_value_and_grad(loss_fn)

            def step(params, ids):
                loss, grads = value_and_grad(params, ids)
                return loss, grads, {k: p - 0.1 * grads[k] for k, p in params.items()}
            jitted = jax.jit(interop.jax_view(step))
            torch_step = interop.torch_view(jitted)
            loss, grads, new_params = torch_step(params, batches[0].to("jax"))
            for batch in batches[1:]:
                _, _, new_params = torch_step(new_params, batch.to("jax"))
            assert jitted._cache_size() == 1  # compiled once for the three steps
        finally:
            module.call = real_call
    assert abs(float(loss.jax()) - ref_loss) <= 1e-5 * abs(ref_loss)
    patched = set(grads)
    for name, grad in ref_grads.items():
        key, want = _as_patched(name, grad, patched)
        assert _rel(_np(grads[key]), want) < 1e-4, name
