"""The norm TPU benchmark (benchmarks/norm_tpu.py) runs on the CPU (--dry-run, interpreted
kernels, tiny rows), so it is ready for the chip: XLA and every stellax contender time, both
passes, match XLA's outputs and gradients, and land as rows of the suite's results schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "gbps", "pct_peak", "device", "date"}


def test_dry_run_times_and_checks_every_contender(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "norm.json"
    proc = subprocess.run([sys.executable, "benchmarks/norm_tpu.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "summary" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-norm-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert rows and all(SCHEMA <= set(r) for r in rows)
    assert {r["op"] for r in rows} == {"rms_norm", "layer_norm"}
    assert {r["pass"] for r in rows} == {"fwd", "fwd+bwd"}
    for r in rows:
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["pct_peak"] > 0 and r["vs_xla"] > 0, r
        assert r["max_rel_err"] < 3e-2 and r["rel_l2"] < 1e-2, r
    for case in {r["case"] for r in rows}:
        for pass_ in ("fwd", "fwd+bwd"):
            group = [r for r in rows if r["case"] == case and r["pass"] == pass_]
            # XLA (the peer and reference), stellax's default config (its own pick), an explicit block size.
            assert [r["contender"] for r in group if r["peer"]] == ["stellax:xla"]
            defaults = [r for r in group if r["default"]]
            assert len(defaults) == 1 and defaults[0]["config"].startswith("default(block_rows=")
            assert any(r["config"].startswith("block_rows=") for r in group)
    # The byte model is the same for every contender of a case and pass: gbps · ms is constant.
    for case in {r["case"] for r in rows}:
        moved = {round(r["gbps"] * r["ms"], 3) for r in rows if r["case"] == case and r["pass"] == "fwd"}
        assert len(moved) == 1, moved
