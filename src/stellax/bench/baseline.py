"""Regression tracking: compare benchmark records with a baseline.

A suite measures every case in several *rounds* (``rounds_ms``: the fastest
iteration of each round; `RoundsRecord`). On a shared machine interference
only ever adds time, and it comes in bursts: a burst can slow most iterations
of a round (and so its median), rarely all of them, and rarely most rounds.
Two measurements of the same key (op, case, implementation, mode) are
therefore compared on the median over rounds of each round's best time, and
the noise band comes from the rounds' spread:

    noise = max(noise_k × SE, min_rel × baseline)
    SE    = 1.2533 × sqrt(s_b² / n_b + s_c² / n_c)

where ``s = 1.4826 × MAD`` is a robust standard deviation of a side's rounds
(one round hit by a burst does not widen it) and 1.2533 the standard error
factor of a median. Records without rounds (older result files) fall back to
the interquartile range of the iterations:
``noise = noise_k × max(IQR_b, IQR_c, min_rel × median_b)``.

A slowdown beyond the noise is a *regression*; it *fails* (non-zero exit of
``stellax bench --baseline``) only when it is also over ``threshold``
(relative), so the same benchmark run twice on a quiet machine fails nothing
(the threshold absorbs run-to-run offsets the rounds cannot see) while a
real 1.5× slowdown exceeds both.

`measure_rounds` alternates several measurements round by round (ABBA
order), so that load changes on a shared machine hit every side alike;
`stellax bench bisect` compares commits that way.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from .measurement import BenchmarkRecord

MEDIAN_SE = math.sqrt(math.pi / 2)  # standard error of a median / (sigma / sqrt(n)) for normal data


@dataclasses.dataclass
class RoundsRecord(BenchmarkRecord):
    """A `BenchmarkRecord` measured in several rounds; ``rounds_ms`` holds
    each round's fastest iteration (ms). ``times_ms`` holds every iteration
    of every round, so the record's median/IQR are over all iterations."""

    rounds_ms: list = dataclasses.field(default_factory=list)


def with_rounds(record: BenchmarkRecord, rounds_ms: Sequence[float]) -> RoundsRecord:
    """``record`` as a `RoundsRecord` carrying the per-round times."""
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(BenchmarkRecord)}
    return RoundsRecord(**fields, rounds_ms=[float(t) for t in rounds_ms])


def rounds_of(record: BenchmarkRecord) -> list[float]:
    """The per-round times of ``record`` (empty for a record measured without rounds)."""
    return [float(t) for t in (getattr(record, "rounds_ms", None) or [])]


def merge_rounds(runs: Sequence[Sequence[BenchmarkRecord]]) -> list[RoundsRecord]:
    """Merge several runs of the same cases into one record per key: the rounds
    of every run (a run without rounds counts as one round: its minimum), and
    every iteration, with the median/IQR recomputed over them. A key that
    failed in any run keeps that run's failed record."""
    from .timing import summarize

    by_key: dict[str, list[BenchmarkRecord]] = {}
    for run in runs:
        for r in run:
            by_key.setdefault(r.key, []).append(r)
    merged = []
    for key, recs in by_key.items():
        bad = next((r for r in recs if not r.ok), None)
        if bad is not None:
            merged.append(with_rounds(bad, rounds_of(bad)))
            continue
        times = [float(t) for r in recs for t in r.times_ms]
        rounds = [t for r in recs for t in (rounds_of(r) or [float(r.min_ms if r.min_ms is not None
                                                                   else r.median_ms)])]
        out = with_rounds(recs[0], rounds)
        if times:
            s = summarize(times)
            out.times_ms, out.median_ms, out.min_ms, out.mean_ms = times, s.median, s.min, s.mean
            out.p25_ms, out.p75_ms, out.iqr_ms, out.iterations = s.p25, s.p75, s.iqr, s.n
        merged.append(out)
    return merged


