"""What the one-process chip benchmarks share (the ``benchmarks/*_tpu.py`` scripts and the model
benchmarks `stellax.bench.model_train` / `stellax.bench.model_serve`): the environment record, the
timer, and `ChipRun`, a run's rows written to its JSON after every row so that a command cut short
keeps what it measured (`ChipRun.compute_row`: the row of a compute-bound contender).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

#: When the process started measuring (the import of this module, at the top of every script).
START = time.perf_counter()


#: The passes a benchmark with ``--passes`` times: the forward, and the forward with the backward.
PASSES = ("fwd", "fwd+bwd")


def elapsed() -> float:
    """Seconds since `START`: what each script's ``--budget`` is compared with."""
    return time.perf_counter() - START


def environment(dry: bool) -> dict:
    """Python, jax and libtpu versions and the first device (kind, platform), and the device count."""
    dev = jax.devices()[0]
    env = {"python": sys.version.split()[0], "jax": jax.__version__, "device_kind": dev.device_kind,
           "platform": dev.platform, "devices": len(jax.devices()), "dry_run": dry}
    try:
        from importlib.metadata import version
        env["libtpu"] = version("libtpu")
    except Exception:  # noqa: BLE001 - optional: no libtpu off a TPU host
        env["libtpu"] = None
    return env


def errors(out, ref) -> tuple[float, float]:
    """``(max|out - ref| / max|ref|, largest relative L2 error)`` over the leaves of ``out`` and
    ``ref`` (``inf`` on a non-finite output)."""
    worst_max = worst_l2 = 0.0
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref), strict=True):
        o, r = np.asarray(jnp.asarray(o, jnp.float32)), np.asarray(jnp.asarray(r, jnp.float32))
        if not np.all(np.isfinite(o)):
            return math.inf, math.inf
        worst_max = max(worst_max, float(np.max(np.abs(o - r))) / (float(np.max(np.abs(r))) or 1.0))
        worst_l2 = max(worst_l2, float(np.linalg.norm(o - r)) / (float(np.linalg.norm(r)) or 1.0))
    return worst_max, worst_l2


def time_fn(fn, args, reps: int, warmup: int) -> tuple[float, float, object]:
    """``(compile + first run seconds, median ms of reps, output)`` of ``fn(*args)``: one first call,
    ``warmup`` untimed calls, then ``reps`` timed ones, each ended by ``block_until_ready``."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return first, float(np.median(times)) if times else float("nan"), out


class ChipRun:
    """A benchmark run: its arguments (``dry_run``, ``reps``, ``warmup``, ``out``, ``budget``), the
    environment, and its rows, saved as ``{"format": fmt, "version": 1, "environment", "seconds",
    "rows"}`` (plus `extra`) by `save`. ``reps`` / ``warmup`` default to the given pairs
    ``(dry run, chip)``."""

    def __init__(self, args, fmt: str, *, reps: tuple[int, int], warmup: tuple[int, int]):
        self.args = args
        self.dry = args.dry_run
        self.reps = args.reps if args.reps is not None else reps[0 if self.dry else 1]
        self.warmup = args.warmup if args.warmup is not None else warmup[0 if self.dry else 1]
        self.format = fmt
        self.env = environment(self.dry)
        self.device = self.env["device_kind"]
        self.date = datetime.date.today().isoformat()
        self.rows: list[dict] = []
        self.out = Path(args.out)
        self.passes = [p for p in getattr(args, "passes", "").split(",") if p]
        for p in self.passes:
            if p not in PASSES:
                raise SystemExit(f"--passes: expected fwd and/or fwd+bwd, got {p!r}")

    def extra(self) -> dict:
        """More top-level fields of the JSON (none here)."""
        return {}

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"format": self.format, "version": 1, "environment": self.env, **self.extra(),
               "seconds": round(elapsed(), 1), "rows": self.rows}
        self.out.write_text(json.dumps(doc, indent=1))

    def picked_cases(self, count: int, main=None) -> list[int]:
        """The case indices ``--cases`` names, in its order; without it the ``main`` set where
        the script has one (not in a dry run, which takes every case), else every one of ``count``."""
        named = [int(i) for i in self.args.cases.split(",") if i]
        if named:
            return named
        return list(main) if main is not None and not self.dry else list(range(count))

    def over_budget(self) -> bool:
        """Whether ``--budget`` seconds have passed (no new case or contender starts then)."""
        return elapsed() > self.args.budget

    def run_cases(self, picked: list[int], run_one) -> None:
        """``run_one(i)`` for each case index of ``picked`` in order, the JSON saved after each,
        until ``--budget`` is spent: the cases not started are named, and kept as the
        environment's ``left``."""
        for n, i in enumerate(picked):
            if self.over_budget():
                print(f"budget of {self.args.budget:.0f} s spent: cases {picked[n:]} not run", flush=True)
                self.env["left"] = picked[n:]
                break
            run_one(i)
            self.save()
        self.save()

    def compute_row(self, fields: dict, label: str, *, flops: float, peak: float | None, ms=None, xla_ms=None,
                    errs=(None, None), compile_s=None, error=None, skipped=None) -> dict:
        """One compute-bound contender's row, appended, saved and printed after ``label``: ``fields``
        (``op``, ``case``, ``pass``, ``contender``, ``config``, ``default``, ``peer``) then ``ms``,
        ``tflops = flops / ms``, ``pct_peak`` (of ``peak`` TFLOP/s; None without one), ``bound``,
        ``vs_xla = xla_ms / ms``, ``max_rel_err`` and ``rel_l2`` (``errs``, `errors`), ``compile_s``,
        ``device``, ``date``, ``skipped`` and ``error`` (a row with either has ``ms`` None)."""
        tflops = None if ms is None else flops / (ms * 1e-3) / 1e12
        pct = None if tflops is None or peak is None else 100.0 * tflops / peak
        r = {**fields, "ms": ms, "tflops": tflops, "pct_peak": pct, "bound": "compute",
             "vs_xla": None if ms is None or xla_ms is None else xla_ms / ms, "max_rel_err": errs[0],
             "rel_l2": errs[1], "compile_s": compile_s, "device": self.device, "date": self.date,
             "skipped": skipped, "error": error}
        self.rows.append(r)
        self.save()
        if skipped or error:
            print(f"{label} {'skipped: ' + skipped if skipped else 'ERROR ' + error[:300]}", flush=True)
        else:
            ratio = "" if r["vs_xla"] is None else f" {r['vs_xla']:5.2f}x XLA"
            err = "" if errs[1] is None else f" max_rel_err {errs[0]:.1e} rel_l2 {errs[1]:.1e}"
            print(f"{label} {ms:9.3f} ms {tflops:6.2f} TFLOP/s {pct or 0:5.1f}%{ratio}{err} "
                  f"(first call {compile_s:.1f} s)", flush=True)
        return r


def parser(description: str, *, reps: tuple[int, int], warmup: tuple[int, int], budget: float,
           stops: str = "case", dry: str = "tiny shapes", passes: bool = False) -> argparse.ArgumentParser:
    """The options every chip benchmark takes: ``--out``, ``--dry-run``, ``--reps`` and ``--warmup``
    (defaults ``(dry run, chip)``), ``--budget`` (seconds; no new ``stops`` starts past it),
    ``--cases`` and, with ``passes``, ``--passes`` (`ChipRun.passes`); a script adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--dry-run", action="store_true", help=f"CPU, interpreted kernels, {dry}")
    p.add_argument("--reps", type=int, default=None,
                   help=f"timed runs per contender (default {reps[1]}, dry run {reps[0]})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed runs after the first (default {warmup[1]}, dry run {warmup[0]})")
    p.add_argument("--budget", type=float, default=budget, help=f"seconds; no new {stops} starts past it")
    p.add_argument("--cases", default="", help="comma-separated case indices to run (default: all, in order)")
    if passes:
        p.add_argument("--passes", default=",".join(PASSES), help="fwd and/or fwd+bwd, comma-separated (default both)")
    return p


def list_cases(cases, main_set) -> int:
    """``--list``: each case's index, ``main`` for the default set, and its label."""
    for i, case in enumerate(cases):
        print(f"{i:2d} {'main ' if i in main_set else '     '}{case.label()}")
    return 0


def mark_best(rows: list[dict]) -> None:
    """Set ``best`` on each of ``rows`` (one contender's configs): true on the fastest that ran."""
    ok = [r for r in rows if r.get("ms") is not None and r.get("error") is None]
    for r in rows:
        r["best"] = False
    if ok:
        min(ok, key=lambda r: r["ms"])["best"] = True


def run(run_cls, args, *, tpu_interpret: bool = False, target: str | None = None) -> int:
    """``run_cls(args).main()``; a dry run with stellax's kernels interpreted (and, with
    ``tpu_interpret``, jax's own Mosaic TPU kernels too, for the peers; with ``target``, e.g.
    ``"v5e"``, dispatching as on that TPU generation: ``implementation=None`` picks its kernels)."""
    if not args.dry_run:
        return run_cls(args).main()
    import contextlib

    import stellax

    with contextlib.ExitStack() as stack:
        if target is not None:
            stack.enter_context(stellax.lowering_target(target))
        stack.enter_context(stellax.interpret_mode())
        if tpu_interpret:
            from jax.experimental.pallas import tpu as pltpu

            stack.enter_context(pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()))
        return run_cls(args).main()

