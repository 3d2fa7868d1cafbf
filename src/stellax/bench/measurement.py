"""`benchmark`: time one function (forward, backward or both) on this device.

A measurement compiles once (trace + lower + compile time is recorded),
warms up, then times many iterations rotating among several input sets whose
float arrays are fresh random values (never zeros), with the device timer of
`timing` (CUPTI kernel time on NVIDIA GPUs, wall clock with
``block_until_ready`` on the CPU). The record carries per-iteration times,
their median/min/IQR, the peak memory XLA planned (``memory_analysis``), the
FLOP and byte counts of the stellax ops it ran (their cost models) or of
XLA's cost analysis, and the roofline numbers against the device's peaks.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from ..core.op import UnsupportedError
from ..core.platform import current_platform
from ..core.selection import observe_calls
from . import inputs as inputs_lib
from . import roofline as roofline_lib
from . import timing as timing_lib

MODES = ("forward", "backward", "forward_backward")


@dataclasses.dataclass
class BenchmarkRecord:
    """One measurement. Times are milliseconds, memory bytes."""

    name: str
    mode: str = "forward"
    device_kind: str = ""
    backend: str = ""
    timer: str = ""
    times_ms: list = dataclasses.field(default_factory=list)
    median_ms: float | None = None
    min_ms: float | None = None
    mean_ms: float | None = None
    p25_ms: float | None = None
    p75_ms: float | None = None
    iqr_ms: float | None = None
    iterations: int = 0
    input_sets: int = 0
    compile_time_s: float | None = None
    lower_time_s: float | None = None
    peak_memory_bytes: int | None = None
    memory: dict = dataclasses.field(default_factory=dict)
    flops: float | None = None
    bytes_accessed: float | None = None
    cost_source: str | None = None
    xla_flops: float | None = None
    xla_bytes_accessed: float | None = None
    dtype: str | None = None
    roofline: dict = dataclasses.field(default_factory=dict)
    peaks_source: str | None = None
    ops: list = dataclasses.field(default_factory=list)
    # Suite metadata.
    suite: str | None = None
    op: str | None = None
    case: str | None = None
    implementation: str | None = None
    error: str | None = None
    skipped: str | None = None

    @property
    def key(self) -> str:
        """Identity of the measurement across runs (for baselines)."""
        if self.op is not None:
            return f"{self.op}|{self.case}|{self.implementation}|{self.mode}"
        return f"{self.name}|{self.mode}"

    @property
    def ok(self) -> bool:
        return self.error is None and self.skipped is None and self.median_ms is not None

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["key"] = self.key
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "BenchmarkRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def summary(self) -> str:
        if not self.ok:
            return f"{self.name} [{self.mode}]: {self.error or self.skipped}"
        parts = [f"{self.name} [{self.mode}]: median {self.median_ms:.4g} ms (IQR {self.iqr_ms:.2g}, "
                 f"min {self.min_ms:.4g}, n={self.iterations}, {self.timer})",
                 f"compile {self.compile_time_s:.2f} s"]
        r = self.roofline or {}
        if r.get("tflops") is not None:
            parts.append(f"{r['tflops']:.3g} TFLOP/s")
        if r.get("gbps") is not None:
            parts.append(f"{r['gbps']:.3g} GB/s")
        if r.get("pct_roofline") is not None:
            parts.append(f"{r['pct_roofline']:.0f}% of roofline ({r['bound']}-bound)")
        if self.peak_memory_bytes:
            parts.append(f"peak memory {self.peak_memory_bytes / 2**20:.1f} MiB")
        return ", ".join(parts)

    def __str__(self) -> str:
        return self.summary()


# -- helpers ---------------------------------------------------------------------
def _has_array(tree) -> bool:
    return any(inputs_lib.is_array(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def _has_float(tree) -> bool:
    return any(inputs_lib.is_float(leaf) for leaf in jax.tree_util.tree_leaves(tree))


def _first_float_dtype(tree) -> str | None:
    for leaf in jax.tree_util.tree_leaves(tree):
        if inputs_lib.is_float(leaf):
            return np.dtype(leaf.dtype).name
    return None


def _float_outputs(out):
    return [leaf for leaf in jax.tree_util.tree_leaves(out) if inputs_lib.is_float(leaf)]


def _memory_stats(compiled) -> tuple[int | None, dict]:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None, {}
    if stats is None:
        return None, {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes", "peak_memory_in_bytes")
    memory = {f: int(getattr(stats, f)) for f in fields if getattr(stats, f, None) is not None}
    peak = memory.get("peak_memory_in_bytes") or 0
    if not peak:
        peak = (memory.get("argument_size_in_bytes", 0) + memory.get("output_size_in_bytes", 0)
                + memory.get("temp_size_in_bytes", 0) - memory.get("alias_size_in_bytes", 0))
    return (int(peak) if peak else None), memory


def _cost_stats(compiled) -> tuple[float | None, float | None]:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001
        return None, None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None, None
    flops = cost.get("flops")
    nbytes = cost.get("bytes accessed")
    return (float(flops) if flops and flops > 0 else None), (float(nbytes) if nbytes and nbytes > 0 else None)


class _OpRecorder:
    """Records the stellax op calls of a traced function. Operands that are
    inputs of the timed function are mapped back to their concrete values, so
    cost models can read data-dependent sizes (ragged group sizes, segment
    ids, masks)."""

    def __init__(self):
        self.calls = []
        self.concrete: dict[int, Any] = {}
        self._keep: list = []

    def __call__(self, op, implementation, call, config):
        self.calls.append((op, implementation, call, config))

    def bind(self, traced_args, concrete_args) -> None:
        for t, c in zip(jax.tree_util.tree_leaves(traced_args), jax.tree_util.tree_leaves(concrete_args)):
            self.concrete[id(t)] = c
            self._keep.append(t)

    def _concrete_call(self, call):
        found = {k: self.concrete[id(v)] for k, v in call.arrays.items() if v is not None and id(v) in self.concrete}
        return call.replace_arrays(**found) if found else call

    def _model(self, op, call, which: str) -> float:
        model = op.flops if which == "flops" else op.bytes_accessed
        try:
            return model(self._concrete_call(call))
        except Exception:  # noqa: BLE001 - a model that needs values it cannot see
            return model(call)

    def cost(self) -> tuple[float, float]:
        flops = sum(self._model(op, call, "flops") for op, _, call, _ in self.calls)
        nbytes = sum(self._model(op, call, "bytes") for op, _, call, _ in self.calls)
        return flops, nbytes

    def names(self) -> list:
        return [[op.name, impl.name] for op, impl, _, _ in self.calls]


@dataclasses.dataclass
class Prepared:
    """A benchmark compiled and ready to time (see `prepare`)."""

    compiled: Any
    sets: list
    lower_time_s: float
    compile_time_s: float
    ops: list
    model_flops: float
    model_bytes: float
    dtype: str | None


def _gradient_target(call, args, kwargs, dyn_pos, dyn_kw, sets, *, mode, argnums, grad_kwargs, seed):
    """The timed function and its input sets for ``mode`` ``backward`` / ``forward_backward``:
    the VJP of ``call``'s float outputs w.r.t. the chosen float arguments, with random cotangents."""
    if argnums is None:
        diff_pos = [j for j, i in enumerate(dyn_pos) if _has_float(args[i])]
    else:
        wanted = [argnums] if isinstance(argnums, int) else list(argnums)
        diff_pos = [dyn_pos.index(i) for i in wanted if i in dyn_pos]
    if grad_kwargs is None:
        diff_kw = [k for k in dyn_kw if _has_float(kwargs[k])]
    else:
        diff_kw = [k for k in grad_kwargs if k in dyn_kw]
    if not diff_pos and not diff_kw:
        raise ValueError(f"mode={mode!r}: no differentiable (float array) argument")

    def split(dyn_a, dyn_k):
        return tuple(dyn_a[j] for j in diff_pos), {k: dyn_k[k] for k in diff_kw}

    def merged(dyn_a, dyn_k, diff):
        dyn_a = list(dyn_a)
        for j, a in zip(diff_pos, diff[0]):
            dyn_a[j] = a
        return _float_outputs(call(tuple(dyn_a), {**dyn_k, **diff[1]}))

    def vjp_of(dyn_a, dyn_k):
        return jax.vjp(lambda diff: merged(dyn_a, dyn_k, diff), split(dyn_a, dyn_k))

    out_shapes = jax.eval_shape(lambda a, k: merged(a, k, split(a, k)), *sets[0])
    if not out_shapes:
        raise ValueError(f"mode={mode!r}: the function has no float output to differentiate")
    cts = [[inputs_lib.random_like(jax.random.fold_in(jax.random.PRNGKey(seed + 1000), i * 97 + j), s)
            for j, s in enumerate(out_shapes)] for i in range(len(sets))]
    if mode == "forward_backward":
        def target(dyn_a, dyn_k, ct):
            _, pullback = vjp_of(dyn_a, dyn_k)
            return pullback(ct)

        return target, [(s[0], s[1], ct) for s, ct in zip(sets, cts)]
    # backward: the forward and its residuals are computed up front, untimed
    forward = jax.jit(vjp_of)
    pullbacks = [forward(*s)[1] for s in sets]

    def target(pullback, ct):
        return pullback(ct)

    return target, [(p, ct) for p, ct in zip(pullbacks, cts)]


