"""Benchmark suites: one per op family, built from whatever ops are registered.

A suite runs every registered op of the family on its default benchmark
shapes (``op.benchmarks(platform)``: small on a CPU, real on accelerators)
with each implementation that runs here natively (kernel implementations
are skipped on a CPU unless ``interpret=True``; they are for testing there)
and each peer (``op.peers``: other libraries' functions with the op's
signature), in each mode (``forward``, plus ``forward_backward`` for
differentiable ops by default). Failures are recorded, never fatal; peers
that refuse a case (``UnsupportedError``/``NotImplementedError``) are
recorded as skipped.

Each case is timed in ``rounds`` rounds (the timing budget split among
them; a case slower than its budget gets two); the records carry each round's fastest iteration
(`baseline.RoundsRecord`), what baseline comparisons use and take their
noise estimate from. ``case`` (a regular expression on
the record key ``op|case|implementation|mode``) selects cases.

With a time budget, every op gets its turn first: the first case forward of
every op of every suite is measured before anything else (always, even past
the budget), then the rest runs in priority order with the remaining time
shared among the suites; what the budget cuts off is recorded as skipped
("time budget exhausted").
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
import traceback
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp

from .._op_names import display_name, resolve_op_names
from ..core.op import Example, Op, UnsupportedError, registered_ops
from ..core.platform import current_platform, interpret_mode
from ..testing.validation import compiled_examples
from . import baseline as baseline_lib
from . import measurement as bench_lib
from . import roofline as roofline_lib
from . import timing as timing_lib

PEER_PREFIX = "peer:"


class NoMatchingCase(ValueError):
    """A ``case`` pattern that matches no benchmark of the suites run."""


def families(ops: dict[str, Op] | None = None) -> dict[str, list[Op]]:
    """Op families (suite names) → their registered ops that have benchmarks."""
    ops = registered_ops() if ops is None else ops
    out: dict[str, list[Op]] = {}
    for name in sorted(ops):
        op = ops[name]
        if op._benchmarks is None:
            continue
        out.setdefault(op.family, []).append(op)
    return dict(sorted(out.items()))


def only_ops(known: dict[str, list[Op]], names: Sequence[str],
             suites: Sequence[str] | None = None) -> dict[str, list[Op]]:
    """The suites of ``known`` (`families`; only ``suites`` when given) cut to the ops
    ``names`` names (registry or public names: ``rms_norm`` is ``layer_norm``).

    Raises:
      ValueError: a name that is no op (`UnknownOpError`), an op without benchmarks,
        or ops in none of ``suites``.
    """
    wanted = resolve_op_names(names)
    have = {op.name for ops in known.values() for op in ops}
    missing = [display_name(n) for n in wanted if n not in have]
    if missing:
        raise ValueError(f"ops {missing} have no benchmarks; ops with benchmarks: {sorted(have)}")
    cut = {family: [op for op in ops if op.name in wanted] for family, ops in known.items()
           if not suites or family in suites}
    cut = {family: ops for family, ops in cut.items() if ops}
    if not cut:
        raise ValueError(f"ops {list(names)} are in none of the suites {list(suites or ())}")
    return cut


def suite_names() -> list[str]:
    return list(families())


def grad_spec(op: Op, example: Example) -> tuple[list[int], list[str]]:
    """Positions and keyword names of the example's differentiable float operands."""
    if not op.differentiable:
        return [], []
    try:
        names = list(op.check(*example.args, **example.kwargs).arrays)
    except Exception:  # noqa: BLE001
        names = []
    positions = [i for i, a in enumerate(example.args)
                 if i < len(names) and names[i] in op.differentiable and bench_lib._has_float(a)]
    kwargs = [k for k, v in example.kwargs.items() if k in op.differentiable and bench_lib._has_float(v)]
    return positions, kwargs


def default_modes(op: Op, example: Example) -> list[str]:
    positions, kwargs = grad_spec(op, example)
    return ["forward", "forward_backward"] if (positions or kwargs) else ["forward"]


