#!/usr/bin/env python3
"""The stellax TPU suite: check, tune and benchmark every Mosaic TPU kernel on a
lent TPU, in commands that each fit the machine's 10-minute limit.

    PYTHONPATH=$PYTHONPATH:src python3 benchmarks/tpu_suite.py --list            # the plan and its time
    PYTHONPATH=$PYTHONPATH:src python3 benchmarks/tpu_suite.py --out $OUT        # run (resumes)
    PYTHONPATH=$PYTHONPATH:src python3 benchmarks/tpu_suite.py --stages bench --ops attention,ragged_dot

Run from the repository root, no install needed. The work is planned per stage
and op (every op with a ``mosaic_tpu`` implementation, or ``--ops``):

1. **environment**: python, jax, libtpu, the device and its generation;
2. **check**: each Mosaic TPU kernel natively against the golden on its
   built-in examples (float32 at ``precision="highest"``, held to 1e-5; bfloat16)
   and on its first benchmark shape, forward and gradients. A benchmark-shape
   golden that would not fit the device's memory is replaced by the op's
   memory-linear XLA path in float32 at ``highest`` (itself checked against the
   golden on the examples), and the record names the golden used;
3. **autotune**: each kernel on its first ``--tune-cases`` benchmark shapes,
   forward and backward ops, at most ``--max-configs`` configs per call; the
   configs go to ``autotune-<device>.json`` in the shipped-cache format (ready
   for ``src/stellax/autotune/shipped/``);
4. **bench**: the first ``--cases`` benchmark shapes, forward and
   forward+backward, every stellax implementation that runs natively (with the
   config stellax picks by itself: shipped cache, then heuristic) and the peers
   (jax's splash attention, megablox gmm/tgmm, ragged paged attention,
   ``jax.lax.ragged_dot``, ...). A program that would not fit the device's
   memory is skipped before it runs, with its estimated bytes;
5. **attention**: issue 37's comparison, case by case (`benchmarks/attention_tpu.py`'s
   `CASES`, ``--attention-cases``): stellax's default config (and explicit configs,
   ``--attention-configs``) against jax's splash attention with its block sizes
   searched (512 and 1024), forward and forward+backward, each output checked against
   a float32 golden; rows carry ``config``, ``vs_splash`` and ``vs_xla``;
6. **attention_xla**: the same cases' XLA paths (stellax's ``xla_chunked`` and
   ``jax.nn.dot_product_attention`` where its logits fit), added to the attention
   stage's rows: every row's ``vs_xla`` is its time against the faster of the two.

Every command reads and extends one JSON file, ``stellax-tpu-suite-<date>-<device>.json``
under ``--out``: rows measured again replace the old ones, the rest is kept, and
a stage's ops already done are skipped (``--redo`` runs them again, ``--fresh``
starts a new file; ``--resume PATH`` carries on from an earlier day's file). A
command stops taking new work when its ``--budget`` (default 540 s) would be
passed and says what is left: run it again to go on.
The schema is documented in ``benchmarks/README.md``.

``--dry-run`` runs the same stages on the CPU with the TPU kernels interpreted,
on the ops' small examples (the tests run it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT = "stellax-tpu-suite"
VERSION = 2
STAGES = ("environment", "check", "autotune", "bench", "attention", "attention_xla")
#: The attention stages' contenders (attention_tpu --contenders): issue 37's comparison with
#: splash, and the XLA paths added to the same cases' rows.
ATTENTION_CONTENDERS = {"attention": "default,explicit,splash", "attention_xla": "xla"}

#: Seconds of one unit of work on a v5e, for ``--list`` and the budget (measured
#: 2026-12-05: a native check with gradients 1-9 s, mostly compiling; a benchmark
#: item, compile and three timing rounds, 3-6 s; 2026-12-06: a tuned config of
#: attention at T=16384 12 s (190 s for 8 forward and 8 backward configs), of
#: GDN/KDA at T=32768 float32 30-40 s, of dequantize 2 s; 2026-12-07: the whole check stage,
#: 226 checks, about 1050 s of three commands, 4.6 s a check; attention's 24 benchmark items at
#: T=16384 243 s, 10 s an item).
#: bench_item was measured on the v5e's eleventh run: the GDN bench's 12 timings took 168 s, the
#: attention bench's 24 took 242 s (7.0 had been guessed). A unit that ran before is estimated at
#: its recorded seconds instead (`Results.unit_seconds`).
SECONDS = {"check": 4.6, "autotune_config": 12.0, "bench_item": 14.0, "op_setup": 2.0}
#: On the CPU (dry run, interpreted kernels): a unit is slower.
DRY_SECONDS = {"check": 25.0, "autotune_config": 8.0, "bench_item": 8.0, "op_setup": 2.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"),
                   help="output directory (default: $OUT, else benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreted TPU kernels, the ops' small examples")
    p.add_argument("--list", action="store_true", help="print the plan (stages, ops, work, estimated time, what "
                                                        "is done already) and exit")
    p.add_argument("--budget", type=float, default=None, help="seconds for this command (default 540; dry 300)")
    p.add_argument("--ops", default="", help="comma list of op names, the registry's or the public function's "
                                             "(default: every op with a TPU kernel)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of stages (default: {','.join(STAGES)})")
    p.add_argument("--skip", default="", help="comma list of stages to leave out")
    p.add_argument("--cases", type=int, default=2, help="benchmark shapes per op in the bench stage (default 2)")
    p.add_argument("--tune-cases", type=int, default=1, help="benchmark shapes tuned per op (default 1)")
    p.add_argument("--max-configs", type=int, default=8, help="configs tried per tuned call (default 8)")
    p.add_argument("--attention-cases", default="all",
                   help="the attention stage's cases: indices of attention_tpu.CASES, 'main' or 'all' (default all)")
    p.add_argument("--attention-configs", default="none",
                   help="explicit stellax configs the attention stage times beside the default (attention_tpu "
                        "--configs names; default none: the default against splash)")
    p.add_argument("--redo", action="store_true", help="run the selected stages' ops again even if done")
    p.add_argument("--fresh", action="store_true", help="start a new results file instead of extending it")
    p.add_argument("--resume", default=None, metavar="PATH",
                   help="carry on from this results file (e.g. a committed one from an earlier day) when "
                        "today's file under --out does not exist yet")
    args = p.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        p.error(f"--stages: expected names from {list(STAGES)}, got {unknown}")
    skip = set(filter(None, args.skip.split(",")))
    args.stage_list = [s for s in STAGES if s in stages and s not in skip]
    return args


# -- the results document ---------------------------------------------------------------
class Results:
    """The suite's JSON document: loaded if it exists, extended, saved atomically."""

    def __init__(self, path: Path, *, fresh: bool, dry_run: bool):
        self.path = path
        data = None
        if path.exists() and not fresh:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT or data.get("version") != VERSION:
                raise SystemExit(f"tpu_suite: {path} is not a {FORMAT} v{VERSION} file; use --fresh or another --out")
        self.data = data or {"format": FORMAT, "version": VERSION, "dry_run": dry_run, "commands": [],
                             "done": {s: [] for s in STAGES}, "environment": {},
                             "check": {"passed": 0, "failures": 0, "skipped": 0, "records": []},
                             "autotune": {"entries": [], "failures": []}, "rows": [], "errors": []}
        for stage in STAGES:  # a file from before a stage existed
            self.data["done"].setdefault(stage, [])
        self.data.setdefault("unit_seconds", {})  # stage -> unit -> seconds its last run took

    def unit_seconds(self, stage: str, unit: str) -> float | None:
        return self.data["unit_seconds"].get(stage, {}).get(unit)

    def record_seconds(self, stage: str, unit: str, seconds: float) -> None:
        self.data["unit_seconds"].setdefault(stage, {})[unit] = round(seconds, 1)

    def done(self, stage: str, op: str) -> bool:
        return op in self.data["done"][stage]

    def mark_done(self, stage: str, op: str) -> None:
        if op not in self.data["done"][stage]:
            self.data["done"][stage].append(op)

    def replace(self, section: list, new: list, key) -> None:
        """``section`` with the items of ``new`` replacing those of the same ``key``."""
        fresh = {key(item) for item in new}
        section[:] = [item for item in section if key(item) not in fresh] + list(new)

    def recount(self) -> None:
        check = self.data["check"]
        records = check["records"]
        check["passed"] = sum(r["result"] == "ok" for r in records)
        check["failures"] = sum(r["result"] == "fail" for r in records)
        check["skipped"] = sum(r["result"] == "skip" for r in records)

    def save(self) -> None:
        self.recount()
        text = json.dumps(self.data, indent=1, default=repr) + "\n"
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)


