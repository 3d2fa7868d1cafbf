"""The evaluation environment: `lab new` candidates pass unchanged, each bad
input is a clear error or a report naming the problem, and a candidate that
crashes, hangs or exhausts memory yields a report, never a crash here."""

import json

import pytest

from stellax.lab import cli, template
from stellax.lab.candidate import find_op
from stellax.lab.errors import LabError
from stellax.lab.evaluate import Worker, evaluate

FAST = {"dtypes": ["float32"], "max_examples": 1, "benchmark_min_time": 0.05, "benchmark_rounds": 2}
NO_BENCH = {**FAST, "benchmark": False}

HEAD = '''import dataclasses
import stellax
OP = "hadamard_transform"
_BASE = stellax.registered_ops()[OP].implementations["xla"]
'''


def _tier(report, name):
    return next(t for t in report["tiers"] if t["name"] == name)


def test_new_candidate_evaluates_as_correct_and_is_timed(tmp_path, hadamard_shapes, capsys):
    path = tmp_path / "cand.py"
    assert cli.main(["new", str(path), "--op", "hadamard_transform"]) == 0
    assert "IMPLEMENTATION = dataclasses.replace(_BASE" in path.read_text()
    report = evaluate(path, "hadamard_transform", options=FAST, shapes=hadamard_shapes, time_limit=240)
    assert report["schema_version"] == 1
    assert report["status"] == "passed", report["summary"]
    assert [t["name"] for t in report["tiers"]] == ["load", "contract", "numerics", "gradients", "determinism",
                                                    "lowering", "compile", "benchmark"]
    assert _tier(report, "gradients")["status"] == "skipped"  # hadamard_transform has no VJP operands
    worst = report["numerics"]["worst"]
    assert worst["rel_l2"] <= worst["tolerance"] and worst["index"] is not None
    case = report["benchmark"]["cases"][0]
    assert case["baseline"] == "xla" and case["candidate_ms"] > 0 and case["speedup"] > 0
    assert report["score"] > 1.0
    assert "PASSED" in report["summary"] and "speed vs xla" in report["summary"]
    assert cli.main(["new", str(path), "--op", "hadamard_transform"]) == 2  # exists: refused without --force
    assert "exists already" in capsys.readouterr().err


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    with pytest.raises(LabError, match="no registered op 'no_such_op'"):
        find_op("no_such_op")
    (tmp_path / "c.py").write_text("X = 1\n")
    assert cli.main(["evaluate", str(tmp_path / "c.py"), "--op", "no_such_op"]) == 2
    assert "no registered op 'no_such_op'" in capsys.readouterr().err
    with pytest.raises(LabError, match="has no config type"):
        template.config_template(find_op("hadamard_transform"), "xla")
    with pytest.raises(LabError, match="no such file"):
        evaluate(tmp_path / "missing.py", "hadamard_transform")


def test_load_failures_name_file_and_line(worker):
    report = worker.evaluate("X = 1\n", "hadamard_transform", display="empty.py", options=NO_BENCH)
    assert report["status"] == "failed" and report["first_failure"]["tier"] == "load"
    assert "defines no implementation" in report["first_failure"]["message"]

    report = worker.evaluate("x = 1\ndef f(:\n", "hadamard_transform", display="broken.py", options=NO_BENCH)
    failure = report["first_failure"]
    assert failure["tier"] == "load" and failure["type"] == "SyntaxError"
    assert failure["file"] == "broken.py" and failure["line"] == 2

    report = worker.evaluate(HEAD + "import not_a_module_anywhere\n", "hadamard_transform", display="imp.py",
                             options=NO_BENCH)
    failure = report["first_failure"]
    assert failure["type"] == "ModuleNotFoundError" and failure["file"] == "imp.py" and failure["line"] == 5
    assert "broken.py" not in report["summary"] and "imp.py:5" in report["summary"]

    report = worker.evaluate(HEAD + "IMPLEMENTATION = _BASE\n", "hadamard_transform", options=NO_BENCH)
    assert "taken by a built-in implementation" in report["first_failure"]["message"]
    report = worker.evaluate('OP = "layer_norm"\nBASE = "xla"\n', "hadamard_transform", options=NO_BENCH)
    assert "declares OP = 'layer_norm'" in report["first_failure"]["message"]


