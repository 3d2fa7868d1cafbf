"""The GPU suite script runs end to end on the CPU (--dry-run: interpreted
kernels, tiny shapes) so it cannot rot between GPU sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_suite_dry_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--families", "norm",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    results = [f for f in files if f.startswith("stellax-gpu-suite-") and f.endswith("-dry-run.json")]
    assert len(results) == 1, files
    data = json.loads((tmp_path / results[0]).read_text())
    assert data["format"] == "stellax-gpu-suite" and not data["errors"]
    assert list(data["stages"]) == ["environment", "calibrate", "check", "headline", "autotune", "bench"]
    assert all(isinstance(t, (int, float)) for t in data["stages"].values()), data["stages"]
    assert data["environment"]["jax"] and data["calibration"]["matmul"]["flops_per_s"] > 0
    checked = {(c["op"], c["implementation"]) for c in data["check"] if c["passed"]}
    assert {("layer_norm", "triton"), ("layer_norm", "xla"), ("layer_norm_backward", "triton")} <= checked
    assert [e["op"] for e in data["autotune"]["entries"]] == ["layer_norm"]
    assert data["autotune"]["exported_to"] in files
    timed = {(r["op"], r["implementation"]) for r in data["bench"]["records"] if r["median_ms"]}
    assert {("layer_norm", "triton"), ("layer_norm", "xla")} <= timed
    assert any(f.startswith("summary-") and f.endswith(".md") for f in files)
    assert "check:" in proc.stdout and "median ms" in proc.stdout and "headline case" in proc.stdout
    # Every headline case ran (interpreted): stellax timed, peers measured or reported unavailable.
    headline = data["headline"]
    assert [h["op"] for h in headline] == ["attention"] * 4 + ["ragged_dot", "paged_attention",
                                                               "chunk_gated_delta_rule"]
    assert all(h["stellax"]["median_ms"] > 0 for h in headline), headline
    attention = headline[0]
    assert set(attention["peers"]) == {"jax.nn (cudnn)", "torch SDPA"}
    assert attention["prediction"]["fraction_of_roofline"] > 0
    assert set(headline[4]["peers"]) == {"jax.lax.ragged_dot", "dense matmul (same FLOPs)"}
    assert headline[4]["peers"]["jax.lax.ragged_dot"]["stellax_speedup"] > 0


def test_gpu_suite_on_a_slow_device_keeps_the_headline_first(tmp_path):
    """Every second counted 50 times (a device 50× slower): the budget runs out during the
    headline stage, and what was measured is its first cases, in order, after the numerics."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--families", "norm",
                           "--skip", "calibrate,autotune,bench", "--time-scale", "50", "--budget", "600",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = [p for p in tmp_path.iterdir() if p.name.startswith("stellax-gpu-suite-")]
    data = json.loads(result.read_text())
    assert data["time_scale"] == 50 and not data["errors"], data["errors"]
    assert data["stage_end_s"]["check"] <= data["stage_end_s"]["headline"]
    headline = data["headline"]
    measured = [bool((h.get("stellax") or {}).get("median_ms")) for h in headline]
    assert measured[0], headline[0]
    assert measured == sorted(measured, reverse=True), measured  # a prefix was measured, the rest cut
    assert not all(measured) and headline[-1]["skipped"] == "time budget exhausted"
    # The cases measured after the first started before the headline deadline (40% of the budget
    # after the reserve, from the end of the numerics).
    starts = [h["finished_at_s"] - h["elapsed_s"] for h, m in zip(headline, measured) if m]
    assert all(t <= 0.40 * (600 - 10) + data["stage_end_s"]["check"] for t in starts[1:])
