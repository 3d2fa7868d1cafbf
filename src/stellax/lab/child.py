"""The evaluation child process: ``python -m stellax.lab.child``.

It reads job file paths from stdin, one per line, and for each job (a JSON
object: ``candidate`` path, ``display`` name, ``op``, ``options``,
``workdir``, ``out``) loads the candidate, registers it on a copy of the op
and runs the tiers, writing ``progress`` (the tier running now) and finally
the report to ``out`` (both atomically, by rename). The parent
(`stellax.lab.evaluate`) enforces the time and memory limits; this process
only has to report what it can.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _write(path: str, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, default=_default)
    os.replace(tmp, path)


def _default(value):
    if hasattr(value, "item"):
        return value.item()
    return repr(value)


def run_job(job: dict) -> dict:
    """Evaluate one candidate; always returns a finished report."""
    from ..core import current_platform, interpret_enabled
    from . import candidate as candidate_lib
    from . import report as report_lib
    from . import tiers as tiers_lib
    from .errors import LabError

    t_start = time.perf_counter()
    path, display = job["candidate"], job.get("display") or job["candidate"]
    tiers_lib.CANDIDATE_PATHS[:] = [path, display]
    progress_path = job["out"] + ".progress"

    def progress(name):
        _write(progress_path, {"tier": name, "tiers": tiers})

    with open(path) as f:
        source = f.read()
    cand = {"file": display, "sha256": candidate_lib.source_hash(source), "name": None, "backend": None,
            "kind": None}
    tiers: list[dict] = []
    platform = current_platform()
    report = {"schema_version": report_lib.SCHEMA_VERSION, "op": job["op"], "candidate": cand,
              "status": "failed", "first_failure": None, "tiers": tiers, "numerics": None, "benchmark": None,
              "environment": _environment(platform), "limits": job.get("limits", {})}
    progress("load")
    t0 = time.perf_counter()
    try:
        op = candidate_lib.find_op(job["op"])
        module = candidate_lib.load_module(path)
        impl = candidate_lib.implementation_of(module, op, display)
        cand.update(name=impl.name, backend=impl.backend, kind=candidate_lib.candidate_kind(module),
                    config_type=impl.config_type.__name__ if impl.config_type else None)
        options = tiers_lib.Options.from_dict(job.get("options"))
        bench_examples = None
        if options.benchmarks_from_file:
            if not callable(getattr(module, "BENCHMARKS", None)):
                raise LabError(f"{display}: benchmarks_from_file is set but the file defines no BENCHMARKS(platform)")
            bench_examples = list(module.BENCHMARKS(platform))
        elif job.get("shapes"):
            shapes = candidate_lib.load_module(job["shapes"])
            if not callable(getattr(shapes, "BENCHMARKS", None)):
                raise LabError(f"--shapes {job['shapes']}: the file defines no BENCHMARKS(platform) -> [Example]")
            bench_examples = list(shapes.BENCHMARKS(platform))
    except MemoryError:
        raise
    except BaseException as e:  # noqa: BLE001 - syntax errors, import errors, bad definitions
        if isinstance(e, KeyboardInterrupt):
            raise
        error = tiers_lib.error_info(e, path, display)
        if isinstance(e, LabError):
            error.update(excerpt="", file=display, line=None)
        tiers.append(report_lib.tier("load", "failed", time.perf_counter() - t0, error["message"], error))
        report["first_failure"] = {"tier": "load", **error}
        report["wall_s"] = round(time.perf_counter() - t_start, 3)
        return report_lib.finish(report)
    tiers.append(report_lib.tier("load", "passed", time.perf_counter() - t0, f"{cand['kind']} {impl.name!r}"))
    lab_op = candidate_lib.with_implementation(op, impl)
    runner = tiers_lib.Runner(op, lab_op, impl, options, bench_examples)
    report["environment"]["interpret"] = bool(runner.interpret or interpret_enabled())
    done, failure, bench = tiers_lib.run_tiers(runner, progress, tiers)
    report.update(tiers=done, first_failure=failure, benchmark=bench,
                  status="failed" if failure else "passed")
    worst = runner.worst
    if worst is not None:
        worst = {k: v for k, v in worst.items() if k != "_key"}
    report["numerics"] = {"worst": worst, "cases": runner.numeric_cases, "unsupported": runner.unsupported}
    report["wall_s"] = round(time.perf_counter() - t_start, 3)
    return report_lib.finish(report)


def _environment(platform) -> dict:
    import jax

    from .. import _version
    return {"platform": platform.backend, "device_kind": platform.device_kind, "jax": jax.__version__,
            "stellax": getattr(_version, "__version__", "?"), "python": sys.version.split()[0],
            "interpret": False, "pid": os.getpid()}


def main() -> int:
    """Serve jobs from stdin until it closes."""
    for line in sys.stdin:
        job_path = line.strip()
        if not job_path:
            continue
        with open(job_path) as f:
            job = json.load(f)
        os.chdir(job["workdir"])
        try:
            report = run_job(job)
        except MemoryError:
            from . import report as report_lib
            report = report_lib.failure_report(job["op"], {"file": job.get("display")}, "memory",
                                               "MemoryError: the candidate exhausted the memory limit",
                                               tier_name=_last_tier(job), limits=job.get("limits"))
        except Exception as e:  # noqa: BLE001 - a bug outside the tiers still yields a report
            from . import report as report_lib
            report = report_lib.failure_report(job["op"], {"file": job.get("display")}, "crashed",
                                               f"{type(e).__name__}: {e}", tier_name=_last_tier(job),
                                               excerpt=traceback.format_exc()[-3000:], limits=job.get("limits"))
        _write(job["out"], report)
        sys.stderr.flush()
        sys.stdout.flush()
    return 0


def _last_tier(job: dict) -> str:
    try:
        with open(job["out"] + ".progress") as f:
            return json.load(f)["tier"]
    except Exception:  # noqa: BLE001
        return "load"


if __name__ == "__main__":
    sys.exit(main())