def test_wrong_results_and_empty_space_fail_their_tiers(worker):
    wrong = HEAD + '''
def run(call, config):
    return _BASE.run(call, config) * 1.01

IMPLEMENTATION = dataclasses.replace(_BASE, name="wrong", run=run)
'''
    report = worker.evaluate(wrong, "hadamard_transform", options=NO_BENCH)
    assert report["first_failure"]["tier"] == "numerics"
    worst = report["numerics"]["worst"]
    assert not worst["passed"] and worst["rel_l2"] == pytest.approx(0.01, rel=0.05)
    assert worst["what"] == "output[0]" and len(worst["index"]) == 2
    assert report["score"] < 1.0 and report["benchmark"] is None

    shape = HEAD + '''
def run(call, config):
    return _BASE.run(call, config)[..., :-1]

IMPLEMENTATION = dataclasses.replace(_BASE, name="short", run=run)
'''
    report = worker.evaluate(shape, "hadamard_transform", options=NO_BENCH)
    assert report["first_failure"]["tier"] == "contract" and "expected float32[5, 64]" in report["first_failure"]["message"]

    empty = '''from stellax.ops.attention.configs import ChunkedConfig
BASE = "xla_chunked"
HEURISTIC = lambda call: ChunkedConfig(64, 64)
SPACE = lambda call: []
'''
    report = worker.evaluate(empty, "attention", options=NO_BENCH)
    assert report["first_failure"]["tier"] == "contract"
    assert "config space of 'lab_xla_chunked' is empty" in report["first_failure"]["message"]


def test_crash_hang_and_memory_yield_reports():
    with Worker(time_limit=25, memory_limit_mb=4096) as worker:
        segv = HEAD + "import ctypes\nctypes.string_at(0)\n"
        report = worker.evaluate(segv, "hadamard_transform", options=NO_BENCH)
        assert report["status"] == "crashed" and "SIGSEGV" in report["first_failure"]["message"]
        assert report["first_failure"]["tier"] == "load"

        hang = HEAD + "import time\nwhile True:\n    time.sleep(0.1)\n"
        t_limit = worker.time_limit
        report = worker.evaluate(hang, "hadamard_transform", options=NO_BENCH)
        assert report["status"] == "timeout" and report["first_failure"]["tier"] == "load"
        assert f"time limit of {t_limit:g} s" in report["first_failure"]["message"]
        assert report["wall_s"] >= t_limit

        hog = HEAD + "import numpy\nBIG = numpy.ones((1 << 40,), numpy.uint8)\n"
        report = worker.evaluate(hog, "hadamard_transform", options=NO_BENCH)
        assert report["status"] in ("memory", "failed")
        assert "MemoryError" in json.dumps(report["first_failure"]) or report["status"] == "memory"
        assert report["score"] < 1.0


def test_kernel_candidate_runs_interpreted_and_lowers(worker):
    """A Pallas (Triton) candidate on a CPU: numerics interpreted, lowered for cuda, scored by its tiers."""
    kernel = HEAD + 'IMPLEMENTATION = dataclasses.replace(stellax.registered_ops()[OP].implementations["triton"], ' \
                    'name="tri")\n'
    report = worker.evaluate(kernel, "hadamard_transform", options=FAST)
    assert report["status"] == "passed", report["summary"]
    assert report["candidate"]["backend"] == "triton" and report["environment"]["interpret"] is True
    assert _tier(report, "lowering")["detail"].startswith("lowered for cuda")
    assert _tier(report, "benchmark")["status"] == "skipped" and "not timed on a CPU" in report["summary"]
    assert report["score"] == 1.0
