"""Benchmark history: one JSON line per `stellax bench --record DIR` run.

Each line of ``DIR/history.jsonl`` is one run: when, the git commit of the
stellax source tree (when it is a checkout), the stellax / jax versions, the
device, and per case (record key ``op|case|implementation|mode``) the median
time, the spread and the rounds' best times. A run is appended with a single
``write`` of the complete line on a file opened for appending, so readers and
concurrent writers never see half a run. `load` names the file and line of
anything it cannot read; `table` and `plot` show each case over time.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Sequence

from rich.table import Table

from .baseline import rounds_of, spread
from .measurement import BenchmarkRecord

FILE_NAME = "history.jsonl"
FORMAT = "stellax-bench-history"
FORMAT_VERSION = 1


class HistoryError(ValueError):
    """A history file that cannot be read (the message names the file and line)."""


def history_path(target: str | os.PathLike) -> Path:
    """The history file of ``target``: ``target/history.jsonl`` for a directory (existing or not),
    ``target`` itself when it names a ``.jsonl`` file."""
    path = Path(target)
    if path.suffix == ".jsonl" and not path.is_dir():
        return path
    return path / FILE_NAME


def _spread_ms(record: BenchmarkRecord) -> float | None:
    """A standard deviation of the record's time: from its rounds, else from its IQR (IQR / 1.349)."""
    rounds = rounds_of(record)
    if len(rounds) >= 2:
        return spread(rounds)
    return record.iqr_ms / 1.349 if record.iqr_ms is not None else None


def make_entry(records: Sequence[BenchmarkRecord], env: dict[str, Any]) -> dict[str, Any]:
    """The history entry of one run (``env`` as from `report.environment`)."""
    cases = {}
    for r in records:
        if not r.ok:
            continue
        cases[r.key] = {"suite": r.suite, "median_ms": float(r.median_ms), "spread_ms": _spread_ms(r),
                        "iqr_ms": r.iqr_ms, "min_ms": r.min_ms, "rounds_ms": rounds_of(r),
                        "iterations": r.iterations}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "created": env.get("created"),
        "commit": env.get("git_commit"), "stellax": env.get("stellax"), "jax": env.get("jax"),
        "jaxlib": env.get("jaxlib"), "device": env.get("device"), "device_kind": env.get("device_kind"),
        "backend": env.get("backend"), "timers": sorted({r.timer for r in records if r.ok and r.timer}),
        "skipped": sum(1 for r in records if r.skipped is not None),
        "failed": sum(1 for r in records if r.error is not None),
        "cases": cases,
    }


def append(target: str | os.PathLike, entry: dict[str, Any]) -> Path:
    """Append ``entry`` as one line to the history of ``target``; returns the file.

    The line is serialized completely first (a value JSON cannot hold raises
    before anything is written), then written with one ``write`` on a file
    opened with ``O_APPEND``. If the file does not end in a newline (a writer
    that died mid-line), the new entry starts on a fresh line."""
    _validate(entry, "entry", 0)
    line = json.dumps(entry, sort_keys=True, allow_nan=False, separators=(",", ":")) + "\n"
    path = history_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        if os.fstat(fd).st_size and not _ends_with_newline(path):
            line = "\n" + line
        data = line.encode("utf-8")
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(f"{path}: short write ({written} of {len(data)} bytes); the last line may be cut off")
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _validate(entry: Any, where: str, lineno: int) -> None:
    """Raise `HistoryError` unless ``entry`` looks like a history entry."""
    at = f"{where}, line {lineno}" if lineno else where
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        found = entry.get("format") if isinstance(entry, dict) else type(entry).__name__
        raise HistoryError(f"{at}: not a stellax bench history entry (expected an object with "
                           f"format {FORMAT!r}, got {found!r})")
    if entry.get("format_version") != FORMAT_VERSION:
        raise HistoryError(f"{at}: history format_version {entry.get('format_version')!r} is not "
                           f"{FORMAT_VERSION} (written by another stellax version)")
    cases = entry.get("cases")
    if not isinstance(cases, dict):
        raise HistoryError(f"{at}: 'cases' should be an object of case → times, got {type(cases).__name__}")
    for key, case in cases.items():
        median = case.get("median_ms") if isinstance(case, dict) else None
        if not isinstance(median, (int, float)) or not math.isfinite(median) or median <= 0:
            raise HistoryError(f"{at}: case {key!r} has no positive median_ms (got {median!r})")


def load(target: str | os.PathLike) -> list[dict[str, Any]]:
    """Every entry of the history of ``target`` (oldest first). Raises
    `HistoryError` naming the file and line of the first bad line, or when
    there is no history file."""
    path = history_path(target)
    if not path.is_file():
        raise HistoryError(f"{path}: no benchmark history there (record runs with "
                           f"`stellax bench --record {path.parent}`)")
    entries = []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as e:
                raise HistoryError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                   f"fix or delete that line") from None
            _validate(entry, str(path), lineno)
            entries.append(entry)
    return entries


