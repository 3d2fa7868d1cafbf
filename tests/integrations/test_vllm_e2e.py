"""stellax as vLLM's attention backend, end to end on vLLM's CPU engine.

Marked ``vllm`` (not in the default tier: engine start-ups take minutes on
two cores). Runs in the venv `vllm_env.py` creates; skipped, with the setup
command, when it is missing. ``benchmarks/vllm_offline.py`` runs every scenario
(a Llama-style GQA model, a Mistral with a 16-token sliding window and a
GPT-OSS-style model with attention sinks and alternating windowed layers;
prefix caching off, on (a second pass over cached pages) and chunked prefill
mixed with decodes) once with ``attention_backend="STELLAX"`` and once with
vLLM's own ``CPU_ATTN``; greedy token ids must be identical and the logprobs
within 1e-3, except that a sequence may part ways at a near-tie: a step where
both backends rank the two tokens within 2e-3 of each other and each picks the
other's runner-up (two correct float32 attentions can order such a pair either
way; the rest of that sequence then continues from different tokens and is not
compared). The same for vLLM's fp8 KV caches (``kv_cache_dtype="fp8"`` and
``"fp8_e5m2"``, with unit and with calibrated-style per-tensor scales), which
vLLM's CPU backend runs too: both backends write the same codes (checked
byte for byte against vLLM's own cache-write op) and read them with the
layer's ``k_scale`` / ``v_scale``. Start-up refusals run vLLM too: a cache
dtype stellax cannot read (``int8_per_token_head``) and an ALiBi model must
stop the engine before any request, naming the option.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_env  # noqa: E402

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "benchmarks" / "vllm_offline.py"
RUNS = [f"{m}/{s}" for m in ("llama", "mistral", "gptoss") for s in ("plain", "prefix", "chunked")]
LOGPROB_TOL = 1e-3
#: the widest top-1/top-2 logprob gap that two backends within LOGPROB_TOL of each other can order differently.
TIE_GAP = 2 * LOGPROB_TOL


@pytest.fixture(scope="module")
def vllm_python():
    problem = vllm_env.check()
    if problem:
        pytest.skip(f"{problem}; create it with: {vllm_env.setup_command()}")
    return str(vllm_env.python_path())


def _env():
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("PYTHONPATH", None)
    return env


def _worst_logprob_gap(ours, theirs, name):
    """The largest logprob difference over the steps where both backends generated the same tokens.

    Token ids must agree step by step; the one allowed parting is a near-tie
    (see the module docstring), checked on both sides: the two tokens swap
    places between the backends and each backend ranks them within TIE_GAP.
    A sequence is compared up to and including that step.
    """
    worst, partings = 0.0, []
    for seq, (a_ids, b_ids) in enumerate(zip(ours["token_ids"], theirs["token_ids"], strict=True)):
        assert len(a_ids) == len(b_ids), f"{name} sequence {seq}: {len(a_ids)} tokens vs {len(b_ids)}"
        for step, (a, b) in enumerate(zip(a_ids, b_ids)):
            if a != b:
                a_gap = ours["logprobs"][seq][step] - ours["runner_up_logprobs"][seq][step]
                b_gap = theirs["logprobs"][seq][step] - theirs["runner_up_logprobs"][seq][step]
                assert ours["runner_up_ids"][seq][step] == b and theirs["runner_up_ids"][seq][step] == a, (
                    f"{name} sequence {seq} step {step}: stellax picked {a} (runner-up "
                    f"{ours['runner_up_ids'][seq][step]}), CPU_ATTN picked {b} (runner-up "
                    f"{theirs['runner_up_ids'][seq][step]}): not a swap of the top two")
                assert max(a_gap, b_gap) <= TIE_GAP, (
                    f"{name} sequence {seq} step {step}: stellax picked {a}, CPU_ATTN picked {b}, but the "
                    f"top-two gaps are {a_gap:.2e} / {b_gap:.2e} (> {TIE_GAP:.0e}): not a near-tie")
                worst = max(worst, abs(ours["logprobs"][seq][step] - theirs["runner_up_logprobs"][seq][step]),
                            abs(ours["runner_up_logprobs"][seq][step] - theirs["logprobs"][seq][step]))
                partings.append(f"sequence {seq} step {step} (gaps {a_gap:.1e} / {b_gap:.1e})")
                break
            worst = max(worst, abs(ours["logprobs"][seq][step] - theirs["logprobs"][seq][step]))
    if partings:
        print(f"{name}: parted at near-ties: {', '.join(partings)}")
    return worst


@pytest.fixture(scope="module")
def results(vllm_python, tmp_path_factory):
    """backend name → the runner's JSON (both backends, every scenario)."""
    out = {}
    root = tmp_path_factory.mktemp("vllm")
    for backend in ("CPU_ATTN", "STELLAX"):
        path = root / f"{backend}.json"
        run = subprocess.run([vllm_python, str(RUNNER), "--backend", backend, "--out", str(path)],
                             capture_output=True, text=True, env=_env(), cwd=root, timeout=1500)
        assert run.returncode == 0, f"{backend} run failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
        out[backend] = json.loads(path.read_text())
    return out


