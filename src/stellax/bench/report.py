"""Reports of benchmark records: console table, JSON, markdown, PNG plots."""

from __future__ import annotations

import datetime
import json
import os
import platform as pyplatform
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jaxlib
import numpy as np
from rich.console import Console
from rich.table import Table

from .._version import __version__
from .._files import atomic_write_text
from ..core.platform import current_platform, interpret_enabled
from .baseline import RoundsRecord
from .measurement import BenchmarkRecord
from .suites import speedups

FORMAT = "stellax-bench"


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""


    plat = current_platform()
    env = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "stellax": __version__, "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", "?"),
        "python": sys.version.split()[0], "machine": pyplatform.machine(), "os": pyplatform.platform(),
        "backend": plat.backend, "device_kind": plat.device_kind, "device": plat.describe(),
        "device_count": jax.device_count(), "interpret": interpret_enabled(),
    }
    try:
        root = Path(__file__).resolve().parents[3]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5)
        if commit.returncode == 0:
            env["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def to_json(records: Sequence[BenchmarkRecord], *, env: dict | None = None, peaks=None,
            extra: dict | None = None) -> dict:
    return {"format": FORMAT, "format_version": 1, "environment": env or environment(),
            "peaks": peaks.to_json() if peaks is not None else None,
            "records": [r.to_json() for r in records], **(extra or {})}


def write_json(path: str | os.PathLike, records, **kwargs) -> str:
    text = json.dumps(to_json(records, **kwargs), indent=1, default=_json_default) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        return "-"

    atomic_write_text(Path(path), text)
    return str(path)


def _json_default(value):
    try:

        if isinstance(value, np.generic):
            return value.item()
    except ImportError:  # pragma: no cover
        pass
    return repr(value)


def load_records(path_or_data) -> tuple[list[BenchmarkRecord], dict]:
    """Records and environment from a `stellax bench --json` file or a GPU
    suite result (its ``bench`` section)."""
    if isinstance(path_or_data, (str, os.PathLike)):
        data = json.loads(Path(path_or_data).read_text())
    else:
        data = path_or_data
    if isinstance(data, dict) and "records" not in data and isinstance(data.get("bench"), dict):
        data = data["bench"]
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError("not a stellax benchmark result (no 'records' list)")
    return [RoundsRecord.from_json(r) for r in data["records"]], data.get("environment", {})


def skip_reason(record: BenchmarkRecord) -> str | None:
    """The short reason a record was not measured (``None`` when it was or when it failed):
    the text before the first ``:``, at most 60 characters."""
    if record.skipped is None:
        return None
    return record.skipped.split(":", 1)[0].strip()[:60] or "skipped"


def skip_summary(records: Sequence[BenchmarkRecord]) -> str:
    """One line: how many records were measured, skipped (by reason, most first) and failed."""
    reasons: dict[str, int] = {}
    for r in records:
        reason = skip_reason(r)
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + 1
    skipped = sum(reasons.values())
    failed = sum(1 for r in records if r.error is not None)
    measured = sum(1 for r in records if r.ok)
    line = f"{measured} of {len(records)} records measured, {skipped} skipped"
    if reasons:
        line += " (" + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])) + ")"
    if failed:
        line += f", {failed} failed"
    return line


def _fmt(value, spec: str, empty: str = "-") -> str:
    if value is None:
        return empty
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


COLUMNS = ("suite", "op", "case", "impl", "mode", "median ms", "IQR ms", "min ms", "TFLOP/s", "GB/s",
           "% roof", "vs xla", "compile s", "peak MiB", "note")


def rows(records: Sequence[BenchmarkRecord]) -> list[list[str]]:
    fast = speedups(records)
    out = []
    for r in records:
        if not r.ok:
            status = f"error: {r.error}" if r.error else f"skipped: {r.skipped}"
            out.append([r.suite or "", r.op or r.name, r.case or "", r.implementation or "", r.mode,
                        "", "", "", "", "", "", "", "", "", status[:120]])
            continue
        roof = r.roofline or {}
        out.append([
            r.suite or "", r.op or r.name, r.case or "", r.implementation or "", r.mode,
            _fmt(r.median_ms, ".4g"), _fmt(r.iqr_ms, ".2g"), _fmt(r.min_ms, ".4g"),
            _fmt(roof.get("tflops"), ".3g"), _fmt(roof.get("gbps"), ".4g"), _fmt(roof.get("pct_roofline"), ".0f"),
            _fmt(fast.get(r.key), ".2f") + ("x" if r.key in fast else ""),
            _fmt(r.compile_time_s, ".2f"),
            _fmt(r.peak_memory_bytes / 2**20 if r.peak_memory_bytes else None, ".1f"), "",
        ])
    return out


