"""`stellax bench model`: its kinds, its errors, and the benchmarks' own argument checks under its name.
(The dry runs of the two benchmarks are tests/test_model_step.py and tests/test_model_serve.py.)"""

import importlib
import json

import pytest

from stellax.bench import cli as bench_cli
from stellax.bench import model_plot


def test_help_lists_the_kinds_and_a_bare_call_is_a_usage_error(capsys):
    assert bench_cli.main(["model", "--help"]) == 0
    out = capsys.readouterr().out
    assert "stellax bench model {train, serve, plot}" in out and all(f"{k} " in out for k in ("train", "serve", "plot"))
    assert bench_cli.main(["model"]) == 2


def test_an_unknown_kind_is_named(capsys):
    assert bench_cli.main(["model", "infer", "--out", "x.json"]) == 2
    assert "expected one of train, serve, plot, got 'infer'" in capsys.readouterr().err


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


def _train_json(path, rows):
    path.write_text(json.dumps({"format": "stellax-model-step", "rows": rows}))
    return str(path)


def _row(family, seq, contender, tps, mfu=None, op="model_train"):
    return {"op": op, "case": f"{family} seq={seq} batch=1", "pass": "fwd+bwd", "contender": contender,
            "tokens_per_s": tps, "pct_peak": mfu}


def test_plot_merges_runs_and_keeps_measured_rows_only():
    rows = [_row("dense", 4096, "stellax", 100.0, 40.0), _row("dense", 4096, "jax", 50.0),
            _row("dense", 16384, "stellax", 80.0), _row("dense", 16384, "jax", None),  # not measured
            _row("hybrid", 4096, "stellax", 30.0), _row("dense", 4096, "stellax", 120.0, 45.0),  # a later run
            _row("dense", 4096, "stellax", 1.0, op="model_decode")]
    points = model_plot.measured_points(rows)
    assert points == {"dense": {"jax": [(4096, 50.0, None)], "stellax": [(4096, 120.0, 45.0), (16384, 80.0, None)]},
                      "hybrid": {"stellax": [(4096, 30.0, None)]}}


def test_plot_command_writes_a_png_and_names_bad_files(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="pip install 'stellax[bench]' (matplotlib)")
    first = _train_json(tmp_path / "a.json", [_row("dense", 4096, "stellax", 100.0, 40.0), _row("dense", 4096, "jax", 50.0)])
    second = _train_json(tmp_path / "b.json", [_row("dense", 16384, "stellax", 90.0, 48.0)])
    out = tmp_path / "fig" / "tokens.png"
    assert bench_cli.main(["model", "plot", first, second, "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and "dense: 3 points" in capsys.readouterr().out
    empty = _train_json(tmp_path / "empty.json", [_row("dense", 4096, "jax", None)])
    assert bench_cli.main(["model", "plot", empty, "--out", str(out)]) == 1
    assert "no measured model_train rows" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert bench_cli.main(["model", "plot", str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert "bad.json: cannot read it as JSON" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[]")
    assert bench_cli.main(["model", "plot", str(tmp_path / "list.json"), "--out", str(out)]) == 2
    assert "expected the JSON of `stellax bench model train`" in capsys.readouterr().err
