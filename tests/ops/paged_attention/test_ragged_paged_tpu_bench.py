"""The ragged paged / MLA TPU benchmark (benchmarks/ragged_paged_tpu.py) runs on the CPU
(--dry-run, interpreted kernels, tiny cases), so it is ready for the chip: stellax's ragged
and MLA contenders time, match the golden on the checked sequences (whose free slots hold
NaN) and land as rows of the suite's results schema; jax's ragged kernel, which cannot run
interpreted on jax 0.10.2, is an error row, not a crash. The golden's chunking and the
causal FLOP count are checked on their own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "gbps", "pct_peak", "device", "date"}


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ragged_paged_tpu
    finally:
        sys.path.pop(0)
    return ragged_paged_tpu


def test_causal_flops_counts_visible_pairs():
    bench = _bench()
    case = bench.Ragged(((3, 5),), 2, 4, q_heads=2)
    # prefill: tokens at positions 2, 3, 4 see 3, 4, 5 keys; decodes see 4 each
    pairs = 3 + 4 + 5 + 4 + 4
    assert bench.causal_flops(case, 8) == 2.0 * 2 * 16 * pairs


def test_golden_chunks_are_the_ragged_golden(monkeypatch):
    import jax.numpy as jnp
    from stellax.ops.paged_attention import ragged_paged_attention_op

    bench = _bench()
    monkeypatch.setattr(bench, "GOLDEN_CHUNK", 16)
    case = bench.Ragged(((40, 64), (8, 24)), 3, 40, q_heads=4)
    args = bench.ragged_inputs(0, case, 2, 128, jnp.float32)
    seqs = bench.checked_sequences(case)
    assert seqs == [0, 1, 2, 3]
    idx, ref = bench.ragged_golden(args, seqs)
    assert list(idx) == list(range(40 + 8 + 2))
    whole = np.asarray(ragged_paged_attention_op.reference(*args))[idx]
    np.testing.assert_allclose(np.asarray(ref), whole, rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(whole))


def test_dry_run_times_and_checks_every_contender(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "ragged.json"
    proc = subprocess.run([sys.executable, "benchmarks/ragged_paged_tpu.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-ragged-paged-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert rows and all(SCHEMA <= set(r) for r in rows)
    ops = {r["op"] for r in rows}
    assert ops == {"ragged_paged_attention", "mla_decode"}
    stellax = [r for r in rows if r["contender"] == "stellax:mosaic_tpu"]
    assert len(stellax) >= 4
    for r in stellax:
        assert r["error"] is None, r
        assert r["ms"] > 0 and r["gbps"] > 0 and r["tflops"] > 0, r
        assert r["max_rel_err"] < 3e-2 and r["rel_l2"] < 1e-2, r
    # the prefill fix (one kv head per matmul) is among the timed configs
    assert any(r["config"].endswith("split_heads") and r["op"] == "ragged_paged_attention" for r in stellax)
    defaults = [r for r in rows if r["default"]]
    assert sorted(r["op"] for r in defaults) == ["mla_decode", "ragged_paged_attention"]
    assert all(r["config"] == "default" for r in defaults)
    assert all(r["peer"] for r in rows if r["contender"].startswith("jax:"))
