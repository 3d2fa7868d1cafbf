"""The stage-ablation chip benchmark of the Mosaic TPU linear-attention forward kernel
(benchmarks/linear_attention_ablation_tpu.py) runs on the CPU (--dry-run: tiny shapes, the kernel
interpreted): GDN with nothing and with the solve left out, KDA with its channel scores left out and
SSD, rows in the results schema with the model's time; the main set is the first nine cases."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "benchmarks/linear_attention_ablation_tpu.py", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def test_ablation_dry_run(tmp_path):
    out = tmp_path / "ablation.json"
    proc = _run("--dry-run", "--out", str(out), "--cases", "0,2,8,13", "--budget", "1000")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-linear-attention-ablation-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert [(r["op"], r["skip"]) for r in rows] == [
        ("chunk_gated_delta_rule", ""), ("chunk_gated_delta_rule", "solve"), ("chunk_kda", "spans"), ("ssd", "")]
    for r in rows:
        assert r["error"] is None and r["skipped"] is None and r["ms"] > 0 and r["model_ms"] > 0, r
        assert r["stage"] == "kernel:fwd" and r["contender"] == "stellax:mosaic_tpu" and not r["peer"]
        assert (r["tflops"] is None) == bool(r["skip"]), r
    assert rows[0]["config"] == "explicit(64/128/2)"


def test_ablation_list_marks_the_main_set(tmp_path):
    proc = _run("--list", "--out", str(tmp_path / "unused.json"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert sum(" main " in line for line in lines) == 9 and len(lines) == 16, proc.stdout
