"""stellax as vLLM's attention backend, end to end on vLLM's CPU engine.

Marked ``vllm`` (not in the default tier: engine start-ups take minutes on
two cores). Runs in the venv `vllm_env.py` creates; skipped, with the setup
command, when it is missing. ``benchmarks/vllm_offline.py`` runs every scenario
(a Llama-style GQA model, a Mistral with a 16-token sliding window and a
GPT-OSS-style model with attention sinks and alternating windowed layers;
prefix caching off, on (a second pass over cached pages) and chunked prefill
mixed with decodes) once with ``attention_backend="STELLAX"`` and once with
vLLM's own ``CPU_ATTN``; greedy token ids must be identical and the logprobs
within 1e-3. Start-up refusals run vLLM too: a quantized cache dtype and an
ALiBi model must stop the engine before any request, naming the option.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_env  # noqa: E402

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "benchmarks" / "vllm_offline.py"
RUNS = [f"{m}/{s}" for m in ("llama", "mistral", "gptoss") for s in ("plain", "prefix", "chunked")]
LOGPROB_TOL = 1e-3


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
    assert ours["token_ids"] == theirs["token_ids"]
    worst = max(abs(a - b) for x, y in zip(ours["logprobs"], theirs["logprobs"]) for a, b in zip(x, y, strict=True))
    assert worst <= LOGPROB_TOL, f"{name}: logprobs differ by up to {worst:.2e}"


def test_the_window_changes_the_generation(results):
    """Mistral is the Llama with a 16-token window: generations of prompts
    longer than the window differ, so a backend that ignored it would fail the
    comparison above (the models share their seeded weights)."""
    runs = results["STELLAX"]["runs"]
    assert runs["mistral/plain"]["token_ids"] != runs["llama/plain"]["token_ids"]


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


@pytest.mark.parametrize("kind, option", [("fp8", "kv_cache_dtype"), ("alibi", "alibi_slopes")])
def test_unsupported_options_are_refused_at_start_up(vllm_python, tmp_path, kind, option):
    (tmp_path / "benchmarks_runner.py").write_text(RUNNER.read_text())
    (tmp_path / "refuse.py").write_text(REFUSAL)
    run = subprocess.run([vllm_python, "refuse.py", kind, str(tmp_path)], capture_output=True, text=True,
                         env=_env(), cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "REFUSED" in run.stdout, run.stdout[-2000:]
    assert f"{option}: " in run.stdout and "stellax" in run.stdout.lower(), run.stdout[-2000:]
