"""The MoE TPU benchmark (benchmarks/moe_tpu.py) runs on the CPU (--dry-run, interpreted
kernels, tiny shapes), so it is ready for the chip: `moe_mlp` and the same layer written with
`jax.lax.ragged_dot` + jnp match the float32 layer forward and backward, and int8 per-channel
weights match the float32 product of their dequantized values, as rows of the results schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "pct_peak", "bound", "device",
          "date", "skipped", "error"}
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_reference_layer_is_stellax_moe_mlp():
    """The peer layer (ragged_dot + jnp) computes what `stellax.moe_mlp` computes (xla path, float32)."""
    import moe_tpu

    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    t, d, f, e, k = 40, 32, 16, 6, 2
    x = jax.random.normal(ks[0], (t, d), jnp.float32)
    logits = jax.random.normal(ks[1], (t, e), jnp.float32)
    wgu = jax.random.normal(ks[2], (e, d, 2, f), jnp.float32) / np.sqrt(d)
    wd = jax.random.normal(ks[3], (e, f, d), jnp.float32) / np.sqrt(f)
    hi = jax.lax.Precision.HIGHEST
    ours = moe_tpu.reference_layer(x, logits, wgu, wd, k, precision=hi)
    want = stellax.moe_mlp(x, logits, wgu, wd, top_k=k, implementation="xla", precision="highest")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-5, atol=1e-5)
    g_ours = jax.grad(lambda a, b: jnp.sum(moe_tpu.reference_layer(a, logits, b, wd, k, precision=hi) ** 2),
                      argnums=(0, 1))(x, wgu)
    g_want = jax.grad(lambda a, b: jnp.sum(stellax.moe_mlp(a, logits, b, wd, top_k=k, implementation="xla",
                                                           precision="highest") ** 2), argnums=(0, 1))(x, wgu)
    for a, b in zip(g_ours, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.extended  # ~90 s: interpreted moe_mlp forward and backward
def test_dry_run_times_and_checks_every_contender(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, "benchmarks/moe_tpu.py", "--dry-run", "--budget", "1000", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "summary" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-moe-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert rows and all(SCHEMA <= set(r) for r in rows)
    layer = [r for r in rows if r["op"] == "moe_mlp"]
    assert {(r["pass"], r["contender"]) for r in layer} == {
        (p, c) for p in ("fwd", "fwd+bwd") for c in ("stellax:moe_mlp", "jax:ragged_dot_layer")}
    int8 = [r for r in rows if r["op"] == "ragged_dot_quantized"]
    assert {r["contender"] for r in int8} == {"stellax:mosaic_tpu bf16 weights", "stellax:mosaic_tpu int8 weights"}
    for r in rows:
        assert r["error"] is None and r["skipped"] is None, r
        assert r["ms"] > 0 and r["tflops"] > 0, r
        assert r["rel_l2"] < 2e-2 and r["max_rel_err"] < 5e-2, r
