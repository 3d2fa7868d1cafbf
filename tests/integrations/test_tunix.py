"""`stellax.integrations.tunix.apply_kernels` on Tunix's Llama 3 and Qwen 3
(tiny configs, random weights): logits against the unpatched model, a Tunix
PeftTrainer SFT run and a LoRA run (qwix) patched vs unpatched with matching
losses, greedy generation with Tunix's sampler giving identical tokens, and
the error for a family the patcher does not know."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

_REASON = ("Tunix is not installed: pip install --no-deps google-tunix==0.1.7 google-metrax clu qwix && "
           "pip install 'stellax[tunix]' (see docs/integrations.md for its runtime deps)")
for _name in ("tunix", "flax", "optax", "qwix"):
    if importlib.util.find_spec(_name) is None:
        pytest.skip(_REASON, allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

try:
    import qwix  # noqa: E402
    from tunix.generate import sampler as sampler_lib  # noqa: E402
    from tunix.models.llama3 import model as llama3  # noqa: E402
    from tunix.models.qwen3 import model as qwen3  # noqa: E402
    from tunix.sft import peft_trainer, utils as sft_utils  # noqa: E402
except ImportError as e:  # a runtime dependency of Tunix is missing
    pytest.skip(f"{_REASON}: {e}", allow_module_level=True)

from stellax.integrations import tunix as stt  # noqa: E402

V, B, T = 32, 2, 12
_DIMS = dict(num_layers=1, vocab_size=V, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8, num_kv_heads=2,
             rope_theta=10000, norm_eps=1e-6)


def _randomize(model, seed=0):
    """Random weights everywhere (Tunix initializes MLP kernels to zero)."""
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [jax.random.normal(k, x.shape, x.dtype) * 0.3 if x.ndim > 1 else x for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(tree, leaves))
    return model


def _llama():
    return _randomize(llama3.Llama3(llama3.ModelConfig(**_DIMS), rngs=nnx.Rngs(0)))


def _qwen3():
    return _randomize(qwen3.Qwen3(qwen3.ModelConfig(**_DIMS), rngs=nnx.Rngs(0)))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _inputs(seed=1):
    ids = jax.random.randint(jax.random.key(seed), (B, T), 0, V)
    mask = jnp.ones((B, T), bool).at[0, :3].set(False)  # left padding in row 0
    return ids, mask


def _model_args(ids, mask):
    return ids, sft_utils.build_positions_from_mask(mask), None, sft_utils.make_causal_attn_mask(mask)


@pytest.mark.parametrize("build", [_llama, _qwen3], ids=["llama3", "qwen3"])
def test_patched_logits_match_and_parameters_are_shared(build):
    model = build()
    ids, mask = _inputs()
    ref, _ = nnx.jit(lambda m, *a: m(*a))(model, *_model_args(ids, mask))
    params_before = {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    report = stt.apply_kernels(model)
    assert report["layers/0/attn"] == "stellax attention"
    assert report["layers/0/mlp"] == "stellax gated_linear_unit"
    assert report["final_norm"] == "stellax rms_norm"
    assert {id(v) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)} == params_before
    out, _ = nnx.jit(lambda m, *a: m(*a))(model, *_model_args(ids, mask))
    assert _rel(out, ref) < 1e-5


def _train(model, steps=3, lora=False):
    if lora:
        provider = qwix.LoraProvider(module_path=".*q_proj|.*v_proj|.*down_proj|.*up_proj", rank=4, alpha=2.0)
        ids, mask = _inputs()
        ids_, pos, _, attn = _model_args(ids, mask)
        model = qwix.apply_lora_to_model(model, provider, ids_, pos, None, attn, rngs=nnx.Rngs(3))
    config = peft_trainer.TrainingConfig(eval_every_n_steps=1000, max_steps=steps, pbar_description=None)
    trainer = peft_trainer.PeftTrainer(model, optax.adam(1e-2), config)

    def gen(x):
        return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
                "positions": sft_utils.build_positions_from_mask(x.input_mask),
                "attention_mask": sft_utils.make_causal_attn_mask(x.input_mask)}
    trainer = trainer.with_gen_model_input_fn(gen)
    data = [peft_trainer.TrainingInput(*_inputs(seed)) for seed in range(steps)]
    trainer.train(data)
    return trainer.metrics_logger.get_metric_history("", "loss", "train"), model


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sft", "lora"])
def test_peft_trainer_losses_match_patched_vs_unpatched(lora):
    base = _llama()
    patched = nnx.clone(base)
    stt.apply_kernels(patched)
    ref, _ = _train(base, lora=lora)
    got, model = _train(patched, lora=lora)
    assert len(ref) == 3
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert stt.is_patched(model.layers[0].attn)


class _Tokenizer:
    """A word-level tokenizer over the test vocabulary (ids ``0..V-1``; 0 pad, 1 bos, 2 eos)."""

    def encode(self, text, **kwargs):
        return [int(w) for w in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return 1

    def eos_id(self):
        return 2

    def pad_id(self):
        return 0


def test_sampler_generates_identical_tokens():
    base = _qwen3()
    patched = nnx.clone(base)
    stt.apply_kernels(patched)
    cache = sampler_lib.CacheConfig(cache_size=32, num_layers=1, num_kv_heads=2, head_dim=8)
    prompts = ["5 9 11 3 7", "4 8"]
    outs = []
    for model in (base, patched):
        sampler = sampler_lib.Sampler(model, _Tokenizer(), cache)
        result = sampler(prompts, max_generation_steps=6, temperature=0.0, echo=False)
        outs.append(result.text)
    assert outs[0] == outs[1]
    assert all(len(t.split()) > 0 for t in outs[0])


def test_unknown_family_is_an_error_naming_it():
    class Gemma(nnx.Module):
        pass
    with pytest.raises(ValueError, match=r"unknown Tunix model family Gemma .*llama3 .*qwen3"):
        stt.apply_kernels(Gemma())
