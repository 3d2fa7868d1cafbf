"""The TPU suite script runs end to end on the CPU (--dry-run: the Mosaic TPU
kernels interpreted, tiny shapes) so it is ready the day a TPU is lent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stellax

ROOT = Path(__file__).resolve().parents[1]
TPU_OPS = sorted(name for name, op in stellax.registered_ops().items() if "mosaic_tpu" in op.implementations)


@pytest.mark.skipif(not TPU_OPS, reason="no op has a mosaic_tpu implementation")
def test_tpu_suite_dry_run(tmp_path):
    ops = ",".join(n for n in TPU_OPS if n.startswith("layer_norm"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "benchmarks/tpu_suite.py", "--dry-run", "--ops", ops, "--out",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("stellax-tpu-suite-")]
    data = json.loads(path.read_text())
    assert data["format"] == "stellax-tpu-suite" and data["dry_run"] and not data["errors"], data["errors"]
    assert set(data["stages"]) == {"environment", "check", "autotune", "bench"}
    checked = {c["op"] for c in data["check"] if c.get("passed")}
    assert checked == set(ops.split(",")), data["check"]
    assert {e["op"] for e in data["autotune"]["entries"]} <= set(ops.split(","))
    timed = {(r["op"], r["implementation"]) for r in data["bench"]["records"] if r.get("median_ms")}
    assert ("layer_norm", "mosaic_tpu") in timed and ("layer_norm", "xla") in timed, timed


def test_splash_peer_matches_the_golden_in_interpret_mode():
    """The suite's jax_splash peer (jax's bundled kernel) computes the op's
    math, so its timings compare like with like."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    import numpy as np

    spec = importlib.util.spec_from_file_location("tpu_suite", ROOT / "benchmarks" / "tpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, 256, 2, 128), jnp.float32) for key in keys)
    with stellax.interpret_mode():
        out = suite.splash_peer(q, k, v, is_causal=True)
    ref = stellax.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-3, atol=2e-3)
    with pytest.raises(stellax.UnsupportedError, match="jax_splash peer"):
        suite.splash_peer(q, k[:, :, :1], v[:, :, :1])


def _suite_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tpu_suite", ROOT / "benchmarks" / "tpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    return suite


def test_moe_peers_match_the_golden_in_interpret_mode():
    """The suite's grouped-matmul peers (jax.lax.ragged_dot, bundled megablox gmm and
    tgmm, interpreted) compute the ops' math: an empty group, group sizes summing to
    less than M (M not a multiple of megablox's row tile), an expert-parallel offset."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    suite = _suite_module()
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    lhs = jax.random.normal(keys[0], (200, 128), jnp.float32)
    rhs = jax.random.normal(keys[1], (3, 128, 128), jnp.float32) / 12
    sizes = jnp.asarray([60, 0, 110], jnp.int32)  # 170 of 200 rows
    ops = stellax.registered_ops()

    def close(a, b):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)

    golden = ops["ragged_dot"].reference(lhs, rhs, sizes)
    with stellax.interpret_mode():
        close(suite.megablox_gmm_peer(lhs, rhs, sizes), golden)
        close(suite.megablox_gmm_peer(lhs, rhs[1:], sizes, group_offset=jnp.int32(1)),
              ops["ragged_dot"].reference(lhs, rhs[1:], sizes, group_offset=jnp.int32(1)))
        close(suite.megablox_tgmm_peer(lhs.T, lhs[:, :64], sizes),
              ops["ragged_dot_tgmm"].reference(lhs.T, lhs[:, :64], sizes))
        close(suite.megablox_tgmm_peer(lhs, lhs[:, :64], sizes, group_offset=jnp.int32(1), num_local_groups=2,
                                       transpose_lhs=True),
              ops["ragged_dot_tgmm"].reference(lhs, lhs[:, :64], sizes, group_offset=jnp.int32(1),
                                               num_local_groups=2, transpose_lhs=True))
    close(suite.ragged_dot_peer(lhs, rhs, sizes), golden)
    with pytest.raises(stellax.UnsupportedError, match="megablox"):
        suite.megablox_gmm_peer(lhs, rhs, sizes, activation="silu")
    assert set(suite.MOE_PEERS) == {"ragged_dot", "ragged_dot_tgmm"}