class Suite:
    """One command: options, clock, the device and the results document."""

    def __init__(self, args, platform):
        self.args = args
        self.platform = platform
        self.start = time.monotonic()
        self.budget = args.budget if args.budget is not None else (300.0 if args.dry_run else 540.0)
        self.seconds = DRY_SECONDS if args.dry_run else SECONDS
        self.device = "dry-run" if args.dry_run else platform.tpu.name
        self.date = datetime.date.today().isoformat()
        self.results: Results | None = None
        self.units: list[dict] = []

    def remaining(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {text}", flush=True)

    def interpreted(self):
        """Interpret mode in a dry run (the TPU kernels on the CPU), else nothing."""
        from stellax.core import interpret_mode

        return interpret_mode(True) if self.args.dry_run else contextlib.nullcontext()


def tpu_ops(args) -> list:
    """Ops with a ``mosaic_tpu`` implementation (those named by --ops)."""
    import stellax
    from stellax._op_names import UnknownOpError, resolve_op_names

    ops = stellax.registered_ops()
    try:
        wanted = resolve_op_names([n for n in args.ops.split(",") if n], ops)  # rms_norm is layer_norm
    except UnknownOpError as e:
        raise SystemExit(f"--ops: {e}") from None
    return [op for name, op in sorted(ops.items())
            if "mosaic_tpu" in op.implementations and (not wanted or name in wanted)]


def abstract_cases(suite: Suite, op, count: int) -> list:
    """The op's first ``count`` benchmark calls as shape structs (nothing allocated); its
    examples in a dry run."""
    from stellax.testing.validation import abstract_examples, abstract_examples_of

    if suite.args.dry_run:
        return list(abstract_examples_of(op, "float32")[:1])
    if count is None:
        return abstract_examples(lambda: op.benchmarks(suite.platform))
    return abstract_examples(lambda: op.benchmarks(suite.platform)[:count])[:count] if count else []


def concrete_cases(suite: Suite, op, count: int, *, start: int = 0) -> list:
    """The same calls with device arrays, as the op's benchmark builder makes them: calls
    ``start`` to ``count - 1``; only the first ``count`` are computed (`compiled_examples`; an
    op's later benchmark shapes can be far larger: the 256-expert grouped matmul's weights alone
    are 7.5 GB, more than a v5e holds beside them)."""
    import jax
    import jax.numpy as jnp

    from stellax.bench.inputs import randomize_tree
    from stellax.core import Example
    from stellax.testing.validation import compiled_examples

    if suite.args.dry_run:
        return list(op.examples(jnp.float32)[:1])[start:]
    if not count:
        return []
    # The builder's own values (log-decays below zero, A < 0, routing logits ...): random normal
    # values in their place send a linear-attention state to inf and a check on them cannot fail.
    # A builder that gives only shapes (`jax.ShapeDtypeStruct`: the quantized weights' codes and
    # scales) gets random values for them, as `stellax bench` times (`materialize`), in the
    # returned calls only.
    examples = compiled_examples(lambda: op.benchmarks(suite.platform), count)
    return [Example(e.label, *randomize_tree((e.args, e.kwargs), jax.random.PRNGKey(i), randomize=False))
            for i, e in enumerate(examples) if i >= start]


def first_supported_case(suite: Suite, op):
    """The first benchmark call the Mosaic TPU kernel supports on this device (the check stage's
    benchmark shape: an fp8 weight format is not one a v5e runs), or None."""
    impl = op.implementations["mosaic_tpu"]
    for index, example in enumerate(abstract_cases(suite, op, None)):
        if impl.supported(op.check(*example.args, **example.kwargs)):
            (case,) = concrete_cases(suite, op, index + 1, start=index)
            return case
    return None


# -- the plan ----------------------------------------------------------------------------
def plan(suite: Suite, ops: list) -> list[dict]:
    """One unit per (stage, op): what it runs and its estimated seconds."""
    import jax.numpy as jnp

    from stellax.bench.suites import default_modes
    from stellax.testing.validation import abstract_examples_of

    s = suite.seconds
    units = []
    for stage in suite.args.stage_list:
        if stage == "environment":
            units.append({"stage": stage, "op": "-", "work": "versions and device", "seconds": 1.0})
            continue
        if stage in ATTENTION_CONTENDERS:
            units += attention_units(suite, stage)
            continue
        for op in ops:
            if stage == "check":
                n = sum(len(abstract_examples_of(op, d)) for d in ("float32", "bfloat16"))
                n = 1 if suite.args.dry_run else n + 1
                work, seconds = f"{n} checks", n * s["check"]
            elif stage == "autotune":
                impl = op.implementations["mosaic_tpu"]
                configs = 0
                for example in abstract_cases(suite, op, suite.args.tune_cases):
                    call = op.check(*example.args, **example.kwargs)
                    space = len(impl.config_space(call)) if impl.supported(call) else 0
                    configs += min(space, 2 if suite.args.dry_run else suite.args.max_configs)
                grads = 2 if op.differentiable else 1
                work, seconds = f"{configs} configs x {grads} (forward, backward ops)", configs * grads * s["autotune_config"]
            else:
                items = 0
                for example in abstract_cases(suite, op, 1 if suite.args.dry_run else suite.args.cases):
                    contenders = len(_bench_implementations(suite, op)) + len(op.peers)
                    modes = ["forward"] if suite.args.dry_run else default_modes(op, example)
                    items += contenders * len(modes)
                work, seconds = f"{items} timings", items * s["bench_item"]
            units.append({"stage": stage, "op": op.name, "work": work, "seconds": round(seconds + s["op_setup"], 1)})
    return with_recorded_seconds(suite, units)


def with_recorded_seconds(suite: Suite, units: list[dict]) -> list[dict]:
    """A unit that ran before is estimated at the seconds its last run took (the per-item
    figures above are averages; a T=16384 compile is not a 1024-token one)."""
    for unit in units:
        seconds = suite.results.unit_seconds(unit["stage"], unit["op"]) if suite.results else None
        if seconds is not None:
            unit["seconds"] = seconds
            unit["work"] += f" (last run {seconds:.0f} s)"
    return units


def list_plan(suite: Suite, units: list[dict]) -> None:
    done = suite.results.data["done"] if suite.results else {}
    total = left = 0.0
    print(f"{'stage':<12} {'op':<42} {'estimated s':>11}  {'status':<8} work")
    for u in units:
        finished = u["op"] in done.get(u["stage"], []) and not suite.args.redo
        total += u["seconds"]
        left += 0 if finished else u["seconds"]
        print(f"{u['stage']:<12} {u['op']:<42} {u['seconds']:>11.0f}  {'done' if finished else 'to do':<8} {u['work']}")
    commands = max(1, -(-int(left) // int(max(1.0, suite.budget - 30))))
    print(f"total {total:.0f} s estimated on {'this CPU (dry run)' if suite.args.dry_run else 'a v5e'}; "
          f"{left:.0f} s left to do: about {commands} command(s) of --budget {suite.budget:.0f}")


# -- stages ------------------------------------------------------------------------------
def environment_stage(suite: Suite, ops) -> None:
    import importlib.metadata

    import jax

    env = {"python": sys.version.split()[0], "jax": jax.__version__,
           "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()],
           "device_kind": suite.platform.device_kind, "platform": suite.platform.describe(),
           "generation": suite.platform.tpu.describe() if suite.platform.tpu else None}
    try:
        env["libtpu"] = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        env["libtpu"] = None
    from stellax.bench.measurement import device_memory_free
    env["device_memory_free_bytes"] = device_memory_free()
    suite.results.data["environment"] = env
    for key, value in env.items():
        suite.log(f"  {key}: {value}")


def _check_record(op, example_label, dtype, result, golden="reference", seconds=0.0) -> dict:
    w = result.worst
    outcome = "skip" if result.skipped else ("ok" if result.passed else "fail")
    return {"op": op.name, "implementation": "mosaic_tpu", "example": example_label, "dtype": dtype,
            "result": outcome, "golden": golden, "rel_l2": None if w is None else w.rel_l2,
            "tolerance": None if w is None else w.tolerance, "detail": result.skipped or result.detail,
            "seconds": round(seconds, 2)}


def check_op(suite: Suite, op) -> list[dict]:
    """The examples (float32 at 'highest', bfloat16; in threads: compiling dominates),
    then the first benchmark shape."""
    from stellax.testing import report as check_report
    from stellax.testing.plan import plan_checks

    dtypes = ["float32"] if suite.args.dry_run else ["float32", "bfloat16"]
    jobs = plan_checks({op.name: op}, full=True, dtypes=dtypes, implementations=["mosaic_tpu"])
    jobs = jobs[:1] if suite.args.dry_run else jobs
    threads = 1 if suite.args.dry_run else max(1, min(8, (os.cpu_count() or 2) - 1))
    report = check_report.run_quietly(jobs, platform=suite.platform.describe(), mode="suite", threads=threads)
    records = [dict(row, golden="reference") for row in report.rows]
    for r in records:
        suite.log(f"  check {op.name} {r['example']} {r['dtype']}: {r['result']} rel_l2={r['rel_l2']} {r['detail']}")
    if not suite.args.dry_run:
        example = first_supported_case(suite, op)
        if example is not None:
            t0 = time.perf_counter()
            record = check_at_scale(op, example)
            record["seconds"] = round(time.perf_counter() - t0, 2)
            records.append(record)
            suite.log(f"  check {op.name} {example.label} (benchmark shape, golden {record['golden']}): "
                      f"{record['result']} {record['rel_l2']} {record['detail']}")
            del example
    return records


def check_at_scale(op, example) -> dict:
    """One benchmark-shape call of the Mosaic TPU kernel (its own dtype, forward)
    against the golden — or, where the golden's program would not fit the device,
    the op's memory-linear XLA path in float32 at 'highest'."""
    import jax
    import jax.numpy as jnp

    from stellax.bench.measurement import DeviceMemoryError, compile_within_memory
    from stellax.testing.numerics import compare_on_device, upcast
    from stellax.testing.validation import CheckResult

    dtype = next((l.dtype for l in jax.tree_util.tree_leaves(example.args) if jnp.issubdtype(l.dtype, jnp.floating)),
                 jnp.float32)
    label = f"{example.label} (benchmark shape)"
    arrays = {k: v for k, v in example.kwargs.items() if hasattr(v, "dtype")}
    static = {k: v for k, v in example.kwargs.items() if k not in arrays}

    highest = {"precision": "highest"} if "precision" in _check_params(op) else {}

    def golden_of(name, cast=upcast):
        if name == "reference":
            return lambda *a, **k: op.reference(*cast(a), **cast(k), **static)
        return lambda *a, **k: op(*cast(a), **cast(k), **static, implementation=name, **highest)

    xla_names = [n for n in ("xla_chunked", "xla") if n in op.implementations]
    # The float32 goldens first; then, where float32 copies of the operands do not fit (a 64-expert
    # layer's weights), the XLA paths on the operands as given, at 'highest'.
    goldens = [(n, golden_of(n), n if n == "reference" else f"{n} (float32, highest)")
               for n in ["reference"] + xla_names]
    goldens += [(n, golden_of(n, cast=lambda t: t), f"{n} ({jnp.dtype(dtype).name} operands, highest)")
                for n in xla_names if jnp.dtype(dtype) != jnp.float32]

    try:
        kernel = jax.jit(lambda *a, **k: op(*a, **k, **static, implementation="mosaic_tpu"))
        compiled = compile_within_memory(kernel.lower(*example.args, **arrays),
                                         what=f"{op.name} mosaic_tpu at {example.label}")
        out = compiled(*example.args, **arrays)
        golden, reasons = None, []
        for name, fn, described in goldens:
            try:
                with jax.default_matmul_precision("highest"):
                    golden_compiled = compile_within_memory(jax.jit(fn).lower(*example.args, **arrays),
                                                            what=f"the golden ({described})")
            except DeviceMemoryError as e:
                reasons.append(str(e))
                continue
            golden = described
            expected = golden_compiled(*example.args, **arrays)
            break
        if golden is None:
            result = CheckResult(op.name, "mosaic_tpu", jnp.dtype(dtype).name, label, True, None,
                                 skipped="no golden fits: " + "; ".join(reasons))
            return _check_record(op, label, jnp.dtype(dtype).name, result, golden="none")
        expected_leaves = jax.tree_util.tree_leaves(expected)
        if not all(bool(jnp.all(jnp.isfinite(r))) for r in expected_leaves if jnp.issubdtype(r.dtype, jnp.inexact)):
            # NaN against NaN compares equal: such a check could not fail.
            result = CheckResult(op.name, "mosaic_tpu", jnp.dtype(dtype).name, label, False, None,
                                 detail="the golden has non-finite values: the benchmark inputs are outside "
                                        "the op's domain")
            return _check_record(op, label, jnp.dtype(dtype).name, result, golden=golden)
        summaries = [compare_on_device(o, r, dtype=dtype) for o, r in
                     zip(jax.tree_util.tree_leaves(out), expected_leaves)]
        worst = max(summaries, key=lambda s: (not s.passed, s.rel_l2 / max(s.tolerance, 1e-30)))
        result = CheckResult(op.name, "mosaic_tpu", jnp.dtype(dtype).name, label, all(s.passed for s in summaries),
                             worst)
        return _check_record(op, label, jnp.dtype(dtype).name, result, golden=golden)
    except DeviceMemoryError as e:
        result = CheckResult(op.name, "mosaic_tpu", jnp.dtype(dtype).name, label, True, None, skipped=str(e))
        return _check_record(op, label, jnp.dtype(dtype).name, result, golden="none")
    except Exception as e:  # noqa: BLE001 - a crash is a failed check, the suite goes on
        result = CheckResult(op.name, "mosaic_tpu", jnp.dtype(dtype).name, label, False, None,
                             detail=f"{type(e).__name__}: {e}"[:400])
        return _check_record(op, label, jnp.dtype(dtype).name, result)


def _check_params(op) -> set:
    import inspect

    return set(inspect.signature(op.check).parameters)


class NothingTuned(RuntimeError):
    """Every config of an op's tuning failed: the op is not done (a later command tries again)."""


def autotune_op(suite: Suite, op) -> None:
    """Tune the Mosaic TPU kernel (and its backward op) on the first benchmark shapes;
    `NothingTuned` when configs were tried and none of them ran."""
    from stellax.autotune import autotune
    from stellax.autotune.cli import tuning_function

    records = suite.results.data["autotune"]
    deadline = time.monotonic() + max(0.0, suite.remaining() - 15)
    tuned, failures = 0, []
    for example in concrete_cases(suite, op, suite.args.tune_cases):
        with suite.interpreted():
            fn = tuning_function(op, "mosaic_tpu", example.args, example.kwargs, backward=bool(op.differentiable))
            r = autotune(fn, *example.args, max_configs=2 if suite.args.dry_run else suite.args.max_configs,
                         force=True, cache=False, use_shipped=False, deadline=deadline, **example.kwargs)
        entries = [dict(e.to_json(), case=example.label, key_string=e.entry.key_string) for e in r.entries]
        suite.results.replace(records["entries"], entries, key=lambda e: e["key_string"])
        records["failures"].extend(r.failures)
        tuned += len(r.entries)
        failures += list(r.failures)
        for e in r.entries:
            suite.log(f"  tuned {e.entry.op}/{e.entry.implementation}: {e.entry.config} {e.entry.time_ms:.4g} ms")
        for failure in r.failures:  # e.g. every config out of HBM: said here, not only in the JSON
            suite.log(f"  not tuned {failure['op']}/{failure['implementation']}: {failure['error'][:300]}")
        del example
    export_cache(suite)
    if failures and not tuned:
        raise NothingTuned(f"no config of {op.name} ran ({len(failures)} failure(s), first: "
                           f"{failures[0].get('error', '')[:200]})")


def export_cache(suite: Suite) -> None:
    """Every tuned entry so far as one shipped-format cache file beside the results."""
    from stellax.autotune import device_slug
    from stellax.autotune.cache import Entry, atomic_write_text, dump_cache_text

    entries = {}
    for data in suite.results.data["autotune"]["entries"]:
        entry = Entry.from_json(data)
        entries[entry.key_string] = entry
    if entries:
        path = suite.results.path.parent / f"autotune-{device_slug()}.json"
        atomic_write_text(path, dump_cache_text(entries, device=device_slug(), device_kind=suite.platform.device_kind))
        suite.results.data["autotune"]["exported_to"] = path.name


def _bench_implementations(suite: Suite, op) -> list[str]:
    """The stellax implementations timed: the kernels and the XLA paths that run here."""
    return [n for n, impl in op.implementations.items()
            if impl.backend in ("mosaic_tpu", "xla")]


def bench_op(suite: Suite, op) -> list[dict]:
    from stellax.bench.suites import SuiteOptions, run_suite

    options = SuiteOptions(
        interpret=suite.args.dry_run, max_cases=1 if suite.args.dry_run else suite.args.cases,
        use_examples=suite.args.dry_run, modes=("forward",) if suite.args.dry_run else None,
        min_time=0.005 if suite.args.dry_run else None, input_sets=2 if suite.args.dry_run else None,
        implementations=tuple(_bench_implementations(suite, op)) + tuple(op.peers))
    records = run_suite(op.family, options, ops=[op], progress=lambda text: suite.log("  " + text))
    defaults = default_implementations(suite, op, records)
    return [row_of(r, defaults, suite) for r in records]


def default_implementations(suite: Suite, op, records) -> dict[str, str]:
    """Case label → the implementation stellax picks by itself for it here."""
    import jax.numpy as jnp

    examples = op.examples(jnp.float32)[:1] if suite.args.dry_run else []
    out = {}
    from stellax.testing.validation import abstract_examples

    cases = examples or abstract_examples(lambda: op.benchmarks(suite.platform)[:suite.args.cases])
    from stellax.bench.suites import _unique_labels

    for example, label in zip(cases, _unique_labels(cases)):
        try:
            with suite.interpreted():
                impl = op.select(op.check(*example.args, **example.kwargs))
            out[label] = impl.name
        except Exception:  # noqa: BLE001 - no implementation: no default row
            pass
    if suite.args.dry_run:  # on a CPU dispatch never picks an interpreted kernel; the dry run stands for a TPU
        out = {label: "mosaic_tpu" for label in out}
    return out


def contender_of(implementation: str) -> tuple[str, bool]:
    """A record's implementation label as the rows' ``contender`` and whether it is a peer."""
    from stellax.bench.suites import PEER_PREFIX

    if not implementation.startswith(PEER_PREFIX):
        return f"stellax:{implementation}", False
    name = implementation[len(PEER_PREFIX):]
    if name.startswith("jax.lax."):
        return f"xla:{name[len('jax.lax.'):]}", True
    if name.startswith("jax_"):
        return f"jax:{name[len('jax_'):]}", True
    return name, True


def row_of(record, defaults: dict[str, str], suite: Suite) -> dict:
    """One row of the results schema (benchmarks/README.md) from a benchmark record."""
    contender, peer = contender_of(record.implementation or "")
    roof = record.roofline or {}
    bound = roof.get("bound")
    pct = roof.get("pct_peak_flops") if bound == "compute" else roof.get("pct_peak_bandwidth")
    return {"op": record.op, "case": record.case, "pass": "fwd" if record.mode == "forward" else "fwd+bwd",
            "contender": contender, "default": (not peer) and defaults.get(record.case) == record.implementation,
            "peer": peer, "ms": record.median_ms, "tflops": roof.get("tflops"), "gbps": roof.get("gbps"),
            "pct_peak": pct, "bound": bound, "peak_hbm_bytes": record.peak_memory_bytes,
            "device": suite.platform.device_kind, "date": suite.date,
            "skipped": record.skipped, "error": record.error}


def row_key(row: dict) -> tuple:
    """A row's identity: a later measurement of the same one replaces it. The attention stage's
    rows are told apart by ``config``; its default row names the configs picked, which may change."""
    config = row.get("config")
    return row["op"], row["case"], row["pass"], row["contender"], \
        "default" if str(config or "").startswith("default(") else config


# -- the attention stage (issue 37) ----------------------------------------------------------
def attention_bench(suite: Suite, stage: str = "attention", budget: float | None = None):
    """`benchmarks/attention_tpu.py`'s run for this suite's options and ``stage``'s contenders (its
    dry run in a dry run)."""
    import attention_tpu

    argv = ["--out", str(suite.results.path.with_suffix(".attention.json")),
            "--cases", suite.args.attention_cases, "--budget", str(budget if budget is not None else 1e9),
            "--configs", suite.args.attention_configs, "--contenders", ATTENTION_CONTENDERS[stage]]
    return attention_tpu, attention_tpu.Run(attention_tpu.parse_args(argv + (["--dry-run"] if suite.args.dry_run else [])))


def attention_units(suite: Suite, stage: str) -> list[dict]:
    """One unit per attention case: its timings at the bench stage's seconds per item, plus a
    golden. ``attention``: two passes x the default, the explicit configs and splash's block
    sizes; ``attention_xla``: two passes x the two XLA paths."""
    module, run = attention_bench(suite, stage)
    per_pass = {"default": 1, "explicit": len(run.explicit), "splash": len(run.splash), "xla": 2}
    timings = len(run.passes) * sum(per_pass[c] for c in run.contenders)
    return [{"stage": stage, "op": module.CASES[i].name, "work": f"{timings} timings and a golden",
             "seconds": round((timings + 1) * suite.seconds["bench_item"] + suite.seconds["op_setup"], 1),
             "index": i} for i in run.picked()]


def attention_stage(suite: Suite, stage: str, units: list[dict]) -> str | None:
    """Run the attention cases not done yet in ``stage`` (`attention_units`); the first one the
    budget leaves out (or None). Rows replace those of the same case, pass, contender and config,
    and every row's ``vs_splash`` and ``vs_xla`` are set again over the merged rows."""
    from stellax.bench import chip_run

    results = suite.results
    for unit in units:
        if results.done(stage, unit["op"]) and not suite.args.redo:
            continue
        if suite.remaining() < unit["seconds"]:
            return unit["op"]
        suite.log(f"{stage} {unit['op']} (estimated {unit['seconds']:.0f} s, {suite.remaining():.0f} s left)")

        def run_case(unit=unit) -> bool:
            module, run = attention_bench(suite, stage, budget=chip_run.elapsed() + suite.remaining())
            run.run_case(unit["index"])
            results.replace(results.data["rows"], run.rows, key=row_key)
            # the attention stages' rows (the bench stage's attention rows carry no ratios)
            module.set_ratios([r for r in results.data["rows"] if r["op"] == "attention" and "vs_splash" in r])
            if any(r.get("skipped") == "budget spent" for r in run.rows):
                suite.log(f"  {stage} {unit['op']}: the budget ran out inside the case; the next command runs it again")
                return False
            return True

        if run_unit(suite, stage, unit["op"], run_case) is False:
            return unit["op"]
    return None


# -- the command -------------------------------------------------------------------------
def run_unit(suite: Suite, stage: str, name: str, work) -> bool | None:
    """One unit of a stage (an op, an attention case): ``work()`` says whether it completed,
    and a completed unit is marked done and its earlier error dropped; an exception is recorded
    as the unit's error (None is returned: the suite goes on). The results are saved and the
    process's compiled programs dropped (a finished unit's hold host memory)."""
    import jax

    results = suite.results
    drop_error = lambda: [e for e in results.data["errors"] if (e.get("stage"), e.get("op")) != (stage, name)]
    completed = None
    began = time.monotonic()
    try:
        completed = work()
    except Exception as e:  # noqa: BLE001 - a failed unit is recorded; the others still run
        results.data["errors"] = drop_error() + [{"stage": stage, "op": name, "date": suite.date,
                                                  "error": f"{type(e).__name__}: {e}"[:600]}]
        suite.log(f"  {stage} {name} FAILED: {type(e).__name__}: {e}"[:400])
    else:
        if completed:
            results.mark_done(stage, name)
            results.data["errors"] = drop_error()
            results.record_seconds(stage, name, time.monotonic() - began)
    results.save()
    gc.collect()
    jax.clear_caches()
    return completed


def run_stage(suite: Suite, stage: str, ops: list, units: dict) -> str | None:
    """Run one stage over the ops not done yet, each that fits the time left; the first op the
    budget leaves out (or None)."""
    results = suite.results
    if stage == "environment":
        environment_stage(suite, ops)
        return None
    if stage in ATTENTION_CONTENDERS:
        return attention_stage(suite, stage, [u for u in suite.units if u["stage"] == stage])
    left_out = None
    for op in ops:
        if results.done(stage, op.name) and not suite.args.redo:
            continue
        estimate = units[(stage, op.name)]
        if suite.remaining() < estimate:  # a later, smaller op may still fit
            left_out = left_out or op.name
            continue
        suite.log(f"{stage} {op.name} (estimated {estimate:.0f} s, {suite.remaining():.0f} s left)")

        def run_op(op=op) -> bool:
            if stage == "check":
                # An op checked again replaces all its records: a benchmark call that changed (the
                # first one the device supports) leaves no stale record behind.
                results.replace(results.data["check"]["records"], check_op(suite, op), key=lambda r: r["op"])
            elif stage == "autotune":
                autotune_op(suite, op)
            else:
                results.replace(results.data["rows"], bench_op(suite, op), key=row_key)
            return True

        run_unit(suite, stage, op.name, run_op)
    return left_out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["STELLAX_INTERPRET"] = "1"  # every stage runs the TPU kernels interpreted
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("STELLAX_AUTOTUNE_WARN", "0")
    from stellax.core import current_platform

    platform = current_platform()
    if not args.dry_run and platform.tpu is None and not args.list:
        print(f"tpu_suite: this device is {platform.describe()}, not a TPU (use --dry-run on a CPU, or --list)")
        return 2
    if not args.dry_run and platform.tpu is None:  # --list on a CPU plans for a v5e
        from stellax.core.platform import Platform
        platform = Platform("tpu", "TPU v5 lite")
    suite = Suite(args, platform)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{FORMAT}-{suite.date}-{suite.device}.json"
    if args.resume and not args.fresh and not path.exists():
        if not Path(args.resume).is_file():
            raise SystemExit(f"tpu_suite: --resume: {args.resume} is not a file")
        path.write_text(Path(args.resume).read_text())
    suite.results = Results(path, fresh=args.fresh, dry_run=args.dry_run)
    ops = tpu_ops(args)
    import tpu_peers

    tpu_peers.install(ops)
    with contextlib.nullcontext() if not args.list or platform.backend == current_platform().backend else \
            _planning_as(platform):
        units = plan(suite, ops)
    if args.list:
        list_plan(suite, units)
        return 0
    estimates = {(u["stage"], u["op"]): u["seconds"] for u in units}
    suite.units = units
    suite.log(f"stellax TPU suite{' (dry run)' if args.dry_run else ''} on {platform.describe()}: stages "
              f"{','.join(args.stage_list)}, {len(ops)} ops, budget {suite.budget:.0f} s -> {path}")
    command = {"argv": sys.argv[1:] if argv is None else list(argv), "date": suite.date,
               "started": datetime.datetime.now().isoformat(timespec="seconds")}
    left = {}
    for stage in args.stage_list:
        began = time.monotonic()
        suite.log(f"stage {stage}")
        stopped_at = run_stage(suite, stage, ops, estimates)
        if stopped_at:
            left[stage] = stopped_at
            suite.log(f"  budget: {stage} stops before {stopped_at}; run the same command again to go on")
        command.setdefault("stages", {})[stage] = round(time.monotonic() - began, 2)
    command["seconds"] = round(time.monotonic() - suite.start, 2)
    command["left"] = left
    suite.results.data["commands"].append(command)
    suite.results.save()
    check = suite.results.data["check"]
    suite.log(f"done: check {check['passed']} passed, {check['failures']} failures, {check['skipped']} skipped; "
              f"{len(suite.results.data['rows'])} rows; {len(suite.results.data['errors'])} errors"
              + (f"; left for the next command: {left}" if left else ""))
    return 1 if check["failures"] or suite.results.data["errors"] else 0


@contextlib.contextmanager
def _planning_as(platform):
    """Plan benchmark shapes for ``platform`` (a TPU) from a CPU: `--list` off the device."""
    from stellax.core import lowering_target

    with lowering_target("v5e"):
        yield


if __name__ == "__main__":
    sys.exit(main())
