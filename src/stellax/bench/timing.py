"""Timers: how long one run of a compiled function takes on the device.

* ``wall``: host wall clock around each call, ending with
  ``jax.block_until_ready`` (the CPU default; includes dispatch overhead).
* ``cupti``: on NVIDIA GPUs, the summed device time of every kernel the call
  launched, read by CUPTI through ``jax.experimental.mosaic.gpu.profiler``
  (no Python or launch overhead). The default on a GPU when it works.
* ``batched``: wall clock over a batch of back-to-back calls with one
  synchronization at the end, divided by the batch size (dispatch overlaps
  device work; the GPU fallback when CUPTI is unavailable).
* ``profiler``: the device work of each call from a `jax.profiler` trace
  (XProf's parser as shipped in jaxlib, `jax.profiler.ProfileData`): the
  union of the intervals of the XLA operations the call executed (optionally
  only those whose op or program name matches a regex), without host launch
  overhead. The default on TPUs, and on GPUs when the ``xprof`` package is
  installed. On a CPU it reads the thunk events of the host threads.

Every timer rotates among several input sets and warms up first.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..core.platform import current_platform, host_platform
from . import trace as trace_lib


@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary of per-iteration times (milliseconds)."""

    n: int
    median: float
    min: float
    max: float
    mean: float
    p25: float
    p75: float
    std: float

    @property
    def iqr(self) -> float:
        return self.p75 - self.p25

    @property
    def relative_iqr(self) -> float:
        return self.iqr / self.median if self.median > 0 else 0.0

    def to_json(self) -> dict:
        return {"n": self.n, "median_ms": self.median, "min_ms": self.min, "max_ms": self.max,
                "mean_ms": self.mean, "p25_ms": self.p25, "p75_ms": self.p75, "iqr_ms": self.iqr,
                "std_ms": self.std}


def summarize(times_ms: Sequence[float]) -> Stats:
    t = np.asarray(list(times_ms), dtype=np.float64)
    if t.size == 0:
        nan = float("nan")
        return Stats(0, nan, nan, nan, nan, nan, nan, nan)
    p25, med, p75 = np.percentile(t, [25, 50, 75])
    return Stats(int(t.size), float(med), float(t.min()), float(t.max()), float(t.mean()), float(p25),
                 float(p75), float(t.std()))


def _call(fn, args):
    return fn(*args)


class Timer:
    """Base timer. ``time(fn, sets)`` → per-iteration times in ms."""

    name = "timer"

    def __init__(self, *, min_time: float = 0.2, max_time: float = 5.0, min_iterations: int = 5,
                 max_iterations: int = 1000, warmup: int = 1):
        self.min_time = float(min_time)
        self.max_time = float(max_time)
        self.min_iterations = int(min_iterations)
        self.max_iterations = int(max_iterations)
        self.warmup = int(warmup)

    def _warm(self, fn, sets) -> float:
        """Run each input set once (plus ``warmup`` rounds); returns the
        estimated seconds per call from the last round."""
        per_call = float("inf")
        for r in range(1 + max(0, self.warmup)):
            t0 = time.perf_counter()
            for args in sets:
                jax.block_until_ready(_call(fn, args))
            if r > 0 or self.warmup <= 0:
                per_call = min(per_call, (time.perf_counter() - t0) / len(sets))
        return max(per_call, 1e-7)

    def iterations_for(self, per_call_s: float) -> int:
        n = math.ceil(self.min_time / per_call_s)
        n = min(n, max(1, int(self.max_time / per_call_s)))
        return int(min(self.max_iterations, max(self.min_iterations, n)))

    def time(self, fn: Callable[..., Any], sets: Sequence[tuple], iterations: int | None = None) -> list[float]:
        raise NotImplementedError


class WallTimer(Timer):
    name = "wall"

    def time(self, fn, sets, iterations=None):
        per_call = self._warm(fn, sets)
        n = iterations or self.iterations_for(per_call)
        times = []
        for i in range(n):
            args = sets[i % len(sets)]
            t0 = time.perf_counter()
            jax.block_until_ready(_call(fn, args))
            times.append((time.perf_counter() - t0) * 1e3)
        return times


class BatchedWallTimer(Timer):
    name = "batched"

    def __init__(self, *, batch_time: float = 2e-3, **kwargs):
        super().__init__(**kwargs)
        self.batch_time = batch_time

    def time(self, fn, sets, iterations=None):
        per_call = self._warm(fn, sets)
        batch = int(min(100, max(len(sets), math.ceil(self.batch_time / per_call))))
        n = iterations or self.iterations_for(per_call * batch)
        times, k = [], 0
        for _ in range(n):
            t0 = time.perf_counter()
            out = None
            for _ in range(batch):
                out = _call(fn, sets[k % len(sets)])
                k += 1
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) * 1e3 / batch)
        return times


class CuptiTimer(Timer):
    """Kernel time from CUPTI (``mosaic.gpu.profiler.measure``)."""

    name = "cupti"

    def time(self, fn, sets, iterations=None):
        from jax.experimental.mosaic.gpu import profiler

        per_call = self._warm(fn, sets)
        n = iterations or self.iterations_for(per_call)
        per_set = max(1, math.ceil(n / len(sets)))
        # Interleave rounds so every set is timed throughout the run.
        rounds = max(1, min(per_set, 4))
        chunk = max(1, math.ceil(per_set / rounds))
        times: list[float] = []
        for _ in range(rounds):
            for args in sets:
                _, timings = profiler.measure(fn, iterations=chunk)(*args)
                if timings is None:
                    raise RuntimeError("CUPTI saw no kernel launches")
                if not isinstance(timings, list):
                    timings = [timings]
                times.extend(float(t) for t in timings)
        return times


