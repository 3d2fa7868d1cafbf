"""``stellax autotune``: tune benchmark suites or shapes from a JSON file and
write the configs to the user cache.

Shapes file (``--shapes``): a JSON list of calls, each
``{"op": "layer_norm", "args": [{"shape": [4096, 4096], "dtype": "bfloat16"},
{"shape": [4096], "dtype": "bfloat16"}, null], "kwargs": {"subtract_mean": false},
"backward": true}``: an object with ``shape`` and ``dtype`` is a random array,
anything else is passed as it is; ``backward`` (default true for
differentiable ops) tunes the backward ops too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from rich.console import Console

import stellax  # noqa: F401  (registers the ops)

from ..bench.inputs import materialize_example
from .._op_names import UnknownOpError, resolve_op_name, resolve_op_names
from ..bench.suites import families, grad_spec, only_ops
from ..bench.timing import TIMER_NAMES
from ..core.op import Example, registered_ops
from ..core.platform import current_platform, interpret_mode
from ..testing.numerics import random_array
from . import cache as cache_lib
from . import keys as keys_lib
from . import programs
from .api import AutotuneResult, autotune, progress_printer, tune_calls


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stellax autotune",
                                description="Tune the kernels of benchmark suites (op families) or of shapes "
                                            "from a JSON file; results go to the user autotuning cache.")
    p.add_argument("suites", nargs="*", help="op families to tune on their benchmark shapes (default: all)")
    p.add_argument("--ops", default=None,
                   help="comma list of ops to tune (registry or public names: rms_norm, dot_product_attention); "
                        "default: every op of the suites")
    p.add_argument("--shapes", metavar="FILE.json", help="tune these calls instead of suites")
    p.add_argument("--from-hlo", metavar="FILE", help="tune the stellax calls of a program from its HLO / StableHLO "
                                                      "text (jax.jit(f).lower(...).as_text()) or an XLA dump "
                                                      "directory, without the program's code")
    p.add_argument("--from-trace", metavar="DIR", help="tune the stellax calls of a jax.profiler / XProf trace "
                                                       "directory, the most expensive first (their measured times "
                                                       "are printed)")
    p.add_argument("--implementations", default=None, help="comma list of kernel implementations to tune")
    p.add_argument("--max-configs", type=int, default=None, help="at most this many configs per call")
    p.add_argument("--max-cases", type=int, default=None, help="at most this many shapes per op")
    p.add_argument("--no-backward", action="store_true", help="do not tune backward ops")
    p.add_argument("--force", action="store_true", help="re-tune calls that are already cached")
    p.add_argument("--interpret", action="store_true",
                   help="tune interpreted kernels (on a CPU; for testing: the timings mean nothing)")
    p.add_argument("--timer", default="auto", choices=TIMER_NAMES)
    p.add_argument("--cache-dir", metavar="DIR", help="the cache directory (default: $STELLAX_CACHE_DIR or the "
                                                      "user cache dir)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the user cache")
    p.add_argument("--out", metavar="RESULT.json", help="also write the result (configs and searches) as JSON")
    p.add_argument("--export", metavar="CACHE.json",
                   help="also write the configs as a cache file (e.g. to ship in stellax/autotune/shipped/)")
    p.add_argument("--show", action="store_true", help="print the user cache of this device and exit")
    p.add_argument("--quiet", action="store_true")
    return p


def _array_from_spec(spec, key):
    if isinstance(spec, dict) and "shape" in spec:
        dtype = jnp.dtype(spec.get("dtype", "float32"))
        shape = tuple(int(d) for d in spec["shape"])
        if jnp.issubdtype(dtype, jnp.inexact):
            return random_array(key, shape, dtype)
        if "value" in spec:
            return jnp.asarray(spec["value"], dtype).reshape(shape)
        return jnp.zeros(shape, dtype)
    return spec


def load_shapes(path: str):
    """``[(op, args, kwargs, backward, label)]`` from a shapes file."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("calls", [])
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of calls")
    ops = registered_ops()
    out = []
    for i, item in enumerate(data):
        try:
            name = resolve_op_name(item.get("op"), ops)  # a public function's name works too
        except UnknownOpError as e:
            raise ValueError(f"{path}[{i}].op: {e}") from None
        key = jax.random.PRNGKey(i)
        keys = jax.random.split(key, len(item.get("args", [])) + len(item.get("kwargs", {})) + 1)
        args = tuple(_array_from_spec(a, k) for a, k in zip(item.get("args", []), keys))
        kwargs = {k: _array_from_spec(v, kk) for (k, v), kk in zip(item.get("kwargs", {}).items(),
                                                                    keys[len(args):])}
        out.append((ops[name], args, kwargs, item.get("backward", True), item.get("label", f"{name}[{i}]")))
    return out


