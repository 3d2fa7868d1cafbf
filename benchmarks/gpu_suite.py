#!/usr/bin/env python3
"""The stellax GPU suite: one command for a lent GPU machine.

    PYTHONPATH=src python benchmarks/gpu_suite.py --out $OUT

Run from the repository root, no install needed. Within a time budget
(default 7.5 minutes) it:

1. prints the environment (python, jax, devices, torch/triton, nvidia-smi);
2. calibrates the peaks (a large bf16 matmul and a device-to-device copy);
3. checks every op with every implementation (its Triton/Mosaic kernels
   natively) against the golden: first one float32 example and one real
   shape of each, then the other examples (bfloat16, float32) and shapes
   while its share of the budget (25%) lasts;
4. times the headline cases (``benchmarks/headline.py``: attention forward
   and backward at T = 16k against cuDNN and torch SDPA, ragged_dot against
   jax.lax.ragged_dot and a dense matmul, paged decode against the copy
   bandwidth, GDN forward at T = 32k) with TFLOP/s, % of peak, peer ratios
   and the cost model's prediction (up to 40% of the budget);
5. autotunes the kernels on the first benchmark shapes, the cost model's
   most promising configs first (configs exported in the shipped-cache
   format, ready for ``src/stellax/autotune/shipped/``);
6. runs every benchmark suite (with the tuned configs) against XLA, cuDNN
   and the other peers, with roofline numbers;
7. writes one JSON file ``stellax-gpu-suite-<date>-<device>.json`` (rewritten
   after each stage, so a crash keeps what was done), a markdown summary and
   the exported autotuning cache into the output directory.

``--dry-run`` runs the same stages on the CPU with interpreted kernels and
tiny shapes in well under a minute (the test suite runs it so the script
cannot rot). ``--time-scale F`` counts every second the suite spends as F
seconds against the budget (a device F times slower): the rehearsal that
shows the stages and the headline cases keep their order when time is short.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"),
                   help="output directory (default: $OUT, else benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreted kernels, tiny shapes")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run (default 450; dry run 600)")
    p.add_argument("--families", default=None, help="comma list of op families (default: all)")
    p.add_argument("--skip", default="",
                   help="comma list of stages to skip: calibrate,check,headline,autotune,bench")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="count each second spent as this many against the budget (simulates a slower device)")
    p.add_argument("--real-cases", type=int, default=2, help="benchmark shapes per op checked for numerics")
    p.add_argument("--bench-cases", type=int, default=3, help="benchmark shapes per op timed")
    p.add_argument("--tune-cases", type=int, default=1, help="benchmark shapes per op autotuned")
    p.add_argument("--max-configs", type=int, default=24, help="configs per tuned call (default 24)")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.dry_run:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["STELLAX_INTERPRET"] = "1"
# The autotuning cache of this run lives next to the output, not in the user's home.
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("STELLAX_AUTOTUNE_WARN", "0")

START = time.monotonic()
BUDGET = ARGS.budget if ARGS.budget is not None else (600.0 if ARGS.dry_run else 450.0)


def elapsed() -> float:
    """Seconds spent against the budget (real seconds × ``--time-scale``)."""
    return (time.monotonic() - START) * ARGS.time_scale


def now() -> float:
    """The suite's clock: deadlines are in these units (see `elapsed`)."""
    return elapsed()


def real_deadline(deadline: float) -> float:
    """A `now()` deadline as a ``time.monotonic()`` one, for library calls that take those."""
    return time.monotonic() + max(0.0, deadline - now()) / ARGS.time_scale


def remaining() -> float:
    return BUDGET - elapsed()


def log(text: str) -> None:
    print(f"[{elapsed():6.1f}s] {text}", flush=True)