@dataclasses.dataclass
class SuiteOptions:
    modes: Sequence[str] | None = None
    implementations: Sequence[str] | None = None
    peers: bool = True
    interpret: bool = False
    timer: str = "auto"
    max_cases: int | None = None
    budget_s: float | None = None
    input_sets: int | None = None
    min_time: float | None = None  # seconds of timed iterations per case, over all rounds
    use_examples: bool = False  # the small numerics examples instead of benchmark shapes (dry runs)
    rounds: int = 3  # timing rounds per case (their spread is the noise estimate of --baseline)
    case: str | None = None  # regular expression on the record key op|case|implementation|mode
    ops: Sequence[str] | None = None  # only these ops (registry or public names: rms_norm is layer_norm)

    def __post_init__(self):
        if int(self.rounds) < 1:
            raise ValueError(f"rounds: expected at least 1, got {self.rounds!r}")
        if self.case is not None:
            try:
                re.compile(self.case)
            except re.error as e:
                raise ValueError(f"case: {self.case!r} is not a valid regular expression ({e})") from None


def _targets(op: Op, options: SuiteOptions, platform) -> list[tuple[str, Callable, Any]]:
    """(label, function, implementation or None) to benchmark for ``op``."""
    out = []
    for name, impl in op.implementations.items():
        if options.implementations and name not in options.implementations:
            continue
        if impl.is_kernel and platform.backend == "cpu" and not options.interpret:
            continue
        out.append((name, None, impl))
    if options.peers:
        for name, fn in op.peers.items():
            label = PEER_PREFIX + name
            if options.implementations and label not in options.implementations and name not in options.implementations:
                continue
            out.append((label, fn, None))
    return out


def _op_fn(op: Op, impl_name: str):
    def fn(*args, **kwargs):
        return op(*args, implementation=impl_name, **kwargs)
    fn.__name__ = f"{op.name}[{impl_name}]"
    return fn


@dataclasses.dataclass(frozen=True)
class _WorkItem:
    """One measurement of a suite: (op, case, implementation or peer, mode)."""

    priority: int
    order: int
    group: tuple
    op: Op
    example: Any
    label: str
    mode: str
    positions: Any
    kw: Any
    target: tuple


def _suite_timer(options: SuiteOptions, platform):
    """The timer of one round: the per-case time and minimum iterations split among the rounds."""
    rounds = int(options.rounds)
    defaults = timing_lib.default_budget()
    min_iterations = 3 if platform.backend == "cpu" else defaults["min_iterations"]
    min_time = options.min_time if options.min_time is not None else defaults["min_time"]
    timer_kwargs = {"warmup": 0 if platform.backend == "cpu" else 1,
                    "min_iterations": max(1, math.ceil(min_iterations / rounds)),
                    "min_time": min_time / rounds}
    return timing_lib.make_timer(options.timer, **timer_kwargs)


def _unique_labels(examples) -> list[str]:
    """Example labels with ``#n`` appended to repeats."""
    seen: dict[str, int] = {}
    labels = []
    for example in examples:
        label = example.label
        if label in seen:
            seen[label] += 1
            label = f"{label} #{seen[label]}"
        else:
            seen[label] = 0
        labels.append(label)
    return labels


def item_key(op_name: str, case: str, label: str, mode: str) -> str:
    """The record key of a work item (`BenchmarkRecord.key`)."""
    return f"{op_name}|{case}|{label}|{mode}"


