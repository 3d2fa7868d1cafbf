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
    assert set(data["stages"]) == {"environment", "calibrate", "check", "autotune", "bench"}
    assert all(isinstance(t, (int, float)) for t in data["stages"].values()), data["stages"]
    assert data["environment"]["jax"] and data["calibration"]["matmul"]["flops_per_s"] > 0
    checked = {(c["op"], c["implementation"]) for c in data["check"] if c["passed"]}
    assert {("layer_norm", "triton"), ("layer_norm", "xla"), ("layer_norm_backward", "triton")} <= checked
    assert [e["op"] for e in data["autotune"]["entries"]] == ["layer_norm"]
    assert data["autotune"]["exported_to"] in files
    timed = {(r["op"], r["implementation"]) for r in data["bench"]["records"] if r["median_ms"]}
    assert {("layer_norm", "triton"), ("layer_norm", "xla")} <= timed
    assert any(f.startswith("summary-") and f.endswith(".md") for f in files)
    assert "check:" in proc.stdout and "median ms" in proc.stdout