def print_table(records: Sequence[BenchmarkRecord], *, title: str = "", console=None) -> None:

    console = console or Console(width=max(Console().width, 180))
    table = Table(title=title or None, padding=(0, 1))
    for column in COLUMNS[1:]:
        if column == "case":
            table.add_column(column, overflow="fold", min_width=24, max_width=40)
        elif column == "note":
            table.add_column(column, overflow="ellipsis", no_wrap=True, max_width=50)
        else:
            table.add_column(column, no_wrap=True,
                             justify="left" if column in ("op", "impl", "mode") else "right")
    for row in rows(records):
        table.add_row(*row[1:])
    console.print(table)


def markdown(records: Sequence[BenchmarkRecord], *, env: dict | None = None, title: str = "stellax benchmarks",
             extra_sections: Sequence[str] = ()) -> str:
    """A markdown report: environment, then one table per suite."""
    env = env if env is not None else environment()
    lines = [f"# {title}", ""]
    if env:
        lines.append(f"{env.get('device', env.get('device_kind', '?'))}, stellax {env.get('stellax', '?')}, "
                     f"jax {env.get('jax', '?')}, python {env.get('python', '?')}, {env.get('created', '')}"
                     + (f", commit {env['git_commit']}" if env.get("git_commit") else ""))
        lines.append("")
    timers = sorted({r.timer for r in records if r.ok and r.timer})
    if timers:
        lines.append(f"Times are medians over rotated random inputs (timer: {', '.join(timers)}); "
                     "`% roof` is the roofline time (FLOP and byte models over the device peaks) over the "
                     "measured time; `vs xla` is the speedup over the XLA implementation.")
        lines.append("")
    by_suite: dict[str, list] = {}
    for r, row in zip(records, rows(records)):
        by_suite.setdefault(r.suite or "custom", []).append(row)
    for suite, suite_rows in by_suite.items():
        lines += [f"## {suite}", "", "| " + " | ".join(COLUMNS[1:]) + " |",
                  "|" + "---|" * (len(COLUMNS) - 1)]
        for row in suite_rows:
            lines.append("| " + " | ".join(cell.replace("|", "/") for cell in row[1:]) + " |")
        lines.append("")
    for section in extra_sections:
        lines += [section, ""]
    return "\n".join(lines).rstrip() + "\n"


def matplotlib_available() -> tuple[bool, str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False, "matplotlib is not installed (pip install 'stellax[bench]'); skipping plots"
    return True, ""


def plot(records: Sequence[BenchmarkRecord], outdir: str | os.PathLike) -> list[str]:
    """One PNG per suite: median time per case, one bar per implementation
    and mode (log scale), annotated with % of roofline. Needs matplotlib."""
    ok, reason = matplotlib_available()
    if not ok:
        raise ImportError(reason)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    by_suite: dict[str, list[BenchmarkRecord]] = {}
    for r in records:
        if r.ok:
            by_suite.setdefault(r.suite or "custom", []).append(r)
    for suite, recs in by_suite.items():
        cases = list(dict.fromkeys(f"{r.op}\n{r.case}" if r.op else r.name for r in recs))
        series = list(dict.fromkeys(f"{r.implementation or r.name} [{r.mode}]" for r in recs))
        width = 0.8 / max(1, len(series))
        fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cases) * max(1, len(series)) / 3 + 3), 4.8))
        for j, s in enumerate(series):
            xs, ys, labels = [], [], []
            for i, c in enumerate(cases):
                for r in recs:
                    case_name = f"{r.op}\n{r.case}" if r.op else r.name
                    if case_name == c and f"{r.implementation or r.name} [{r.mode}]" == s:
                        xs.append(i + (j - (len(series) - 1) / 2) * width)
                        ys.append(r.median_ms)
                        pct = (r.roofline or {}).get("pct_roofline")
                        labels.append("" if pct is None else f"{pct:.0f}%")
            bars = ax.bar(xs, ys, width=width, label=s)
            for bar, text in zip(bars, labels):
                if text:
                    ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                                va="bottom", fontsize=7)
        ax.set_xticks(np.arange(len(cases)))
        ax.set_xticklabels(cases, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("median time (ms, log)")
        device = recs[0].device_kind
        ax.set_title(f"stellax bench: {suite} on {device} (labels: % of roofline)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = outdir / f"bench-{suite}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths
