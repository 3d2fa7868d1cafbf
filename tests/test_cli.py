"""The command line: info lists implementations; check validates every op (a
quick default, --all the full sweep), streams rows under a progress bar,
writes JSON, and fails on a broken kernel."""

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

import stellax
from stellax import cli
from stellax.testing import CheckResult, plan_checks, select_ops
from stellax.testing import report as check_report


def test_info_runs(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "layer_norm" in out and "triton" in out and "jax" in out


def test_check_passes_for_norm(capsys):
    assert cli.main(["check", "layer_norm", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    assert "0 failure" in out


@pytest.fixture
def broken_layer_norm(monkeypatch):
    """layer_norm's XLA implementation 1% off."""
    from stellax.ops.norm import api, xla

    original = xla.norm_forward

    def broken(*args, **kwargs):
        y, h, mean, rstd = original(*args, **kwargs)
        return y * 1.01, h, mean, rstd

    monkeypatch.setattr(xla, "norm_forward", broken)  # the xla row's kernels: dispatch reaches it by attribute
    assert api.BACKENDS.kernels("xla") is xla


def test_check_fails_on_a_wrong_kernel(broken_layer_norm, capsys):
    assert cli.main(["check", "layer_norm", "--dtypes", "float32", "--implementations", "xla"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_check_json_is_one_document_with_rows_and_summary(capsys):
    assert cli.main(["check", "layer_norm", "--implementations", "xla", "--json"]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # nothing but the document on stdout: no progress bar, no table
    assert document["mode"] == "quick" and document["platform"]
    (row,) = document["rows"]
    assert row["op"] == "layer_norm" and row["implementation"] == "xla" and row["dtype"] == "float32"
    assert row["result"] == "ok" and row["gradients"] is True and row["rel_l2"] <= row["tolerance"]
    assert document["summary"] == {**document["summary"], "checks": 1, "passed": 1, "failed": 0, "skipped": 0}


def test_check_json_reports_the_failure_and_exits_1(broken_layer_norm, capsys, tmp_path):
    path = tmp_path / "check.json"
    assert cli.main(["check", "layer_norm", "--implementations", "xla", "--json", str(path)]) == 1
    document = json.loads(path.read_text())
    assert document["summary"]["failed"] == 1 and document["rows"][0]["result"] == "fail"
    assert document["summary"]["host_memory"]["peak_rss"] > 0
    printed = capsys.readouterr().out  # with a file for the JSON, the progress still goes to the console
    assert "FAIL" in printed and "1 failure(s)" in printed


def test_unknown_op_is_an_error(capsys):
    assert cli.main(["check", "no_such_op"]) == 2


def test_bad_dtype_is_an_error(capsys):
    assert cli.main(["check", "layer_norm", "--dtypes", "float33"]) == 2
    assert "float33" in capsys.readouterr().out


def test_default_plan_checks_every_op_once_in_float32():
    ops = stellax.registered_ops()
    jobs = plan_checks(ops)
    assert {j.op.name for j in jobs} == set(ops)
    assert all(j.dtype == "float32" and j.example is None for j in jobs)
    assert all("xla" in {j.implementation for j in jobs if j.op is op} for op in ops.values())
    assert all(j.gradients == bool(j.op.differentiable) for j in jobs)
    assert len({(j.op.name, j.implementation) for j in jobs}) == len(jobs)


def test_all_plans_every_example_dtype_and_implementation():
    ops = select_ops(stellax.registered_ops(), ["layer_norm"])
    op = ops["layer_norm"]
    jobs = plan_checks(ops, full=True)
    expected = {(i, d, e) for i in op.implementations for d in ("float32", "bfloat16")
                for e in range(len(op.examples(d)))}
    assert {(j.implementation, j.dtype, j.example) for j in jobs} == expected
    assert not plan_checks(ops, implementations=["no_such_impl"])
    assert {j.gradients for j in plan_checks(ops, gradients=False)} == {False}


class _FakeJob:
    """A job whose run records what the console showed before it started."""

    def __init__(self, name, console_file, seen):
        self.op = type("FakeOp", (), {"name": name})()
        self.implementation, self.dtype, self.gradients = "xla", "float32", False
        self.description = f"{name} · xla · float32"
        self._file, self._seen = console_file, seen

    def run(self):
        self._seen.append(self._file.getvalue())
        return CheckResult(self.op.name, "xla", "float32", f"example of {self.op.name}", True, None)


def test_rows_stream_as_checks_finish():
    file = io.StringIO()
    console = Console(file=file, width=160)
    seen = []
    jobs = [_FakeJob(name, file, seen) for name in ("first_op", "second_op")]
    report = check_report.run_watched(jobs, console, platform="cpu", mode="quick")
    assert "first_op" not in seen[0] and "example of first_op" in seen[1]  # printed before the next ran
    assert report.summary()["passed"] == 2 and "0 failure(s), 2 passed" in file.getvalue()


def test_console_script_entry_point():
    result = subprocess.run([sys.executable, "-m", "stellax.cli", "info"], capture_output=True, text=True,
                            timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