def run_cmd(cmd, timeout=15) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (out.stdout or out.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({type(e).__name__})"


def environment_stage(result: dict) -> None:
    import jax

    from stellax.bench import report

    env = report.environment()
    env["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    for name in ("torch", "triton", "jaxlib", "numpy"):
        try:
            module = __import__(name)
            env[f"{name}_version"] = getattr(module, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - optional
            env[f"{name}_version"] = f"unavailable ({type(e).__name__})"
    if not ARGS.dry_run:
        env["nvidia_smi"] = run_cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                     "clocks.max.sm,temperature.gpu,power.draw", "--format=csv"])
    from stellax.bench.timing import cupti_available, default_timer_name

    env["timer"] = default_timer_name()
    env["cupti"] = "ok" if cupti_available()[0] else cupti_available()[1]
    env["dry_run"] = ARGS.dry_run
    result["environment"] = env
    for key, value in env.items():
        log(f"  {key}: {value}")


def calibrate_stage(result: dict) -> None:
    from stellax.bench.calibrate import calibrate, describe

    measurement = calibrate(quick=ARGS.dry_run, save=False)
    result["calibration"] = measurement
    log("  " + describe(measurement))


def _families():
    from stellax.bench.suites import families

    from stellax.core.op import registered_ops

    wanted = ARGS.families.split(",") if ARGS.families else None
    ops = registered_ops()
    by_family = {}
    for name in sorted(ops):
        op = ops[name]
        if wanted and op.family not in wanted:
            continue
        by_family.setdefault(op.family, []).append(op)
    del families
    return by_family


def _dtype_of(example):
    import jax
    import jax.numpy as jnp
    import numpy as np

    for leaf in jax.tree_util.tree_leaves((example.args, example.kwargs)):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return np.dtype(leaf.dtype)
    return np.dtype("float32")


def _check_record(r) -> dict:
    w = r.worst
    return {"op": r.op, "implementation": r.implementation, "dtype": r.dtype, "example": r.example,
            "passed": bool(r.passed), "skipped": r.skipped, "detail": r.detail,
            "rel_l2": None if w is None else w.rel_l2, "tolerance": None if w is None else w.tolerance,
            "max_abs": None if w is None else w.max_abs}


def check_stage(result: dict, deadline: float) -> None:
    """Numerics of every (op, implementation): first one float32 example and
    one real shape each (so every op is covered early), then the remaining
    examples (bfloat16, float32, more real shapes) while time is left."""
    import jax.numpy as jnp

    from stellax.bench.inputs import materialize_example
    from stellax.core.platform import interpret_mode
    from stellax.testing.validation import CheckResult, check_example

    records = result.setdefault("check", [])
    tasks = []  # (tier, order, op, impl_name, label, example, dtype)
    order = 0
    for family, ops in _families().items():
        for op in ops:
            f32 = op.examples(jnp.float32)
            real = [] if ARGS.dry_run else [materialize_example(e) for e in op.benchmarks()[: ARGS.real_cases]]
            bf16 = [] if ARGS.dry_run else op.examples(jnp.bfloat16)
            for impl_name in op.implementations:
                for i, e in enumerate(f32[:1] if ARGS.dry_run else f32):
                    tasks.append((0 if i == 0 else 3, order, op, impl_name, f"example {e.label}", e, jnp.float32))
                for i, e in enumerate(real):
                    tasks.append((1 if i == 0 else 3, order, op, impl_name, f"real {e.label}", e, _dtype_of(e)))
                for i, e in enumerate(bf16):
                    tasks.append((2, order, op, impl_name, f"example {e.label}", e, jnp.bfloat16))
                order += 1
    tasks.sort(key=lambda t: (t[0], t[1]))
    for n, (tier, _, op, impl_name, label, example, dtype) in enumerate(tasks):
        impl = op.implementations[impl_name]
        if now() > deadline:
            records.append({"op": op.name, "implementation": impl_name, "example": label, "passed": None,
                            "skipped": "time budget exhausted"})
            continue
        log(f"  check {op.name}/{impl_name} {jnp.dtype(dtype).name} {label} ...")
        try:
            with interpret_mode(True) if ARGS.dry_run and impl.is_kernel else _null():
                r = check_example(op, impl_name, example, dtype, gradients=not ARGS.dry_run)
        except Exception as e:  # noqa: BLE001 - a crash is a failure, recorded
            r = CheckResult(op.name, impl_name, str(jnp.dtype(dtype)), example.label, False, None,
                            detail=f"{type(e).__name__}: {e}"[:400])
        rec = _check_record(r)
        rec["example"] = label
        records.append(rec)
        status = "skip" if r.skipped else ("ok" if r.passed else "FAIL")
        worst = "" if r.worst is None else f" rel_l2={r.worst.rel_l2:.1e}"
        log(f"    {status}{worst} {r.detail or ''}{(' ' + r.skipped[:80]) if r.skipped else ''}")
        if n % 10 == 9:
            SAVE()


def SAVE():  # replaced in main(): rewrite the result file
    pass


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def autotune_stage(result: dict, deadline: float, out_dir: Path):
    import jax.numpy as jnp

    from stellax.autotune import AutotuneResult, autotune, device_slug
    from stellax.bench.inputs import materialize_example
    from stellax.autotune.cli import tuning_function

    combined = AutotuneResult(device=device_slug())
    records = result.setdefault("autotune", {"entries": [], "failures": [], "skipped": []})
    tuned_any = False
    for family, ops in _families().items():
        for op in ops:
            kernels = [n for n, impl in op.implementations.items() if impl.is_kernel and impl.config_type]
            if not kernels or op._benchmarks is None:
                continue
            examples = op.examples(jnp.float32)[:1] if ARGS.dry_run else op.benchmarks()[: ARGS.tune_cases]
            examples = [materialize_example(e) for e in examples]
            for example in examples:
                for impl_name in kernels:
                    if now() > deadline or (ARGS.dry_run and tuned_any):
                        records["skipped"].append(f"{op.name}/{impl_name} {example.label}")
                        continue
                    impl = op.implementations[impl_name]
                    try:
                        if not impl.supported(op.check(*example.args, **example.kwargs)):
                            records["skipped"].append(f"{op.name}/{impl_name} {example.label}: unsupported")
                            continue
                        fn = tuning_function(op, impl_name, example.args, example.kwargs, backward=not ARGS.dry_run)
                        r = autotune(fn, *example.args, max_configs=2 if ARGS.dry_run else ARGS.max_configs,
                                     force=True, cache=False, use_shipped=False, deadline=real_deadline(deadline),
                                     **example.kwargs)
                    except Exception as e:  # noqa: BLE001
                        records["failures"].append({"op": op.name, "implementation": impl_name,
                                                    "call": example.label, "error": f"{type(e).__name__}: {e}"[:400]})
                        continue
                    tuned_any = True
                    combined.entries.extend(r.entries)
                    records["failures"].extend(r.failures)
                    for e in r.entries:
                        records["entries"].append(e.to_json())
                        log(f"  tuned {e.entry.op}/{e.entry.implementation}: {e.entry.config} "
                            f"{e.entry.time_ms:.4g} ms (heuristic {e.entry.default_time_ms or float('nan'):.4g} ms, "
                            f"{e.tune.failures if e.tune else 0} failed configs)")
                    for f in r.failures:
                        log(f"  tune FAILED {f['op']}/{f['implementation']}: {f['error'][:200]}")
    combined = AutotuneResult(combined.entries, device=device_slug(), failures=records["failures"])
    if combined.entries:
        from stellax.autotune.cache import atomic_write_text, dump_cache_text

        path = out_dir / f"autotune-{device_slug()}.json"
        atomic_write_text(path, dump_cache_text({e.entry.key_string: e.entry for e in combined.entries},
                                                device=device_slug(),
                                                device_kind=result.get("environment", {}).get("device_kind", "")))
        records["exported_to"] = path.name
        log(f"  exported {len(combined.entries)} configs to {path}")
    return combined


def bench_stage(result: dict, deadline: float, tuned) -> None:
    from stellax.bench import report
    from stellax.bench.suites import SuiteOptions, run_suites

    options = SuiteOptions(
        interpret=ARGS.dry_run, max_cases=1 if ARGS.dry_run else ARGS.bench_cases,
        budget_s=max(1.0, (deadline - now()) / ARGS.time_scale), use_examples=ARGS.dry_run,
        modes=("forward",) if ARGS.dry_run else None, min_time=0.005 if ARGS.dry_run else None,
        input_sets=2 if ARGS.dry_run else None,
    )
    names = ARGS.families.split(",") if ARGS.families else None
    from stellax.bench.suites import families

    if names:
        names = [n for n in names if n in families()]
    with tuned if tuned is not None and len(tuned) else _null():
        records = run_suites(names, options, progress=lambda text: log("  " + text))
    from stellax.bench.roofline import device_peaks

    result["bench"] = report.to_json(records, env=result.get("environment"), peaks=device_peaks())
    result["_records"] = records


def headline_stage(result: dict, deadline: float) -> None:
    """The headline cases (`benchmarks/headline.py`) in order until ``deadline``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import headline

    from stellax.core.op import registered_ops

    ops = registered_ops()
    cases = headline.headline_cases(ops, dry=ARGS.dry_run)
    log(f"  headline cases: {max(0.0, deadline - now()):.0f} s")
    result["headline"] = headline.run_cases(
        cases, ops, now=now, deadline=deadline, interpret=ARGS.dry_run, min_time=0.005 if ARGS.dry_run else 0.3,
        calibration=result.get("calibration"), log=log)


def write(result: dict, path: Path) -> None:
    data = {k: v for k, v in result.items() if not k.startswith("_")}
    text = json.dumps(data, indent=1, default=repr) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def summary_table(result: dict) -> str:
    lines = []
    if result.get("headline"):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import headline

        lines += headline.summary_lines(result["headline"])
    checks = [c for c in result.get("check", []) if c.get("passed") is not None and not c.get("skipped")]
    failed = [c for c in checks if not c["passed"]]
    lines.append(f"check: {len(checks) - len(failed)} passed, {len(failed)} failed, "
                 f"{sum(1 for c in result.get('check', []) if c.get('skipped'))} skipped")
    for c in failed[:20]:
        lines.append(f"  FAIL {c['op']}/{c['implementation']} {c.get('dtype')} {c['example']}: "
                     f"rel_l2={c.get('rel_l2')} {c.get('detail') or ''}"[:200])
    tune = result.get("autotune") or {}
    lines.append(f"autotune: {len(tune.get('entries', []))} configs, {len(tune.get('failures', []))} failures")
    records = result.get("_records") or []
    if records:
        from stellax.bench.suites import speedups

        fast = speedups(records)
        lines.append(f"{'op':<22} {'case':<34} {'impl':<22} {'mode':<16} {'median ms':>10} {'%roof':>6} {'vs xla':>7}")
        for r in records:
            if not r.ok:
                status = (r.error or r.skipped or "")[:40]
                lines.append(f"{(r.op or '')[:22]:<22} {(r.case or '')[:34]:<34} {(r.implementation or '')[:22]:<22} "
                             f"{r.mode[:16]:<16} {status}")
                continue
            pct = (r.roofline or {}).get("pct_roofline")
            sp = fast.get(r.key)
            lines.append(f"{(r.op or '')[:22]:<22} {(r.case or '')[:34]:<34} {(r.implementation or '')[:22]:<22} "
                         f"{r.mode[:16]:<16} {r.median_ms:>10.4g} {'' if pct is None else f'{pct:.0f}':>6} "
                         f"{'' if sp is None else f'{sp:.2f}x':>7}")
    return "\n".join(lines)


def main() -> int:
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = out_dir / ".stellax-cache" if ARGS.dry_run else Path("/tmp") / f"stellax-gpu-suite-{os.getpid()}"
    os.environ["STELLAX_CACHE_DIR"] = str(cache_dir)
    log(f"stellax GPU suite{' (dry run)' if ARGS.dry_run else ''}: budget {BUDGET:.0f} s, output {out_dir}")
    import jax  # noqa: F401

    import stellax  # noqa: F401
    from stellax.autotune import device_slug
    from stellax.core.platform import current_platform

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    device = device_slug(current_platform(), interpret=False)
    path = out_dir / f"stellax-gpu-suite-{date}-{device}{'-dry-run' if ARGS.dry_run else ''}.json"
    result: dict = {"format": "stellax-gpu-suite", "format_version": 2, "budget_s": BUDGET,
                    "time_scale": ARGS.time_scale, "stages": {}, "errors": []}
    skip = set(filter(None, ARGS.skip.split(",")))
    if not ARGS.dry_run and current_platform().backend != "gpu":
        log(f"warning: no GPU here ({current_platform().describe()}); kernels will be skipped")

    def stage(name: str, fn, *args):
        if name in skip:
            result["stages"][name] = "skipped"
            return None
        log(f"== {name}")
        t0 = now()
        try:
            value = fn(*args)
            result["stages"][name] = round(now() - t0, 2)  # budget seconds (× --time-scale)
            result.setdefault("stage_end_s", {})[name] = round(now(), 2)
            return value
        except Exception as e:  # noqa: BLE001 - keep going; record it
            result["errors"].append({"stage": name, "error": traceback.format_exc()[-2000:]})
            result["stages"][name] = f"failed after {now() - t0:.1f}s: {type(e).__name__}: {e}"[:300]
            log(f"  stage {name} FAILED: {type(e).__name__}: {e}")
            return None
        finally:
            write(result, path)

    global SAVE
    SAVE = lambda: write(result, path)  # noqa: E731
    stage("environment", environment_stage, result)
    stage("calibrate", calibrate_stage, result)
    # Share what is left (minus a reserve to write): numerics 25%, then the headline cases up to
    # 40% of the total, tuning a quarter of the rest, the benchmark suites the remainder.
    reserve = 10.0 if ARGS.dry_run else 25.0
    share = remaining() - reserve
    stage("check", check_stage, result, now() + 0.25 * share)
    stage("headline", headline_stage, result, now() + min(0.40 * share, remaining() - reserve))
    tuned = stage("autotune", autotune_stage, result, now() + 0.25 * (remaining() - reserve), out_dir)
    stage("bench", bench_stage, result, now() + (remaining() - reserve), tuned)
    result["total_s"] = round(elapsed(), 1)
    write(result, path)
    table = summary_table(result)
    from stellax.bench import report

    md = report.markdown(result.get("_records") or [], env=result.get("environment"),
                         title=f"stellax GPU suite: {result.get('environment', {}).get('device', device)}",
                         extra_sections=["## Summary", "```", table, "```"])
    (out_dir / f"summary-{device}{'-dry-run' if ARGS.dry_run else ''}.md").write_text(md)
    print(table, flush=True)
    log(f"wrote {path} ({result['total_s']} s; stage times {result['stages']})")
    failed_checks = [c for c in result.get("check", []) if c.get("passed") is False]
    return 1 if (result["errors"] or failed_checks) else 0


if __name__ == "__main__":
    sys.exit(main())