def _plan(family: str, ops: list[Op], options: SuiteOptions, platform, deadline: float | None):
    """The suite's work items in natural order, and records for the ops the deadline cut off before
    their inputs were built. Priority: 0 = an op's first case forward with its own implementation,
    1 = the peers and other modes of that case, 2 + i = case i. Only items whose key matches
    ``options.case`` (when set) are planned."""
    pattern = re.compile(options.case) if options.case else None
    items: list[_WorkItem] = []
    unbuilt: list[bench_lib.BenchmarkRecord] = []
    for op_index, op in enumerate(ops):
        if deadline is not None and op_index > 0 and time.monotonic() > deadline:
            # Building the inputs costs time too: past the deadline, skip the op whole.
            unbuilt.append(bench_lib.BenchmarkRecord(
                name=f"{op.name} (all cases)", mode="*", device_kind=platform.device_kind,
                backend=platform.backend, suite=family, op=op.name, case="(all cases)", implementation="*",
                skipped="time budget exhausted"))
            continue
        if options.use_examples:
            examples = op.examples(jnp.float32)[: options.max_cases]
        else:  # only the cases it runs: a later benchmark shape can hold far more (256 experts' 7.5 GB)
            examples = compiled_examples(lambda: op.benchmarks(platform), options.max_cases)
        for case_index, (example, label) in enumerate(zip(examples, _unique_labels(examples))):
            positions, kw = grad_spec(op, example)
            modes = [m for m in (options.modes or default_modes(op, example))
                     if m == "forward" or positions or kw]
            for mode_index, mode in enumerate(modes):
                for target in _targets(op, options, platform):
                    if pattern is not None and not pattern.search(item_key(op.name, label, target[0], mode)):
                        continue
                    own = target[2] is not None
                    if case_index == 0 and mode_index == 0 and own:
                        priority = 0
                    elif case_index == 0:
                        priority = 1
                    else:
                        priority = 2 + case_index
                    items.append(_WorkItem(priority, len(items), (op_index, case_index, mode_index), op, example,
                                           label, mode, positions, kw, target))
    return items, unbuilt


def _run_item(item: _WorkItem, family: str, options: SuiteOptions, platform, timer, input_sets, peaks,
              progress, *, past_deadline: bool) -> tuple[bench_lib.BenchmarkRecord, bool]:
    """Measure one work item, or record why it was skipped or failed; also whether it was measured."""
    impl_label, peer_fn, impl = item.target
    op, example = item.op, item.example
    meta = dict(suite=family, op=op.name, case=item.label, implementation=impl_label)
    name = f"{op.name} {item.label} {impl_label}"
    base = dict(name=name, mode=item.mode, device_kind=platform.device_kind, backend=platform.backend, **meta)
    if past_deadline:
        return bench_lib.BenchmarkRecord(skipped="time budget exhausted", **base), False
    if impl is not None:
        try:
            support = impl.supported(op.check(*example.args, **example.kwargs))
        except Exception as e:  # noqa: BLE001
            return bench_lib.BenchmarkRecord(error=f"check: {type(e).__name__}: {e}"[:300], **base), False
        if not support:
            return bench_lib.BenchmarkRecord(skipped=support.reason[:300], **base), False
    fn = _op_fn(op, impl.name) if impl is not None else peer_fn
    if progress:
        progress(f"{family}: {name} [{item.mode}]")
    record = _measure(fn, example, item.mode, item.positions, item.kw, timer, input_sets, peaks, platform, name,
                      meta, interpret=options.interpret and impl is not None and impl.is_kernel,
                      rounds=int(options.rounds))
    if impl is None and record.error:
        # A peer that cannot run here (library or backend missing) is not a stellax failure.
        record.skipped, record.error = f"peer unavailable: {record.error}"[:300], None
    return record, True


