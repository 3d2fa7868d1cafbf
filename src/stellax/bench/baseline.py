"""Regression tracking: compare benchmark records with a baseline.

Two measurements of the same key (op, case, implementation, mode) differ
*beyond noise* when their medians differ by more than
``noise_k × max(IQR_baseline, IQR_current, min_rel × median_baseline)``:
the interquartile ranges of the two runs say how much the time moves from
iteration to iteration on that machine, so a change inside them is noise.
A slowdown beyond noise is a regression; it *fails* (non-zero exit of
``stellax bench --baseline``) when it is also over ``threshold`` (relative).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .measurement import BenchmarkRecord


@dataclasses.dataclass
class Change:
    key: str
    baseline_ms: float | None
    current_ms: float | None
    ratio: float | None  # current / baseline (> 1: slower)
    noise_ms: float | None
    status: str  # regression | improvement | unchanged | new | missing | failed
    fails: bool = False

    def describe(self) -> str:
        if self.ratio is None:
            return f"{self.status:<11} {self.key}"
        return (f"{self.status:<11} {self.key}: {self.baseline_ms:.4g} ms -> {self.current_ms:.4g} ms "
                f"({self.ratio:.2f}x time, noise ±{self.noise_ms:.2g} ms)")


@dataclasses.dataclass
class Comparison:
    changes: list
    threshold: float

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.status == "regression"]

    @property
    def improvements(self) -> list[Change]:
        return [c for c in self.changes if c.status == "improvement"]

    @property
    def failures(self) -> list[Change]:
        return [c for c in self.changes if c.fails]

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        lines = [f"baseline comparison: {len(self.regressions)} regression(s), {len(self.improvements)} "
                 f"improvement(s) beyond noise, {len(self.failures)} over the {100 * self.threshold:.0f}% "
                 f"threshold; {sum(c.status == 'unchanged' for c in self.changes)} unchanged"]
        for c in self.changes:
            if c.status in ("regression", "improvement", "failed"):
                lines.append(("FAIL " if c.fails else "     ") + c.describe())
        new = [c.key for c in self.changes if c.status == "new"]
        missing = [c.key for c in self.changes if c.status == "missing"]
        if new:
            lines.append(f"     new (no baseline): {len(new)}")
        if missing:
            lines.append(f"     missing (in the baseline only): {len(missing)}")
        return "\n".join(lines)


def _iqr(r: BenchmarkRecord) -> float:
    if r.iqr_ms is not None:
        return float(r.iqr_ms)
    return 0.0


def compare(current: Sequence[BenchmarkRecord], baseline: Sequence[BenchmarkRecord], *, threshold: float = 0.10,
            noise_k: float = 2.0, min_rel: float = 0.02) -> Comparison:
    """Match records by key and classify every change (see the module docstring)."""
    base = {r.key: r for r in baseline}
    cur = {r.key: r for r in current}
    changes = []
    for key, r in cur.items():
        b = base.get(key)
        if b is None or not b.ok:
            changes.append(Change(key, None, r.median_ms, None, None, "new"))
            continue
        if not r.ok:
            status = "failed" if r.error else "missing"
            changes.append(Change(key, b.median_ms, None, None, None, status, fails=bool(r.error)))
            continue
        noise = noise_k * max(_iqr(b), _iqr(r), min_rel * b.median_ms)
        delta = r.median_ms - b.median_ms
        ratio = r.median_ms / b.median_ms if b.median_ms else None
        if delta > noise:
            status = "regression"
        elif -delta > noise:
            status = "improvement"
        else:
            status = "unchanged"
        fails = status == "regression" and ratio is not None and ratio - 1.0 > threshold
        changes.append(Change(key, b.median_ms, r.median_ms, ratio, noise, status, fails))
    for key in base:
        if key not in cur:
            changes.append(Change(key, base[key].median_ms, None, None, None, "missing"))
    order = {"regression": 0, "failed": 1, "improvement": 2, "unchanged": 3, "new": 4, "missing": 5}
    changes.sort(key=lambda c: (order[c.status], -(c.ratio or 0)))
    return Comparison(changes, threshold)
