"""Regression tracking and the `stellax bench` command line."""

import json

import numpy as np
import pytest

from stellax.bench import baseline, report
from stellax.bench import cli as bench_cli
from stellax.bench.measurement import BenchmarkRecord
from stellax.bench.timing import summarize


def _record(key: int, times) -> BenchmarkRecord:
    s = summarize(times)
    return BenchmarkRecord(name=f"case{key}", mode="forward", device_kind="cpu", timer="wall",
                           times_ms=list(times), median_ms=s.median, min_ms=s.min, p25_ms=s.p25, p75_ms=s.p75,
                           iqr_ms=s.iqr, iterations=s.n, suite="synthetic", op="op", case=f"case{key}",
                           implementation="xla")


def _run(rng, center: float, spread: float = 0.05, n: int = 40):
    return center * (1 + spread * rng.standard_normal(n))


def _results(rng, planted: float = 1.0):
    return [_record(i, _run(rng, 1.0 + i) * (planted if i == 2 else 1.0)) for i in range(6)]


def test_planted_regression_is_found_and_noise_is_not():
    rng = np.random.default_rng(0)
    base = _results(rng)
    noisy = baseline.compare(_results(rng), base)  # a fresh draw of the same distributions
    assert noisy.ok and not noisy.regressions and not noisy.improvements
    slow = baseline.compare(_results(rng, planted=2.0), base)
    assert [c.key for c in slow.regressions] == ["op|case2|xla|forward"]
    assert slow.failures and slow.regressions[0].ratio == pytest.approx(2.0, rel=0.1)
    fast = baseline.compare(_results(rng, planted=0.5), base)
    assert fast.ok and [c.key for c in fast.improvements] == ["op|case2|xla|forward"]
    # A slowdown beyond noise but under the threshold is reported, not failed.
    small = baseline.compare(_results(rng, planted=1.3), base, threshold=0.5)
    assert small.regressions and small.ok


def test_noise_comes_from_the_iqr():
    wide = [_record(0, [1.0, 1.5, 2.0, 2.5, 3.0])]  # IQR 1.0 around a median of 2.0
    shifted = [_record(0, [1.6, 2.1, 2.6, 3.1, 3.6])]  # +30%: inside 2 x IQR
    assert baseline.compare(shifted, wide).regressions == []
    far = [_record(0, [4.0, 4.5, 5.0, 5.5, 6.0])]
    assert baseline.compare(far, wide).failures


def _write(path, records):
    report.write_json(path, records, env={"device_kind": "cpu"})
    return str(path)


def test_cli_baseline_exit_codes(tmp_path, capsys):
    rng = np.random.default_rng(1)
    base = _write(tmp_path / "base.json", _results(rng))
    same = _write(tmp_path / "same.json", _results(rng))
    slow = _write(tmp_path / "slow.json", _results(rng, planted=2.0))
    assert bench_cli.main(["--input", same, "--baseline", base, "--quiet"]) == 0
    assert "0 regression(s)" in capsys.readouterr().out
    assert bench_cli.main(["--input", slow, "--baseline", base, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "case2" in out
    assert bench_cli.main(["--input", slow, "--baseline", base, "--quiet", "--threshold", "5"]) == 0


def test_cli_runs_a_suite_and_writes_reports(tmp_path, capsys):
    out_json, out_md, plots = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "plots"
    code = bench_cli.main(["norm", "--max-cases", "1", "--modes", "forward,forward_backward", "--json",
                           str(out_json), "--markdown", str(out_md), "--plot", str(plots)])
    assert code == 0
    text = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["format"] == "stellax-bench" and data["environment"]["device_kind"] == "cpu"
    recs = [r for r in data["records"] if r["error"] is None and r["skipped"] is None]
    assert {(r["op"], r["implementation"], r["mode"]) for r in recs} == {
        ("layer_norm", "xla", "forward"), ("layer_norm", "xla", "forward_backward")}
    assert all(r["median_ms"] > 0 and r["flops"] > 0 and r["roofline"]["gbps"] > 0 for r in recs)
    assert "| layer_norm |" in out_md.read_text()
    if report.matplotlib_available()[0]:
        assert (plots / "bench-norm.png").stat().st_size > 1000
    else:
        assert "matplotlib is not installed" in text
    # The run's own results as a baseline: nothing changed.
    assert bench_cli.main(["--input", str(out_json), "--baseline", str(out_json), "--quiet"]) == 0
    assert bench_cli.main(["no_such_family", "--quiet"]) == 2


def test_cli_list_calibrate_and_profile(tmp_path, capsys):
    assert bench_cli.main(["--list"]) == 0
    assert "norm: layer_norm" in capsys.readouterr().out
    assert bench_cli.main(["--calibrate"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "GB/s" in out and "saved to" in out
    trace = tmp_path / "trace"
    assert bench_cli.main(["norm", "--max-cases", "1", "--modes", "forward", "--profile", str(trace),
                           "--quiet"]) == 0
    from stellax.bench.profiler import trace_files

    assert any(f.endswith(".xplane.pb") for f in trace_files(str(trace)))