class DeviceMemoryError(UnsupportedError):
    """A compiled program needs more device memory than the device has free."""


def device_memory_free(device=None) -> int | None:
    """Bytes of device memory not in use (``None`` where the device does not say: a CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def compiled_memory_bytes(compiled) -> dict[str, int] | None:
    """What a compiled program allocates when it runs: ``outputs``, ``temporaries`` and
    ``code`` bytes (its arguments already exist), from XLA's memory analysis."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        return None
    if m is None:
        return None
    return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
            "temporaries": int(m.temp_size_in_bytes), "code": int(getattr(m, "generated_code_size_in_bytes", 0))}


#: What XLA's compile-time HBM check says when a program's buffers do not fit the device.
_COMPILE_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Ran out of memory")


def compile_within_memory(lowered, *, what: str = "the program", device=None):
    """``lowered.compile()``, with every way of not fitting the device reported as one
    `DeviceMemoryError` naming ``what``: XLA's own compile-time refusal (on a TPU the
    compiler rejects a program whose temporaries exceed HBM) or, once compiled, the
    memory analysis against the free bytes (`require_device_memory`)."""
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - only the out-of-memory refusals are translated
        message = str(e)
        if not any(marker in message for marker in _COMPILE_OOM_MARKERS):
            raise
        raise DeviceMemoryError(f"{what} does not fit the device: {message.splitlines()[0][:300]}") from e
    require_device_memory(compiled, what=what, device=device)
    return compiled


