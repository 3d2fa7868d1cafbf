"""`stellax bench model`: its kinds, its errors, and the benchmarks' own argument checks under its name.
(The dry runs of the two benchmarks are tests/test_model_step.py and tests/test_model_serve.py.)"""

import importlib

import pytest

from stellax.bench import cli as bench_cli


def test_help_lists_both_kinds_and_a_bare_call_is_a_usage_error(capsys):
    assert bench_cli.main(["model", "--help"]) == 0
    out = capsys.readouterr().out
    assert "stellax bench model {train, serve}" in out and "train " in out and "serve " in out
    assert bench_cli.main(["model"]) == 2


def test_an_unknown_kind_is_named(capsys):
    assert bench_cli.main(["model", "infer", "--out", "x.json"]) == 2
    assert "expected one of train, serve, got 'infer'" in capsys.readouterr().err


def test_a_missing_optax_says_which_extra_to_install(monkeypatch, capsys):
    real_import_module = importlib.import_module

    def no_optax(name, *args):
        if name == "optax":
            raise ImportError("No module named 'optax'", name="optax")
        return real_import_module(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_optax)
    assert bench_cli.main(["model", "train", "--out", "x.json"]) == 2
    assert "needs optax, which is not installed: pip install 'stellax[nn]'" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["train", "serve"])
def test_the_benchmarks_parse_their_options_under_the_commands_name(kind, capsys):
    pytest.importorskip("optax", reason="pip install 'stellax[nn]' (flax, optax)")
    with pytest.raises(SystemExit):
        bench_cli.main(["model", kind, "--no-such-option"])
    assert f"usage: stellax bench model {kind}" in capsys.readouterr().err
