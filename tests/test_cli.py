"""The command line: info lists implementations, check validates and fails on a broken kernel."""

import subprocess
import sys

import jax.numpy as jnp

from stellax import cli


def test_info_runs(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "layer_norm" in out and "triton" in out and "jax" in out


def test_check_passes_for_norm(capsys):
    assert cli.main(["check", "layer_norm", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "0 failure" in out


def test_check_fails_on_a_wrong_kernel(monkeypatch, capsys):
    from stellax.ops.norm import api, xla

    original = xla.norm_forward

    def broken(*args, **kwargs):
        y, h, mean, rstd = original(*args, **kwargs)
        return y * 1.01, h, mean, rstd

    monkeypatch.setattr(xla, "norm_forward", broken)
    monkeypatch.setitem(api.layer_norm_op.implementations, "xla", api.Implementation(
        "xla", api._forward_runner(xla, "xla")))
    assert cli.main(["check", "layer_norm", "--dtypes", "float32", "--implementations", "xla"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_unknown_op_is_an_error(capsys):
    assert cli.main(["check", "no_such_op"]) == 2


def test_console_script_entry_point():
    result = subprocess.run([sys.executable, "-m", "stellax.cli", "info"], capture_output=True, text=True,
                            timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
