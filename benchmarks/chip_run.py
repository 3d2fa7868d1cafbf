"""What the one-process chip benchmarks share (`gmm_tpu.py`, `loss_tpu.py`, `norm_tpu.py`,
`paged_decode_tpu.py`, `model_step.py`): the environment record, the timer, and `ChipRun`, a
run's rows written to its JSON after every row so that a command cut short keeps what it measured.

The scripts run as ``python3 benchmarks/<script>.py``, so this module is importable beside them.
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

    def picked_cases(self, count: int) -> list[int]:
        """The case indices ``--cases`` names, in its order (every one of ``count`` when empty)."""
        return [int(i) for i in self.args.cases.split(",") if i] or list(range(count))

    def over_budget(self) -> bool:
        """Whether ``--budget`` seconds have passed (no new case or contender starts then)."""
        return elapsed() > self.args.budget


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


def mark_best(rows: list[dict]) -> None:
    """Set ``best`` on each of ``rows`` (one contender's configs): true on the fastest that ran."""
    ok = [r for r in rows if r.get("ms") is not None and r.get("error") is None]
    for r in rows:
        r["best"] = False
    if ok:
        min(ok, key=lambda r: r["ms"])["best"] = True


def run(run_cls, args, *, tpu_interpret: bool = False) -> int:
    """``run_cls(args).main()``; a dry run with stellax's kernels interpreted (and, with
    ``tpu_interpret``, jax's own Mosaic TPU kernels too, for the peers)."""
    if not args.dry_run:
        return run_cls(args).main()
    import contextlib

    import stellax

    with contextlib.ExitStack() as stack:
        stack.enter_context(stellax.interpret_mode())
        if tpu_interpret:
            from jax.experimental.pallas import tpu as pltpu

            stack.enter_context(pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()))
        return run_cls(args).main()