def test_the_selected_backends_ran(results):
    for name in RUNS:
        assert results["STELLAX"]["runs"][name]["backend_class"] == "StellaxAttentionBackend", name
        assert results["CPU_ATTN"]["runs"][name]["backend_class"] == "CPUAttentionBackend", name


@pytest.mark.parametrize("name", RUNS)
def test_same_tokens_and_logprobs_as_vllm_cpu_attention(results, name):
    ours, theirs = results["STELLAX"]["runs"][name], results["CPU_ATTN"]["runs"][name]
    assert ours["generated_tokens"] == theirs["generated_tokens"] > 0
    worst = _worst_logprob_gap(ours, theirs, name)
    assert worst <= LOGPROB_TOL, f"{name}: logprobs differ by up to {worst:.2e}"


def test_the_window_changes_the_generation(results):
    """Mistral is the Llama with a 16-token window: generations of prompts
    longer than the window differ, so a backend that ignored it would fail the
    comparison above (the models share their seeded weights)."""
    runs = results["STELLAX"]["runs"]
    assert runs["mistral/plain"]["token_ids"] != runs["llama/plain"]["token_ids"]


# -- fp8 KV caches ---------------------------------------------------------------------------
#: name → runner arguments: vLLM's fp8 cache dtypes on the same tiny models (scales 1, or set on every layer
#: as an fp8 checkpoint's calibrated KV scales would be).
FP8_CONFIGS = {
    "fp8": ["--kv-cache-dtype", "fp8", "--models", "llama,gptoss", "--scenarios", "plain,prefix,chunked"],
    "fp8_e5m2": ["--kv-cache-dtype", "fp8_e5m2", "--models", "llama", "--scenarios", "plain"],
    "fp8_scaled": ["--kv-cache-dtype", "fp8", "--kv-scales", "0.05,0.02", "--models", "mistral",
                   "--scenarios", "plain,chunked"],
}
FP8_RUNS = [("fp8", f"{m}/{s}") for m in ("llama", "gptoss") for s in ("plain", "prefix", "chunked")] + [
    ("fp8_e5m2", "llama/plain"), ("fp8_scaled", "mistral/plain"), ("fp8_scaled", "mistral/chunked")]


@pytest.fixture(scope="module")
def fp8_results(vllm_python, tmp_path_factory):
    """config → backend → the runner's JSON (plus ``wall_seconds`` of the whole invocation)."""
    out = {}
    root = tmp_path_factory.mktemp("vllm_fp8")
    for config, args in FP8_CONFIGS.items():
        for backend in ("CPU_ATTN", "STELLAX"):
            path = root / f"{config}-{backend}.json"
            start = time.perf_counter()
            run = subprocess.run([vllm_python, str(RUNNER), "--backend", backend, "--out", str(path), *args],
                                 capture_output=True, text=True, env=_env(), cwd=root, timeout=1500)
            assert run.returncode == 0, f"{config} {backend} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
            out.setdefault(config, {})[backend] = {**json.loads(path.read_text()),
                                                   "wall_seconds": time.perf_counter() - start}
            print(f"{config} {backend}: {out[config][backend]['wall_seconds']:.0f} s")
    return out


@pytest.mark.parametrize("config, name", FP8_RUNS, ids=[f"{c}-{n}" for c, n in FP8_RUNS])
def test_fp8_cache_same_tokens_and_logprobs_as_vllm_cpu_attention(fp8_results, config, name):
    ours, theirs = fp8_results[config]["STELLAX"]["runs"][name], fp8_results[config]["CPU_ATTN"]["runs"][name]
    assert ours["backend_class"] == "StellaxAttentionBackend" and theirs["backend_class"] == "CPUAttentionBackend"
    assert ours["generated_tokens"] == theirs["generated_tokens"] > 0
    worst = _worst_logprob_gap(ours, theirs, f"{config} {name}")
    print(f"{config} {name}: logprobs differ by up to {worst:.2e}")
    assert worst <= LOGPROB_TOL, f"{config} {name}: logprobs differ by up to {worst:.2e}"


def test_fp8_formats_are_honoured(fp8_results):
    """e4m3 and e5m2 codes of the same model give different logprobs on both backends, so neither ignores the
    format (the scales are covered by the scaled runs' comparison with CPU_ATTN above)."""
    for backend in ("STELLAX", "CPU_ATTN"):
        e4m3 = fp8_results["fp8"][backend]["runs"]["llama/plain"]
        e5m2 = fp8_results["fp8_e5m2"][backend]["runs"]["llama/plain"]
        gap = max(abs(a - b) for x, y in zip(e4m3["logprobs"], e5m2["logprobs"]) for a, b in zip(x, y, strict=True))
        assert gap > 10 * LOGPROB_TOL, backend


