"""`stellax bench --record DIR` and `stellax bench history DIR [--plot OUT]`."""

import json

import pytest

from stellax.bench import baseline, history, report
from stellax.bench import cli as bench_cli
from stellax.bench.measurement import BenchmarkRecord


def _records(scale: float = 1.0):
    out = []
    for i, (suite, op) in enumerate([("norm", "layer_norm"), ("norm", "rms_norm"), ("moe", "ragged_dot")]):
        times = [scale * (1 + i) * (1 + 0.01 * k) for k in range(6)]
        r = BenchmarkRecord(name=op, timer="wall", device_kind="cpu", times_ms=times, median_ms=sorted(times)[3],
                            min_ms=min(times), iqr_ms=0.02, iterations=6, suite=suite, op=op, case="64x64",
                            implementation="xla")
        out.append(baseline.with_rounds(r, times[:3]))
    out.append(BenchmarkRecord(name="skipped", suite="moe", op="ragged_dot", case="big", implementation="xla",
                               skipped="time budget exhausted"))
    return out


ENV = {"created": "2026-12-01T10:00:00+00:00", "git_commit": "abc1234", "stellax": "0.1.0", "jax": "0.10.2",
       "device": "cpu (test)", "device_kind": "cpu", "backend": "cpu"}


def test_entries_round_trip_and_append_whole_lines(tmp_path):
    first = history.append(tmp_path, history.make_entry(_records(), ENV))
    assert first == tmp_path / "history.jsonl"
    history.append(tmp_path, history.make_entry(_records(1.5), {**ENV, "git_commit": "def5678"}))
    entries = history.load(tmp_path)
    assert [e["commit"] for e in entries] == ["abc1234", "def5678"]
    case = entries[1]["cases"]["layer_norm|64x64|xla|forward"]
    assert case["median_ms"] == pytest.approx(1.5 * 1.03) and case["suite"] == "norm"
    assert len(case["rounds_ms"]) == 3 and case["spread_ms"] > 0
    assert entries[0]["skipped"] == 1 and entries[0]["jax"] == "0.10.2"
    assert "ragged_dot|big|xla|forward" not in entries[0]["cases"]  # only measured cases
    lines = first.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["format"] == history.FORMAT for line in lines)


def test_a_value_json_cannot_hold_writes_nothing(tmp_path):
    history.append(tmp_path, history.make_entry(_records(), ENV))
    before = (tmp_path / "history.jsonl").read_bytes()
    entry = history.make_entry(_records(), ENV)
    entry["cases"]["layer_norm|64x64|xla|forward"]["spread_ms"] = float("nan")
    with pytest.raises(ValueError):
        history.append(tmp_path, entry)
    assert (tmp_path / "history.jsonl").read_bytes() == before


def test_corrupt_lines_are_named_by_file_and_line(tmp_path, capsys):
    path = history.append(tmp_path, history.make_entry(_records(), ENV))
    with open(path, "a") as f:
        f.write('{"format": "stellax-bench-history", "cas')  # a writer that died mid-line
    with pytest.raises(history.HistoryError, match=r"history.jsonl, line 2: not valid JSON"):
        history.load(tmp_path)
    # The next run starts on a fresh line: the cut line stays the only bad one.
    history.append(tmp_path, history.make_entry(_records(), ENV))
    assert len(path.read_text().splitlines()) == 3
    assert bench_cli.main(["history", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and str(path) in err.replace("\n", "")
    path.write_text('{"format": "something-else"}\n')
    with pytest.raises(history.HistoryError, match="line 1: not a stellax bench history entry"):
        history.load(path)
    with pytest.raises(history.HistoryError, match="no benchmark history"):
        history.load(tmp_path / "nowhere")


def test_cli_records_and_shows_the_history(tmp_path, capsys):
    results = tmp_path / "run.json"
    report.write_json(results, _records(), env=ENV)
    hist = tmp_path / "hist"
    assert bench_cli.main(["--input", str(results), "--record", str(hist), "--quiet"]) == 0
    assert bench_cli.main(["--input", str(results), "--record", str(hist)]) == 0
    out = capsys.readouterr().out
    assert "recorded 3 case(s)" in out
    assert len(history.load(hist)) == 2
    assert bench_cli.main(["history", str(hist)]) == 0
    table = capsys.readouterr().out
    assert "layer_norm|64x64|xla|forward" in table and "abc1234" in table and "1.00x" in table
    assert bench_cli.main(["history", str(hist), "--case", "no_such"]) == 2
    assert "matches none" in capsys.readouterr().err
    if not report.matplotlib_available()[0]:
        assert bench_cli.main(["history", str(hist), "--plot", str(tmp_path / "h.png")]) == 2
        return
    assert bench_cli.main(["history", str(hist), "--plot", str(tmp_path / "h.png")]) == 0
    assert (tmp_path / "h.png").stat().st_size > 1000
    assert bench_cli.main(["history", str(hist), "--plot", str(tmp_path / "plots")]) == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["history-moe.png", "history-norm.png"]
