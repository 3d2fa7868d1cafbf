"""The GLU TPU benchmark (benchmarks/glu_tpu.py) runs on the CPU (--dry-run, interpreted kernels,
a tiny ragged case), so it is ready for the chip: XLA's two matmuls and stellax's kernels at their
own and an explicit config time both passes, match XLA, and land as rows of the results schema, with
stacked weights and with a (gate, up) pair (--weights pair)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("weights", ["stacked", "pair"])
def test_dry_run_times_and_checks_every_contender(tmp_path, weights):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "glu.json"
    command = [sys.executable, "benchmarks/glu_tpu.py", "--dry-run", "--out", str(out), "--weights", weights]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-glu-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert all(r["case"].endswith(" pair") == (weights == "pair") for r in rows)
    for pass_, flops in (("fwd", 4.0 * 200 * 256 * 384), ("fwd+bwd", 12.0 * 200 * 256 * 384)):
        group = [r for r in rows if r["pass"] == pass_]
        assert [r["contender"] for r in group] == ["xla:jnp", "stellax:mosaic_tpu", "stellax:mosaic_tpu"]
        assert group[1]["config"].startswith("default(") and group[2]["config"] == "128x128x128"
        assert [r["default"] for r in group] == [False, True, False]  # stellax's own pick, and only it
        assert [r["peer"] for r in group] == [True, False, False]
        for r in group:
            assert r["error"] is None and r["skipped"] is None, r
            assert r["ms"] > 0 and r["vs_xla"] > 0 and abs(r["tflops"] * r["ms"] * 1e9 - flops) < 1e-3 * flops, r
            assert r["max_rel_err"] < 2e-2 and r["rel_l2"] < 1e-2, r  # bf16 outputs and gradients vs XLA
        assert sum(r["best"] for r in group if not r["peer"]) == 1
