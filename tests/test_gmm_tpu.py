"""The grouped-matmul TPU benchmark (benchmarks/gmm_tpu.py) runs on the CPU (--dry-run,
interpreted kernels, tiny balanced and skewed cases), so it is ready for the chip: every
contender (stellax's default and explicit tilings, XLA's ragged_dot, megablox gmm/tgmm)
times forward and forward+backward, matches the float32 golden on the sampled groups, and
lands as rows of the suite's results schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "pct_peak", "bound", "device",
          "date", "skipped", "error"}
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_group_sizes_balanced_and_dirichlet():
    import gmm_tpu

    balanced = gmm_tpu.group_sizes(16384, 64, None, 0)
    assert balanced.dtype == np.int32 and (balanced == 256).all()
    skewed = gmm_tpu.group_sizes(32768, 64, 0.3, 1)
    assert skewed.sum() == 32768 and skewed.min() >= 0 and skewed.max() > 4 * 512  # skewed, every row in a group
    assert (gmm_tpu.group_sizes(32768, 64, 0.3, 1) == skewed).all()  # seeded
    groups = gmm_tpu.sampled_groups(np.array([5, 0, 9, 0, 0, 2], np.int32))
    assert groups == [0, 1, 2, 3, 5]  # first, last, largest, smallest non-empty, two empty ones


def test_dry_run_times_and_checks_every_contender(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "gmm.json"
    proc = subprocess.run([sys.executable, "benchmarks/gmm_tpu.py", "--dry-run", "--budget", "10000", "--out",
                           str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "summary" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-gmm-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert rows and all(SCHEMA <= set(r) for r in rows)
    cases = {r["case"] for r in rows}
    import gmm_tpu

    tiles = {c.name: c.tiles for c in gmm_tpu.DRY_CASES}
    assert len(cases) == 2 and any(c.startswith("skewed") for c in cases)
    for case in cases:
        for op, kind in (("ragged_dot", "fwd"), ("ragged_dot", "fwd+bwd"), ("ragged_dot_dlhs", "fwd"),
                         ("ragged_dot_tgmm", "fwd")):
            got = [r for r in rows if r["case"] == case and r["pass"] == kind and r["op"] == op]
            contenders = {r["contender"] for r in got}
            assert contenders == {"stellax:mosaic_tpu", "xla:ragged_dot", "jax:megablox_gmm"}, (case, op, kind)
            for r in got:
                assert r["error"] is None and r["skipped"] is None, r
                assert r["ms"] > 0 and r["tflops"] > 0 and r["pct_peak"] > 0, r
                assert r["rel_l2"] < 1e-2 and r["max_rel_err"] < 3e-2, r
            # The default row (and it alone) is stellax's own pick; explicit tilings are rows too.
            defaults = [(r["contender"], r["config"]) for r in got if r["default"]]
            assert defaults == [("stellax:mosaic_tpu", "default")]
            # the case's explicit tilings are rows too
            part = {"ragged_dot_dlhs": "dlhs", "ragged_dot_tgmm": "tgmm"}.get(op, kind)
            assert sum(r["contender"] == "stellax:mosaic_tpu" for r in got) == (1 + len(tiles[case][part])
                                                                              + (part == "tgmm"))
            assert sum(r.get("best", False) for r in got if r["contender"] == "jax:megablox_gmm") == 1
    # The skewed case has empty groups: their weight gradient is exactly zero for every contender.
    skewed_bwd = [r for r in rows if r["case"].startswith("skewed")
                  and (r["pass"] == "fwd+bwd" or r["op"] == "ragged_dot_tgmm")]
    assert skewed_bwd and all(r["empty_dw_zero"] is True for r in skewed_bwd)


def test_budget_skips_contenders_instead_of_running_them(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "gmm.json"
    proc = subprocess.run([sys.executable, "benchmarks/gmm_tpu.py", "--dry-run", "--out", str(out), "--budget", "0",
                           "--cases", "0", "--passes", "fwd"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["skipped"] and r["ms"] is None for r in rows)


def test_group_sizes_with_a_third_of_the_groups_empty():
    import gmm_tpu

    sizes = gmm_tpu.group_sizes(32768, 128, gmm_tpu.EMPTY_THIRD, 0)
    assert sizes.sum() == 32768 and (sizes[2::3] == 0).all()
    live = np.delete(sizes, np.s_[2::3])
    assert live.min() > 0 and live.max() - live.min() <= 1  # the others share the rows equally
