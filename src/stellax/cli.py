"""The `stellax` command line: ``info``, ``check``, ``bench``, ``autotune``."""

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
    table = Table(title="implementations on this device")
    for column in ("op", "implementation", "backend", "runs here"):
        table.add_column(column)
    from stellax.core.op import backend_support
    for name, op in sorted(stellax.registered_ops().items()):
        for impl in op.implementations.values():
            support = backend_support(impl.backend, platform)
            status = "yes" if support else f"no: {support.reason}"
            if support and impl.is_kernel and platform.backend == "cpu":
                status = "interpreted (explicit request only)"
            table.add_row(name, impl.name, impl.backend, status)
    console.print(table)
    return 0


def _check(args) -> int:
    import jax.numpy as jnp
    from rich.console import Console
    from rich.table import Table

    import stellax
    from stellax.testing import check_op

    console = Console(width=max(Console().width, 150))
    ops = stellax.registered_ops()
    selected = ops if not args.ops else {n: op for n, op in ops.items() if n in args.ops or op.family in args.ops}
    if args.ops and not selected:
        console.print(f"[red]no registered op or family matches {args.ops}; known: {sorted(ops)}")
        return 2
    dtypes = [getattr(jnp, d) for d in args.dtypes.split(",")]
    table = Table(title=f"stellax check on {stellax.current_platform().describe()}")
    for column in ("op", "impl", "dtype", "example", "result", "rel L2 (tol)", "max abs", "% within"):
        table.add_column(column)
    failures = 0
    for name, op in sorted(selected.items()):
        impls = None if not args.implementations else [
            i for i in args.implementations.split(",") if i in op.implementations]
        for r in check_op(op, implementations=impls, dtypes=dtypes, gradients=not args.no_gradients):
            if r.skipped:
                table.add_row(r.op, r.implementation, r.dtype, r.example, "[yellow]skip", r.skipped[:60], "", "")
                continue
            failures += not r.passed
            w = r.worst
            result = "[green]ok" if r.passed else f"[red]FAIL {r.detail}"
            table.add_row(r.op, r.implementation, r.dtype, r.example, result,
                          "" if w is None else f"{w.rel_l2:.1e} ({w.tolerance:.0e})",
                          "" if w is None else f"{w.max_abs:.1e}",
                          "" if w is None else f"{100 * w.fraction_within:.1f}")
    console.print(table)
    console.print(f"{'[red]' if failures else '[green]'}{failures} failure(s)")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench and autotune own their argument parsing.
    if argv and argv[0] == "bench":
        from stellax.bench.cli import main as bench_main
        return bench_main(argv[1:])
    if argv and argv[0] == "autotune":
        from stellax.autotune.cli import main as autotune_main
        return autotune_main(argv[1:])
    parser = argparse.ArgumentParser(prog="stellax", description="stellax kernels: info, check, bench, autotune")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, which implementations run here and why not")
    check = sub.add_parser("check", help="validate every op and implementation against the golden")
    check.add_argument("ops", nargs="*", help="op names or families (default: all)")
    check.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes")
    check.add_argument("--implementations", default="", help="comma-separated implementation names")
    check.add_argument("--no-gradients", action="store_true", help="forward only")
    sub.add_parser("bench", help="benchmark ops (see `stellax bench --help`)")
    sub.add_parser("autotune", help="tune kernel configs (see `stellax autotune --help`)")
    args = parser.parse_args(argv)
    return {"info": _info, "check": _check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