CODES = """
import sys, torch
from vllm import _custom_ops as ops
from stellax.integrations.vllm import fp8
from stellax.integrations.vllm.metadata import paged_kv_view
torch.manual_seed(0)
NB, H, PS, D, T = 4, 2, 32, 32, 100
bad = 0
for dt in ("fp8", "fp8_e5m2"):
    for scale in (1.0, 0.037, 3.7):
        k = torch.randn(T, H, D) * torch.logspace(-9, 3, T)[:, None, None]
        v = torch.randn(T, H, D) * torch.logspace(3, -9, T)[:, None, None]
        k[0, 0, :4] = torch.tensor([0.0, -0.0, float("nan"), -1e9])
        slots = torch.randperm(NB * PS)[:T].to(torch.int64)
        cache = torch.zeros(NB, H, 2 * PS, D, dtype=torch.uint8)       # vLLM CPU_ATTN's own write
        kc, vc = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec", k_scale=scale, v_scale=scale, kv_cache_dtype=dt)
        # CPU_ATTN's in-page order: keys [D, PS] (column-major), values [PS, D] per block and head.
        blk, off = slots // PS, slots % PS
        theirs_k = kc.reshape(NB, H, D, PS)[blk, :, :, off]                  # [T, H, D]
        theirs_v = vc[blk, :, off, :]
        ours = torch.zeros(NB * H * PS * 2 * D, dtype=torch.uint8)      # the stellax backend's write
        pages = paged_kv_view(ours.view(NB, H, PS, 2 * D), block_size=PS, num_kv_heads=H, head_size=D,
                              dtype=torch.uint8)
        fp8.write_kv(pages, k, v, slots, scale, scale, dt)
        mine_k, mine_v = pages[blk, off, 0], pages[blk, off, 1]
        n = int((mine_k != theirs_k).sum() + (mine_v != theirs_v).sum())
        print(dt, scale, "mismatching codes:", n, "of", 2 * k.numel())
        bad += n
sys.exit(1 if bad else 0)
"""


def test_fp8_cache_write_equals_vllm_cpu_codes(vllm_python, tmp_path):
    """The stellax backend's fp8 write (`fp8.write_kv`) stores, for every token, head and channel, the byte
    vLLM's CPU backend stores (its `cpu_attn_reshape_and_cache`, truncating), for e4m3 and e5m2, scales 1 and
    not, values from 1e-9 (subnormals) to 1e9 (saturation), ±0 and NaN."""
    (tmp_path / "codes.py").write_text(CODES)
    run = subprocess.run([vllm_python, "codes.py"], capture_output=True, text=True, env=_env(), cwd=tmp_path,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("mismatching codes: 0 of") == 6, run.stdout


def test_prefix_pass_reuses_the_cache_with_the_same_tokens(results):
    """The prefix scenario generates the same prompts twice; the second pass
    reads pages cached by the first and must generate the same tokens."""
    for name in ("llama/prefix", "mistral/prefix", "gptoss/prefix"):
        ids = results["STELLAX"]["runs"][name]["token_ids"]
        half = len(ids) // 2
        assert ids[:half] == ids[half:], name


REFUSAL = """
import sys
from vllm import LLM
from benchmarks_runner import build_model, model_configs
from pathlib import Path
import transformers
kind = sys.argv[1]
root = Path(sys.argv[2])
cfg = model_configs()["llama"]
kwargs = {}
if kind == "alibi":
    cfg = transformers.FalconConfig(vocab_size=512, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   alibi=True, new_decoder_architecture=False, multi_query=False)
    name = "falcon_alibi"
else:
    name = "llama"
    kwargs["kv_cache_dtype"] = kind
path = build_model(name, cfg, root)
try:
    LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", attention_backend="STELLAX", block_size=32,
        enforce_eager=True, distributed_executor_backend="uni", gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=64 << 20, max_model_len=256, **kwargs)
except Exception as e:
    chain = []
    while e is not None:
        chain.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    print("REFUSED", " | ".join(chain))
    sys.exit(0)
print("STARTED")
"""


@pytest.mark.parametrize("kind, option", [("int8_per_token_head", "kv_cache_dtype"), ("alibi", "alibi_slopes")])
def test_unsupported_options_are_refused_at_start_up(vllm_python, tmp_path, kind, option):
    (tmp_path / "benchmarks_runner.py").write_text(RUNNER.read_text())
    (tmp_path / "refuse.py").write_text(REFUSAL)
    run = subprocess.run([vllm_python, "refuse.py", kind, str(tmp_path)], capture_output=True, text=True,
                         env=_env(), cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "REFUSED" in run.stdout, run.stdout[-2000:]
    assert f"{option}: " in run.stdout and "stellax" in run.stdout.lower(), run.stdout[-2000:]