def spread(samples: Sequence[float]) -> float:
    """A robust standard deviation of ``samples``: 1.4826 × their median absolute deviation
    (an outlier does not widen it); 0 for fewer than 2."""
    x = np.asarray(list(samples), dtype=np.float64)
    if x.size < 2:
        return 0.0
    return 1.4826 * float(np.median(np.abs(x - np.median(x))))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The comparison of two sets of samples (ms)."""

    baseline_ms: float
    current_ms: float
    ratio: float | None  # current / baseline (> 1: slower)
    noise_ms: float
    status: str  # regression | improvement | unchanged
    fails: bool


def compare_samples(baseline: Sequence[float], current: Sequence[float], *, threshold: float = 0.10,
                    noise_k: float = 2.0, min_rel: float = 0.02) -> Verdict:
    """Compare the medians of two sets of round times with a noise band from
    their spread (see the module docstring)."""
    base = [float(t) for t in baseline]
    cur = [float(t) for t in current]
    if not base or not cur:
        raise ValueError(f"compare_samples: need at least one time per side, got {len(base)} baseline and "
                         f"{len(cur)} current")
    b, c = float(np.median(base)), float(np.median(cur))
    se = MEDIAN_SE * math.sqrt(spread(base) ** 2 / len(base) + spread(cur) ** 2 / len(cur))
    return _verdict(b, c, max(noise_k * se, min_rel * b), threshold)


def _verdict(b: float, c: float, noise: float, threshold: float) -> Verdict:
    delta = c - b
    ratio = c / b if b else None
    if delta > noise:
        status = "regression"
    elif -delta > noise:
        status = "improvement"
    else:
        status = "unchanged"
    fails = status == "regression" and ratio is not None and ratio - 1.0 > threshold
    return Verdict(b, c, ratio, noise, status, fails)


def measure_rounds(measures: Mapping[str, Callable[[], float | Sequence[float]]], rounds: int = 3, *,
                   progress: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    """Call every measurement once per round, alternating them (ABBA: the order
    is reversed every other round) so drifting load on a shared machine hits
    each alike. A measurement returns milliseconds, or a list of them (rounds
    it measured itself). Returns name → all its times."""
    if rounds < 1:
        raise ValueError(f"rounds: expected at least 1, got {rounds}")
    names = list(measures)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            value = measures[name]()
            values = [value] if isinstance(value, (int, float)) else list(value)
            if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values):
                raise ValueError(f"measurement {name!r} (round {r + 1}): expected a positive time in ms, "
                                 f"got {value!r}")
            out[name].extend(float(v) for v in values)
            if progress:
                progress(f"round {r + 1}/{rounds} {name}: " + ", ".join(f"{v:.4g}" for v in values) + " ms")
    return out


@dataclasses.dataclass
class Change:
    key: str
    baseline_ms: float | None
    current_ms: float | None
    ratio: float | None  # current / baseline (> 1: slower)
    noise_ms: float | None
    status: str  # regression | improvement | unchanged | new | missing | failed
    fails: bool = False
    method: str = ""  # "rounds" or "iqr": where the noise band came from

    def describe(self) -> str:
        if self.ratio is None:
            return f"{self.status:<11} {self.key}"
        return (f"{self.status:<11} {self.key}: {self.baseline_ms:.4g} ms -> {self.current_ms:.4g} ms "
                f"({self.ratio:.2f}x time, noise ±{self.noise_ms:.2g} ms{', ' + self.method if self.method else ''})")


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


def compare_records(current: BenchmarkRecord, baseline: BenchmarkRecord, *, threshold: float = 0.10,
                    noise_k: float = 2.0, min_rel: float = 0.02) -> tuple[Verdict, str]:
    """Compare two successful records of one key: on their rounds when both
    have at least two, else on the iteration IQRs. Returns the verdict and
    the method (``"rounds"`` or ``"iqr"``)."""
    base_rounds, cur_rounds = rounds_of(baseline), rounds_of(current)
    if len(base_rounds) >= 2 and len(cur_rounds) >= 2:
        return compare_samples(base_rounds, cur_rounds, threshold=threshold, noise_k=noise_k,
                               min_rel=min_rel), "rounds"
    noise = noise_k * max(_iqr(baseline), _iqr(current), min_rel * baseline.median_ms)
    return _verdict(baseline.median_ms, current.median_ms, noise, threshold), "iqr"


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
        v, method = compare_records(r, b, threshold=threshold, noise_k=noise_k, min_rel=min_rel)
        changes.append(Change(key, v.baseline_ms, v.current_ms, v.ratio, v.noise_ms, v.status, v.fails, method))
    for key in base:
        if key not in cur:
            changes.append(Change(key, base[key].median_ms, None, None, None, "missing"))
    order = {"regression": 0, "failed": 1, "improvement": 2, "unchanged": 3, "new": 4, "missing": 5}
    changes.sort(key=lambda c: (order[c.status], -(c.ratio or 0)))
    return Comparison(changes, threshold)
