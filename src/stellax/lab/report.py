"""The evaluation report: its schema, its score and its plain-text summary.

One evaluation of one candidate yields one JSON object (`SCHEMA_VERSION`;
docs/lab.md documents every field). The fields a search ranks on:

* ``status``: ``"passed"`` (every tier passed or was skipped), ``"failed"``
  (a tier failed; ``first_failure`` names it), ``"crashed"`` (the child died:
  a signal or an exit without a report), ``"timeout"`` or ``"memory"``;
* ``score``: correctness first, speed second: a candidate that fails scores
  ``tiers_passed / tiers_total`` (in [0, 1)), one that passes scores
  ``1 + speedup`` (``speedup`` 0 when it was not timed, e.g. an interpreted
  kernel on a CPU).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

SCHEMA_VERSION = 1

#: The tiers, in the order they run.
TIERS = ("load", "contract", "numerics", "gradients", "determinism", "lowering", "compile", "benchmark")

STATUSES = ("passed", "failed", "crashed", "timeout", "memory")


def tier(name: str, status: str, seconds: float = 0.0, detail: str = "", error: Mapping | None = None,
         **extra: Any) -> dict:
    """One entry of ``report["tiers"]`` (status: passed, failed or skipped)."""
    if name not in TIERS:
        raise ValueError(f"tier: expected one of {TIERS}, got {name!r}")
    if status not in ("passed", "failed", "skipped"):
        raise ValueError(f"tier status: expected passed, failed or skipped, got {status!r}")
    out = {"name": name, "status": status, "seconds": round(float(seconds), 3), "detail": detail,
           "error": dict(error) if error else None}
    out.update(extra)
    return out


def score_of(report: Mapping) -> float:
    """Correctness first, speed second (see the module docstring)."""
    tiers = report.get("tiers") or []
    if report.get("status") != "passed":
        passed = sum(1 for t in tiers if t["status"] == "passed")
        return passed / len(TIERS)
    speedup = (report.get("benchmark") or {}).get("speedup")
    return 1.0 + (float(speedup) if speedup and math.isfinite(speedup) else 0.0)


def rank_key(report: Mapping) -> tuple:
    """Sort key of reports, best last: passed, then speedup, then tiers passed."""
    passed = report.get("status") == "passed"
    speedup = (report.get("benchmark") or {}).get("speedup") or 0.0
    tiers = sum(1 for t in report.get("tiers") or [] if t["status"] == "passed")
    return (passed, speedup if passed else 0.0, tiers)


def failure_report(op: str, candidate: Mapping, status: str, message: str, *, tier_name: str = "load",
                   tiers: Sequence[Mapping] = (), excerpt: str = "", wall_s: float = 0.0,
                   limits: Mapping | None = None) -> dict:
    """The report of a candidate whose child process did not report by itself
    (crash, timeout, memory) or that could not even start."""
    done = [dict(t) for t in tiers if t.get("status") in ("passed", "skipped")]
    error = {"type": status, "message": message, "excerpt": excerpt, "file": None, "line": None}
    done.append(tier(tier_name, "failed", detail=message, error=error))
    report = {
        "schema_version": SCHEMA_VERSION, "op": op, "candidate": dict(candidate), "status": status,
        "first_failure": {"tier": tier_name, **error}, "tiers": done, "numerics": None, "benchmark": None,
        "environment": {}, "limits": dict(limits or {}), "wall_s": round(wall_s, 3),
    }
    return finish(report)


def finish(report: dict) -> dict:
    """Fill in ``score`` and ``summary`` (call last)."""
    report["score"] = round(score_of(report), 6)
    report["summary"] = summary(report)
    return report


def _fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def summary(report: Mapping) -> str:
    """A short plain-text account written to be pasted into an LLM prompt."""
    cand = report.get("candidate") or {}
    lines = [f"stellax lab report (schema {report.get('schema_version')}): op {report.get('op')}, "
             f"candidate {cand.get('name') or cand.get('file') or '?'} ({cand.get('backend', '?')}): "
             f"{str(report.get('status')).upper()}, score {report.get('score', score_of(report)):.4f}"]
    marks = {"passed": "ok", "failed": "FAIL", "skipped": "skip"}
    lines.append("tiers: " + ", ".join(f"{t['name']} {marks[t['status']]}" for t in report.get("tiers") or []))
    failure = report.get("first_failure")
    if failure:
        where = ""
        if failure.get("file"):
            where = f" at {failure['file']}:{failure.get('line')}"
        lines.append(f"first failure: tier {failure['tier']}{where}: {failure.get('message', '')}"[:600])
        if failure.get("excerpt"):
            lines.append("excerpt:\n" + "\n".join("  " + l for l in str(failure["excerpt"]).splitlines()[-12:]))
    worst = (report.get("numerics") or {}).get("worst")
    if worst:
        lines.append(f"worst numeric error: rel_l2 {_fmt(worst.get('rel_l2'), '.2e')} (tolerance "
                     f"{_fmt(worst.get('tolerance'), '.1e')}), max_abs {_fmt(worst.get('max_abs'), '.2e')} at "
                     f"{worst.get('what')} index {worst.get('index')} on example '{worst.get('example')}' "
                     f"({worst.get('dtype')})")
    bench = report.get("benchmark")
    if bench and bench.get("cases"):
        lines.append(f"speed vs {bench.get('baseline')}: {_fmt(bench.get('speedup'))}x "
                     f"(geometric mean over {len(bench['cases'])} shapes; >1 is faster)")
        for case in bench["cases"]:
            lines.append(f"  {case['example']}: candidate {_fmt(case.get('candidate_ms'))} ms, "
                         f"{bench.get('baseline')} {_fmt(case.get('baseline_ms'))} ms, "
                         f"{_fmt(case.get('speedup'))}x, roofline {_fmt(case.get('pct_roofline'), '.1f')}%")
    elif bench and bench.get("skipped"):
        lines.append(f"benchmark skipped: {bench['skipped']}")
    return "\n".join(lines)
