"""The one-chip model training benchmark (benchmarks/model_step.py, `stellax bench model train`) runs on the CPU (--dry-run: the
tiny dense and hybrid-MoE models, stellax dispatching as on a v5e with its kernels interpreted): both
variants of both models train a few steps from the same initial weights on the same batches, their
first-step losses agree within 2 % and their final losses within 1 % (the tiny convergence check),
the stellax variants run stellax's kernels (GDN, MoE grouped matmuls, attention, norms, fused loss)
and the plain ones none but stellax's XLA GDN, and the rows carry the suite's results schema with
tokens/s and MFU."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "pct_peak", "bound", "device",
          "date", "skipped", "error"}


def _has_tokamax() -> bool:
    try:
        import tokamax  # noqa: F401
    except Exception:  # noqa: BLE001 - tokamax or one of its dependencies
        return False
    return True


def _env():
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _dry_run(tmp_path, *args, peers=("jax",)):
    env = _env()
    out = tmp_path / "model_step.json"
    proc = subprocess.run([sys.executable, "benchmarks/model_step.py", "--dry-run", "--out", str(out),
                           "--budget", "3000", *args], cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-model-step" and doc["environment"]["dry_run"]
    rows = {r["contender"]: r for r in doc["rows"]}
    assert set(rows) == {"stellax", *peers}
    steps = int(args[args.index("--steps") + 1])
    ran = [p for p in peers if rows[p]["skipped"] is None]
    for r in (rows[v] for v in ("stellax", *ran)):
        assert SCHEMA <= set(r) and r["error"] is None and r["skipped"] is None, r
        assert r["op"] == "model_train" and r["pass"] == "fwd+bwd" and r["case"].startswith(r["family"])
        assert r["ms"] > 0 and r["tokens_per_s"] > 0 and r["pct_peak"] > 0 and r["flops_per_step"] > 0, r
        assert len(r["losses"]) == steps and all(math.isfinite(x) for x in r["losses"]), r
        assert r["loss_final"] != r["loss_first"], r                     # the parameters moved
    assert [a["peer"] for a in doc["loss_agreement"]] == [c["peer"] for c in doc["convergence"]] == ran
    for first, final in zip(doc["loss_agreement"], doc["convergence"]):
        assert first["ok"] and first["rel_diff"] < 2e-2, first           # same weights, same batch
        assert final["ok"] and final["rel_diff"] < 1e-2 and final["steps"] == steps, final   # tiny convergence check
    return rows


def test_dry_run_trains_the_dense_model_and_the_variants_agree(tmp_path):
    # All three variants (the default); where tokamax does not import its rows say so and nothing else.
    rows = _dry_run(tmp_path, "--cases", "dense:32:2", "--steps", "4", peers=("jax", "tokamax"))
    assert rows["jax"]["stellax_ops"] == {}                                # plain JAX: no stellax op
    for op in ("attention", "linear_cross_entropy", "gated_linear_unit", "layer_norm"):
        assert op in rows["stellax"]["stellax_ops"], rows["stellax"]["stellax_ops"]
    tokamax = rows["tokamax"]
    if _has_tokamax():
        assert tokamax["skipped"] is None and tokamax["stellax_ops"] == {}, tokamax   # tokamax's ops only
    else:
        assert tokamax["ms"] is None and "pip install tokamax" in tokamax["skipped"], tokamax


def test_dry_run_trains_the_hybrid_moe_model_and_the_variants_agree(tmp_path):
    # 2 steps, no warmup: the interpreted hybrid step is ~30 s on a CPU and its compile ~4 min.
    rows = _dry_run(tmp_path, "--cases", "hybrid:64:2", "--steps", "2", "--warmup", "0", "--variants", "stellax,jax")
    assert rows["jax"]["active_params"] < rows["jax"]["params"]
    assert rows["jax"]["stellax_ops"] == {"chunk_gated_delta_rule": "xla"}    # the only XLA Gated DeltaNet
    ops = rows["stellax"]["stellax_ops"]
    for op in ("chunk_gated_delta_rule", "gated_recurrence_backward", "moe_mlp", "ragged_dot", "attention",
               "linear_cross_entropy"):
        assert op in ops, ops
    assert ops["chunk_gated_delta_rule"] == ops["ragged_dot"] == "mosaic_tpu", ops


def test_tpu_compile_of_the_tiny_models_for_a_v5e(tmp_path):
    """``--tpu-compile v5e``: the tiny dense and hybrid train steps (remat full, as on the chip)
    compile with libtpu for a compile-only v5e, the stellax ones through the Mosaic kernels."""
    pytest.importorskip("libtpu", reason='pip install "libtpu==0.0.42" (the tpu-check extra)')
    env = _env()
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, "benchmarks/model_step.py", "--dry-run", "--tpu-compile", "v5e",
                           "--variants", "stellax,jax", "--out", str(out)],
                          cwd=ROOT, env=env, check=False, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-model-compile" and doc["generation"] == "v5e" and doc["remat"] == "full"
    got = {(r["family"], r["contender"]): r for r in doc["compiled"]}
    assert set(got) == {(f, v) for f in ("dense", "hybrid") for v in ("stellax", "jax")}
    for r in got.values():
        assert r["error"] is None and r["compiled_bytes"] > r["argument_bytes"] > 0, r
    ops = got["hybrid", "stellax"]["stellax_ops"]
    assert ops["chunk_gated_delta_rule"] == ops["ragged_dot"] == ops["attention"] == "mosaic_tpu", ops
    assert got["hybrid", "jax"]["stellax_ops"] == {"chunk_gated_delta_rule": "xla"}
