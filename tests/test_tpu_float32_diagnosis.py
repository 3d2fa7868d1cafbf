"""The float32 diagnosis script (benchmarks/tpu_float32_diagnosis.py) runs on the
CPU (--dry-run), so it is ready on a TPU: its function table measures stellax's
float32 functions through XLA and inside an (interpreted) Pallas kernel, and its
check arrangements swap the chip's functions in and out."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_run_measures_functions_and_arrangements(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "diag.json"
    proc = subprocess.run([sys.executable, "benchmarks/tpu_float32_diagnosis.py", "--dry-run", "--sections",
                           "functions,checks", "--threads", "1", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["host_memory"]["rss_gb_after_devices"] > 0
    for name in ("float32_exp", "float32_log", "float32_tanh", "float32_softplus"):
        for path in ("xla", "mosaic"):
            assert result["functions"][name][path]["max"] < 3e-7, (name, path)
    assert result["functions"]["matmul_highest"]["rel_l2"] < 1e-6
    arrangements = {row["arrangement"] for row in result["checks"]}
    assert len(arrangements) == 3
    ran = [row for row in result["checks"] if row["rel_l2"] is not None]
    assert ran and all(row["passed"] for row in ran)
