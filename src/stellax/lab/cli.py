"""`stellax lab new | evaluate | search | report | promote | mcp`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import archive as archive_lib
from . import template
from .._op_names import display_name
from .candidate import find_op
from .errors import LabError
from .evaluate import DEFAULT_MEMORY_LIMIT_MB, DEFAULT_TIME_LIMIT, evaluate
from .mutate import MutateProposer
from .search import search


def _add_eval_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, help="seconds per evaluation")
    p.add_argument("--memory-limit", type=int, default=DEFAULT_MEMORY_LIMIT_MB, help="MiB per evaluation child")
    p.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the numerics tiers (comma-separated)")
    p.add_argument("--max-examples", type=int, default=None, help="only the first N examples per dtype")
    p.add_argument("--no-benchmark", action="store_true", help="skip the benchmark tier")
    p.add_argument("--bench-time", type=float, default=0.2, help="seconds of interleaved timing per round")
    p.add_argument("--bench-rounds", type=int, default=2, help="timing lasts rounds x --bench-time seconds per shape, candidate and baseline interleaved")
    p.add_argument("--max-benchmarks", type=int, default=None, help="only the first N benchmark shapes")
    p.add_argument("--shapes", default=None, help="a Python file defining BENCHMARKS(platform) -> [Example]: the "
                                                  "benchmark shapes (default: the op's)")


def _options(args) -> dict:
    return {"dtypes": [d.strip() for d in args.dtypes.split(",") if d.strip()], "max_examples": args.max_examples,
            "benchmark": not args.no_benchmark, "benchmark_min_time": args.bench_time,
            "benchmark_rounds": args.bench_rounds, "max_benchmarks": args.max_benchmarks}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stellax lab", description="Write, evaluate and search kernel candidates.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("new", help="write a starting candidate for an op")
    p.add_argument("file")
    p.add_argument("--op", required=True)
    p.add_argument("--from", dest="base", default="xla", help="the implementation to start from (default xla)")
    p.add_argument("--config", default=None, metavar="IMPL",
                   help="write a config-only candidate for implementation IMPL instead")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")

    p = sub.add_parser("evaluate", help="evaluate a candidate file")
    p.add_argument("file")
    p.add_argument("--op", required=True)
    p.add_argument("--json", action="store_true", help="print the JSON report (default: the summary)")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    _add_eval_options(p)

    p = sub.add_parser("search", help="an evolutionary search over candidates")
    p.add_argument("--op", required=True)
    p.add_argument("--proposer", choices=("mutate", "llm"), default="mutate")
    p.add_argument("--budget", type=int, default=20, help="evaluations, the starting candidate included")
    p.add_argument("--seed-file", default=None, help="the starting candidate (default: `lab new`'s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--population", type=int, default=4)
    p.add_argument("--run", default=None, help="run id (an existing one resumes)")
    p.add_argument("--archive", default=None, help=f"SQLite file (default {archive_lib.default_path()})")
    p.add_argument("--base-url", default=None, help="LLM: OpenAI-compatible base URL (env STELLAX_LAB_BASE_URL "
                                                    "or OPENAI_BASE_URL)")
    p.add_argument("--model", default=None, help="LLM: model (env STELLAX_LAB_MODEL or OPENAI_MODEL)")
    p.add_argument("--api-key", default=None, help="LLM: key (env STELLAX_LAB_API_KEY or OPENAI_API_KEY)")
    p.add_argument("--llm-timeout", type=float, default=120.0, help="LLM: seconds per request")
    p.add_argument("--llm-retries", type=int, default=3, help="LLM: attempts per proposal")
    _add_eval_options(p)

    p = sub.add_parser("report", help="markdown and a PNG of a search")
    p.add_argument("--run", default=None, help="run id (default: the latest)")
    p.add_argument("--archive", default=None)
    p.add_argument("--out", default="lab-report", help="output directory")

    p = sub.add_parser("promote", help="write an archived candidate into a plugin package")
    p.add_argument("id", type=int)
    p.add_argument("--archive", default=None)
    p.add_argument("--out", default="stellax-plugins", help="directory to write the package into")
    p.add_argument("--name", default=None, help="implementation name (default lab_<op>_<id>)")
    p.add_argument("--force", action="store_true", help="promote even a candidate that did not pass")

    p = sub.add_parser("mcp", help="serve the lab over MCP (stdio)")
    p.add_argument("--archive", default=None)
    return parser


def _cmd_new(args) -> int:
    op = find_op(args.op)
    path = Path(args.file)
    if path.exists() and not args.force:
        raise LabError(f"{path}: exists already (pass --force to overwrite)")
    text = template.config_template(op, args.config) if args.config else template.implementation_template(op, base=args.base)
    path.write_text(text)
    print(f"wrote {path}: {'config-only candidate for ' + args.config if args.config else 'candidate from ' + args.base}"
          f" of {display_name(op.name)}; evaluate with: stellax lab evaluate {path} --op {args.op}")
    return 0


def _cmd_evaluate(args) -> int:
    report = evaluate(args.file, args.op, time_limit=args.time_limit, memory_limit_mb=args.memory_limit,
                      options=_options(args), shapes=args.shapes)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=repr))
    print(json.dumps(report, indent=1, default=repr) if args.json else report["summary"])
    return 0 if report["status"] == "passed" else 1


def _proposer(args):
    if args.proposer == "mutate":
        return MutateProposer()
    from .llm import LLMProposer
    return LLMProposer.from_environment(base_url=args.base_url, model=args.model, api_key=args.api_key,
                                        timeout=args.llm_timeout, retries=args.llm_retries)


def _cmd_search(args) -> int:
    op = find_op(args.op)
    proposer = _proposer(args)
    if args.seed_file:
        seed_source = Path(args.seed_file).read_text()
    else:
        seed_source = template.implementation_template(op)
    with archive_lib.Archive(args.archive) as archive:
        result = search(op.name, proposer, budget=args.budget, seed_source=seed_source, archive=archive,
                        run_id=args.run, seed=args.seed, population=args.population, time_limit=args.time_limit,
                        memory_limit_mb=args.memory_limit, options=_options(args), shapes=args.shapes)
        best = result["best"]
        print(f"run {result['run']}: {result['evaluated']} evaluations ({result['stopped']}); best #{best['id']} "
              f"score {best['score']:.4f} ({best['report']['status']}) in {archive.path}")
    return 0


def _cmd_report(args) -> int:
    from .summary import write_report
    with archive_lib.Archive(args.archive) as archive:
        paths = write_report(archive, args.run, args.out)
    for p in paths:
        print(f"wrote {p}")
    return 0


def _cmd_promote(args) -> int:
    from .promote import promote
    with archive_lib.Archive(args.archive) as archive:
        path = promote(archive, args.id, args.out, name=args.name, force=args.force)
    print(f"wrote plugin package {path}; use it with: pip install {path}  (or STELLAX_PLUGIN_PATH={path})")
    return 0


def _cmd_mcp(args) -> int:
    from .mcp_server import serve, server_class
    try:
        server_class()
    except ImportError as e:
        raise LabError(str(e)) from None
    serve(archive_path=args.archive)
    return 0


COMMANDS = {"new": _cmd_new, "evaluate": _cmd_evaluate, "search": _cmd_search, "report": _cmd_report,
            "promote": _cmd_promote, "mcp": _cmd_mcp}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``stellax lab``; returns the exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args)
    except LabError as e:
        print(f"stellax lab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
