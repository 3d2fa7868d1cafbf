"""`stellax.core.tokamax_peer.load`: tokamax called from a program with its own command line."""

import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    sys.argv = ["bench.py", "--out", "x.json"]       # a benchmark's own options
    if {load}:
        from stellax.core import tokamax_peer
        tokamax = tokamax_peer.load()
    else:
        import tokamax
    x = jnp.ones((4, 8))
    print(float(tokamax.layer_norm(x, jnp.ones(8), None, subtract_mean=False).sum()))
""")


def _run(load: bool):
    return subprocess.run([sys.executable, "-c", PROGRAM.format(load=load)], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)


def test_tokamax_runs_under_a_command_line_it_does_not_know():
    """Imported plainly, tokamax's first call parses sys.argv as absl flags and fails on ``--out``;
    through `load` the call runs, its flags at their defaults."""
    pytest.importorskip("tokamax", reason="tokamax is an optional peer (pip install tokamax)")
    plain = _run(load=False)
    assert plain.returncode != 0 and "Unknown command line flag 'out'" in plain.stderr, plain.stderr[-500:]
    loaded = _run(load=True)
    assert loaded.returncode == 0, loaded.stderr[-1000:]
    assert float(loaded.stdout.split()[-1]) == pytest.approx(32.0, rel=1e-3)   # RMSNorm of ones: 4 x 8 ones
