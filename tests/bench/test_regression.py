"""Baseline comparison on rounds: a re-run is not flagged, a 1.5x slower implementation is;
the default budget gives every op a turn and says what it skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stellax.bench import baseline, report, suites
from stellax.bench import cli as bench_cli
from stellax.core.call import Call
from stellax.core.op import Example, Implementation, Op


# -- the statistics ------------------------------------------------------------------
def test_compare_samples_needs_threshold_and_noise():
    rng = np.random.default_rng(0)
    base = 10 * (1 + 0.03 * rng.standard_normal(5))
    again = baseline.compare_samples(base, 10 * (1 + 0.03 * rng.standard_normal(5)))
    assert again.status == "unchanged" and not again.fails
    slow = baseline.compare_samples(base, 15 * (1 + 0.03 * rng.standard_normal(5)))
    assert slow.status == "regression" and slow.fails and slow.ratio == pytest.approx(1.5, rel=0.1)
    # Beyond the noise but under the threshold: reported, not failed.
    tight = baseline.compare_samples([10.0, 10.01, 9.99], [10.5, 10.51, 10.49])
    assert tight.status == "regression" and not tight.fails
    # Over the threshold but inside the noise (rounds all over the place): not failed.
    wild = baseline.compare_samples([5.0, 10.0, 20.0], [6.0, 13.0, 24.0])
    assert wild.status == "unchanged" and not wild.fails
    fast = baseline.compare_samples(base, base / 2)
    assert fast.status == "improvement" and not fast.fails
    with pytest.raises(ValueError, match="at least one time"):
        baseline.compare_samples([], [1.0])


def test_spread_is_robust_and_conservative():
    assert baseline.spread([1.0]) == 0.0
    assert baseline.spread([1.0, 3.0]) == pytest.approx(1.4826)  # 1.4826 x MAD
    assert baseline.spread([1.0, 1.1, 0.9, 1.0, 9.0]) == pytest.approx(0.14826)  # one burst does not widen it


def test_measure_rounds_alternates_abba():
    order = []
    times = baseline.measure_rounds({"a": lambda: order.append("a") or 1.0,
                                     "b": lambda: order.append("b") or [2.0, 2.5]}, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert times == {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.5] * 3}
    with pytest.raises(ValueError, match="'bad'.*positive time"):
        baseline.measure_rounds({"bad": lambda: float("nan")}, rounds=1)
    with pytest.raises(ValueError, match="rounds"):
        baseline.measure_rounds({"a": lambda: 1.0}, rounds=0)


def test_records_without_rounds_use_the_iqr():
    rec = report.load_records({"records": [{"name": "x", "op": "o", "case": "c", "implementation": "xla",
                                            "median_ms": 2.0, "iqr_ms": 1.0}]})[0][0]
    assert baseline.rounds_of(rec) == []
    with_rounds = baseline.with_rounds(rec, [2.6, 2.6, 2.6])
    assert baseline.compare_records(with_rounds, rec)[1] == "iqr"  # only one side has rounds
    assert baseline.compare_records(with_rounds, baseline.with_rounds(rec, [2.0, 2.0, 2.0]))[1] == "rounds"


# -- a deliberately slowed implementation, measured by the suite ------------------------
def _loop_op(steps: int) -> Op:
    """An op whose only implementation runs ``steps`` matmul+tanh steps (1.5x steps: 1.5x the work)."""
    def run(call, config):
        w = jnp.full((96, 96), 0.01, jnp.float32)
        return jax.lax.fori_loop(0, steps, lambda i, a: jnp.tanh(a @ w), call.arrays["x"])

    return Op("regression_probe", check=lambda x: Call(arrays={"x": x}, options={}),
              reference=lambda call: run(call, None), implementations=[Implementation("xla", run)],
              benchmarks=lambda platform: [Example("96x96", (jax.ShapeDtypeStruct((96, 96), jnp.float32),))],
              family="regression_probe")


def _rerun_and_slowdown_verdicts() -> list[str]:
    """Measure base / again (same work) / slow (1.5x the work) interleaved in rounds and
    return what is wrong with the comparisons (empty when a rerun is not flagged and the
    slowdown is)."""
    ops = {"base": _loop_op(40), "again": _loop_op(40), "slow": _loop_op(60)}
    options = suites.SuiteOptions(rounds=1, min_time=0.2, peers=False)
    runs = {name: [] for name in ops}

    def measure(name):
        def run():
            records = suites.run_suite("regression_probe", options, ops=[ops[name]])
            runs[name].append(records)
            assert records[0].ok, records[0].error
            return records[0].min_ms
        return run

    # Interleaved: base, again and slow alternate round by round (ABBA), so load changes hit all three.
    baseline.measure_rounds({name: measure(name) for name in ops}, rounds=5)
    merged = {name: baseline.merge_rounds(runs[name]) for name in ops}
    assert len(baseline.rounds_of(merged["base"][0])) == 5
    problems = []
    same = baseline.compare(merged["again"], merged["base"])
    # Not flagged: nothing over the 10% threshold. A rerun may still land just outside the
    # measured noise on a loaded machine, which the comparison reports as a regression below
    # the threshold, not a failure.
    if not same.ok or same.failures:
        problems.append("rerun flagged: " + same.report())
    slow = baseline.compare(merged["slow"], merged["base"])
    if [c.key for c in slow.failures] != ["regression_probe|96x96|xla|forward"]:
        problems.append("1.5x slowdown not flagged: " + slow.report())
    elif not (slow.failures[0].method == "rounds" and slow.failures[0].ratio > 1.25):
        problems.append(f"1.5x slowdown measured as {slow.failures[0].ratio:.2f}x "
                        f"({slow.failures[0].method})")
    return problems


def test_rerun_is_not_flagged_and_a_1_5x_slowdown_is():
    # Wall-clock times on a 2-core CI runner that another test worker shares: a compile
    # in the other worker can halve this process's speed for seconds, longer than the
    # ABBA rounds can absorb (seen as a false 1.59x on a rerun and as a missed slowdown).
    # So the measurement is repeated, up to three times, until one is free of such an
    # episode; the bounds are not loosened, and a comparison that is wrong on a quiet
    # machine fails all three.
    attempts = []
    for _ in range(3):
        problems = _rerun_and_slowdown_verdicts()
        if not problems:
            return
        attempts.append(problems)
    pytest.fail("in all three measurements:\n" + "\n".join("; ".join(p) for p in attempts))


def test_suite_records_carry_their_rounds():
    records = suites.run_suite("regression_probe", suites.SuiteOptions(rounds=3, min_time=0.03),
                               ops=[_loop_op(5)])
    (r,) = records
    # Three rounds, or two when the case ran over its timing budget (each round warms up again).
    assert r.ok and len(baseline.rounds_of(r)) in (2, 3) and r.iterations >= 2
    # Each round's best time is one of the iterations; the best of them is the record's minimum.
    assert set(baseline.rounds_of(r)) <= set(r.times_ms) and min(baseline.rounds_of(r)) == r.min_ms
    again = report.load_records(report.to_json(records, env={}))[0][0]
    assert baseline.rounds_of(again) == baseline.rounds_of(r)  # survives the JSON file


# -- the budget -----------------------------------------------------------------------
def _many_case_op(name: str, family: str, steps: int = 2) -> Op:
    op = _loop_op(steps)
    op.name, op.family = name, family
    op._benchmarks = lambda platform: [Example(f"case{i}", (jax.ShapeDtypeStruct((8 + i, 96), jnp.float32),))
                                       for i in range(3)]
    return op


def test_budget_measures_every_op_first_and_counts_the_skipped(monkeypatch):
    fake = {"fam_a": [_many_case_op("a1", "fam_a"), _many_case_op("a2", "fam_a")],
            "fam_b": [_many_case_op("b1", "fam_b")]}
    monkeypatch.setattr(suites, "families", lambda ops=None: fake)
    records = suites.run_suites(None, suites.SuiteOptions(budget_s=0.0, rounds=1, min_time=0.005))
    measured = {(r.op, r.case) for r in records if r.ok}
    assert measured == {("a1", "case0"), ("a2", "case0"), ("b1", "case0")}
    assert len(records) == 9 and all(r.skipped == "time budget exhausted" for r in records if not r.ok)
    assert report.skip_summary(records) == "3 of 9 records measured, 6 skipped (6 time budget exhausted)"
    with pytest.raises(ValueError, match="matches no benchmark.*fam_a"):
        suites.run_suites(None, suites.SuiteOptions(case="no_such_case", rounds=1))
    only = suites.run_suites(["fam_b"], suites.SuiteOptions(case=r"\|case2\|", rounds=1, min_time=0.005))
    assert [(r.op, r.case) for r in only] == [("b1", "case2")]


def test_cli_prints_the_skip_summary_and_rejects_unknown_cases(capsys):
    assert bench_cli.main(["norm", "--max-cases", "2", "--modes", "forward", "--no-peers", "--budget", "0",
                           "--rounds", "1", "--min-time", "0.005"]) == 0
    err = capsys.readouterr().err
    assert "records measured" in err and "time budget exhausted" in err
    assert bench_cli.main(["norm", "--case", "no_such_case", "--quiet"]) == 2
    assert "matches no benchmark" in capsys.readouterr().err
    assert bench_cli.main(["norm", "--case", "(", "--quiet"]) == 2
    assert "not a valid regular expression" in capsys.readouterr().err
