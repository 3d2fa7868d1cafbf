"""One name per op for users: a public function's name (``rms_norm``,
``dot_product_attention``) works wherever a registered op's name does (issue 36)."""

import json

import pytest

import stellax
from stellax import cli
from stellax._op_names import (OP_ALIASES, UnknownOpError, display_name, is_op_name, resolve_op_name,
                               resolve_op_names, valid_names)


def test_public_names_resolve_to_registered_ops():
    assert resolve_op_name("rms_norm") == "layer_norm"
    assert resolve_op_name("layer_norm") == "layer_norm"
    assert resolve_op_name("dot_product_attention") == "attention"
    assert resolve_op_name("dot_product_attention_varlen") == "attention"
    assert resolve_op_name("attention") == "attention"
    assert resolve_op_name("route") == "moe_route"
    assert resolve_op_names(["rms_norm", "layer_norm", "ragged_dot"]) == ["layer_norm", "ragged_dot"]
    assert is_op_name("rms_norm") and not is_op_name("no_such_op")


def test_every_alias_is_a_public_function_of_a_registered_op():
    ops = stellax.registered_ops()
    for alias, name in OP_ALIASES.items():
        assert callable(getattr(stellax, alias)), alias
        assert name in ops, (alias, name)
        assert alias not in ops, f"{alias} is a registered op itself"


def test_an_unknown_name_lists_the_valid_ones():
    with pytest.raises(UnknownOpError, match="no registered op 'no_such_op'") as e:
        resolve_op_name("no_such_op")
    assert "rms_norm" in str(e.value) and "layer_norm" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert {"rms_norm", "dot_product_attention", "attention"} <= set(valid_names())


def test_display_name_gives_the_public_function():
    assert display_name("attention") == "attention (dot_product_attention)"
    assert display_name("layer_norm") == "layer_norm"


def test_check_takes_the_public_name(capsys):
    assert cli.main(["check", "rms_norm", "--implementations", "xla", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["op"] == "layer_norm" and row["result"] == "ok"


def test_check_public_name_selects_the_op_not_its_family():
    from stellax.testing import select_ops

    ops = stellax.registered_ops()
    assert list(select_ops(ops, ["dot_product_attention"])) == ["attention"]
    assert {"attention", "attention_backward"} <= set(select_ops(ops, ["attention"]))  # a family, as before


def test_check_unknown_name_is_an_error_naming_it(capsys):
    assert cli.main(["check", "layer_norm", "no_such_op"]) == 2
    out = capsys.readouterr().out
    assert "no_such_op" in out and "rms_norm" in out


def test_lab_finds_the_op_by_its_public_name(tmp_path, capsys):
    from stellax.lab import cli as lab_cli
    from stellax.lab.candidate import find_op
    from stellax.lab.errors import LabError

    assert find_op("rms_norm").name == "layer_norm"
    assert find_op("dot_product_attention").name == "attention"
    with pytest.raises(LabError, match="no registered op 'nope'"):
        find_op("nope")
    path = tmp_path / "candidate.py"
    assert lab_cli.main(["new", str(path), "--op", "rms_norm"]) == 0
    assert "--op rms_norm" in capsys.readouterr().out
    assert 'OP = "layer_norm"' in path.read_text() or "OP = 'layer_norm'" in path.read_text()


def test_bench_and_autotune_select_ops_by_public_name():
    from stellax.autotune.cli import suite_calls
    from stellax.bench.suites import families, only_ops

    cut = only_ops(families(), ["rms_norm"])
    assert [op.name for ops in cut.values() for op in ops] == ["layer_norm"]
    with pytest.raises(ValueError, match="no registered op 'nope'"):
        only_ops(families(), ["nope"])
    with pytest.raises(ValueError, match="in none of the suites"):
        only_ops(families(), ["rms_norm"], ["attention"])
    calls = suite_calls([], max_cases=1, ops=["rms_norm"])
    assert calls and {op.name for op, *_ in calls} == {"layer_norm"}


def test_bench_cli_rejects_an_unknown_op(capsys):
    from stellax.bench.cli import main

    assert main(["--ops", "nope", "--budget", "1"]) == 2
    assert "no registered op 'nope'" in capsys.readouterr().err
