"""The paged-decode TPU benchmark (benchmarks/paged_decode_tpu.py) runs on the CPU
(--dry-run, interpreted kernels, a tiny case), so it is ready for the chip: every
stellax contender (bf16, mixed lengths with NaN in the free slots, int8 and int4 caches) and
jax's paged attention time, match the golden and land as rows
of the suite's results schema; jax's ragged paged attention, which cannot run
interpreted on jax 0.10.2, is an error row, not a crash."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "gbps", "pct_peak", "device", "date"}


def test_dry_run_times_and_checks_every_contender(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "paged_decode.json"
    proc = subprocess.run([sys.executable, "benchmarks/paged_decode_tpu.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "max_rel_err" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-paged-decode-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert rows and all(SCHEMA <= set(r) for r in rows)
    by = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    for contender in ("stellax:mosaic_tpu", "jax:paged_attention"):      # XLA only with --xla
        for r in by[contender]:
            assert r["error"] is None, r
            assert r["ms"] > 0 and r["gbps"] > 0 and r["pct_peak"] > 0, r
            assert r["max_rel_err"] < 3e-2 and r["rel_l2"] < 1e-2, r
            assert r["ms_back_to_back"] > 0 and r["pct_peak_back_to_back"] > 0, r
    # The default config rows (and they alone) are stellax's own pick, one per case and cache
    # format; explicit configs are rows too.
    defaults = [r for r in rows if r["default"]]
    cases = {r["case"] for r in rows}
    assert len(cases) == 3 and any("mixed" in c for c in cases)
    assert {r["contender"] for r in defaults} == {"stellax:mosaic_tpu"}
    assert sorted(r["config"] for r in defaults) == ["default"] * 3 + ["int4 default", "int8 default"]
    quant = [r for r in defaults if r["config"] != "default"]
    assert all(r["vs_bf16"] > 0 and r["vs_bf16_back_to_back"] > 0 for r in quant), quant
    assert len(by["stellax:mosaic_tpu"]) >= 6
    assert sum(r.get("best", False) for r in by["jax:paged_attention"]) == 1
    assert all(r["peer"] for r in by["jax:ragged_paged_attention"])