def require_device_memory(compiled, *, what: str = "the program", device=None) -> None:
    """Raise `DeviceMemoryError` (before anything runs) when ``compiled`` would need more
    device memory than is free: the estimated bytes against the device's, both named."""
    free = device_memory_free(device)
    need = compiled_memory_bytes(compiled)
    if free is None or need is None:
        return
    total = need["outputs"] + need["temporaries"] + need["code"]
    if total > free:
        gib = 1 << 30
        raise DeviceMemoryError(
            f"{what} does not fit: it needs {total / gib:.2f} GiB of device memory (outputs "
            f"{need['outputs'] / gib:.2f}, temporaries {need['temporaries'] / gib:.2f} GiB) beyond its "
            f"{need['arguments'] / gib:.2f} GiB of arguments; the device has {free / gib:.2f} GiB free")


def prepare(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, *,
            mode: str = "forward", argnums: Sequence[int] | int | None = None,
            grad_kwargs: Sequence[str] | None = None, input_sets: int = 3, randomize: bool = True,
            seed: int = 0) -> Prepared:
    """Build the timed function for ``mode``, its input sets, and compile it."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    kwargs = dict(kwargs or {})
    args = list(args)
    dyn_pos = [i for i, a in enumerate(args) if _has_array(a)]
    dyn_kw = sorted(k for k, v in kwargs.items() if _has_array(v))
    static_args = {i: a for i, a in enumerate(args) if i not in dyn_pos}
    static_kwargs = {k: v for k, v in kwargs.items() if k not in dyn_kw}
    n_args = len(args)

    def call(dyn_a, dyn_k):
        full = [None] * n_args
        for i, a in static_args.items():
            full[i] = a
        for i, a in zip(dyn_pos, dyn_a):
            full[i] = a
        return fn(*full, **dyn_k, **static_kwargs)

    dyn = (tuple(args[i] for i in dyn_pos), {k: kwargs[k] for k in dyn_kw})
    count = inputs_lib.sets_that_fit(dyn, input_sets, device_memory_free(), randomize=randomize)
    sets = inputs_lib.input_sets(dyn, count, seed=seed, randomize=randomize)
    dtype = _first_float_dtype(dyn)
    recorder = _OpRecorder()
    if mode == "forward":
        target, timed_sets = call, [tuple(s) for s in sets]
    else:
        target, timed_sets = _gradient_target(call, args, kwargs, dyn_pos, dyn_kw, sets, mode=mode,
                                              argnums=argnums, grad_kwargs=grad_kwargs, seed=seed)

    def traced(*a):
        recorder.bind(a, timed_sets[0])
        return target(*a)

    t0 = time.perf_counter()
    with observe_calls(recorder):
        lowered = jax.jit(traced).lower(*timed_sets[0])
    t1 = time.perf_counter()
    compiled = compile_within_memory(lowered, what=getattr(fn, "__name__", "the benchmark"))
    t2 = time.perf_counter()
    try:
        flops, nbytes = recorder.cost()
    except Exception:  # noqa: BLE001 - no usable model: XLA's cost analysis is used instead
        flops, nbytes, recorder.calls = 0.0, 0.0, []
    return Prepared(compiled, timed_sets, t1 - t0, t2 - t0, recorder.names(), flops, nbytes, dtype)


def benchmark(fn: Callable[..., Any], *args, mode: str = "forward", argnums: Sequence[int] | int | None = None,
              grad_kwargs: Sequence[str] | None = None, timer: str | timing_lib.Timer = "auto",
              iterations: int | None = None, input_sets: int = 3, randomize: bool = True, seed: int = 0,
              flops: float | None = None, bytes_accessed: float | None = None, dtype=None,
              peaks: roofline_lib.Peaks | None = None, name: str | None = None,
              min_time: float | None = None, **kwargs) -> BenchmarkRecord:
    """Benchmark ``fn(*args, **kwargs)`` on the default device.

    Args:
      fn: any JAX-traceable function (stellax ops inside are found, and their
        FLOP/byte models used for the roofline).
      args, kwargs: example arguments; arrays define shapes and dtypes (float
        arrays are replaced by random values unless ``randomize=False``: then the
        given values are timed, and the other input sets hold them shifted, see
        `inputs.input_sets`), everything else is passed through as a static value.
      mode: ``"forward"``; ``"backward"`` (the VJP alone: forward and
        residuals computed beforehand, untimed); ``"forward_backward"``
        (forward + VJP in one program).
      argnums / grad_kwargs: which positional / keyword arguments are
        differentiated (default: every one holding float arrays).
      timer: ``"auto"`` (CUPTI on NVIDIA GPUs, wall clock on the CPU),
        ``"cupti"``, ``"batched"``, ``"wall"`` or a `timing.Timer`.
      iterations: timed iterations (default: adaptive, ``min_time`` seconds).
      input_sets: how many input sets to rotate among (fewer where they would not fit the
        free device memory: `inputs.sets_that_fit`; the record says how many).
      flops, bytes_accessed: override the cost models (per call).
      dtype: the compute dtype for the roofline (default: first float input).
      peaks: override the device peaks (default: `roofline.device_peaks`).

    Returns:
      a `BenchmarkRecord`.
    """
    platform = current_platform()
    prepared = prepare(fn, args, kwargs, mode=mode, argnums=argnums, grad_kwargs=grad_kwargs,
                       input_sets=input_sets, randomize=randomize, seed=seed)
    timer_kwargs = {} if min_time is None else {"min_time": min_time}
    timer_obj = timing_lib.make_timer(timer, **timer_kwargs)
    label = name or getattr(fn, "__name__", "fn")
    with jax.profiler.TraceAnnotation(f"stellax.bench {label} [{mode}]"):
        if iterations is not None:
            times = timer_obj.time(prepared.compiled, prepared.sets, iterations)
            used = timer_obj.name
        else:
            times, used = timing_lib.measure(prepared.compiled, prepared.sets, timer_obj)
    return make_record(label, mode, prepared, times, used, flops=flops, bytes_accessed=bytes_accessed,
                       dtype=dtype, peaks=peaks, platform=platform)


def make_record(name: str, mode: str, prepared: Prepared, times: list[float], timer_name: str, *,
                flops=None, bytes_accessed=None, dtype=None, peaks=None, platform=None,
                **metadata) -> BenchmarkRecord:
    platform = platform or current_platform()
    stats = timing_lib.summarize(times)
    peak_mem, memory = _memory_stats(prepared.compiled)
    xla_flops, xla_bytes = _cost_stats(prepared.compiled)
    if flops is not None or bytes_accessed is not None:
        source = "user"
        model_flops, model_bytes = flops, bytes_accessed
    elif prepared.ops:
        source = "model"
        model_flops, model_bytes = prepared.model_flops, prepared.model_bytes
    else:
        source = "xla" if (xla_flops or xla_bytes) else None
        model_flops, model_bytes = xla_flops, xla_bytes
    dtype_name = np.dtype(dtype).name if dtype is not None else prepared.dtype
    peaks = peaks if peaks is not None else roofline_lib.device_peaks(platform)
    seconds = stats.median / 1e3 if stats.n else None
    roof = roofline_lib.analyze(model_flops, model_bytes, seconds, dtype_name, peaks)
    peaks_source = None
    if peaks is not None:
        key = roofline_lib.compute_dtype(dtype_name)
        peaks_source = f"{peaks.name}: flops {peaks.source_of(key)}, bandwidth {peaks.source_of('memory_bandwidth')}"
    return BenchmarkRecord(
        name=name, mode=mode, device_kind=platform.device_kind, backend=platform.backend, timer=timer_name,
        times_ms=[float(t) for t in times], median_ms=stats.median, min_ms=stats.min, mean_ms=stats.mean,
        p25_ms=stats.p25, p75_ms=stats.p75, iqr_ms=stats.iqr, iterations=stats.n,
        input_sets=len(prepared.sets), compile_time_s=prepared.compile_time_s,
        lower_time_s=prepared.lower_time_s, peak_memory_bytes=peak_mem, memory=memory,
        flops=model_flops, bytes_accessed=model_bytes, cost_source=source, xla_flops=xla_flops,
        xla_bytes_accessed=xla_bytes, dtype=dtype_name, roofline=roof, peaks_source=peaks_source,
        ops=prepared.ops, **metadata,
    )