class ProfilerTimer(Timer):
    """Device time of each call from a profiler trace: the union of its XLA op intervals.

    Args:
      op_filter: a regex; only XLA operations whose op name or program name it matches count
        (``None``: all of them).
    """

    name = "profiler"

    def __init__(self, *, op_filter: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.op_filter = re.compile(op_filter) if op_filter else None

    def time(self, fn, sets, iterations=None):
        per_call = self._warm(fn, sets)
        n = iterations or self.iterations_for(per_call)
        with tempfile.TemporaryDirectory(prefix="stellax-profile-") as directory:
            jax.profiler.start_trace(directory)
            try:
                for i in range(n):
                    jax.block_until_ready(_call(fn, sets[i % len(sets)]))
            finally:
                jax.profiler.stop_trace()
            events = [e for f in trace_lib.xplane_files(directory) for e in trace_lib.op_events(f.read_bytes())]
        if self.op_filter is not None:
            events = [e for e in events if self.op_filter.search(e.op) or self.op_filter.search(e.module)]
        return per_iteration_ms(events, n)


def per_iteration_ms(events, iterations: int) -> list[float]:
    """Per-call device times from the op events of ``iterations`` calls: each program execution
    (run id) is one interval union; when a call runs several programs, consecutive executions
    are grouped evenly into the calls."""
    runs: dict[Any, list] = {}
    for e in events:
        runs.setdefault(e.run_id, []).append((e.start_ns, e.end_ns))
    if not runs:
        raise RuntimeError("profiler timer: the trace holds no XLA op events (nothing ran, or the filter "
                           "matched no operation)")
    ordered = sorted(runs.values(), key=lambda spans: min(s for s, _ in spans))
    if len(ordered) % iterations:
        raise RuntimeError(f"profiler timer: {len(ordered)} program executions for {iterations} calls; "
                           "cannot tell which belong to which call")
    per_call = len(ordered) // iterations
    return [trace_lib.union_ns([s for spans in ordered[i * per_call:(i + 1) * per_call] for s in spans]) / 1e6
            for i in range(iterations)]


TIMERS = {"wall": WallTimer, "batched": BatchedWallTimer, "cupti": CuptiTimer, "profiler": ProfilerTimer}
#: The names a ``timer`` option takes: ``"auto"`` (`make_timer` picks) and those of `TIMERS`.
TIMER_NAMES = ("auto", *TIMERS)
_CUPTI_OK: dict[str, tuple[bool, str]] = {}


def cupti_available() -> tuple[bool, str]:
    """Whether the CUPTI timer works here (probed once per device kind)."""
    platform = host_platform()
    if not platform.is_nvidia:
        return False, f"CUPTI needs an NVIDIA GPU, this device is {platform.describe()}"
    if platform.device_kind in _CUPTI_OK:
        return _CUPTI_OK[platform.device_kind]
    try:
        import jax.numpy as jnp
        from jax.experimental.mosaic.gpu import profiler

        x = jnp.arange(1 << 16, dtype=jnp.float32)
        f = jax.jit(lambda a: a * 2.0 + 1.0).lower(x).compile()
        _, t = profiler.measure(f, iterations=2)(x)
        ok = isinstance(t, list) and len(t) == 2 and all(v is not None and v > 0 for v in t)
        result = (True, "") if ok else (False, f"CUPTI probe returned {t!r}")
    except Exception as e:  # noqa: BLE001 - any failure means: use another timer
        result = (False, f"{type(e).__name__}: {e}"[:300])
    _CUPTI_OK[platform.device_kind] = result
    return result


def xprof_installed() -> bool:
    """Whether the ``xprof`` package (XProf's tools) is installed."""
    return importlib.util.find_spec("xprof") is not None


def default_timer_name() -> str:
    """``profiler`` on TPUs, and on GPUs with the ``xprof`` package installed; else ``cupti`` on NVIDIA
    GPUs where it works, ``batched`` on other accelerators; ``wall`` on the CPU."""
    platform = host_platform()
    if platform.backend == "cpu":
        return "wall"
    if platform.backend == "tpu" or (platform.backend == "gpu" and xprof_installed()):
        return "profiler"
    if platform.is_nvidia and cupti_available()[0]:
        return "cupti"
    return "batched"


def make_timer(name: str | Timer = "auto", **kwargs) -> Timer:
    """A timer by name (``auto``, ``wall``, ``batched``, ``cupti``, ``profiler``)."""
    if isinstance(name, Timer):
        return name
    if name == "auto":
        name = default_timer_name()
    if name not in TIMERS:
        raise ValueError(f"timer: expected one of {['auto', *TIMERS]}, got {name!r}")
    defaults = default_budget()
    defaults.update(kwargs)
    return TIMERS[name](**defaults)


def default_budget() -> dict:
    """Timing budget per measurement: short on the CPU, longer on accelerators."""
    if current_platform().backend == "cpu":
        return {"min_time": 0.05, "max_time": 1.0, "min_iterations": 5, "max_iterations": 200}
    return {"min_time": 0.1, "max_time": 1.0, "min_iterations": 10, "max_iterations": 300}


def measure(fn, sets: Sequence[tuple], timer: Timer) -> tuple[list[float], str]:
    """Time ``fn`` over ``sets`` with ``timer``; when the CUPTI or profiler timer fails on an
    accelerator, fall back to the batched wall clock. Returns (times in ms, timer used)."""
    try:
        return timer.time(fn, sets), timer.name
    except Exception:
        if timer.name not in ("cupti", "profiler") or host_platform().backend == "cpu":
            raise
        fallback = BatchedWallTimer(min_time=timer.min_time, max_time=timer.max_time,
                                    min_iterations=timer.min_iterations, max_iterations=timer.max_iterations,
                                    warmup=0)
        return fallback.time(fn, sets), fallback.name
