"""``stellax bench``: run benchmark suites, report, compare with a baseline, record a history.

``stellax bench history DIR`` and ``stellax bench bisect GOOD BAD`` are
subcommands (`history_cli`, `bisect_cli`)."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from .._files import atomic_write_text
from ..core.platform import current_platform
from . import baseline as baseline_lib
from . import bisect as bisect_lib
from . import history as history_lib
from . import report
from . import roofline as roofline_lib
from .calibrate import calibrate, describe
from .measurement import MODES
from .profiler import profile, trace_files
from .suites import NoMatchingCase, SuiteOptions, families, only_ops, run_suites
from .timing import TIMER_NAMES


#: What each command of `stellax bench` does (its ``--help`` description), by subcommand ("": a run).
_DESCRIPTIONS = {
    "": "Benchmark stellax ops per family against XLA and peers, with roofline numbers. With no suite named, "
        "every suite runs on the default shapes of this device. Subcommands: `stellax bench history DIR "
        "[--plot OUT]` (the runs recorded with --record), `stellax bench bisect GOOD BAD --case PATTERN` "
        "(the commit that made a case slower) and `stellax bench model {train,serve} --out FILE` (a whole "
        "model's training step or serving with stellax's kernels against plain JAX).",
    "history": "Show the runs recorded with `stellax bench --record DIR`: a table of each case's median over time, "
               "or plots (--plot).",
    "bisect": "Find the first commit of GOOD..BAD that made the benchmark cases matching --case slower than GOOD "
              "beyond --threshold and the noise. Drives `git bisect --no-checkout`; each commit is measured in a "
              "temporary worktree with PYTHONPATH=<checkout>/src (nothing is installed, your working tree is not "
              "touched), alternating with GOOD round by round.",
}


def _parser(command: str = "") -> argparse.ArgumentParser:
    """The parser of ``stellax bench [command]``, with the command's description."""
    return argparse.ArgumentParser(prog=f"stellax bench {command}".strip(), description=_DESCRIPTIONS[command])


def _timing_arguments(p: argparse.ArgumentParser, *, min_time: str, rounds: str, threshold: str, noise: str) -> None:
    """The options of the commands that time cases and compare the times (a run with --baseline, a
    bisection): --timer, --min-time, --rounds, --threshold and --noise, with these helps."""
    p.add_argument("--timer", default="auto", choices=TIMER_NAMES)
    p.add_argument("--min-time", type=float, default=None, help=min_time)
    p.add_argument("--rounds", type=int, default=3, help=rounds)
    p.add_argument("--threshold", type=float, default=0.10, help=threshold)
    p.add_argument("--noise", type=float, default=2.0, help=noise)


def build_parser() -> argparse.ArgumentParser:
    p = _parser()
    p.add_argument("suites", nargs="*", help="op families to run (default: all); see --list")
    p.add_argument("--list", action="store_true", help="list the suites and their ops, then exit")
    p.add_argument("--ops", default=None,
                   help="comma list of ops to run (registry or public names: rms_norm, dot_product_attention); "
                        "default: every op of the suites")
    p.add_argument("--modes", default=None,
                   help="comma list of forward,backward,forward_backward (default: forward, plus "
                        "forward_backward for differentiable ops)")
    p.add_argument("--implementations", default=None,
                   help="comma list of implementations/peers to run (peers as 'peer:NAME' or NAME)")
    p.add_argument("--no-peers", action="store_true", help="skip other libraries' functions")
    p.add_argument("--interpret", action="store_true",
                   help="also benchmark kernel implementations interpreted on the CPU (testing only)")
    p.add_argument("--max-cases", type=int, default=None, help="at most this many shapes per op")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run, shared among suites (default: 90 on a CPU, none elsewhere)")
    _timing_arguments(
        p, min_time="seconds of timed iterations per measurement (shared by its rounds)",
        rounds="time every case in this many rounds (two when a case is slower than its timing budget); their "
               "best times and spread are what --baseline compares (default 3)",
        threshold="relative slowdown that fails --baseline (default 0.10 = 10%%)",
        noise="changes within NOISE standard errors of the median of the rounds' best times (NOISE x IQR for "
              "results without rounds) count as noise (default 2)")
    p.add_argument("--case", metavar="PATTERN", default=None,
                   help="only the cases whose key op|case|implementation|mode matches this regular expression")
    p.add_argument("--record", metavar="DIR",
                   help="append this run (commit, versions, device, per-case medians) to DIR/history.jsonl")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-' for stdout)")
    p.add_argument("--markdown", metavar="PATH", help="write a markdown report")
    p.add_argument("--plot", metavar="DIR", help="write one PNG per suite into DIR (needs matplotlib)")
    p.add_argument("--baseline", metavar="OLD.json",
                   help="compare with earlier results; exit 1 on a regression beyond --threshold")
    p.add_argument("--input", metavar="RESULTS.json",
                   help="report on saved results instead of running (with --baseline: compare two files)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure peak matmul rate and copy bandwidth first and save them; with no suite "
                        "named, stop after that")
    p.add_argument("--profile", metavar="DIR", help="write a jax.profiler trace (Perfetto/XProf) into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress lines and no table")
    return p


