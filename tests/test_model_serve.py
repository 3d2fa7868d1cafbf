"""The one-chip serving benchmark (`stellax bench model serve`, also benchmarks/model_serve.py) runs on the CPU (--dry-run: the tiny
dense model, stellax dispatching as on a v5e with its kernels interpreted, float32): both variants
prefill and greedily decode 64 tokens with the same tokens (stellax's paged KV cache against plain
JAX's dense one), the stellax variant runs the paged-attention kernel and the plain one no stellax op,
and the rows carry the suite's results schema with tokens/s and MFU."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "pct_peak", "bound", "device",
          "date", "skipped", "error"}


def test_dry_run_serves_both_variants_with_the_same_greedy_tokens(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "model_serve.json"
    # Through the installed command's path (the train test runs the benchmarks/ script).
    proc = subprocess.run([sys.executable, "-m", "stellax.cli", "bench", "model", "serve", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-model-serve" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert {(r["contender"], r["case"].split()[1]) for r in rows} == {
        (v, k) for v in ("stellax", "jax") for k in ("prefill", "decode")}
    for r in rows:
        assert SCHEMA <= set(r) and r["error"] is None and r["skipped"] is None, r
        assert r["op"] == "model_decode" and r["pass"] == "fwd"
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["pct_peak"] > 0, r
    by = {(r["contender"], r["case"].split()[1]): r for r in rows}
    assert by["jax", "decode"]["stellax_ops"] == {}                 # plain JAX: no stellax op
    ops = by["stellax", "decode"]["stellax_ops"]
    for op in ("paged_attention", "attention", "gated_linear_unit", "layer_norm"):
        assert op in ops, ops
    (greedy,) = doc["greedy"]
    assert greedy["compared"] == 65 and greedy["same_tokens"] == 65 and greedy["ok"], greedy
    assert len(set(greedy["stellax"])) > 1                          # not one token repeated
