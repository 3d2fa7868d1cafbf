"""Search one implementation's config space for one call.

All candidate configs are compiled in parallel (threads: tracing is
thread-local in JAX and XLA compiles without the GIL), then timed one after
another on the same random inputs with the device timer (`bench.timing`).
A config that fails to compile or run (resource limits, lowering errors), or
whose output disagrees with the default config's, is recorded and skipped;
the search fails only when every config fails. Ties go to the earlier config
in the space, so the choice is deterministic for equal timings.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..core import selection
from ..core.call import Call
from ..core.platform import current_platform
from ..testing.numerics import compare_on_device, tolerance
from ..bench import inputs as inputs_lib
from ..bench.cost_model import has_model, rank_space
from ..bench import timing as timing_lib
from . import cache as cache_lib
from . import keys as keys_lib

#: True while a tuner runs (config sources must not tune recursively).
TUNING: contextvars.ContextVar[bool] = contextvars.ContextVar("stellax_autotuning", default=False)


class TuneError(RuntimeError):
    """Every candidate config failed."""


@dataclasses.dataclass
class Candidate:
    config: dict
    median_ms: float | None = None
    min_ms: float | None = None
    iqr_ms: float | None = None
    compile_s: float | None = None
    error: str | None = None
    default: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TuneResult:
    op: str
    implementation: str
    signature: tuple
    config: Any
    time_ms: float
    default_time_ms: float | None
    candidates: list
    timer: str
    device: str
    device_kind: str
    elapsed_s: float = 0.0

    @property
    def failures(self) -> int:
        return sum(1 for c in self.candidates if c.error)

    @property
    def speedup(self) -> float | None:
        if self.default_time_ms and self.time_ms:
            return self.default_time_ms / self.time_ms
        return None

    def entry(self) -> cache_lib.Entry:
        config = self.config.to_dict() if hasattr(self.config, "to_dict") else dict(self.config)
        return cache_lib.Entry(
            op=self.op, implementation=self.implementation, signature=self.signature, config=config,
            time_ms=self.time_ms, default_time_ms=self.default_time_ms, timer=self.timer,
            created=cache_lib._now(), candidates=len(self.candidates), failures=self.failures,
            **cache_lib.versions(),
        )


def _config_dict(config) -> dict:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config or {})


def select_configs(space: list, default, max_configs: int | None, *, ranked: bool = False) -> list:
    """The default config first, then the space in order (deduplicated),
    cut to ``max_configs`` when given: the first ones when the space is
    ``ranked`` (best first, `stellax.bench.cost_model.rank_space`), else
    evenly thinned."""
    seen, ordered = set(), []
    for config in ([default] if default is not None else []) + list(space):
        token = repr(_config_dict(config))
        if token not in seen:
            seen.add(token)
            ordered.append(config)
    if max_configs is not None and 0 < max_configs < len(ordered):
        rest = ordered[1:]
        take = max_configs - 1
        if ranked:
            rest = rest[:max(take, 0)]
        elif take > 0:
            idx = np.linspace(0, len(rest) - 1, take).round().astype(int)
            rest = [rest[i] for i in sorted(set(idx.tolist()))]
        else:
            rest = []
        ordered = ordered[:1] + rest
    return ordered


def isolating(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` bound to a snapshot of the *caller's* context (taken now), with
    call observers off and the tuning flag on; safe to run in other threads."""
    snapshot = contextvars.copy_context()

    def runner(*args, **kwargs):
        def inner():
            selection._OBSERVERS.set(())
            TUNING.set(True)
            return fn(*args, **kwargs)
        return snapshot.copy().run(inner)

    return runner


def isolated(fn: Callable[..., Any], *args, **kwargs):
    """Run ``fn`` now in an isolated copy of the current context (see `isolating`)."""
    return isolating(fn)(*args, **kwargs)


def run_in_thread(fn: Callable[..., Any], *args, **kwargs):
    """Run ``fn`` in a fresh thread (a clean JAX trace state: this works even
    while a ``jit`` is being traced) with the current context copied."""
    runner = isolating(fn)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as ex:
        return ex.submit(runner, *args, **kwargs).result()


def _outputs_close(out, ref) -> str | None:
    """Why ``out`` disagrees with the default config's ``ref``, or ``None``: integer leaves
    equal, float leaves finite in the same places and within ``max(20·tolerance, 1e-3)`` rel-L2."""
    out_leaves = jax.tree_util.tree_leaves(out)
    ref_leaves = jax.tree_util.tree_leaves(ref)
    if len(out_leaves) != len(ref_leaves):
        return f"{len(out_leaves)} outputs vs {len(ref_leaves)}"
    for i, (o, r) in enumerate(zip(out_leaves, ref_leaves)):
        if jnp.shape(o) != jnp.shape(r):
            return f"output {i}: shape {jnp.shape(o)} vs {jnp.shape(r)}"
        if not inputs_lib.is_float(o):
            if not bool(jnp.array_equal(o, r)):
                return f"output {i}: integer values differ"
            continue
        rel = compare_on_device(o, r).rel_l2  # on the device: a tuned output can be gigabytes
        if not np.isfinite(rel):
            return f"output {i}: non-finite values where the default config has none"
        tol = max(20 * tolerance(o.dtype), 1e-3)
        if rel > tol:
            return f"output {i}: rel_l2 {rel:.2e} from the default config's result (tol {tol:.0e})"
    return None