def _list(console) -> int:
    for family, ops in families().items():
        console.print(f"{family}: " + ", ".join(
            f"{op.name} (implementations {', '.join(op.implementations)}"
            + (f"; peers {', '.join(op.peers)}" if op.peers else "") + ")" for op in ops), highlight=False)
    return 0


def _options(args, platform, err) -> SuiteOptions | None:
    """Suite options from the arguments (``None`` after printing the error for a bad one)."""
    known = families()
    unknown = [s for s in args.suites if s not in known]
    if unknown:
        err.print(f"unknown suite(s) {unknown}; known suites: {list(known)}")
        return None
    ops = [name for name in args.ops.split(",") if name] if args.ops else None
    if ops:
        try:
            only_ops(known, ops, args.suites)
        except ValueError as e:
            err.print(f"--ops: {e}", highlight=False)
            return None
    modes = args.modes.split(",") if args.modes else None
    bad = [m for m in modes or () if m not in MODES]
    if bad:
        err.print(f"--modes: unknown {bad}; expected some of {MODES}")
        return None
    if args.rounds < 1:
        err.print(f"--rounds: expected at least 1, got {args.rounds}")
        return None
    if args.case is not None:
        try:
            re.compile(args.case)
        except re.error as e:
            err.print(f"--case: {args.case!r} is not a valid regular expression ({e})")
            return None
    budget = args.budget if args.budget is not None else (90.0 if platform.backend == "cpu" else None)
    return SuiteOptions(
        modes=modes, implementations=args.implementations.split(",") if args.implementations else None,
        peers=not args.no_peers, interpret=args.interpret,
        timer="wall" if (args.profile and args.timer in ("auto", "cupti", "profiler")) else args.timer,
        max_cases=args.max_cases, budget_s=budget, min_time=args.min_time, rounds=args.rounds, case=args.case,
        ops=ops,
    )


def _run(args, platform, console, err):
    """Calibrate and/or run the suites: ``records`` or an exit status (int)."""
    if args.calibrate:
        with profile(args.profile):
            measurement = calibrate(timer="wall" if args.profile else args.timer)
        console.print(f"calibration on {platform.describe()}: {describe(measurement)}")
        if measurement.get("saved_to"):
            console.print(f"saved to {measurement['saved_to']}")
        if not args.suites and not args.ops:
            return 0
    elif roofline_lib.device_peaks(platform) is None:
        calibrate(quick=True, save=False)  # CPU: rough in-process ceilings for the roofline columns
    options = _options(args, platform, err)
    if options is None:
        return 2
    progress = None if args.quiet else (lambda text: err.print(f"[dim]{escape(text)}", highlight=False))
    started = time.monotonic()
    try:
        with profile(args.profile) as trace_dir:
            records = run_suites(args.suites or None, options, progress=progress)
    except NoMatchingCase as e:
        err.print(escape(str(e)), highlight=False)
        return 2
    if not args.quiet:
        err.print("[dim]" + escape(f"{len(records)} records in {time.monotonic() - started:.1f} s: "
                                   f"{report.skip_summary(records)}"), highlight=False)
    if trace_dir is not None:
        files = trace_files(str(trace_dir))
        console.print(f"profile trace: {len(files)} file(s) under {trace_dir} (open in Perfetto or XProf)")
    return records


def _write_outputs(args, records, env, platform, console) -> None:
    """The table, and the JSON / markdown / plot files the arguments ask for."""
    if not args.quiet:
        report.print_table(records, title=f"stellax bench on {env.get('device', platform.describe())}",
                           console=console)
    if args.json:
        report.write_json(args.json, records, env=env, peaks=roofline_lib.device_peaks(platform))
        if args.json != "-" and not args.quiet:
            console.print(f"wrote {args.json}")
    if args.markdown:
        atomic_write_text(Path(args.markdown), report.markdown(records, env=env))
        if not args.quiet:
            console.print(f"wrote {args.markdown}")
    if args.plot:
        ok, reason = report.matplotlib_available()
        if not ok:
            console.print(f"--plot: {reason}")
        else:
            for path in report.plot(records, args.plot):
                console.print(f"wrote {path}")


