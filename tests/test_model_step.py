"""The one-chip model benchmark (benchmarks/model_step.py) runs on the CPU (--dry-run: the tiny
preset, stellax dispatching as on a v5e with its kernels interpreted): both variants train a step,
their losses agree on the same weights and batch, the stellax variant runs stellax's kernels and the
plain one none, and the rows carry the suite's results schema with tokens/s and MFU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "pct_peak", "bound", "device",
          "date", "skipped", "error"}


def test_dry_run_trains_both_variants_and_their_losses_agree(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "model_step.json"
    proc = subprocess.run([sys.executable, "benchmarks/model_step.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-model-step" and doc["environment"]["dry_run"]
    rows = {r["contender"]: r for r in doc["rows"]}
    assert set(rows) == {"stellax", "jax"}
    for r in rows.values():
        assert SCHEMA <= set(r) and r["error"] is None and r["skipped"] is None, r
        assert r["op"] == "model_step" and r["pass"] == "train"
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["flops_per_step"] > 0, r
        assert r["loss_last"] < r["loss_first"], r  # the step trains
    assert rows["jax"]["stellax_ops"] == {}  # the plain model calls no stellax op
    ops = rows["stellax"]["stellax_ops"]
    for op in ("attention", "linear_cross_entropy", "gated_linear_unit", "layer_norm"):
        assert op in ops, ops
    assert doc["loss_agreement"] and all(a["ok"] and a["rel_diff"] < 2e-2 for a in doc["loss_agreement"])
