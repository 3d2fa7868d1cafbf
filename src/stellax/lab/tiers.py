"""The evaluation tiers, run inside the child process on an already loaded
candidate (`stellax.lab.child`), in order, stopping at the first failure:

1. ``load``: the file imports and defines an implementation (`candidate`);
2. ``contract``: output structure, shapes and dtypes on the op's examples
   (``jax.eval_shape``) match the op's own ``xla`` implementation; the
   config heuristic returns the config type and the space is not empty;
3. ``numerics``: forward results against the golden (float32 math at the
   highest precision) on every example and dtype, interpreted on a CPU for
   kernels, natively on a device;
4. ``gradients``: for ops with a VJP, gradients of a random projection of the
   outputs against the golden's (2× the forward tolerance);
5. ``determinism``: a second run is bitwise equal (forward and gradients);
6. ``lowering``: kernels lower for every platform their backend targets
   (cuda / tpu) with the backend's custom call;
7. ``compile``: Triton IR to PTX with shared memory within sm_90's limit
   (needs the CUDA plugin wheels), Mosaic TPU compile (needs libtpu);
8. ``benchmark``: median time against the op's current best implementation
   on the benchmark shapes (natively only), with roofline %.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from ..core import Example, Implementation, Op, current_platform, interpret_mode, lowering_target
from ..bench import analyze, device_peaks
from ..bench.inputs import materialize_example
from ..testing import compare, golden, lower_config, platforms_of, random_array, upcast
from ..testing.validation import projected_loss
from ..testing import assert_fits_smem, compile_triton_to_ptx, lower_for, triton_compiler_available
from ..testing.lowering import DEFAULT_TARGET
from . import report as report_lib


class TierFailure(Exception):
    """A tier's verdict that the candidate is wrong (not a crash of the candidate)."""


@dataclasses.dataclass
class Options:
    """What the tiers run on (JSON-able; the parent sends them to the child)."""

    dtypes: tuple = ("float32", "bfloat16")
    max_examples: int | None = None
    benchmark: bool = True
    benchmark_min_time: float = 0.2
    benchmark_rounds: int = 2
    max_benchmarks: int | None = None
    benchmarks_from_file: bool = False

    @classmethod
    def from_dict(cls, data: dict | None) -> "Options":
        data = dict(data or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"options: unknown fields {sorted(unknown)}; expected {sorted(names)}")
        if "dtypes" in data:
            data["dtypes"] = tuple(data["dtypes"])
        return cls(**data)


