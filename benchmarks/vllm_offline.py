"""Offline vLLM runs on tiny random-weight models, with any attention backend.

Runs in the vLLM virtual environment (``python tests/integrations/vllm_env.py``
creates it), never in stellax's own: vLLM pins its own torch / transformers.
Used by the end-to-end tests (tests/integrations/test_vllm_e2e.py, which
compare ``--backend STELLAX`` with ``--backend CPU_ATTN``) and, with
``--throughput``, for the tokens/s table in docs/integrations.md ("vLLM").

    python benchmarks/vllm_offline.py --backend STELLAX --out runs.json [--models llama,mistral] [--throughput]
                                      [--kv-cache-dtype fp8 [--kv-scales 0.05,0.02]]

Models are built with `transformers` from configs written here (no
downloads), saved next to the output and loaded by vLLM from disk, with
``skip_tokenizer_init=True`` and token-id prompts. vLLM's ``load_format="dummy"``
is not used for the comparisons: it draws weights so small that every logit
is equal, which would make any backend "agree". Each scenario is one
``vllm.LLM`` in this process (engine and worker in-process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``).

Scenarios (each on each model):
* ``plain``: 8 prompts of 3..90 tokens, greedy, 12 new tokens, prefix caching off.
* ``prefix``: prompts sharing a 70-token prefix, prefix caching on, generated
  twice (the second pass reads the cached pages of the first).
* ``chunked``: the plain prompts with ``max_num_batched_tokens=32``: long
  prompts are prefilled in chunks mixed with other requests' decodes.
* ``--kv-cache-dtype``: vLLM's cache dtype for every scenario (``fp8``,
  ``fp8_e5m2``, ...); ``--kv-scales K,V`` then sets every attention layer's
  per-tensor ``k_scale`` / ``v_scale`` after start-up, as an fp8 checkpoint's
  calibrated KV scales would (both backends read the same layer fields).
* ``throughput`` (``--throughput``): the plain prompts repeated to
  ``--num-prompts``, timed after an untimed warm-up pass; ``generated_tokens /
  seconds`` is the tokens/s in docs/integrations.md.

Output JSON: ``{"vllm": version, "backend": name, "runs": {"<model>/<scenario>":
{"token_ids": [[...], ...], "logprobs": [[...], ...], "runner_up_ids": [[...], ...],
"runner_up_logprobs": [[...], ...], "seconds": s, "cpu_seconds": s, "generated_tokens": n}}}``
(``logprobs``: the logprob of each generated token; ``runner_up_*``: the most likely other token at
each step and its logprob, so a comparison can tell a near-tie from a real difference; ``cpu_seconds``: the
process's CPU time over the same span, all threads: less sensitive than wall time to other load on
a shared machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

VOCAB = 512
BLOCK_SIZE = 32


def model_configs():
    """Name → a transformers config of a tiny decoder (GQA: 4 query heads, 2 kv heads, head_dim 32).

    ``gptoss`` is GPT-OSS's architecture: sinks, alternating windowed / full
    layers and a MoE MLP (vLLM's CPU build runs it unquantized in float32)."""
    from transformers import GptOssConfig, LlamaConfig, MistralConfig

    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                  initializer_range=0.2, tie_word_embeddings=False, torch_dtype="float32")
    return {
        "llama": LlamaConfig(**common),
        # A 16-token window: prompts longer than it generate differently from the same-weight Llama.
        "mistral": MistralConfig(**common, sliding_window=16),
        # Attention sinks (one learned logit per head) on every layer, a 16-token window on every other
        # layer (two KV-cache groups), a 4-expert MoE MLP.
        "gptoss": GptOssConfig(**{**common, "intermediate_size": 128}, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=16),
    }


def build_model(name: str, config, root: Path) -> Path:
    """Save a random-weight model (seeded) under ``root/name``; returns its path."""
    import torch
    from transformers import AutoModelForCausalLM

    path = root / name
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(path)
    return path


def prompts(kind: str):
    """Token-id prompts of different lengths (seeded)."""
    import random

    rng = random.Random(1234)
    draw = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]
    if kind == "prefix":
        shared = draw(70)
        return [shared + draw(n) for n in (1, 5, 17, 33)]
    return [draw(n) for n in (3, 9, 16, 17, 31, 50, 70, 90)]


