"""The stage-by-stage chip benchmark of the Mosaic TPU linear-attention pipeline
(benchmarks/linear_attention_stages_tpu.py) runs on the CPU (--dry-run: tiny cases, the kernels
interpreted): every stage of GDN (forward kernel, states pass, backward kernel at its default of two
heads per step and at one, the op forward and forward+backward) and SSD's forward kernel, a variant config, each with the
cost model's prediction, rows in the results schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def test_stages_dry_run(tmp_path):
    out = tmp_path / "stages.json"
    proc = subprocess.run([sys.executable, "benchmarks/linear_attention_stages_tpu.py", "--dry-run", "--out", str(out),
                           "--cases", "0,1", "--variants", "128/128/2", "--budget", "1000"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-linear-attention-stages-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    gdn = [(r["stage"], r["config"]) for r in rows if r["op"] == "chunk_gated_delta_rule"]
    stages = [s for s, _ in gdn]
    assert stages == ["kernel:fwd", "kernel:fwd", "kernel:fwd", "op:fwd", "kernel:states", "kernel:bwd",
                      "kernel:bwd", "op:fwd+bwd", "kernel:bwd"], gdn
    assert gdn[1][1] == "explicit(128/128/2)"
    # --policy three_pass (the default): the forward and backward kernels again at the old bfloat16 policy.
    assert gdn[2][1].startswith("policy=three_pass(") and gdn[6][1] == "policy=three_pass(128/128/2)"
    # The backward's default batches both heads (the backward heuristic); --bwd-heads 1 the old default.
    assert gdn[5][1] == "default(128/128/2)" and gdn[-1][1] == "explicit(128/128/1)"
    assert [r["stage"] for r in rows if r["op"] == "ssd"] == ["kernel:fwd", "kernel:fwd"]  # no policy row: no solve
    assert rows[4]["op"] == "ssd" and rows[6]["stage"] == "kernel:states"  # every forward first
    for r in rows:
        assert r["error"] is None and r["skipped"] is None and r["ms"] > 0 and r["model_ms"] > 0, r
        assert r["contender"] == "stellax:mosaic_tpu" and not r["peer"]