def _compile_all(configs, compile_one, candidates, compile_workers, progress) -> list:
    """Compile every config in parallel threads; a failure is recorded on its candidate (entry ``None``)."""
    compiled: list = [None] * len(configs)
    workers = compile_workers or min(8, max(1, (os.cpu_count() or 2)), len(configs))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
        runner = isolating(compile_one)
        futures = {ex.submit(runner, c): i for i, c in enumerate(configs)}
        done = 0
        for future in concurrent.futures.as_completed(futures):
            i = futures[future]
            try:
                compiled[i], candidates[i].compile_s = future.result()
            except Exception as e:  # noqa: BLE001 - a failing config is skipped
                candidates[i].error = f"compile: {type(e).__name__}: {e}"[:400]
            done += 1
            if progress:
                progress("compile", done, len(configs))
    return compiled


def _time_all(compiled, sets, candidates, timer, verify: bool, progress, deadline: float | None = None) -> str:
    """Time every compiled config one after another on the same inputs (a config whose output
    disagrees with the first one's is recorded as wrong, not timed; once ``time.monotonic()``
    passes ``deadline`` the rest are recorded as skipped); returns the timer's name."""
    timer_obj = timing_lib.make_timer(timer)
    used_timer = timer_obj.name
    reference = None
    for i, exe in enumerate(compiled):
        if exe is None:
            continue
        if deadline is not None and time.monotonic() > deadline and any(c.median_ms is not None for c in candidates):
            candidates[i].error = "skipped: deadline reached"
            continue
        try:
            out = isolated(lambda: jax.block_until_ready(exe(*sets[0])))
            if verify:
                if reference is None:
                    reference = out
                else:
                    problem = _outputs_close(out, reference)
                    if problem:
                        candidates[i].error = f"wrong result: {problem}"
                        continue
            times, used_timer = isolated(timing_lib.measure, exe, sets, timer_obj)
            stats = timing_lib.summarize(times)
            candidates[i].median_ms, candidates[i].min_ms, candidates[i].iqr_ms = stats.median, stats.min, stats.iqr
        except Exception as e:  # noqa: BLE001
            candidates[i].error = f"run: {type(e).__name__}: {e}"[:400]
        if progress:
            progress("time", i + 1, len(compiled))
    return used_timer


def tune_call(op, implementation, call: Call, *, max_configs: int | None = None,
              timer: str | timing_lib.Timer = "auto", concrete: Mapping[str, Any] | None = None,
              input_sets: int = 2, compile_workers: int | None = None, verify: bool = True, seed: int = 0,
              progress: Callable[[str, int, int], None] | None = None,
              deadline: float | None = None) -> TuneResult:
    """Find the fastest config of ``implementation`` (an `Implementation` or
    its name) of ``op`` for ``call`` (arrays may be tracers or shape structs;
    float operands are replaced by random values, other operands come from
    ``concrete`` by name when known). Past ``deadline`` (``time.monotonic()``)
    the configs not yet timed are skipped; the default config is always timed."""
    started = time.perf_counter()
    impl = op.implementations[implementation] if isinstance(implementation, str) else implementation
    if impl.config_type is None:
        raise ValueError(f"{op.name}/{impl.name} has no config to tune")
    abstract = call.abstract()
    support = impl.supported(abstract)
    if not support:
        raise TuneError(f"{op.name}/{impl.name} cannot run {abstract.describe()} here: {support.reason}")
    space = impl.config_space(abstract)
    ranked = max_configs is not None and has_model(op.name, impl.name)
    if ranked:  # the cost model's most promising configs first (static-tier flagged ones last)
        space = rank_space(op, impl.name, abstract, space)
    configs = select_configs(space, impl.default_config(abstract), max_configs, ranked=ranked)
    base_key = jax.random.PRNGKey(seed)
    sets = [(inputs_lib.arrays_from_abstract(abstract.arrays, jax.random.fold_in(base_key, i), concrete),)
            for i in range(max(1, input_sets))]

    def make_fn(config):
        def run(arrays):
            return op.run(abstract.replace_arrays(**arrays), implementation=impl.name, config=config)
        return run

    def compile_one(config):
        t0 = time.perf_counter()
        compiled = jax.jit(make_fn(config)).lower(*sets[0]).compile()
        return compiled, time.perf_counter() - t0

    candidates = [Candidate(_config_dict(c), default=(i == 0)) for i, c in enumerate(configs)]
    compiled = _compile_all(configs, compile_one, candidates, compile_workers, progress)
    used_timer = _time_all(compiled, sets, candidates, timer, verify, progress, deadline)

    timed = [(c.median_ms, i) for i, c in enumerate(candidates) if c.error is None and c.median_ms is not None]
    if not timed:
        reasons = "; ".join(f"{c.config}: {c.error}" for c in candidates[:5])
        raise TuneError(f"{op.name}/{impl.name}: every config failed for {abstract.describe()}: {reasons}")
    best_ms, best = min(timed)
    platform = current_platform()
    return TuneResult(
        op=op.name, implementation=impl.name, signature=keys_lib.make_key(op.name, impl.name, call.signature())[2],
        config=configs[best], time_ms=best_ms, default_time_ms=candidates[0].median_ms,
        candidates=candidates, timer=used_timer, device=keys_lib.device_slug(platform),
        device_kind=platform.device_kind, elapsed_s=time.perf_counter() - started,
    )


@contextlib.contextmanager
def no_tuning():
    """Config sources must not start tuners inside this block."""
    token = TUNING.set(True)
    try:
        yield
    finally:
        TUNING.reset(token)
