"""Run `stellax check` jobs and report them: watched (a progress bar with one
row printed per finished check) or quietly (one JSON document at the end).

A row is a plain dict (the JSON schema):

``op, implementation, dtype, example, result`` (``"ok"``, ``"fail"`` or
``"skip"``), ``gradients`` (bool), ``rel_l2``, ``tolerance``, ``max_abs``,
``fraction_within`` (``None`` when nothing was compared), ``detail`` (why it
failed or was skipped) and ``seconds`` (wall time of the check).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Iterable

from .plan import CheckJob
from .validation import CheckResult


@dataclasses.dataclass
class CheckReport:
    """Every row of one run and where it ran."""

    platform: str
    mode: str
    rows: list[dict] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    def count(self, result: str) -> int:
        return sum(r["result"] == result for r in self.rows)

    @property
    def failures(self) -> int:
        return self.count("fail")

    def summary(self) -> dict:
        return {"checks": len(self.rows), "passed": self.count("ok"), "failed": self.failures,
                "skipped": self.count("skip"), "seconds": round(self.seconds, 2)}

    def to_json(self) -> dict:
        return {"platform": self.platform, "mode": self.mode, "rows": self.rows, "summary": self.summary()}


def row_of(job: CheckJob, result: CheckResult, seconds: float) -> dict:
    """The report row of one finished check."""
    w = result.worst
    outcome = "skip" if result.skipped else ("ok" if result.passed else "fail")
    return {
        "op": result.op, "implementation": result.implementation, "dtype": result.dtype,
        "example": result.example, "gradients": job.gradients, "result": outcome,
        "rel_l2": None if w is None else w.rel_l2, "tolerance": None if w is None else w.tolerance,
        "max_abs": None if w is None else w.max_abs,
        "fraction_within": None if w is None else w.fraction_within,
        "detail": result.skipped or result.detail, "seconds": round(seconds, 3),
    }


def _run(jobs: Iterable[CheckJob], report: CheckReport, on_row=None) -> CheckReport:
    start = time.perf_counter()
    for job in jobs:
        t0 = time.perf_counter()
        result = job.run()
        row = row_of(job, result, time.perf_counter() - t0)
        report.rows.append(row)
        if on_row is not None:
            on_row(job, row)
    report.seconds = time.perf_counter() - start
    return report


def run_quietly(jobs: list[CheckJob], *, platform: str, mode: str) -> CheckReport:
    """Run every job, printing nothing."""
    return _run(jobs, CheckReport(platform, mode))


def write_json(report: CheckReport, path: str) -> None:
    """The report as one JSON document to ``path`` (``"-"``: stdout)."""
    text = json.dumps(report.to_json(), indent=1)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


_HEADER = f"{'result':<6} {'op':<34} {'impl':<12} {'dtype':<9} {'grad':<4} {'rel L2 (tol)':<18} " \
          f"{'max abs':<8} {'% within':>8} {'time':>6}  example"


def format_row(row: dict) -> str:
    """One fixed-width line for a row (rich markup for the result; the example
    label and detail are escaped)."""
    from rich.markup import escape

    colour = {"ok": "green", "fail": "red", "skip": "yellow"}[row["result"]]
    result = f"[{colour}]{row['result'].upper() if row['result'] == 'fail' else row['result']:<6}[/]"
    if row["rel_l2"] is None:
        errors = f"{'':<18} {'':<8} {'':>8}"
    else:
        errors = (f"{row['rel_l2']:.1e} ({row['tolerance']:.0e})".ljust(18)
                  + f" {row['max_abs']:<8.1e} {100 * row['fraction_within']:>8.1f}")
    line = (f"{result} {row['op']:<34} {row['implementation']:<12} {row['dtype']:<9} "
            f"{'yes' if row['gradients'] else 'no':<4} {errors} {row['seconds']:>5.1f}s  {escape(row['example'])}")
    if row["detail"]:
        line += f"\n       [{colour}]{escape(row['detail'])}[/]"
    return line


def run_watched(jobs: list[CheckJob], console, *, platform: str, mode: str) -> CheckReport:
    """Run every job under a progress bar (op, implementation, dtype, elapsed),
    printing each row above it as it finishes, then a summary line."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console.print(f"stellax check ({mode}) on {platform}: {len(jobs)} checks", highlight=False)
    console.print(_HEADER, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=len(jobs))

        def describe(job: CheckJob) -> str:
            return escape(job.description)

        def on_row(job: CheckJob, row: dict) -> None:
            progress.console.print(format_row(row), highlight=False)
            progress.advance(task)

        def announced(jobs):
            for job in jobs:
                progress.update(task, description=describe(job))
                yield job

        report = _run(announced(jobs), CheckReport(platform, mode), on_row)
    summary = report.summary()
    colour = "red" if report.failures else "green"
    console.print(f"[{colour}]{summary['failed']} failure(s)[/], {summary['passed']} passed, "
                  f"{summary['skipped']} skipped, {summary['checks']} checks in {summary['seconds']:.1f} s",
                  highlight=False)
    return report