class _SuiteRun:
    """One family's planned work items and the records measured so far."""

    def __init__(self, family: str, ops: list[Op], options: SuiteOptions, platform, progress,
                 deadline: float | None = None):
        self.family, self.options, self.platform, self.progress = family, options, platform, progress
        self.peaks = roofline_lib.device_peaks(platform)
        self.timer = _suite_timer(options, platform)
        self.input_sets = options.input_sets or (2 if platform.backend == "cpu" else 3)
        self.items, self.unbuilt = _plan(family, ops, options, platform, deadline)
        self.done: dict[int, bench_lib.BenchmarkRecord] = {}

    def pending(self) -> list[_WorkItem]:
        """The items not run yet, in priority order."""
        return [t for t in sorted(self.items, key=lambda t: (t.priority, t.order)) if t.order not in self.done]

    def run(self, item: _WorkItem, *, past_deadline: bool) -> bool:
        """Measure (or skip) one item; whether it was measured."""
        self.done[item.order], measured = _run_item(item, self.family, self.options, self.platform, self.timer,
                                                    self.input_sets, self.peaks, self.progress,
                                                    past_deadline=past_deadline)
        return measured

    def first_turns(self) -> None:
        """Each op's turn: its first case forward with its own implementations until one is measured."""
        for op_index in dict.fromkeys(t.group[0] for t in self.items):
            for item in self.pending():
                if item.group[0] == op_index and item.priority == 0 and self.run(item, past_deadline=False):
                    break

    def records(self) -> list[bench_lib.BenchmarkRecord]:
        """The records in natural order (op, case, mode), peers given the op's cost model."""
        records: list[bench_lib.BenchmarkRecord] = []
        by_group: dict[tuple, list] = {}
        for item in self.items:
            by_group.setdefault(item.group, []).append(self.done[item.order])
        for group in sorted(by_group):
            _share_cost_model(by_group[group], self.peaks)
            records.extend(by_group[group])
        return records + self.unbuilt


def run_suite(family: str, options: SuiteOptions | None = None, *, ops: Iterable[Op] | None = None,
              progress: Callable[[str], None] | None = None, deadline: float | None = None,
              guarantee_one: bool = True) -> list[bench_lib.BenchmarkRecord]:
    """Benchmark one family; returns one record per (op, case, implementation, mode).

    With a ``deadline``, the work runs in priority order so a short budget
    still covers every op: first each op's first case forward with its own
    implementations, then the peers and other modes of that case, then the
    other cases; what the deadline cuts off is recorded as skipped. The
    family's very first measurement runs even past the deadline
    (``guarantee_one``). Records come back in the natural order."""
    options = options or SuiteOptions()
    platform = current_platform()
    ops = list(ops) if ops is not None else families().get(family, [])
    if not ops:
        raise ValueError(f"suite {family!r}: no registered op of that family has benchmarks; "
                         f"known suites: {suite_names()}")
    suite = _SuiteRun(family, ops, options, platform, progress, deadline)
    first = True
    for item in suite.pending():
        past = deadline is not None and time.monotonic() > deadline and not (first and guarantee_one)
        measured = suite.run(item, past_deadline=past)
        first = first and not measured
    return suite.records()


def _measure(fn, example, mode, positions, kw, timer, input_sets, peaks, platform, name, meta, *, interpret,
             rounds: int = 1):
    try:
        with interpret_mode(True) if interpret else _null():
            prepared = bench_lib.prepare(fn, example.args, example.kwargs, mode=mode,
                                         argnums=positions if mode != "forward" else None,
                                         grad_kwargs=kw if mode != "forward" else None, input_sets=input_sets,
                                         randomize=False)  # the builder's values are in the op's domain
            times, best, used = [], [], timer.name
            started, total = time.perf_counter(), timer.min_time * max(1, rounds)
            with jax.profiler.TraceAnnotation(f"stellax.bench {name} [{mode}]"):
                for r in range(max(1, rounds)):
                    if r >= 2 and time.perf_counter() - started > total:
                        break  # a slow case: two rounds give the spread, more would cost a warm-up each
                    round_times, used = timing_lib.measure(prepared.compiled, prepared.sets, timer)
                    times.extend(round_times)
                    best.append(float(min(round_times)))
        record = bench_lib.make_record(name, mode, prepared, times, used, peaks=peaks, platform=platform, **meta)
        return baseline_lib.with_rounds(record, best)
    except (UnsupportedError, NotImplementedError) as e:
        return bench_lib.BenchmarkRecord(name=name, mode=mode, device_kind=platform.device_kind,
                                         backend=platform.backend, skipped=f"{type(e).__name__}: {e}"[:300], **meta)
    except Exception as e:  # noqa: BLE001 - a failing case is recorded, the suite goes on
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        return bench_lib.BenchmarkRecord(name=name, mode=mode, device_kind=platform.device_kind,
                                         backend=platform.backend, error=detail[:500], **meta)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _share_cost_model(records: list[bench_lib.BenchmarkRecord], peaks) -> None:
    """Peers run the same math as the op: give them the op's FLOP/byte model."""
    model = next((r for r in records if r.ok and r.cost_source == "model"), None)
    if model is None:
        return
    for r in records:
        if r.ok and r.cost_source != "model":
            r.flops, r.bytes_accessed, r.cost_source = model.flops, model.bytes_accessed, "model (op)"
            r.roofline = roofline_lib.analyze(r.flops, r.bytes_accessed, r.median_ms / 1e3, r.dtype, peaks)