def _compare_baseline(args, records, env, console) -> int:
    """0 when no regression against ``--baseline`` beyond ``--threshold``, else 1."""
    base_records, base_env = report.load_records(args.baseline)
    if base_env.get("device_kind") and base_env.get("device_kind") != env.get("device_kind"):
        console.print(f"[yellow]note: the baseline ran on {base_env.get('device_kind')}, "
                      f"this on {env.get('device_kind')}")
    comparison = baseline_lib.compare(records, base_records, threshold=args.threshold, noise_k=args.noise)
    console.print(comparison.report(), highlight=False)
    return 0 if comparison.ok else 1


def _record(args, records, env, console) -> int:
    """Append the run to the ``--record`` history; 0, or 2 when it cannot be written."""
    try:
        path = history_lib.append(args.record, history_lib.make_entry(records, env))
    except (OSError, ValueError) as e:
        console.print(escape(f"--record {args.record}: nothing written: {e}"), highlight=False)
        return 2
    if not args.quiet:
        console.print(escape(f"recorded {sum(r.ok for r in records)} case(s) in {path}"), highlight=False)
    return 0


def history_parser() -> argparse.ArgumentParser:
    p = _parser("history")
    p.add_argument("dir", metavar="DIR", help="the history directory (or its history.jsonl)")
    p.add_argument("--plot", metavar="OUT", help="draw each case over time: OUT.png (one file, a panel per "
                                                  "suite) or a directory (one PNG per suite); needs matplotlib")
    p.add_argument("--case", metavar="PATTERN", help="only cases whose key matches this regular expression")
    p.add_argument("--last", type=int, default=8, help="runs shown in the table (default 8; 0: all)")
    return p


def history_cli(argv: list[str]) -> int:
    """``stellax bench history DIR [--plot OUT]``."""
    args = history_parser().parse_args(argv)
    console = Console(width=max(Console().width, 200))
    err = Console(stderr=True, soft_wrap=True)
    try:
        entries = history_lib.load(args.dir)
        if args.plot:
            ok, reason = report.matplotlib_available()
            if not ok:
                err.print(f"--plot: {reason}", highlight=False)
                return 2
            for path in history_lib.plot(entries, args.plot, args.case):
                console.print(escape(f"wrote {path}"), highlight=False)
        else:
            console.print(history_lib.table(entries, args.case, last=args.last))
    except (history_lib.HistoryError, re.error) as e:
        err.print(escape(f"stellax bench history: {e}"), highlight=False)
        return 2
    return 0


def bisect_parser() -> argparse.ArgumentParser:
    p = _parser("bisect")
    p.add_argument("good", metavar="GOOD", help="a commit (or any revision) without the slowdown")
    p.add_argument("bad", metavar="BAD", help="a later commit with it")
    p.add_argument("--case", metavar="PATTERN",
                   help="the cases to time: a regular expression on op|case|implementation|mode (required "
                        "unless --command is given); their best times are summed")
    p.add_argument("--repo", metavar="DIR", default=None, help="the git repository (default: the current one)")
    p.add_argument("--suites", default=None,
                   help="comma list of suites to run (default: those with an op whose name --case matches "
                        "or contains, else all)")
    p.add_argument("--command", default=None,
                   help="instead of stellax bench: a command run in each checkout that prints a time in ms last")
    _timing_arguments(
        p, min_time="seconds of timed iterations per case",
        rounds="measurements per commit, alternated with GOOD's (default 3)",
        threshold="relative slowdown that counts as a regression (default 0.10 = 10%%)",
        noise="noise band in standard errors (default 2)")
    return p


def _bisect_suites(pattern: str) -> list[str]:
    """The suites with an op whose name the pattern matches or names (none: every suite)."""
    regex = re.compile(pattern)
    return [family for family, ops in families().items()
            if any(regex.search(op.name) or op.name in pattern for op in ops)]


