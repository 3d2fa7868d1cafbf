"""`stellax.torch.apply_kernels` on tiny random-initialized transformers models:
the patch report, and convergence — 20 AdamW steps patched and unpatched from
the same weights on the same batches (float32): losses equal at every step
within 1e-4 relative, a few parameters' gradients within 1e-4, and greedy
generation of 8 tokens identical."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="pip install 'torch==2.13.0'")
transformers = pytest.importorskip("transformers", reason="pip install 'stellax[transformers]'")

import stellax.torch as st  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 128, 16, 2, 20
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))


def _qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_SMALL, head_dim=8))


def _gemma2():
    cfg = transformers.Gemma2Config(**_SMALL, head_dim=8, sliding_window=8, query_pre_attn_scalar=8,
                                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                    hidden_activation="gelu_pytorch_tanh")
    return transformers.Gemma2ForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    return transformers.MixtralForCausalLM(cfg)


def _gpt_oss():
    cfg = transformers.GptOssConfig(**{**_SMALL, "intermediate_size": 32}, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"])
    return transformers.GptOssForCausalLM(cfg)


def _qwen3_next():
    cfg = transformers.Qwen3NextConfig(
        **{**_SMALL, "num_hidden_layers": 2}, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"])
    return transformers.Qwen3NextForCausalLM(cfg)


def _mamba2():
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8,
                                    expand=2, head_dim=8, num_heads=8, n_groups=1, chunk_size=8,
                                    tie_word_embeddings=False)
    return transformers.Mamba2ForCausalLM(cfg)


def _kimi_linear():
    cfg = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, head_dim=8, qk_head_dim=16, num_experts=4, num_experts_per_token=2,
        num_shared_experts=1, mlp_layer_types=["dense", "sparse"], layer_types=["linear_attention", "full_attention"],
        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return transformers.KimiLinearForCausalLM(cfg)


def _pair(build, seed=0):
    torch.manual_seed(seed)
    ref = build().float()
    ours = copy.deepcopy(ref)
    return ref, ours


def _batches(seed=1):
    """Four random batches, cycled: learnable (memorized) in 20 steps."""
    g = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(4)]
    return [distinct[i % 4] for i in range(STEPS)]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One torch intra-op thread: on a loaded CPU, torch's OpenMP workers
    spinning beside XLA's thread pool made each training step ~35x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: parameters whose gradients are compared (name fragments; the first matrix matching each)
_PROBES = ("embed_tokens", "layers.0.", "layers.1.", "lm_head")


def _probe_grads(model):
    grads = {}
    for fragment in _PROBES:
        for name, p in model.named_parameters():
            if fragment in name and p.ndim == 2 and p.grad is not None and name not in grads:
                grads[name] = p.grad.detach().clone()
                break
    return grads


def _train(model, batches):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grads = [], []
    for i, ids in enumerate(batches):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if i in (0, len(batches) - 1):
            grads.append(_probe_grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _check_convergence(build, expect_patched):
    ref, ours = _pair(build)
    report = st.apply_kernels(ours)
    for kind in expect_patched:
        assert report.count(kind) > 0, f"{kind} not patched:\n{report}"
    batches = _batches()
    ref_losses, ref_grads = _train(ref, batches)
    our_losses, our_grads = _train(ours, batches)
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(ref_losses), rtol=1e-4, atol=0.0)
    assert ref_losses[-1] < ref_losses[0] - 0.1, f"the models did not train: {ref_losses}"
    for got, want in zip(our_grads, ref_grads):
        assert got.keys() == want.keys() and len(want) >= 3
        for name in want:  # relative L2 error (the numerics policy's measure)
            err = ((got[name] - want[name]).norm() / want[name].norm()).item()
            assert err <= 1e-4, f"{name}: gradient rel-L2 error {err:.2e} > 1e-4"
    ref.eval()
    ours.eval()
    prompt = batches[0][:, :6]
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = ours.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert want.shape == (BATCH, 14)
    assert torch.equal(got, want), (got, want)
    # the patched modules really ran stellax: their forwards are rebound, the weights are the model's
    return report, ours


def test_llama_convergence():
    report, model = _check_convergence(_llama, ("norm", "mlp", "attention"))
    assert model.config._attn_implementation == "stellax"
    mlp = model.model.layers[0].mlp
    assert mlp.forward.__func__.__name__ == "_mlp_forward" and mlp.gate_proj.weight.grad is None


def test_gemma2_convergence():
    # 1 + weight norms, GeGLU (gelu_tanh), logit soft-capping, sliding windows
    report, _ = _check_convergence(_gemma2, ("norm", "mlp", "attention"))
    assert any("1 + weight" in what for _, _, what in report.patched)
    assert any("gelu_tanh" in what for _, _, what in report.patched)


def test_mixtral_convergence():
    report, _ = _check_convergence(_mixtral, ("norm", "attention", "moe router", "moe experts"))


def test_qwen3_next_convergence():
    # hybrid: a Gated DeltaNet layer (stellax kernels through the mixer's hooks) + a gated attention layer,
    # MoE with a shared expert
    report, _ = _check_convergence(_qwen3_next, ("norm", "attention", "linear attention", "moe experts"))


def test_mamba2_convergence():
    report, _ = _check_convergence(_mamba2, ("norm", "linear attention"))


@pytest.mark.slow
def test_qwen3_convergence():
    _check_convergence(_qwen3, ("norm", "mlp", "attention"))


@pytest.mark.slow
def test_gpt_oss_convergence():
    # attention sinks, biased interleaved experts with the clamped SwiGLU gate
    _check_convergence(_gpt_oss, ("norm", "attention", "moe router", "moe experts"))


@pytest.mark.slow
def test_kimi_linear_convergence():
    # KDA mixers through their chunk_kda / fused_recurrent_kda hooks, MLA attention, MoE experts
    report, _ = _check_convergence(_kimi_linear, ("norm", "mlp", "attention", "linear attention", "moe experts"))
    assert any("KimiLinearTopkRouter" in why for why in report.reasons("moe router"))


def test_report_says_what_and_why():
    ref, ours = _pair(_mamba2)
    report = st.apply_kernels(ours)
    text = str(report)
    assert "linear attention" in text and "ssd / ssd_step" in text
    assert any(what == "rms_norm (gated)" for _, _, what in report.patched)  # Mamba2's gated group norm
    # Mamba2ForCausalLM has a `backbone`, not a `model`: the loss is not patched, and says why
    assert any("not a causal LM with a base `model`" in why for why in report.reasons("loss"))
    again = st.apply_kernels(ours)
    assert not again.patched or all(kind in ("attention", "moe experts") for _, kind, _ in again.patched)
    assert any("already patched" in why for _, _, why in again.skipped)


def test_switches_off():
    _, ours = _pair(_llama)
    report = st.apply_kernels(ours, attention=False, norm=False, mlp=False, moe=False, linear_attention=False,
                              loss=False)
    assert report.patched == [] and report.skipped == []
    assert ours.config._attn_implementation != "stellax"


def test_attention_with_dropout_is_not_patched():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_SMALL, "attention_dropout": 0.1}))
    report = st.apply_kernels(model)
    assert report.count("attention") == 0 and model.config._attn_implementation != "stellax"
    assert any("attention_dropout = 0.1 > 0" in why for why in report.reasons("attention"))
    assert report.count("norm") == 5 and report.count("mlp") == 2


def test_rejects_non_modules():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        st.apply_kernels("llama")