def case_keys(entries: Sequence[dict], pattern: str | None = None) -> list[str]:
    """The case keys of the history (first seen first), those matching ``pattern`` (a regular expression)."""
    regex = re.compile(pattern) if pattern else None
    keys = dict.fromkeys(k for e in entries for k in e["cases"])
    out = [k for k in keys if regex is None or regex.search(k)]
    if regex is not None and not out:
        raise HistoryError(f"case pattern {pattern!r} matches none of the {len(keys)} cases in the history"
                           + (f" (e.g. {list(keys)[:3]})" if keys else ""))
    return out


def run_label(entry: dict, index: int) -> str:
    """A short name for a run: its index, commit and date."""
    commit = (entry.get("commit") or "")[:9]
    date = (entry.get("created") or "")[:10]
    return f"#{index}" + (f" {commit}" if commit else "") + (f" {date}" if date else "")


def table(entries: Sequence[dict], pattern: str | None = None, last: int = 8) -> Table:
    """A table: one row per case, the median (ms) of the last ``last`` runs, and last / first."""
    shown = list(enumerate(entries))[-last:] if last > 0 else list(enumerate(entries))
    keys = case_keys(entries, pattern)
    t = Table(title=f"stellax bench history: {len(entries)} run(s), {len(keys)} case(s)", padding=(0, 1))
    t.add_column("case", overflow="fold", max_width=60)
    for i, e in shown:
        t.add_column(run_label(e, i), justify="right")
    t.add_column("last / first", justify="right")
    for key in keys:
        cells = [_cell(e["cases"].get(key)) for _, e in shown]
        times = [e["cases"][key]["median_ms"] for e in entries if key in e["cases"]]
        ratio = f"{times[-1] / times[0]:.2f}x" if len(times) >= 2 else "-"
        t.add_row(key, *cells, ratio)
    return t


def _cell(case: dict | None) -> str:
    if case is None:
        return "-"
    text = f"{case['median_ms']:.4g}"
    if case.get("spread_ms"):
        text += f" ±{case['spread_ms']:.2g}"
    return text


def plot(entries: Sequence[dict], out: str | os.PathLike, pattern: str | None = None) -> list[str]:
    """Draw each case's median over the runs (log scale, error bars: spread).
    ``out`` ending in ``.png``: one file with one panel per suite; otherwise a
    directory with one ``history-<suite>.png`` per suite. Needs matplotlib."""
    from .report import matplotlib_available

    ok, reason = matplotlib_available()
    if not ok:
        raise ImportError(reason)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = case_keys(entries, pattern)
    by_suite: dict[str, list[str]] = {}
    for key in keys:
        suite = next((e["cases"][key].get("suite") for e in entries if key in e["cases"]), None) or "custom"
        by_suite.setdefault(suite, []).append(key)
    labels = [run_label(e, i) for i, e in enumerate(entries)]
    out = Path(out)
    single = out.suffix == ".png"
    if single:
        fig, axes = plt.subplots(len(by_suite), 1, figsize=(max(7.0, 0.9 * len(entries) + 5), 3.6 * len(by_suite)),
                                 squeeze=False)
        panels = list(zip(by_suite.items(), axes[:, 0]))
    else:
        panels = []
        for item in by_suite.items():
            fig_one, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(entries) + 5), 4.2))
            panels.append((item, ax))
    paths = []
    for (suite, suite_keys), ax in panels:
        for key in suite_keys:
            xs = [i for i, e in enumerate(entries) if key in e["cases"]]
            ys = [entries[i]["cases"][key]["median_ms"] for i in xs]
            errs = [entries[i]["cases"][key].get("spread_ms") or 0.0 for i in xs]
            ax.errorbar(xs, ys, yerr=errs, marker="o", markersize=3, capsize=2, linewidth=1,
                        label=key)
        ax.set_yscale("log")
        ax.set_ylabel("median ms (log)")
        ax.set_title(f"stellax bench history: {suite}")
        ax.set_xticks(range(len(entries)))
        ax.set_xticklabels(labels, fontsize=6, rotation=30, ha="right")
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        if not single:
            outdir = out
            outdir.mkdir(parents=True, exist_ok=True)
            path = outdir / f"history-{suite}.png"
            ax.figure.tight_layout()
            _save(ax.figure, path)
            plt.close(ax.figure)
            paths.append(str(path))
    if single:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        _save(fig, out)
        plt.close(fig)
        paths.append(str(out))
    return paths


def _save(fig, path: Path) -> None:
    """Save a figure through a temporary file, so a failed save leaves no partial PNG."""
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


__all__ = ["FILE_NAME", "FORMAT", "HistoryError", "append", "case_keys", "history_path", "load", "make_entry",
           "plot", "table"]