def run_scenario(model_path: Path, backend: str, scenario: str, *, max_tokens: int, num_prompts: int | None = None,
                 kv_cache_dtype: str = "auto", kv_scales: tuple[float, float] | None = None):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=str(model_path), skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=512,
                  block_size=BLOCK_SIZE, enforce_eager=True, distributed_executor_backend="uni",
                  attention_backend=backend, enable_prefix_caching=scenario == "prefix", max_num_seqs=16,
                  # the machine's memory is shared: a small reservation and a 64 MiB cache.
                  gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv_cache_dtype)
    if scenario == "chunked":
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=32)
    llm = LLM(**kwargs)
    if kv_scales is not None:
        _set_kv_scales(llm, *kv_scales)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True, detokenize=False)
    batch = prompts("prefix" if scenario == "prefix" else "plain")
    if num_prompts is not None:
        batch = (batch * (num_prompts // len(batch) + 1))[:num_prompts]
    passes = 2 if scenario == "prefix" else 1
    requests = [TokensPrompt(prompt_token_ids=p) for p in batch]
    if num_prompts is not None:  # throughput: a warm-up pass first (stellax compiles its padded shapes once)
        llm.generate(requests, params, use_tqdm=False)
    token_ids, logprobs, runner_up_ids, runner_up_logprobs = [], [], [], []
    start, cpu_start = time.perf_counter(), time.process_time()
    generated = 0
    for _ in range(passes):
        outs = llm.generate(requests, params, use_tqdm=False)
        for out in outs:
            c = out.outputs[0]
            token_ids.append(list(c.token_ids))
            logprobs.append([float(step[t].logprob) for t, step in zip(c.token_ids, c.logprobs)])
            others = [max((lp for lp in step.items() if lp[0] != t), key=lambda lp: lp[1].logprob)
                      for t, step in zip(c.token_ids, c.logprobs)]
            runner_up_ids.append([int(o) for o, _ in others])
            runner_up_logprobs.append([float(lp.logprob) for _, lp in others])
            generated += len(c.token_ids)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    backend_used = _backend_class(llm)
    del llm
    gc.collect()
    return {"token_ids": token_ids, "logprobs": logprobs, "runner_up_ids": runner_up_ids,
            "runner_up_logprobs": runner_up_logprobs, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "generated_tokens": generated,
            "backend_class": backend_used}


def _set_kv_scales(llm, k_scale: float, v_scale: float) -> None:
    """Every attention layer's per-tensor fp8 scales (the fields vLLM's fp8 checkpoints load)."""
    from vllm.model_executor.layers.attention import Attention

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise RuntimeError("--kv-scales: no vllm Attention layer found in the model")
    for layer in layers:
        layer._k_scale.fill_(k_scale)
        layer._v_scale.fill_(v_scale)
        layer._k_scale_float, layer._v_scale_float = float(k_scale), float(v_scale)


def _backend_class(llm) -> str | None:
    """The attention backend class the in-process engine built (None if it cannot be seen)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner.attn_groups[0][0].backend.__name__
    except Exception:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="vLLM attention backend: STELLAX or CPU_ATTN")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--models", default="llama,mistral,gptoss")
    parser.add_argument("--scenarios", default="plain,prefix,chunked")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--throughput", action="store_true",
                        help="one extra timed 'plain' run per model with --num-prompts prompts, after a warm-up run")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype for every scenario")
    parser.add_argument("--kv-scales", default=None, help="K,V: per-tensor fp8 scales set on every attention layer")
    args = parser.parse_args(argv)
    scales = None if args.kv_scales is None else tuple(float(x) for x in args.kv_scales.split(","))
    cache = dict(kv_cache_dtype=args.kv_cache_dtype, kv_scales=scales)

    import vllm

    configs = model_configs()
    root = args.out.parent / "vllm_models"
    root.mkdir(parents=True, exist_ok=True)
    result = {"vllm": vllm.__version__, "backend": args.backend, "runs": {}}
    for name in args.models.split(","):
        path = build_model(name, configs[name], root)
        for scenario in args.scenarios.split(","):
            if scenario:
                result["runs"][f"{name}/{scenario}"] = run_scenario(path, args.backend, scenario,
                                                                    max_tokens=args.max_tokens, **cache)
        if args.throughput:
            result["runs"][f"{name}/throughput"] = run_scenario(path, args.backend, "plain", max_tokens=args.max_tokens,
                                                                num_prompts=args.num_prompts, **cache)
        args.out.write_text(json.dumps(result))
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