def suite_calls(suites, max_cases=None, ops=None):
    """The benchmark calls of ``suites`` (all when empty), only those of ``ops`` when given."""
    known = families()
    unknown = [s for s in suites if s not in known]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; known suites: {list(known)}")
    if ops:
        known = only_ops(known, ops, suites)
    out = []
    for family in ([s for s in suites if s in known] if suites else list(known)):
        for op in known[family]:
            examples = op.benchmarks()
            if max_cases is not None:
                examples = examples[:max_cases]
            for ex in examples:
                ex = materialize_example(ex)
                out.append((op, ex.args, dict(ex.kwargs), True, f"{op.name} {ex.label}"))
    return out


def tuning_function(op, impl_name: str, args, kwargs, backward: bool):
    """The function autotuned for one call: the op (and, for differentiable
    ops, its gradient, so backward ops are tuned too)."""
    def forward(*a, **k):
        return op(*a, implementation=impl_name, **k)

    positions, grad_kw = grad_spec(op, Example("", tuple(args), dict(kwargs))) if backward else ([], [])
    if not positions and not grad_kw:
        return forward

    def with_grad(*a, **k):
        def loss(diff_a, diff_k):
            full = list(a)
            for i, v in zip(positions, diff_a):
                full[i] = v
            out = forward(*full, **{**k, **diff_k})
            return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree_util.tree_leaves(out)
                       if jnp.issubdtype(leaf.dtype, jnp.inexact))
        return jax.grad(loss, argnums=(0, 1))(tuple(a[i] for i in positions), {n: k[n] for n in grad_kw})

    return with_grad


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.cache_dir:
        os.environ["STELLAX_CACHE_DIR"] = args.cache_dir
    console = Console(width=max(Console().width, 140))
    err = Console(stderr=True)
    platform = current_platform()
    with interpret_mode(True) if args.interpret else _Null():
        device = keys_lib.device_slug(platform)
        if args.show:
            c = cache_lib.user_cache(device)
            console.print(f"{c.path}: {len(c)} entries")
            for entry in c.entries().values():
                console.print(f"  {entry.op}/{entry.implementation} {keys_lib.describe_signature(entry.signature)}: "
                              f"{entry.config} ({entry.time_ms} ms, stellax {entry.stellax_version}, "
                              f"jax {entry.jax_version})", highlight=False)
            return 0
        if args.from_hlo or args.from_trace:
            return _tune_program(args, console, err, device, platform)
        try:
            ops = [name for name in args.ops.split(",") if name] if args.ops else None
            calls = load_shapes(args.shapes) if args.shapes else suite_calls(args.suites, args.max_cases, ops)
            if ops and args.shapes:
                wanted = resolve_op_names(ops)
                calls = [c for c in calls if c[0].name in wanted]
        except (OSError, ValueError) as e:
            err.print(f"stellax autotune: {e}")
            return 2
        wanted = args.implementations.split(",") if args.implementations else None
        native_kernels = platform.backend != "cpu" or args.interpret
        if not native_kernels:
            err.print("stellax autotune: kernels do not run natively on a CPU, so there is nothing to tune here "
                      "(use --interpret to tune interpreted kernels for testing)")
            return 0
        results = AutotuneResult(device=device, device_kind=platform.device_kind)
        progress = None if args.quiet else progress_printer()
        started = time.monotonic()
        for n, (op, call_args, call_kwargs, backward, label) in enumerate(calls):
            kernel_impls = [name for name, impl in op.implementations.items()
                            if impl.is_kernel and impl.config_type is not None and (not wanted or name in wanted)]
            for impl_name in kernel_impls:
                impl = op.implementations[impl_name]
                try:
                    support = impl.supported(op.check(*call_args, **call_kwargs))
                except Exception as e:  # noqa: BLE001
                    err.print(f"{label}: {type(e).__name__}: {e}")
                    continue
                if not support:
                    if not args.quiet:
                        err.print(f"[dim]{label} / {impl_name}: skipped ({support.reason})")
                    continue
                fn = tuning_function(op, impl_name, call_args, call_kwargs, backward and not args.no_backward)

                def step(stage, done, total, _label=f"[{n + 1}/{len(calls)}] {label} / {impl_name}"):
                    if progress:
                        progress(f"{_label}: {stage}", done, total)

                r = autotune(fn, *call_args, max_configs=args.max_configs, timer=args.timer, force=args.force,
                             cache=not args.no_cache, use_shipped=not args.no_cache, progress=step, **call_kwargs)
                results.entries.extend(r.entries)
                results.failures.extend(r.failures)
        if progress:
            progress.close()
        results = AutotuneResult(results.entries, device=device, device_kind=platform.device_kind,
                                 failures=results.failures)
        return _report(args, console, results, device, platform, started)


