"""The linear cross-entropy TPU benchmark (benchmarks/loss_tpu.py) runs on the CPU (--dry-run,
interpreted kernels, a tiny ragged case), so it is ready for the chip: every contender (full-logits
XLA, the chunked XLA path, the Mosaic kernels at the default config — the fused sweep forward +
backward —, their recompute path, and an explicit config of three token chunks) times, matches
the reference in both passes and lands as rows of the suite's results schema with memory figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "pct_peak", "bound", "device",
          "date", "skipped", "error"}


def test_dry_run_times_and_checks_every_contender(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "loss_tpu.json"
    proc = subprocess.run([sys.executable, "benchmarks/loss_tpu.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "summary" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-loss-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert rows and all(SCHEMA <= set(r) for r in rows)
    seen = {(r["pass"], r["contender"], r["config"]) for r in rows}
    for kind in ("fwd", "fwd+bwd"):
        for contender, config in (("xla:full_logits", "-"), ("stellax:xla_chunked", "default"),
                                  ("stellax:mosaic_tpu", "default"),
                                  ("stellax:mosaic_tpu", "block_t=16,block_v=128,chunk_t=16")):
            assert (kind, contender, config) in seen, (kind, contender, config)
    # The fused sweep's default (forward + backward) beside the recompute path it replaced.
    assert ("fwd+bwd", "stellax:mosaic_tpu", "recompute") in seen
    assert ("fwd", "stellax:mosaic_tpu", "recompute") not in seen
    # The roofline model of the fused sweep sits beside the rows that run it, and only those.
    fused = {(r["pass"], r["config"]) for r in rows if r["model_ms"] is not None}
    assert fused == {("fwd+bwd", "default"), ("fwd+bwd", "block_t=16,block_v=128,chunk_t=16")}
    assert all(r["model_ms"] > 0 for r in rows if r["model_ms"] is not None)
    tokamax = [r for r in rows if r["contender"] == "tokamax:mosaic_tpu"]
    assert {r["pass"] for r in tokamax} == {"fwd", "fwd+bwd"}
    assert all(r["skipped"] and "tokamax" in r["skipped"] and r["ms"] is None for r in tokamax)  # TPU only
    rows = [r for r in rows if r["contender"] != "tokamax:mosaic_tpu"]
    for r in rows:
        assert r["error"] is None and r["skipped"] is None, r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["pct_peak"] > 0 and r["vs_xla"] > 0, r
        assert r["reference"] == "xla:full_logits", r
        assert r["loss_rel_err"] < 1e-2, r
        assert r["program_mib"] is not None and r["program_mib"] > 0, r
        if r["pass"] == "fwd+bwd":
            assert r["rel_l2"] < 2e-2, r
        else:
            assert r["rel_l2"] is None, r
    # The default-config Mosaic rows (and they alone) are stellax's own pick.
    defaults = {(r["pass"], r["contender"], r["config"]) for r in rows if r["default"]}
    assert defaults == {("fwd", "stellax:mosaic_tpu", "default"), ("fwd+bwd", "stellax:mosaic_tpu", "default")}
    assert all(r["peer"] == (r["contender"] == "xla:full_logits") for r in rows)
    assert all(r["peer"] for r in tokamax)
