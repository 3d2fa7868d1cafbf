"""The linear-attention chip benchmark (benchmarks/linear_attention_tpu.py) and the long-T error
measurement (benchmarks/linear_attention_bf16_error.py) run on the CPU (--dry-run: tiny cases,
the Mosaic kernels interpreted), so both are ready for their runs: every contender is timed and
checked against the float32 XLA path, rows in the results schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _run(script, out, *extra):
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--dry-run", "--out", str(out), *extra],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_chip_benchmark_dry_run(tmp_path):
    doc = _run("linear_attention_tpu.py", tmp_path / "la.json", "--ops", "ssd")
    assert doc["format"] == "stellax-linear-attention-tpu" and doc["environment"]["dry_run"]
    for pass_ in ("fwd", "fwd+bwd"):
        group = [r for r in doc["rows"] if r["pass"] == pass_]
        assert [r["contender"] for r in group] == ["xla:chunked", "stellax:mosaic_tpu", "stellax:mosaic_tpu[f32]",
                                                   "stellax:mosaic_tpu[policy=three_pass]"]
        assert [r["peer"] for r in group] == [True, False, False, False]
        assert group[1]["config"].startswith("default(") and group[1]["best"]
        for r in group:
            assert r["error"] is None and r["skipped"] is None and r["ms"] > 0 and r["tflops"] > 0, r
            assert r["rel_l2"] < 2e-2, r  # against the XLA path in float32


def test_error_measurement_dry_run(tmp_path):
    doc = _run("linear_attention_bf16_error.py", tmp_path / "err.json")
    rows = doc["rows"]
    assert [r["contender"] for r in rows] == ["xla", "kernel"]
    for r in rows:
        assert set(r["errors"]) == {"out", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}
        assert max(r["errors"].values()) < 2e-2, r