def error_info(exc: BaseException, candidate_path: str, display: str) -> dict:
    """Type, message, traceback excerpt and the candidate's file:line (the
    innermost frame in the candidate file, else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if isinstance(exc, SyntaxError) and exc.filename == candidate_path:
        file, line = display, exc.lineno
    else:
        ours = [f for f in frames if f.filename == candidate_path]
        pick = ours[-1] if ours else (frames[-1] if frames else None)
        file = None if pick is None else (display if pick.filename == candidate_path else pick.filename)
        line = None if pick is None else pick.lineno
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    excerpt = "\n".join(text.replace(candidate_path, display).splitlines()[-14:])
    message = f"{type(exc).__name__}: {exc}".replace(candidate_path, display)
    return {"type": type(exc).__name__, "message": message[:2000], "excerpt": excerpt[-3000:],
            "file": file, "line": line}


def _split_kwargs(example: Example) -> tuple[dict, dict]:
    arrays = {k: v for k, v in example.kwargs.items() if hasattr(v, "dtype")}
    return arrays, {k: v for k, v in example.kwargs.items() if k not in arrays}


def _is_float_tree(a) -> bool:
    leaves = jax.tree_util.tree_leaves(a)
    return bool(leaves) and all(hasattr(l, "dtype") and jnp.issubdtype(l.dtype, jnp.floating) for l in leaves)


class Runner:
    """The state the tiers share: the op, the candidate registered on a copy
    of it, the examples and the results so far."""

    def __init__(self, op: Op, lab_op: Op, impl: Implementation, options: Options, bench_examples=None):
        self.op, self.lab_op, self.impl, self.options = op, lab_op, impl, options
        self.platform = current_platform()
        self.interpret = impl.is_kernel and self.platform.backend == "cpu"
        self.cases: list[tuple[str, Example, Any]] = []  # (dtype, example, call) the candidate supports
        self.unsupported: list[str] = []
        self.first: dict[tuple, list] = {}  # (dtype, label) -> first forward leaves (+ gradient leaves)
        self.numeric_cases: list[dict] = []
        self.worst: dict | None = None
        self.bench_examples = bench_examples

    # -- helpers ------------------------------------------------------------------
    def mode(self):
        return interpret_mode(True) if self.interpret else contextlib.nullcontext()

    def fns(self, example: Example, implementation: str) -> tuple[Callable, Callable, dict]:
        arrays, static = _split_kwargs(example)
        lab_op = self.lab_op

        def run(*args, **kw):
            return lab_op(*args, implementation=implementation, **kw, **static)

        def ref(*args, **kw):
            return lab_op.reference(*args, **kw, **static)
        return run, ref, arrays

    def grad_positions(self, example: Example, call) -> list[int]:
        if not self.op.differentiable:
            return []
        names = list(call.arrays)
        return [i for i, a in enumerate(example.args)
                if a is not None and _is_float_tree(a) and i < len(names) and names[i] in self.op.differentiable]

    def examples(self):
        for dtype in self.options.dtypes:
            for example in self.op.examples(jnp.dtype(dtype))[:self.options.max_examples]:
                yield dtype, example

    # -- tiers --------------------------------------------------------------------
    def contract(self) -> str:
        impl = self.impl
        for dtype, example in self.examples():
            call = self.op.check(*example.args, **example.kwargs)
            with self.mode():  # a kernel on a CPU runs interpreted
                support = impl.supported(call)
            if not support:
                self.unsupported.append(f"{example.label} ({dtype}): {support.reason}")
                continue
            if impl.config_type is not None:
                config = impl.default_config(call)
                if not isinstance(config, impl.config_type):
                    raise TierFailure(f"heuristic returned {type(config).__name__}, expected "
                                      f"{impl.config_type.__name__} on example '{example.label}'")
                if not impl.config_space(call):
                    raise TierFailure(f"the config space of {impl.name!r} is empty on example '{example.label}' "
                                      f"({dtype}): nothing to autotune or search")
            run, _, arrays = self.fns(example, impl.name)
            base, _, _ = self.fns(example, "xla")
            with self.mode():
                got = jax.eval_shape(run, *example.args, **arrays)
            want = jax.eval_shape(base, *example.args, **arrays)
            got_leaves, got_tree = jax.tree_util.tree_flatten(got)
            want_leaves, want_tree = jax.tree_util.tree_flatten(want)
            if got_tree != want_tree:
                raise TierFailure(f"output structure {got_tree} differs from the op's {want_tree} on example "
                                  f"'{example.label}' ({dtype})")
            for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
                if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
                    raise TierFailure(f"output {i} is {g.dtype}{list(g.shape)}, expected {w.dtype}{list(w.shape)} "
                                      f"on example '{example.label}' ({dtype})")
            self.cases.append((dtype, example, call))
        if not self.cases:
            raise TierFailure("the candidate supports none of the op's examples: "
                              + "; ".join(self.unsupported)[:1000])
        skipped = f"; unsupported: {len(self.unsupported)}" if self.unsupported else ""
        return f"{len(self.cases)} example calls{skipped}"

    def _record(self, summaries, what, dtype, example, outs, refs):
        for i, (s, o, r) in enumerate(zip(summaries, outs, refs)):
            index = None
            o64 = np.asarray(jnp.asarray(o).astype(jnp.float32), np.float64)
            r64 = np.asarray(jnp.asarray(r).astype(jnp.float32), np.float64)
            if o64.size:
                with np.errstate(invalid="ignore"):
                    diff = np.where(np.isnan(o64) != np.isnan(r64), np.inf, np.nan_to_num(np.abs(o64 - r64)))
                index = [int(k) for k in np.unravel_index(int(np.argmax(diff)), o64.shape)]
            case = {"example": example.label, "dtype": dtype, "what": f"{what}[{i}]", "rel_l2": s.rel_l2,
                    "max_abs": s.max_abs, "tolerance": s.tolerance, "fraction_within": s.fraction_within,
                    "has_nan": s.has_nan, "passed": s.passed, "index": index}
            self.numeric_cases.append(case)
            ratio = s.rel_l2 / max(s.tolerance, 1e-30) if math.isfinite(s.rel_l2) else math.inf
            key = (not s.passed, ratio)
            if self.worst is None or key > self.worst["_key"]:
                self.worst = {**case, "_key": key}

    def numerics(self) -> str:
        failures = []
        for dtype, example, _ in self.cases:
            run, ref, arrays = self.fns(example, self.impl.name)
            with self.mode():
                out = jax.tree_util.tree_leaves(jax.jit(run)(*example.args, **arrays))
            expected = jax.tree_util.tree_leaves(golden(ref, *example.args, **arrays))
            if len(out) != len(expected):
                raise TierFailure(f"{len(out)} outputs vs {len(expected)} in the reference on '{example.label}'")
            summaries = [compare(o, r, dtype=dtype) for o, r in zip(out, expected)]
            self._record(summaries, "output", dtype, example, out, expected)
            self.first[(dtype, example.label)] = [np.asarray(o) for o in out]
            failures += [f"'{example.label}' ({dtype}) output[{i}] {s}" for i, s in enumerate(summaries) if not s.passed]
        if failures:
            raise TierFailure(f"{len(failures)} outputs outside tolerance; first: {failures[0]}")
        return f"{len(self.cases)} example calls within tolerance"

    def _grads(self, example, call, implementation_fn, ref_fn, arrays, positions, leaves):
        keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
        cots = [random_array(k, l.shape, jnp.float32) for k, l in zip(keys, leaves)]

        def loss_of(fn, args, kwargs):
            return projected_loss(fn, args, kwargs, positions, cots)

        diff_args = [example.args[i] for i in positions]
        argnums = tuple(range(len(positions)))
        with self.mode():
            grads = jax.jit(jax.grad(loss_of(implementation_fn, example.args, arrays), argnums=argnums))(*diff_args)
        ref_grads = golden(jax.grad(loss_of(ref_fn, upcast(list(example.args)), upcast(arrays)), argnums=argnums),
                           *diff_args)
        return jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)

    def gradients(self) -> str:
        done, failures = 0, []
        for dtype, example, call in self.cases:
            positions = self.grad_positions(example, call)
            if not positions:
                continue
            run, ref, arrays = self.fns(example, self.impl.name)
            leaves = self.first[(dtype, example.label)]
            grads, ref_grads = self._grads(example, call, run, ref, arrays, positions, leaves)
            summaries = [compare(g, r, dtype=dtype, gradient=True) for g, r in zip(grads, ref_grads)]
            self._record(summaries, "gradient", dtype, example, grads, ref_grads)
            self.first[(dtype, example.label, "grad")] = [np.asarray(g) for g in grads]
            failures += [f"'{example.label}' ({dtype}) gradient[{i}] {s}" for i, s in enumerate(summaries) if not s.passed]
            done += 1
        if failures:
            raise TierFailure(f"{len(failures)} gradients outside tolerance; first: {failures[0]}")
        if not done:
            return "skipped: the op has no differentiable operands" if not self.op.differentiable else \
                "skipped: no example has differentiable float operands"
        return f"{done} example calls within tolerance"

    def determinism(self) -> str:
        for dtype, example, call in self.cases:
            run, ref, arrays = self.fns(example, self.impl.name)
            with self.mode():
                again = jax.tree_util.tree_leaves(jax.jit(run)(*example.args, **arrays))
            for i, (a, b) in enumerate(zip(self.first[(dtype, example.label)], again)):
                if a.tobytes() != np.asarray(b).tobytes():
                    raise TierFailure(f"output[{i}] of '{example.label}' ({dtype}) differs between two runs")
            grads = self.first.get((dtype, example.label, "grad"))
            if grads is not None:
                positions = self.grad_positions(example, call)
                again_g, _ = self._grads(example, call, run, ref, arrays, positions, self.first[(dtype, example.label)])
                for i, (a, b) in enumerate(zip(grads, again_g)):
                    if a.tobytes() != np.asarray(b).tobytes():
                        raise TierFailure(f"gradient[{i}] of '{example.label}' ({dtype}) differs between two runs")
        return f"{len(self.cases)} example calls bitwise equal on a second run"

    def _lowering_example(self):
        return self.cases[0][1]

    def lowering(self) -> str:
        platforms = platforms_of(self.impl.backend)
        if not platforms:
            return "skipped: an XLA candidate lowers wherever XLA runs"
        example = self._lowering_example()
        for platform in platforms:
            lower_config(self.lab_op, self.impl.name, example.args, example.kwargs, platform=platform,
                         grad=bool(self.grad_positions(example, self.op.check(*example.args, **example.kwargs))))
        return f"lowered for {', '.join(platforms)} on '{example.label}'"

    def compile(self) -> str:
        backend = self.impl.backend
        if backend == "triton":
            ok, reason = triton_compiler_available()
            if not ok:
                return f"skipped: {reason}"
            example = self._lowering_example()
            arrays, static = _split_kwargs(example)
            lab_op, name = self.lab_op, self.impl.name
            lowered = lower_for(lambda a, kw: lab_op(*a, implementation=name, **kw, **static),
                                tuple(example.args), arrays, platform="cuda")
            kernels = compile_triton_to_ptx(lowered, "9.0")
            assert_fits_smem(kernels, "9.0")
            return "PTX sm_90: " + ", ".join(f"{k.name} smem {k.smem_bytes} B" for k in kernels)
        if backend == "mosaic_tpu":
            if importlib.util.find_spec("libtpu") is None:
                return "skipped: libtpu is not installed (pip install libtpu==0.0.42)"
            return self._compile_tpu()
        return f"skipped: no compile tier for backend {backend!r}"

    def _compile_tpu(self) -> str:
        topology = topologies.get_topology_desc(topology_name="v6e:2x2", platform="tpu")
        device = topology.devices[0]
        example = self._lowering_example()
        arrays, static = _split_kwargs(example)
        lab_op, name = self.lab_op, self.impl.name

        def struct(x):
            if hasattr(x, "shape") and hasattr(x, "dtype"):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device))
            return x
        args, kw = jax.tree_util.tree_map(struct, (example.args, arrays))
        with lowering_target(DEFAULT_TARGET["tpu"]):
            compiled = jax.jit(lambda a, k: lab_op(*a, implementation=name, **k, **static)).trace(args, kw).lower(
                lowering_platforms=("tpu",)).compile()
        memory = compiled.memory_analysis()
        return f"compiled for TPU v6e; temp {getattr(memory, 'temp_size_in_bytes', '?')} B"

    def benchmark(self) -> dict:
        if not self.options.benchmark:
            return {"skipped": "benchmark disabled (--no-benchmark)"}
        if self.interpret:
            return {"skipped": "an interpreted kernel is not timed on a CPU; the candidate is scored by the "
                               "tiers it passes"}
        examples = self.bench_examples if self.bench_examples is not None else self.op.benchmarks(self.platform)
        examples = list(examples)[:self.options.max_benchmarks]
        if not examples:
            return {"skipped": f"{self.op.name} has no benchmark shapes on {self.platform.describe()}"}
        peaks = device_peaks(self.platform)
        cases, baselines = [], set()
        for raw in examples:
            example = materialize_example(raw)
            call = self.op.check(*example.args, **example.kwargs)
            support = self.impl.supported(call)
            if not support:
                cases.append({"example": example.label, "skipped": support.reason})
                continue
            best = self.op.select(call)
            baselines.add(best.name)
            arrays, static = _split_kwargs(example)
            compiled = {}
            for who, op, name in (("candidate", self.lab_op, self.impl.name), ("baseline", self.op, best.name)):
                def fn(*args, _op=op, _name=name, **kw):
                    return _op(*args, implementation=_name, **kw, **static)
                compiled[who] = jax.jit(fn).lower(*example.args, **arrays).compile()
            times = interleaved_times(compiled, example.args, arrays, self.options.benchmark_min_time,
                                      self.options.benchmark_rounds)
            c, b = times["candidate"], times["baseline"]
            ratios = sorted(bt / ct for bt, ct in zip(b, c) if ct > 0)
            flops, nbytes = self.op.flops(call), self.op.bytes_accessed(call)
            dtype = next((np.dtype(a.dtype).name for a in example.args if hasattr(a, "dtype")), None)
            roof = {who: analyze(flops, nbytes, min(t) / 1e3, dtype, peaks).get("pct_roofline")
                    for who, t in times.items()}
            cases.append({"example": example.label, "baseline": best.name, "candidate_ms": float(np.median(c)),
                          "baseline_ms": float(np.median(b)), "candidate_min_ms": min(c), "baseline_min_ms": min(b),
                          "speedup": float(np.median(ratios)) if ratios else None,
                          "speedup_of_minima": min(b) / min(c) if min(c) > 0 else None, "pairs": len(ratios),
                          "pct_roofline": roof["candidate"], "baseline_pct_roofline": roof["baseline"],
                          "flops": flops or None, "bytes_accessed": nbytes or None})
        timed = [c["speedup"] for c in cases if c.get("speedup")]
        speedup = math.exp(sum(math.log(s) for s in timed) / len(timed)) if timed else None
        return {"baseline": ",".join(sorted(baselines)) or None, "cases": cases, "speedup": speedup,
                "timer": "wall clock, candidate and baseline interleaved; speedup = median of paired ratios"}


def interleaved_times(compiled: dict, args, kwargs, min_time: float, rounds: int) -> dict[str, list[float]]:
    """Per-iteration milliseconds of each compiled function, the functions run
    alternately (order flipped every iteration) so that both see the same
    machine load; ``rounds`` × ``min_time`` seconds in all, at least 5 pairs."""
    names = list(compiled)
    for name in names:  # warm up
        jax.block_until_ready(compiled[name](*args, **kwargs))
    out: dict[str, list[float]] = {n: [] for n in names}
    budget = max(1, rounds) * min_time
    start = time.perf_counter()
    i = 0
    while i < 5 or (time.perf_counter() - start < budget and i < 2000):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](*args, **kwargs))
            out[name].append((time.perf_counter() - t0) * 1e3)
        i += 1
    return out


def run_tiers(runner: Runner, progress: Callable[[str], None], started: list[dict]) -> tuple[list[dict], dict | None,
                                                                                              dict | None]:
    """Run tiers 2–8 (load already passed); returns (tiers, first failure, benchmark)."""
    tiers = started
    bench = None
    for name in report_lib.TIERS[1:]:
        progress(name)
        t0 = time.perf_counter()
        try:
            if name == "benchmark":
                bench = runner.benchmark()
                status = "skipped" if bench.get("skipped") else "passed"
                detail = bench.get("skipped") or f"speedup {bench.get('speedup')}"
            else:
                detail = getattr(runner, name)()
                status = "skipped" if detail.startswith("skipped") else "passed"
        except TierFailure as e:
            error = {"type": "TierFailure", "message": str(e)[:2000], "excerpt": "", "file": None, "line": None}
            tiers.append(report_lib.tier(name, "failed", time.perf_counter() - t0, str(e)[:2000], error))
            return tiers, {"tier": name, **error}, bench
        except MemoryError:
            raise
        except Exception as e:  # the candidate crashed inside the tier
            error = runner_error(e)
            tiers.append(report_lib.tier(name, "failed", time.perf_counter() - t0, error["message"], error))
            return tiers, {"tier": name, **error}, bench
        tiers.append(report_lib.tier(name, status, time.perf_counter() - t0, detail))
    return tiers, None, bench


#: Set by the child: (candidate path in the temporary directory, the name shown to users).
CANDIDATE_PATHS = ["", ""]


def runner_error(exc: BaseException) -> dict:
    return error_info(exc, CANDIDATE_PATHS[0], CANDIDATE_PATHS[1])