def run_suites(names: Sequence[str] | None = None, options: SuiteOptions | None = None, *,
               progress: Callable[[str], None] | None = None) -> list[bench_lib.BenchmarkRecord]:
    """Run several suites (default: all).

    Without a budget the suites run one after the other. With
    ``options.budget_s`` every op gets its turn first: the first case forward
    of every op of every suite is measured (even past the budget), then the
    rest in priority order, the remaining time shared evenly among the suites
    (each gets its part plus what earlier ones left). With ``options.case``,
    a pattern that matches no case raises `NoMatchingCase` (a `ValueError`)."""
    options = options or SuiteOptions()
    known = families()
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; known suites: {list(known)}")
    if options.ops:
        known = only_ops(known, options.ops, names)
    names = [n for n in names if n in known] if names else list(known)
    if options.budget_s is None:
        records = [r for name in names for r in run_suite(name, options, ops=known[name], progress=progress)]
    else:
        records = _run_budgeted(names, known, options, progress)
    if options.case and not records:
        raise NoMatchingCase(f"case pattern {options.case!r} matches no benchmark of suite(s) {names}; keys "
                             f"look like 'op|case|implementation|mode', e.g. {_example_keys(names, known)}")
    return records


def _run_budgeted(names, known, options: SuiteOptions, progress) -> list[bench_lib.BenchmarkRecord]:
    """Every op's first turn in every suite, then the rest suite by suite within the shared budget.
    Every suite's inputs are built first (they are alive until the suite is done)."""
    start = time.monotonic()
    platform = current_platform()
    suites = [_SuiteRun(name, known[name], options, platform, progress) for name in names]
    for suite in suites:
        suite.first_turns()
    records = []
    for i, suite in enumerate(suites):
        remaining = options.budget_s - (time.monotonic() - start)
        deadline = time.monotonic() + max(0.0, remaining / (len(suites) - i))
        for item in suite.pending():
            suite.run(item, past_deadline=time.monotonic() > deadline)
        records.extend(suite.records())
        suites[i] = None  # its inputs can go
    return records


def _example_keys(names, known, limit: int = 3) -> list[str]:
    """A few record keys of the named suites (for an error message); examples are not built."""
    keys = []
    for name in names:
        for op in known[name]:
            keys.append(item_key(op.name, "<case>", "xla", "forward"))
    return keys[:limit]


def speedups(records: Sequence[bench_lib.BenchmarkRecord], baseline_impl: str = "xla") -> dict[str, float]:
    """Record key → speedup over the ``baseline_impl`` row of the same op, case and mode."""
    base = {(r.op, r.case, r.mode): r.median_ms for r in records if r.ok and r.implementation == baseline_impl}
    out = {}
    for r in records:
        b = base.get((r.op, r.case, r.mode))
        if r.ok and b:
            out[r.key] = b / r.median_ms
    return out


__all__ = ["NoMatchingCase", "PEER_PREFIX", "SuiteOptions", "families", "grad_spec", "item_key", "run_suite",
           "run_suites", "speedups", "suite_names"]
