"""The `stellax` command line: ``info``, ``check``, ``bench``, ``autotune``, ``lab``."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    import jax
    import jaxlib
    from rich.console import Console
    from rich.table import Table

    import stellax
    from stellax.core import current_platform, interpret_enabled

    console = Console(width=max(Console().width, 150))
    platform = current_platform()
    console.print(f"stellax {stellax.__version__}  jax {jax.__version__}  jaxlib {jaxlib.__version__}")
    console.print(f"devices: {', '.join(f'{d.platform}:{d.device_kind}' for d in jax.devices())}")
    console.print(f"platform: {platform.describe()}  interpret mode: {'on' if interpret_enabled() else 'off'}")
    from stellax.autotune.cache import shipped_cache
    from stellax.autotune.keys import device_slug
    from stellax.core.precision import describe_contract

    console.print(describe_contract(), highlight=False)
    shipped = shipped_cache(device_slug(platform))
    console.print(f"shipped autotune cache for this device: {shipped.path.name} ({len(shipped)} configs)"
                  if len(shipped) else f"shipped autotune cache for this device: none ({shipped.path.name} is not "
                  f"shipped; kernels use their heuristics)", highlight=False)
    table = Table(title="implementations on this device")
    for column in ("op", "implementation", "backend", "runs here"):
        table.add_column(column)
    from stellax._op_names import display_name
    from stellax.core.op import backend_support
    for name, op in sorted(stellax.registered_ops().items()):
        for impl in op.implementations.values():
            support = backend_support(impl.backend, platform)
            status = "yes" if support else f"no: {support.reason}"
            deferred = impl.defers_to_xla(platform) if support and impl.defers_to_xla is not None else None
            if support and impl.is_kernel and platform.backend == "cpu":
                status = "interpreted (explicit request only)"
            elif deferred:
                status = f"explicit request only: {deferred}"
            table.add_row(display_name(name), impl.name, impl.backend, status)
    console.print(table)
    tpu_table = Table(title="TPU generations (Mosaic TPU kernels run on v5e and newer)")
    for column in ("generation", "device kind", "VMEM", "scoped VMEM default", "MXU", "cores/device",
                   "MXU dtypes", "kernels"):
        tpu_table.add_column(column)
    from stellax.core.tpu import TPU_GENERATIONS
    for g in TPU_GENERATIONS.values():
        mark = "*" if platform.tpu is g else ""
        tpu_table.add_row(g.name + mark, g.device_kinds[0], f"{g.vmem_bytes >> 20} MiB",
                          f"{g.scoped_vmem_bytes >> 20} MiB", f"{g.mxu}x{g.mxu}", str(g.cores_per_chip),
                          ", ".join(g.matmul_dtypes), "yes" if g.kernels else "no (XLA)")
    console.print(tpu_table)
    from stellax.lab.plugins import info_lines
    for line in info_lines():
        console.print(line, highlight=False, markup=False)
    return 0


#: XLA's CPU backend optimization level for `stellax check`: its checks are
#: small, so compiling dominates, and LLVM at level 0 compiles the random
#: inputs and interpreted kernels several times faster (a threefry normal:
#: 0.15 s instead of 0.9 s of CPU). Results stay IEEE float math (no fast
#: math), compared with the golden at the same tolerances. A level already
#: in ``XLA_FLAGS`` is kept.
CHECK_XLA_FLAG = "--xla_backend_optimization_level=0"


#: Host memory the TPU runtime maps for host-device transfers when `stellax
#: check` starts it (``TPU_PREMAPPED_BUFFER_SIZE``): the runtime's default is
#: 4 GiB, resident from the start (a bare jax process on a v5e: 13.8 GB RSS by
#: default, 10.0 GB with 256 MiB). A check's arrays are a few MB; a value
#: already set is kept.
CHECK_TPU_PREMAPPED_BUFFER = 256 << 20


def _fast_compiles() -> None:
    """Add `CHECK_XLA_FLAG` to ``XLA_FLAGS`` and set `CHECK_TPU_PREMAPPED_BUFFER`
    before jax starts its backend (no effect once it has, e.g. when `main` runs
    inside a test session)."""
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CHECK_XLA_FLAG}".strip()
    os.environ.setdefault("TPU_PREMAPPED_BUFFER_SIZE", str(CHECK_TPU_PREMAPPED_BUFFER))


def _default_workers(platform) -> int:
    """One worker process per core (at most 2) on a CPU; in-process on an accelerator."""
    import os

    return min(2, os.cpu_count() or 1) if platform.backend == "cpu" else 1


def _default_threads(platform) -> int:
    """On an accelerator (one process holds it), compile-bound checks in up to 8 threads; 1 on a CPU."""
    import os

    return 1 if platform.backend == "cpu" else max(1, min(8, (os.cpu_count() or 2) - 1))


def _check_tpu_compile(args, console, selected) -> int:
    """`stellax check --tpu-compile`: tier 3 for the Mosaic TPU kernels."""
    import json
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from rich.table import Table

    from stellax.core.tpu import KERNEL_GENERATIONS
    from stellax.testing import tpu_compile

    available, reason = tpu_compile.libtpu_available()
    if not available:
        console.print(f"[red]{reason}")
        return 2
    generations = args.generations.split(",") if args.generations else list(KERNEL_GENERATIONS)
    unknown = [g for g in generations if g not in KERNEL_GENERATIONS]
    if unknown:
        console.print(f"[red]--generations: expected names from {list(KERNEL_GENERATIONS)}, got {unknown}")
        return 2

    def show(case, result):
        if not result.ok or args.verbose:
            console.print(f"{case.id}: {result.describe()}", highlight=False, markup=False)

    results = tpu_compile.run_tier(selected, generations, every_config=args.all, on_result=show,
                                   benchmarks=args.benchmarks)
    rows = tpu_compile.summary_rows(results)
    if args.json:
        text = json.dumps({"generations": generations, "every_config": args.all, "rows": rows}, indent=1)
        print(text) if args.json == "-" else open(args.json, "w").write(text + "\n")
    table = Table(title=f"Mosaic TPU compile tier ({'every config' if args.all else 'heuristic configs'})")
    for column in ("op", "implementation", "generation", "compiled", "rejected", "max VMEM (MiB)"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["op"], row["implementation"], row["generation"], str(row["compiled"]),
                      str(row["rejected"]), f"{row['max_vmem_mib']:.2f}")
    console.print(table)
    return 1 if any(not r.ok for r in results) else 0


def _check(args) -> int:
    if args.static_gpu:
        from stellax.testing.static_gpu import run_cli
        return run_cli(args.ops, args.arch.split(","), json_path=args.json, heuristic_only=args.heuristic_only)
    _fast_compiles()
    from stellax.testing import report as check_report

    # Watched from here (before jax starts its backend), so that a start-up peak is seen and named.
    watch = check_report.MemoryWatch(interval=0.05).start()
    watch.phase = "registering the ops"
    from rich.console import Console

    import stellax
    from stellax._op_names import is_op_name, valid_names
    from stellax.testing.plan import plan_checks, select_ops

    console = Console(width=max(Console().width, 150), stderr=bool(args.json == "-"))
    ops = stellax.registered_ops()
    families = sorted({op.family for op in ops.values()})
    unknown = [n for n in args.ops if not is_op_name(n, ops) and n not in families]
    if unknown:
        console.print(f"[red]no registered op or family matches {unknown}; known ops: {valid_names(ops)}; "
                      f"families: {families}", highlight=False)
        return 2
    selected = select_ops(ops, args.ops)
    if args.tpu_compile:
        return _check_tpu_compile(args, console, selected)
    watch.phase = "planning the checks"
    try:
        jobs = plan_checks(selected, full=args.all, dtypes=args.dtypes.split(",") if args.dtypes else None,
                           implementations=args.implementations.split(",") if args.implementations else None,
                           gradients=not args.no_gradients, precision=args.precision)
    except ValueError as e:
        console.print(f"[red]{e}")
        return 2
    watch.phase = "starting the backend"
    platform = stellax.current_platform()
    watch.phase = "between start-up and the first check"
    threads = args.threads if args.threads else _default_threads(platform)
    workers = args.workers if args.workers else (1 if threads > 1 else _default_workers(platform))
    mode = "all" if args.all else "quick"
    if args.json == "-":
        report = check_report.run_quietly(jobs, platform=platform.describe(), mode=mode, workers=workers,
                                          threads=threads, watch=watch)
    else:
        report = check_report.run_watched(jobs, console, platform=platform.describe(), mode=mode, workers=workers,
                                          threads=threads, watch=watch)
    if args.json:
        check_report.write_json(report, args.json)
    return 1 if report.failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench, autotune and lab own their argument parsing.
    if argv and argv[0] == "bench":
        from stellax.bench.cli import main as bench_main
        return bench_main(argv[1:])
    if argv and argv[0] == "autotune":
        from stellax.autotune.cli import main as autotune_main
        return autotune_main(argv[1:])
    if argv and argv[0] == "lab":
        from stellax.lab.cli import main as lab_main
        return lab_main(argv[1:])
    parser = argparse.ArgumentParser(prog="stellax", description="stellax kernels: info, check, bench, autotune, lab")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, which implementations run here and why not")
    check = sub.add_parser(
        "check", help="validate every op against its golden (quick by default; --all for the full sweep)",
        description="Check ops against their golden references. By default every op runs its first example "
                    "in float32 (gradients too for differentiable ops) through its XLA implementations and the "
                    "kernels that interpret quickly on a CPU; --all runs every example, implementation and "
                    "dtype (float32, bfloat16). Exit code 1 on any failure.")
    check.add_argument("ops", nargs="*", help="op names (the registry's or the public function's: rms_norm is "
                                              "layer_norm) or families (default: all)")
    check.add_argument("--all", action="store_true",
                       help="the full sweep: every example, every implementation, float32 and bfloat16")
    check.add_argument("--dtypes", default="", help="comma-separated dtypes (default: float32; with --all "
                                                     "float32,bfloat16)")
    check.add_argument("--implementations", default="", help="comma-separated implementation names")
    check.add_argument("--no-gradients", action="store_true", help="forward only")
    check.add_argument("--precision", default="highest",
                       help="contraction precision the ops that take one run at: highest (default: float32 "
                            "results within 1e-5 of the golden, on a TPU too), high (1e-4) or default (one "
                            "bfloat16 pass on a TPU: bfloat16's 1e-2); see stellax.core.precision")
    check.add_argument("--threads", type=int, default=0,
                       help="threads running checks in this process (default: 1 on a CPU; up to 8 on an "
                            "accelerator, where one process holds the device and compiles run in parallel)")
    check.add_argument("--workers", type=int, default=0,
                       help="processes running checks (default: one per core, at most 2, on a CPU; 1 elsewhere)")
    check.add_argument("--json", nargs="?", const="-", metavar="PATH",
                       help="write one JSON document (rows and summary) to PATH (progress still printed) or, "
                            "without PATH, to stdout (nothing else printed)")
    check.add_argument("--static-gpu", action="store_true",
                       help="the static GPU tier instead: every Triton kernel config's PTX (tensor cores, spills, "
                            "cp.async, registers, occupancy); needs the cuda-check extra; exit 1 when a config "
                            "the heuristic can choose fails")
    check.add_argument("--arch", default="9.0,8.0", help="with --static-gpu: compute capabilities (default 9.0,8.0)")
    check.add_argument("--heuristic-only", action="store_true",
                       help="with --static-gpu: only the configs the heuristic chooses (they decide the exit code)")
    check.add_argument("--tpu-compile", action="store_true",
                       help="tier 3 for Mosaic TPU kernels: compile with the real TPU compiler (libtpu, the "
                            "tpu-check extra; no TPU needed) for each generation, heuristic configs on examples "
                            "and benchmark sizes (every config with --all); prints compiled / rejected / VMEM")
    check.add_argument("--generations", default="", help="with --tpu-compile: comma-separated TPU generations "
                                                         "(default: v5e,v5p,v6e,tpu7x)")
    check.add_argument("--verbose", action="store_true", help="with --tpu-compile: print every compile")
    check.add_argument("--benchmarks", type=int, default=None,
                       help="with --tpu-compile: compile only the first N benchmark calls per op (default: all)")
    sub.add_parser("bench", help="benchmark ops (see `stellax bench --help`)")
    sub.add_parser("autotune", help="tune kernel configs (see `stellax autotune --help`)")
    sub.add_parser("lab", help="kernel lab: write, evaluate and search candidates (see `stellax lab --help`)")
    args = parser.parse_args(argv)
    return {"info": _info, "check": _check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
