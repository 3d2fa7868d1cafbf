"""Run `stellax check` jobs and report them: watched (a progress bar with one
row printed per finished check) or quietly (one JSON document at the end).

A row is a plain dict (the JSON schema):

``op, implementation, dtype, example, result`` (``"ok"``, ``"fail"`` or
``"skip"``), ``gradients`` (bool), ``rel_l2``, ``tolerance``, ``max_abs``,
``fraction_within`` (``None`` when nothing was compared), ``detail`` (why it
failed or was skipped), ``seconds`` (wall time of the check) and
``cpu_seconds`` (CPU time of this process during it: on a loaded machine the
wall time says little).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from typing import Iterable

from .plan import CheckJob, row_of
from .process_memory import host_memory, rss_now


@dataclasses.dataclass
class CheckReport:
    """Every row of one run and where it ran."""

    platform: str
    mode: str
    rows: list[dict] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    #: `MemoryWatch.summary` of the run (where the host memory peaked), when watched.
    memory_trace: dict = dataclasses.field(default_factory=dict)
    #: Seconds from the start to the first check (building the examples).
    examples_seconds: float | None = None

    def count(self, result: str) -> int:
        return sum(r["result"] == result for r in self.rows)

    @property
    def failures(self) -> int:
        return self.count("fail")

    def summary(self) -> dict:
        return {"checks": len(self.rows), "passed": self.count("ok"), "failed": self.failures,
                "skipped": self.count("skip"), "seconds": round(self.seconds, 2),
                "cpu_seconds": round(self.cpu_seconds, 2), "examples_seconds": self.examples_seconds,
                "host_memory": {**host_memory(), **self.memory_trace}}

    def to_json(self) -> dict:
        return {"platform": self.platform, "mode": self.mode, "rows": self.rows, "summary": self.summary()}


class MemoryWatch:
    """Samples this process's resident memory (`rss_now`) every ``interval`` seconds
    in a daemon thread while the ``with`` block runs (or from `start` to `stop`),
    keeping the largest sample, when it came and what ``running()`` said then (the
    checks in flight, or the `phase` the caller set): the process's ``peak_rss``
    alone cannot tell a peak while checks ran from one in start-up. The largest
    sample of each label is kept too (`summary`'s ``sampled_phases``).

    `stellax check` starts one before jax starts its backend and names its phases
    (``registering the ops``, ``planning the checks``, ...), so the whole process is watched."""

    #: Labels whose own peaks `summary` lists (the largest ones).
    PHASES_SHOWN = 6

    def __init__(self, running=None, interval: float = 0.1):
        self.created = time.perf_counter()
        self.phase_starts: dict[str, float] = {}
        self.phase = "start-up"
        self.running = running if running is not None else (lambda: self.phase)
        self.interval = interval
        self.peak, self.at, self.during = 0, 0.0, ""
        self.phase_peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="stellax-memory", daemon=True)

    def _sample(self) -> None:
        while True:
            rss = rss_now()
            if rss is not None:
                try:
                    label = self.running()
                except Exception as e:  # a label must not end the sampling
                    label = f"unlabelled ({type(e).__name__})"
                if rss > self.phase_peaks.get(label, 0):
                    self.phase_peaks[label] = rss
                if rss > self.peak:
                    self.peak, self.at, self.during = rss, time.perf_counter() - self.created, label
            if self._stop.wait(self.interval):
                return

    @property
    def phase(self) -> str:
        """What the process is doing (the samples' label until `running` is replaced);
        setting it records when each phase began (`summary`'s ``phase_starts``)."""
        return self._phase

    @phase.setter
    def phase(self, label: str) -> None:
        self._phase = label
        self.phase_starts.setdefault(label, round(time.perf_counter() - self.created, 2))

    def start(self) -> "MemoryWatch":
        """Start sampling, unless started already (returns self)."""
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (waits for the sampling thread to end)."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "MemoryWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict:
        """``{"sampled_peak": bytes, "sampled_peak_at": seconds, "sampled_peak_during": text,
        "sampled_phases": {label: bytes}, "phase_starts": {phase: seconds}}`` (the
        `PHASES_SHOWN` labels with the largest samples; when each `phase` began, from the
        watch's creation; empty where no sample was read)."""
        if not self.peak:
            return {}
        phases = sorted(self.phase_peaks.items(), key=lambda item: -item[1])[:self.PHASES_SHOWN]
        return {"sampled_peak": self.peak, "sampled_peak_at": round(self.at, 1), "sampled_peak_during": self.during,
                "sampled_phases": dict(phases), "phase_starts": dict(self.phase_starts)}


def _sequential(jobs: Iterable[CheckJob]):
    """The events of `workers.events`, run in this process."""
    cpu_start = time.process_time()
    for job in jobs:
        yield "start", job, None
        t0, c0 = time.perf_counter(), time.process_time()
        result = job.run()
        yield "done", job, row_of(job, result, time.perf_counter() - t0, time.process_time() - c0)
    yield "cpu", None, time.process_time() - cpu_start


def _run(jobs: list[CheckJob], report: CheckReport, *, workers: int = 1, threads: int = 1, on_start=None,
         on_row=None, watch: MemoryWatch | None = None) -> CheckReport:
    """Run ``jobs``, in ``workers`` processes (or ``threads`` threads of this process,
    for an accelerator only one process can hold) when they split into several
    (whole ops per worker: a single op runs here); rows in plan order at the end.
    ``watch``: a running `MemoryWatch` of the whole process (`stellax check`'s), which
    labels its samples by the checks in flight from here on and is stopped at the end;
    without one, the run is watched by its own."""
    from . import workers as workers_lib

    start = time.perf_counter()
    order = {id(job): i for i, job in enumerate(jobs)}
    if threads > 1 and len(jobs) > 1:
        stream = workers_lib.threaded_events(jobs, threads)
    elif workers > 1 and len(workers_lib.partition(jobs, workers)) > 1:
        stream = workers_lib.events(jobs, workers)
    else:
        stream = _sequential(jobs)
    done, running = [], {}

    def in_flight() -> str:
        if not done and not running:
            return "building the examples"
        return "; ".join(f"{j.op.name}/{j.implementation}/{j.dtype}" for j in list(running.values())) or "between checks"

    watch = watch if watch is not None else MemoryWatch()
    watch.phase = "building the examples"
    watch.running = in_flight
    with watch:
        for kind, job, value in stream:
            if kind == "start":
                if report.examples_seconds is None:
                    report.examples_seconds = round(time.perf_counter() - start, 1)
                running[id(job)] = job
                if on_start is not None:
                    on_start(job)
            elif kind == "done":
                running.pop(id(job), None)
                if workers <= 1:  # where the memory grows: this process ran the check
                    value["host_rss"] = rss_now()
                done.append((order[id(job)], value))
                if on_row is not None:
                    on_row(job, value)
            elif kind == "cpu":
                report.cpu_seconds += value
    report.memory_trace = watch.summary()
    report.rows = [row for _, row in sorted(done, key=lambda item: item[0])]
    report.seconds = time.perf_counter() - start
    return report


def run_quietly(jobs: list[CheckJob], *, platform: str, mode: str, workers: int = 1, threads: int = 1,
                watch: MemoryWatch | None = None) -> CheckReport:
    """Run every job, printing nothing (``watch``: as `_run`)."""
    return _run(jobs, CheckReport(platform, mode), workers=workers, threads=threads, watch=watch)


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


def _memory_text(memory: dict) -> str:
    if "peak_rss" not in memory:
        return ""
    gb = 1e9
    text = f"peak host RSS {memory['peak_rss'] / gb:.1f} GB"
    if memory.get("device_mapped"):
        text += (f" ({memory['device_mapped'] / gb:.1f} GB of it the accelerator's memory mapped in: "
                 f"{memory['peak_host'] / gb:.1f} GB host memory at the peak)")
    elif "anonymous" in memory:
        text += (f" (now {memory.get('rss', 0) / gb:.1f} GB: {memory['anonymous'] / gb:.1f} allocated, "
                 f"{memory.get('file', 0) / gb:.1f} file-mapped, {memory.get('shared', 0) / gb:.1f} shared)")
    if "sampled_peak" in memory:
        text += (f"; sampled peak {(memory['sampled_peak'] - memory.get('device_mapped', 0)) / gb:.1f} GB host "
                 f"at {memory['sampled_peak_at']:.0f} s ({memory['sampled_peak_during']})")
    return text + " "


def run_watched(jobs: list[CheckJob], console, *, platform: str, mode: str, workers: int = 1,
                threads: int = 1, watch: MemoryWatch | None = None) -> CheckReport:
    """Run every job under a progress bar (the op, implementation and dtype
    running, elapsed time), printing each row above it as it finishes, then a
    summary line (``watch``: as `_run`)."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    processes = f", {workers} worker processes" if workers > 1 else (f", {threads} threads" if threads > 1 else "")
    precision = getattr(jobs[0], "precision", None) if jobs else None
    precision = f", precision={precision}" if precision else ""
    console.print(f"stellax check ({mode}{precision}) on {platform}: {len(jobs)} checks{processes}", highlight=False)
    console.print(_HEADER, highlight=False)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    running: dict[int, str] = {}
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=len(jobs))

        def show() -> None:
            progress.update(task, description=escape(" | ".join(running.values()) or "finishing"))

        def on_start(job: CheckJob) -> None:
            running[id(job)] = job.description
            show()

        def on_row(job: CheckJob, row: dict) -> None:
            running.pop(id(job), None)
            progress.console.print(format_row(row), highlight=False)
            progress.advance(task)
            show()

        report = _run(jobs, CheckReport(platform, mode), workers=workers, threads=threads, on_start=on_start,
                      on_row=on_row, watch=watch)
    summary = report.summary()
    colour = "red" if report.failures else "green"
    first = summary["examples_seconds"]
    console.print(f"[{colour}]{summary['failed']} failure(s)[/], {summary['passed']} passed, "
                  f"{summary['skipped']} skipped, {summary['checks']} checks in {summary['seconds']:.1f} s "
                  f"{'' if first is None else f'(first check at {first:.0f} s) '}"
                  f"{_memory_text(summary['host_memory'])}"
                  f"({summary['cpu_seconds']:.1f} s CPU)", highlight=False)
    return report