def bisect_cli(argv: list[str]) -> int:
    """``stellax bench bisect GOOD BAD --case PATTERN``: 0 when a regressed commit is named, 1 when none
    regressed, 2 on bad input."""
    p = bisect_parser()
    args = p.parse_args(argv)
    console = Console(width=max(Console().width, 200))
    err = Console(stderr=True, soft_wrap=True)
    if args.case is None and args.command is None:
        p.error("--case PATTERN is required (or --command CMD)")
    if args.rounds < 1:
        p.error(f"--rounds: expected at least 1, got {args.rounds}")
    if args.command is not None:
        command = shlex.split(args.command)
        if not command:
            p.error("--command: empty command")
        runner = bisect_lib.command_runner(command)
        label = args.case or args.command
    else:
        try:
            suites = args.suites.split(",") if args.suites else _bisect_suites(args.case)
        except re.error as e:
            p.error(f"--case: {args.case!r} is not a valid regular expression ({e})")
        runner = bisect_lib.stellax_runner(args.case, suites, min_time=args.min_time, timer=args.timer)
        label = args.case
    try:
        with bisect_lib.checkout_measure(args.repo, runner) as measure:
            result = bisect_lib.bisect(args.repo, args.good, args.bad, measure, threshold=args.threshold,
                                       noise_k=args.noise, rounds=args.rounds, label=label,
                                       progress=lambda text: err.print(f"[dim]{escape(text)}", highlight=False))
    except bisect_lib.BisectError as e:
        err.print(escape(f"stellax bench bisect: {e}"), highlight=False)
        return 2
    console.print(escape(result.message), highlight=False)
    return 0 if result.found else 1


#: `stellax bench model KIND`: the module whose ``main(argv, prog)`` runs each kind.
MODEL_BENCHMARKS = {"train": "stellax.bench.model_train", "serve": "stellax.bench.model_serve",
                    "plot": "stellax.bench.model_plot"}
#: The kinds that build models (flax, optax: the ``nn`` extra); ``plot`` only reads their JSON.
_MODEL_KINDS_NEEDING_NN = ("train", "serve")


def model_cli(argv: list[str]) -> int:
    """``stellax bench model {train,serve,plot} ARGS``: the model benchmarks (`stellax.bench.model_train`,
    `stellax.bench.model_serve`; ``--help`` after the kind lists their options), which build their
    models from `stellax.nn` and train with optax (the ``nn`` extra), and the plot of training
    tokens/s by sequence length from their JSON (`stellax.bench.model_plot`)."""
    kinds = ", ".join(MODEL_BENCHMARKS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: stellax bench model {{{kinds}}} [--help] --out FILE [options]\n\n"
              "A whole model on this device with stellax's kernels against the same model in plain JAX:\n"
              "  train  training steps of a ~500M dense and a hybrid-MoE decoder (tokens/s, MFU, peak HBM,\n"
              "         loss agreement; --dry-run: tiny models on the CPU)\n"
              "  serve  prefill and greedy decode of the dense model, stellax's paged KV cache against a\n"
              "         dense-cache plain-JAX decode\n"
              "  plot   training tokens/s by sequence length from train's JSON files (PNG; needs matplotlib)")
        return 0 if argv else 2
    kind = argv[0]
    if kind not in MODEL_BENCHMARKS:
        print(f"stellax bench model: expected one of {kinds}, got {kind!r}", file=sys.stderr)
        return 2
    import importlib

    try:
        for needed in ("flax", "optax") if kind in _MODEL_KINDS_NEEDING_NN else ():
            importlib.import_module(needed)
    except ImportError as e:
        print(f"stellax bench model {kind}: needs {e.name}, which is not installed: pip install 'stellax[nn]'",
              file=sys.stderr)
        return 2
    module = importlib.import_module(MODEL_BENCHMARKS[kind])
    return module.main(argv[1:], prog=f"stellax bench model {kind}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "model":
        return model_cli(argv[1:])
    if argv and argv[0] == "history":
        return history_cli(argv[1:])
    if argv and argv[0] == "bisect":
        import stellax  # noqa: F401  (registers the ops, for --case's default suites)

        return bisect_cli(argv[1:])
    args = build_parser().parse_args(argv)
    import stellax  # noqa: F401  (registers the ops)

    console = Console(stderr=False, width=max(Console().width, 240))
    err = Console(stderr=True, soft_wrap=True)
    if args.list:
        return _list(console)
    platform = current_platform()
    if args.input:
        records, env = report.load_records(args.input)
    else:
        env = report.environment()
        records = _run(args, platform, console, err)
        if isinstance(records, int):
            return records
    _write_outputs(args, records, env, platform, console)
    if args.record and _record(args, records, env, console):
        return 2
    return _compare_baseline(args, records, env, console) if args.baseline else 0
