"""Evaluate candidates in a child process with a time and a memory limit.

The parent never imports candidate code. It copies the candidate into a
fresh temporary directory, hands the child (`stellax.lab.child`) a job file
and waits for the report file, killing the child when the time limit passes.
The child runs under ``RLIMIT_AS`` (the memory limit). A child that dies
(segfault, abort), hangs or runs out of memory yields a report with status
``crashed``, ``timeout`` or ``memory`` naming the tier it was in, never an
exception in the caller.

A `Worker` keeps one child alive across evaluations (a search evaluates many
candidates; importing jax costs seconds): every candidate still runs in its
own temporary directory, as a fresh module, registered on a copy of its op,
and the child is replaced after any crash, timeout or ``recycle`` jobs.
`evaluate` uses a fresh child per call.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from . import report as report_lib
from .candidate import source_hash
from .errors import LabError

DEFAULT_TIME_LIMIT = 600.0
DEFAULT_MEMORY_LIMIT_MB = 8192

_MEMORY_MARKERS = ("MemoryError", "bad_alloc", "RESOURCE_EXHAUSTED", "Cannot allocate memory", "out of memory",
                   "Out of memory")


def child_command(limit_bytes: int) -> list[str]:
    """The child's command line: it sets its own ``RLIMIT_AS`` (and no core
    dumps) before importing anything else (no ``preexec_fn``: forking a
    multithreaded JAX process to run Python code can deadlock)."""
    code = ("import resource, runpy; "
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, {limit_bytes})); "
            "resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
            "runpy.run_module('stellax.lab.child', run_name='__main__')")
    return [sys.executable, "-c", code]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


class Worker:
    """One evaluation child process serving jobs (see the module docstring)."""

    def __init__(self, *, time_limit: float = DEFAULT_TIME_LIMIT, memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB,
                 recycle: int = 25, keep: bool = False):
        if time_limit <= 0:
            raise LabError(f"time limit: expected a positive number of seconds, got {time_limit}")
        if memory_limit_mb <= 0:
            raise LabError(f"memory limit: expected a positive number of MiB, got {memory_limit_mb}")
        self.time_limit = float(time_limit)
        self.memory_limit_mb = int(memory_limit_mb)
        self.recycle = recycle
        self.keep = keep
        self.proc: subprocess.Popen | None = None
        self.jobs_done = 0
        self.root = Path(tempfile.mkdtemp(prefix="stellax-lab-"))
        self._log = None

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the child ---------------------------------------------------------------
    def _start(self) -> None:
        log_dir = self.root / f"child-{len(list(self.root.glob('child-*')))}"
        log_dir.mkdir()
        self._log = log_dir
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            child_command(self.memory_limit_mb << 20), stdin=subprocess.PIPE,
            stdout=open(log_dir / "stdout.txt", "wb"), stderr=open(log_dir / "stderr.txt", "wb"),
            cwd=str(self.root), env=env, start_new_session=True)
        self.jobs_done = 0

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.proc = None

    def close(self) -> None:
        """Stop the child and remove the temporary directories."""
        if self.proc is not None and self.proc.poll() is None and self.proc.stdin:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- one evaluation ------------------------------------------------------------
    def evaluate(self, source: str, op: str, *, display: str = "candidate.py", options: Mapping | None = None,
                 shapes: str | None = None) -> dict:
        """Evaluate candidate ``source`` for ``op``; always returns a report."""
        if self.proc is None or self.proc.poll() is not None or self.jobs_done >= self.recycle:
            self._kill()
            self._start()
        n = len(list(self.root.glob("job-*")))
        workdir = self.root / f"job-{n}"
        workdir.mkdir()
        candidate_path = workdir / "candidate.py"
        candidate_path.write_text(source)
        limits = {"time_s": self.time_limit, "memory_mb": self.memory_limit_mb}
        job = {"candidate": str(candidate_path), "display": display, "op": op, "options": dict(options or {}),
               "workdir": str(workdir), "out": str(workdir / "report.json"), "limits": limits,
               "shapes": str(Path(shapes).resolve()) if shapes else None}
        job_path = workdir / "job.json"
        job_path.write_text(json.dumps(job))
        out = Path(job["out"])
        cand = {"file": display, "sha256": source_hash(source), "name": None, "backend": None, "kind": None}
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write((str(job_path) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        status = None
        while True:
            if out.exists():
                break
            if self.proc.poll() is not None:
                status = "crashed"
                break
            if time.perf_counter() - t0 > self.time_limit:
                status = "timeout"
                break
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        if status is None:
            self.jobs_done += 1
            report = json.loads(out.read_text())
            report["wall_s"] = round(wall, 3)
            return report_lib.finish(report)
        progress = {}
        try:
            progress = json.loads(Path(str(out) + ".progress").read_text())
        except (OSError, ValueError):
            pass
        tier_name = progress.get("tier", "load")
        returncode = self.proc.poll()
        self._kill()
        stderr = _tail(self._log / "stderr.txt")
        if status == "timeout":
            message = f"the evaluation ran past the time limit of {self.time_limit:g} s in tier {tier_name} (killed)"
        elif any(m in stderr for m in _MEMORY_MARKERS) or returncode == -signal.SIGKILL:
            status = "memory"
            message = (f"the child exhausted the memory limit of {self.memory_limit_mb} MiB in tier {tier_name} "
                       f"(exit {returncode})")
        else:
            how = f"signal {signal.Signals(-returncode).name}" if returncode and returncode < 0 else f"exit {returncode}"
            message = f"the child process died ({how}) in tier {tier_name} without a report"
        return report_lib.failure_report(op, cand, status, message, tier_name=tier_name,
                                         tiers=progress.get("tiers", []), excerpt=stderr[-2000:], wall_s=wall,
                                         limits=limits)


def evaluate(candidate: str | os.PathLike, op: str, *, time_limit: float = DEFAULT_TIME_LIMIT,
             memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, options: Mapping | None = None,
             shapes: str | None = None) -> dict:
    """Evaluate the candidate file ``candidate`` for ``op`` in a fresh child
    process and return its report (see docs/lab.md for the schema)."""
    path = Path(candidate)
    if not path.is_file():
        raise LabError(f"candidate: no such file {str(path)!r}")
    from .candidate import find_op
    op = find_op(op).name  # the registry name (``--op`` may name the public function)
    with Worker(time_limit=time_limit, memory_limit_mb=memory_limit_mb, recycle=1) as worker:
        return worker.evaluate(path.read_text(), op, display=str(path), options=options, shapes=shapes)


def summary_text(report: Mapping[str, Any]) -> str:
    """The report's plain-text summary (for an LLM prompt)."""
    return report.get("summary") or report_lib.summary(report)
