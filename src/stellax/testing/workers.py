"""Run `stellax check` jobs in worker processes, one per CPU core, and stream
each event back as it happens.

The checks are compile-bound and single-threaded, so on a 2-core CPU two
workers halve the wall time. Each worker gets whole ops (an op's examples are
built once, by one worker), balanced by job count; it re-creates its jobs from
the registry by name (ops are not picklable) and reports, through a queue:

* ``("start", index)`` before a job runs;
* ``("done", index, row)`` with the finished row (`report.row_of`);
* ``("cpu", seconds)`` with its CPU time once its jobs are done.

`events` turns these into ``(kind, job, value)`` for the parent; a worker that
dies leaves its unfinished jobs as failed rows saying so.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_lib
import time
from typing import Iterator

from .plan import CheckJob
from .validation import CheckResult

Event = tuple[str, CheckJob | None, object]


def partition(jobs: list[CheckJob], workers: int) -> list[list[int]]:
    """Job indices per worker: whole ops, the largest first to the least loaded."""
    by_op: dict[str, list[int]] = {}
    for i, job in enumerate(jobs):
        by_op.setdefault(job.op.name, []).append(i)
    bins: list[list[int]] = [[] for _ in range(max(1, workers))]
    for indices in sorted(by_op.values(), key=len, reverse=True):
        min(bins, key=len).extend(indices)
    return [sorted(b) for b in bins if b]


def _spec(index: int, job: CheckJob) -> tuple:
    return index, job.op.name, job.implementation, job.dtype, job.example, job.gradients


def _worker(specs: list[tuple], events) -> None:  # pragma: no cover - runs in a child process
    from ..core import registered_ops
    from . import report

    ops = registered_ops()
    for index, name, implementation, dtype, example, gradients in specs:
        job = CheckJob(ops[name], implementation, dtype, example, gradients)
        events.put(("start", index))
        t0, c0 = time.perf_counter(), time.process_time()
        result = job.run()
        events.put(("done", index, report.row_of(job, result, time.perf_counter() - t0, time.process_time() - c0)))
    events.put(("cpu", time.process_time()))


def events(jobs: list[CheckJob], workers: int) -> Iterator[Event]:
    """Run ``jobs`` in ``workers`` spawned processes, yielding events as they come."""
    from . import report

    context = multiprocessing.get_context("spawn")  # jax must not be forked
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=([_spec(i, jobs[i]) for i in part], queue), daemon=True)
                 for part in partition(jobs, workers)]
    for p in processes:
        p.start()
    pending, reported = set(range(len(jobs))), 0
    try:
        while reported < len(processes):
            try:
                message = queue.get(timeout=1.0)
            except queue_lib.Empty:
                if any(p.is_alive() for p in processes):
                    continue
                break  # every worker is gone: what is left failed
            kind = message[0]
            if kind == "start":
                yield "start", jobs[message[1]], None
            elif kind == "done":
                pending.discard(message[1])
                yield "done", jobs[message[1]], message[2]
            else:
                reported += 1
                yield "cpu", None, message[1]
    finally:
        for p in processes:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    for index in sorted(pending):
        job = jobs[index]
        result = CheckResult(job.op.name, job.implementation, job.dtype, "-", False, None,
                             detail="the worker process running this check died")
        yield "done", job, report.row_of(job, result, 0.0)
