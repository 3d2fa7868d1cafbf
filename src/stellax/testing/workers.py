"""Run `stellax check` jobs in worker processes, one per CPU core (or, on an
accelerator one process holds, in threads: `threaded_events`), and stream
each event back as it happens.

The checks are compile-bound and single-threaded, so on a 2-core CPU two
workers halve the wall time. Each worker gets whole ops (an op's examples are
built once, by one worker), balanced by job count; it re-creates its jobs from
the registry by name (ops are not picklable) and reports, through a queue:

* ``("start", index)`` before a job runs;
* ``("done", index, row)`` with the finished row (`plan.row_of`);
* ``("cpu", seconds)`` with its CPU time once its jobs are done.

`events` turns these into ``(kind, job, value)`` for the parent; a worker that
dies leaves its unfinished jobs as failed rows saying so.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_lib
import time
from typing import Iterator

from . import process_memory
from .plan import CheckJob, row_of
from .validation import CheckResult

Event = tuple[str, CheckJob | None, object]


def release_host_memory(ceiling: int | None = None) -> bool:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``; nothing
    elsewhere) and, when the process still holds more than ``ceiling`` bytes of host
    memory (its RSS less the accelerator's mappings; always when ``ceiling`` is None),
    drop jax's compiled programs (`jax.clear_caches`) too. Returns whether it dropped them.

    A check compiles a handful of programs that are never called again, and jax
    keeps every one: on a v5e, `stellax check --all` grew from 4.2 to 7.4 GB of
    host memory over its 648 checks (per-row ``host_rss`` in
    benchmarks/results/check-all-v5e-2026-12-06-c1ab002.json). But dropping them
    costs time where ops share programs (the random inputs, the comparisons): the
    quick check took 118.5 s with the drops against 88-104 s without (docs/tpu.md),
    so `threaded_events` drops them only above a ceiling. Calls already running keep
    their programs; a later call of a dropped one recompiles."""
    _trim_heap()
    if ceiling is not None:
        now = process_memory.host_bytes_now()
        if now is not None and now <= ceiling:
            return False
    import jax

    jax.clear_caches()
    _trim_heap()
    return True


def _trim_heap() -> None:
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: `threaded_events` keeps compiled programs while the process holds less host memory than this
#: fraction of its peak before the checks (on an accelerator, the runtime's start-up: a bare JAX
#: process on a v5e host peaks at 6.0 GB, benchmarks/results/host_memory_bare_jax-v5e-2026-12-07.json),
#: so the checks do not raise the process's peak and do not pay recompiles below it.
KEEP_PROGRAMS_BELOW = 0.8


def program_ceiling() -> int | None:
    """The host memory (bytes) above which `threaded_events` drops compiled programs:
    `KEEP_PROGRAMS_BELOW` of the process's host peak so far; None where it cannot be read
    (then every release drops them)."""
    memory = process_memory.host_memory()
    peak = memory.get("peak_host", memory.get("peak_rss"))
    return None if not peak else int(KEEP_PROGRAMS_BELOW * peak)


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
    return index, job.op.name, job.implementation, job.dtype, job.example, job.gradients, job.precision


def _worker(specs: list[tuple], events) -> None:  # pragma: no cover - runs in a child process
    from ..core import registered_ops

    ops = registered_ops()
    for index, name, implementation, dtype, example, gradients, precision in specs:
        job = CheckJob(ops[name], implementation, dtype, example, gradients, precision)
        events.put(("start", index))
        t0, c0 = time.perf_counter(), time.process_time()
        result = job.run()
        events.put(("done", index, row_of(job, result, time.perf_counter() - t0, time.process_time() - c0)))
    events.put(("cpu", time.process_time()))


def threaded_events(jobs: list[CheckJob], threads: int) -> Iterator[Event]:
    """Run ``jobs`` in ``threads`` threads of this process, yielding events as they come.

    For an accelerator, which one process holds: the checks are compile-bound,
    XLA compiles outside the GIL, and the device runs what is ready, so on a
    TPU host's many cores the wall time falls with the thread count. The
    examples are built first, once per op and dtype, in the same threads
    (building them compiles their random-number programs; built one after the
    other on a v5e they kept 8 threads idle: the 79 checks' own times added up
    to 265 s, the run took 156 s); then each thread takes the next job when it
    is free. Host memory is released (`release_host_memory`) after every
    ``threads`` examples built (on a v5e the quick check's peak, 5.3 GB, came
    while they were built with one release at the end) and whenever an op's
    last check finishes; compiled programs are dropped then only above
    `program_ceiling` (below it, dropping them bought no lower peak and cost
    recompiles)."""
    import concurrent.futures

    from .validation import examples_of

    pairs = list(dict.fromkeys((job.op, job.dtype) for job in jobs))
    ceiling = program_ceiling()
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(threads, len(pairs))),
                                               thread_name_prefix="stellax-examples") as pool:
        for built, _ in enumerate(pool.map(lambda pair: examples_of(*pair), pairs), start=1):
            if built % threads == 0 or built == len(pairs):
                release_host_memory(ceiling)  # the random-number programs that built them
    left_of_op: dict[str, int] = {}
    for job in jobs:
        left_of_op[job.op.name] = left_of_op.get(job.op.name, 0) + 1

    results: "queue_lib.Queue" = queue_lib.Queue()
    cpu_start = time.process_time()

    def run(indices: Iterator[int]) -> None:
        for index in indices:
            results.put(("start", index, None))
            t0 = time.perf_counter()
            try:
                result = jobs[index].run()
            except BaseException as e:  # noqa: BLE001 - a crash is a failed row, the other threads go on
                job = jobs[index]
                result = CheckResult(job.op.name, job.implementation, job.dtype, "-", False, None,
                                     detail=f"{type(e).__name__}: {e}"[:300])
            results.put(("done", index, row_of(jobs[index], result, time.perf_counter() - t0)))

    # Each thread takes the next job when it is free (dealt round-robin in advance, one
    # thread drew the slow linear-attention checks while others sat idle).
    pending: "queue_lib.SimpleQueue[int]" = queue_lib.SimpleQueue()
    for index in range(len(jobs)):
        pending.put(index)

    def next_jobs():
        while True:
            try:
                yield pending.get_nowait()
            except queue_lib.Empty:
                return

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(threads, len(jobs)),
                                               thread_name_prefix="stellax-check") as pool:
        futures = [pool.submit(run, next_jobs()) for _ in range(min(threads, len(jobs)))]
        finished = 0
        while finished < len(jobs):
            try:
                kind, index, row = results.get(timeout=1.0)
            except queue_lib.Empty:
                if all(f.done() for f in futures):
                    break
                continue
            if kind == "start":
                yield "start", jobs[index], None
            else:
                finished += 1
                left_of_op[jobs[index].op.name] -= 1
                if not left_of_op[jobs[index].op.name]:
                    release_host_memory(ceiling)  # the op's programs: no later check calls them
                yield "done", jobs[index], row
    yield "cpu", None, time.process_time() - cpu_start


def events(jobs: list[CheckJob], workers: int) -> Iterator[Event]:
    """Run ``jobs`` in ``workers`` spawned processes, yielding events as they come."""
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
        yield "done", job, row_of(job, result, 0.0)