def _program_records(args, console):
    """The calls recovered from ``--from-hlo`` / ``--from-trace`` (printed, with trace times)."""
    if args.from_hlo:
        records = programs.calls_from_hlo(args.from_hlo)
        console.print(f"{len(records)} stellax call(s) in {args.from_hlo}:")
        for r in records:
            console.print(f"  {r.describe()}", highlight=False, markup=False)
        return records
    traced = programs.calls_from_trace(args.from_trace)
    console.print(f"{len(traced)} stellax call(s) in the trace {args.from_trace}, most time first:")
    for t in traced:
        console.print(f"  {t.time_ms:10.3f} ms  {t.executions:4d} run(s)  {t.record.describe()}",
                      highlight=False, markup=False)
    return [t.record for t in traced]


def _tune_program(args, console, err, device, platform) -> int:
    """``--from-hlo`` / ``--from-trace``: tune the implementations the program used, as recorded."""
    try:
        records = _program_records(args, console)
    except (OSError, ValueError) as e:
        err.print(f"stellax autotune: {e}", highlight=False, markup=False)
        return 2
    calls, skipped = programs.observed_calls(records)
    wanted = args.implementations.split(",") if args.implementations else None
    calls = [c for c in calls if not wanted or c.implementation in wanted]
    if not args.quiet:
        for line in skipped:
            err.print(f"[dim]skipped {line}", highlight=False)
    if not calls:
        err.print("stellax autotune: none of the recovered calls has a config to tune here")
        return 0
    started = time.monotonic()
    results = tune_calls(calls, max_configs=args.max_configs, timer=args.timer, force=args.force,
                         cache=not args.no_cache, use_shipped=not args.no_cache,
                         progress=None if args.quiet else True)
    return _report(args, console, results, device, platform, started)


def _report(args, console, results, device, platform, started) -> int:
    """Print the summary, write ``--out`` / ``--export``; exit status 1 when everything failed."""
    console.print(results.summary(), highlight=False, markup=False)
    console.print(f"{len(results.entries)} config(s) ({len(results.tuned)} tuned) in "
                  f"{time.monotonic() - started:.1f} s; cache: "
                  f"{'not written' if args.no_cache else cache_lib.user_cache(device).path}", highlight=False)
    if args.out:
        results.save(args.out)
        console.print(f"wrote {args.out}")
    if args.export:
        exported = cache_lib.ConfigCache(args.export, device=device, device_kind=platform.device_kind)
        exported.put([e.entry for e in results.entries])
        console.print(f"wrote {args.export}")
    return 1 if results.failures and not results.entries else 0


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
