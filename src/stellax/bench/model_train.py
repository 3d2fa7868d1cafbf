"""Training steps of a dense and a hybrid-MoE decoder on one chip: stellax's kernels against plain JAX
and tokamax.

    stellax bench model train --out model_step.json          # installed (pip install "stellax[nn]")
    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/model_step.py --out $OUT/model_step.json

The models (issue 42) are in `stellax.bench.model_zoo`, each built three ways over one parameter
pytree (``--variants``): from `stellax.nn` layers (``stellax``: every op with
``implementation=None``, what stellax picks on the device), as the same math in plain JAX (``jax``,
the peer), and as that plain model with tokamax's ops where tokamax has them (``tokamax``, a second
peer; its rows are ``skipped`` with the reason where tokamax does not import). The rows'
``stellax_ops`` lists the stellax ops each variant called (`stellax.core.selection.observe_calls`):
empty for the plain dense model, ``chunk_gated_delta_rule: xla`` for the peers' hybrid (stellax's
XLA chunked GDN is the only XLA Gated DeltaNet).

Precision: mixed. Parameters and AdamW moments float32 (16 bytes per parameter with the gradient),
activations and matmul operands bfloat16, accumulation / norms / softmax / loss float32. The
optimizer is ``optax.chain(clip_by_global_norm(1.0), adamw(lr, b1=0.9, b2=0.95,
weight_decay=0.1))`` with ``--lr`` (default 3e-4); the step is ``jax.jit`` with parameters and
optimizer state donated. ``--remat full`` (default) wraps each block in ``jax.checkpoint``;
``--remat none`` keeps everything (the dry run's default: interpreted Pallas kernels run through ``io_callback``, whose effects
``jax.checkpoint`` cannot partially evaluate).

Models (``--cases`` picks ``family:seq:batch``; the main set is ``dense:4096:2,hybrid:4096:2``):

* ``dense`` (526.2M parameters, 477.0M in matmuls): D=1536, 16 layers, 16 query heads over 4 kv
  heads of 128, SwiGLU hidden 4096, vocab 32000 (Llama-2's, not Llama-3's 128256: at D=1536 that
  vocab would put 394M of the 500M parameters into the two embedding tables, and its float32
  ``[T, V]`` logits could not sit beside the plain model's optimizer state), RoPE theta 500000.
  Memory: 16 B x 526M = 8.4 GB of parameters, gradients and moments, ~7 GB of a v5e's 15.75 GiB
  left for activations. Cases ``dense:4096:2`` (8192 tokens; the plain model's ``[B, N, S, S]``
  float32 attention logits are 2.1 GB a layer) and ``dense:16384:1`` (those logits are 17 GB: the
  plain model is expected not to fit -- an error row with XLA's message).
* ``hybrid`` (520.2M parameters, 135.1M active per token): Qwen3-Next-style, D=1024, 2 groups of
  [3 Gated DeltaNet blocks (8 heads, K=V=128) + 1 gated-attention block (8 query heads over 2 kv
  heads of 128)], each block's MLP a top-8 of 64 experts SwiGLU MoE (expert hidden 256, softmax
  routing, normalized weights) plus a shared SwiGLU expert (hidden 512), vocab 32000. The experts
  are 403M of the parameters. Memory: 16 B x 520M = 8.3 GB, as the dense model; the routed
  activations of a block are ``T·k`` rows (65536 at 8192 tokens: 67 MB of bfloat16 gate/up
  output). Cases ``hybrid:4096:2`` and ``hybrid:32768:1`` (there the plain model's float32 logits
  and their gradient are 8.4 GB and its attention layers' logits 34 GB: expected not to fit).
* ``--dry-run`` runs the tiny twins on the CPU (`TINY`): dense D=64, 2 layers, vocab 256, seq 32;
  hybrid D=64, 1 group (3 GDN + 1 attention), 8 experts top-2, vocab 256, seq 64.

Data: a learnable synthetic stream (`model_zoo.learnable_batch`: token ``t+1`` is a fixed
permutation of token ``t`` except 10 % uniform noise), a fresh batch every step, both variants the
same batches from the same initial parameters. ``--steps N`` trains N steps in all (default ``1 +
warmup + reps``); the step times are those after the first ``1 + warmup`` (median as ``ms``);
``loss_final`` is the mean loss of the last ``max(1, N // 10)`` steps; ``losses`` the whole curve.
``--steps 200`` is the convergence check: the two variants' ``loss_final`` within 1 %
(``convergence`` in the JSON, ``ok`` per case; a dry run checks it at a few steps).

Model FLOPs per step (see `DenseConfig.flops_per_step`, `HybridConfig.flops_per_step`)::

    dense:  6·P_matmul·B·S + 6·B·S²·N·H·L                     (causal attention at half)
    hybrid: 6·P_active·B·S + 6·B·S²·N·H·L_attn + 3·B·S·HG·(6·K·V + 64·(2K + V))·L_gdn

``P_matmul`` / ``P_active``: every parameter that enters a matmul per token (projections, router,
the top-k experts' and the shared expert's ``3·D·F``, the output projection ``D·V``; not the
embedding gather nor norm scales). The GDN term counts per token and value head the forward's
three ``2·K·V`` state products (output, delta, update) and the intra-chunk ``q kᵀ``, ``k kᵀ``,
``A v`` over half a 64-token chunk, times 3 for the backward. Recomputation (remat) is not
counted. MFU = model FLOPs / step time / peak bf16 FLOP/s (197e12 on a v5e); ``pct_peak`` = MFU %.

Peak HBM (``peak_hbm_bytes``): ``memory_stats()['peak_bytes_in_use']`` where the backend reports it
(a TPU), else the compiled step's ``memory_analysis()`` (``compiled_bytes`` always). The peak is per
process, so on a TPU each (case, variant) runs in its own subprocess by default. ``--in-process``
(and the dry run) runs them in one process instead and compiles them all at once first, a thread
each (compiles overlap: the command takes about the longest compile, not their sum), then runs them
one after another; there a row's device peak is the process's so far (``peak_hbm_source`` says so)
and ``compiled_bytes`` is the per-variant figure.

The JSON (``--out``) holds ``{"format": "stellax-model-step", "version": 3, "environment", "models",
"rows", "loss_agreement", "convergence"}`` (the last two one entry per case and peer: ``peer``,
``stellax`` and ``peer_loss``, ``rel_diff``, ``ok``); rows in the suite's results schema
(benchmarks/README.md: op ``model_train``, case ``"<family> seq=S batch=B"``, pass ``fwd+bwd``,
contender ``stellax`` / ``jax`` / ``tokamax`` (the peers), ms, tflops, pct_peak, bound, peak_hbm_bytes, device, date, skipped, error) plus
``tokens_per_s``, ``mfu``, ``family``, ``batch``, ``seq``, ``params``, ``active_params``,
``flops_per_step``, ``loss_first``, ``loss_last``, ``loss_final``, ``losses``, ``compile_s``,
``compiled_bytes``, ``remat``, ``stellax_ops``. It is rewritten after every row; ``--budget``
seconds (default 400) stops starting new runs, and a run still going 150 s past it is killed (an
error row), so the whole command ends within ``budget + 150`` s (550 s by default: under the
chip machine's 600 s per command).

Chip time (v5e; not measured on a chip). The four programs of the main set compiled for a v5e
(libtpu's compiler on a compile-only topology device, on the shared 2-core CPU of the dev box,
loaded): compile 85 s (dense stellax), 78 s (dense jax), 226 s (hybrid stellax), 390 s (hybrid
jax; the XLA chunked GDN and ragged dots are slow to compile); ``memory_analysis`` totals 10.9 /
13.9 / 12.9 / 13.9 GiB (arguments 5.9 GiB: parameters and AdamW state; the rest temporaries) -- all
under a v5e's 15.75 GiB. On the chip's host (13 cores, not shared) expect about half those compile
times, plus ~15 s of process start and initialization per run and ~5 s of steps: dense case
~110 s for both variants, hybrid case ~200-300 s; the main set ~5-7 minutes, not 4. With
``--in-process`` the four compiles overlap on the host's cores: the main set ~4 minutes (bounded by
the plain hybrid's compile, ~200 s), at the price of clean per-variant device peaks.

``--tpu-compile v5e`` (no chip; libtpu installed, ``JAX_PLATFORMS=cpu``): the cases' train steps
compiled for a compile-only v5e device, with compile seconds and ``memory_analysis`` (the numbers
above); with ``--dry-run``, the tiny models.

Checks (exit status 1 on a failure): per case and peer, its first-step loss and stellax's (same
initial weights, same batch: the forward before any update) within 2 %, and their final losses
within 1 %.

``--dry-run``: the tiny models on the CPU, stellax dispatching as on a v5e
(`stellax.lowering_target`) with its Pallas kernels interpreted, every run in one process (the test
suite runs it with a few steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from stellax.bench import chip_run
from stellax.bench.chip_run import elapsed, environment
from stellax.bench.model_zoo import LOSSES, DenseConfig, HybridConfig, init_params, learnable_batch

#: Peak dense bf16 FLOP/s by device kind; the dry run reports against a v5e's.
BF16_PEAK = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12,
             "TPU7x": 2307e12}
V5E_PEAK = 197e12
#: Relative loss difference allowed between the variants on the same weights and batch (bf16 activations).
LOSS_RTOL = 2e-2
#: Relative difference allowed between the variants' final losses after training (the convergence check).
CONVERGENCE_RTOL = 1e-2

CHIP = {"dense": DenseConfig(vocab=32000, d_model=1536, layers=16, heads=16, kv_heads=4, head_dim=128, hidden=4096),
        "hybrid": HybridConfig(vocab=32000, d_model=1024, groups=2, heads=8, kv_heads=2, head_dim=128, gdn_heads=8,
                               gdn_head_dim=128, experts=64, top_k=8, expert_hidden=256, shared_hidden=512)}
TINY = {"dense": DenseConfig(vocab=256, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, hidden=128,
                             rope_theta=10000.0),
        "hybrid": HybridConfig(vocab=256, d_model=64, groups=1, heads=4, kv_heads=2, head_dim=16, gdn_heads=2,
                               gdn_head_dim=32, experts=8, top_k=2, expert_hidden=32, shared_hidden=64,
                               rope_theta=10000.0)}
#: Seconds past --budget that a started run may take before it is killed.
GRACE_S = 150.0
MAIN_CASES = "dense:4096:2,hybrid:4096:2"
ALL_CASES = "dense:4096:2,hybrid:4096:2,dense:16384:1,hybrid:32768:1"
DRY_CASES = "dense:32:2,hybrid:64:2"
VARIANTS = ("stellax", "jax", "tokamax")
#: The peers, each compared with ``stellax`` (loss agreement, convergence, tokens/s ratio).
PEERS = ("jax", "tokamax")


def unavailable(variant: str) -> str | None:
    """Why ``variant`` cannot run here (its optional peer library does not import), else None."""
    if variant != "tokamax":
        return None
    try:
        from stellax.core import tokamax_peer

        tokamax_peer.load()
    except Exception as e:  # noqa: BLE001 - tokamax itself or one of its dependencies
        return f"tokamax does not import (optional peer: pip install tokamax): {type(e).__name__}: {e}"
    return None


def parse_args(argv=None, prog: str | None = None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="tiny models on the CPU, interpreted kernels")
    p.add_argument("--cases", default="", help=f"comma-separated family:seq:batch (default {MAIN_CASES}; "
                   f"all: {ALL_CASES}; dry run {DRY_CASES})")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default all; tokamax is skipped where it "
                        "does not import)")
    p.add_argument("--reps", type=int, default=None, help="timed steps (default 5, dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 1)")
    p.add_argument("--steps", type=int, default=None, help="steps in all (default 1 + warmup + reps; "
                   "200: the convergence check)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--remat", choices=("full", "none"), default=None,
                   help="jax.checkpoint per block (default full; none in the dry run)")
    p.add_argument("--budget", type=float, default=400.0,
                   help="seconds; no new run starts past it, a run still going 150 s past it is killed")
    p.add_argument("--in-process", action="store_true", help="no subprocess per run (peak HBM then cumulative)")
    p.add_argument("--tpu-compile", default=None, metavar="GEN",
                   help="compile the cases' train steps for a GEN chip (v5e, v6e, ...) with libtpu, run nothing")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # "family:seq:batch:variant", internal
    args = p.parse_args(argv)
    if args.remat is None and args.tpu_compile:
        args.remat = "full"       # compiled for the chip: the chip's program
    if args.remat is None:
        # Interpreted Mosaic kernels run through io_callback, whose effects jax.checkpoint cannot partial-eval.
        args.remat = "none" if args.dry_run else "full"
    args.reps = args.reps if args.reps is not None else (2 if args.dry_run else 5)
    args.warmup = args.warmup if args.warmup is not None else 1
    if args.steps is None:
        args.steps = 1 + args.warmup + args.reps
    if args.steps < 2 + args.warmup:
        raise SystemExit(f"--steps: need at least 2 + warmup = {2 + args.warmup} steps, got {args.steps}")
    return args


def parse_cases(text: str, models: dict) -> list[tuple[str, int, int]]:
    """``"family:seq:batch,..."`` -> ``[(family, seq, batch), ...]``, each family one of ``models``."""
    cases = []
    for item in (c for c in text.split(",") if c):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in models or not all(v.isdigit() for v in parts[1:]):
            raise SystemExit(f"--cases: expected family:seq:batch with family in {sorted(models)}, got {item!r}")
        cases.append((parts[0], int(parts[1]), int(parts[2])))
    return cases


def make_optimizer(lr: float = 3e-4):
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.1))


def make_step(loss_fn, tx):
    import optax

    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


# -- measuring ----------------------------------------------------------------------------------
def compiled_bytes(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def device_peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
        return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
    except Exception:  # noqa: BLE001
        return None


class OpObserver:
    """The first implementation stellax picked for each op called while active (`observe_calls`)."""

    def __init__(self):
        self.seen: dict[str, str] = {}

    def __call__(self, op, implementation, call, config):
        self.seen.setdefault(getattr(op, "name", str(op)), getattr(implementation, "name", str(implementation)))


def compile_variant(cfg, variant: str, seq: int, batch: int, *, remat: str, lr: float = 3e-4):
    """The train step of ``variant`` lowered from abstract inputs (no device memory) and compiled:
    ``(compiled, seconds, {op: implementation})``. Safe to run in a thread: `Run` compiles every run
    at once that way in one process (``--in-process``; each thread in a copy of the caller's context,
    so `stellax.lowering_target` and interpret mode hold there too)."""
    from stellax.core.selection import observe_calls

    tx = make_optimizer(lr)
    params = jax.eval_shape(lambda: init_params(cfg, 0))
    opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq), jax.numpy.int32)
    step = make_step(functools.partial(LOSSES[variant], cfg, remat), tx)
    seen = OpObserver()
    t0 = time.perf_counter()
    with observe_calls(seen):
        compiled = step.lower(params, opt_state, tokens, tokens).compile()
    return compiled, time.perf_counter() - t0, dict(sorted(seen.seen.items()))


def run_variant(cfg, variant: str, seq: int, batch: int, *, steps: int, warmup: int, remat: str,
                lr: float = 3e-4, seed: int = 0, compiled=None) -> dict:
    """Train one variant ``steps`` steps on the learnable stream (compiling it first unless
    ``compiled``, a `compile_variant` result, is given); returns the measured fields of its row
    (``ms``: median of the steps after the first ``1 + warmup``; ``compile_s``: compile + first step)."""
    step, compile_s, ops = compiled or compile_variant(cfg, variant, seq, batch, remat=remat, lr=lr)
    tx = make_optimizer(lr)
    params = init_params(cfg, seed)
    opt_state = jax.jit(tx.init)(params)
    tokens, labels = jax.jit(learnable_batch, static_argnums=(0, 1, 2, 3, 4))(cfg, seed, 0, steps * batch, seq)
    tokens, labels = tokens.reshape(steps, batch, seq), labels.reshape(steps, batch, seq)
    est = compiled_bytes(step)
    losses, times = [], []
    for i in range(steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, tokens[i], labels[i])
        losses.append(jax.block_until_ready(loss))
        times.append((time.perf_counter() - t) * 1e3)
    losses = [float(x) for x in losses]
    timed = times[1 + warmup:]
    peak = device_peak_bytes()
    del params, opt_state
    tail = max(1, steps // 10)
    return {"ms": float(np.median(timed)), "loss_first": losses[0], "loss_last": losses[-1],
            "loss_final": float(np.mean(losses[-tail:])), "losses": [round(x, 5) for x in losses],
            "steps": steps, "compile_s": round(compile_s + times[0] * 1e-3, 2), "compiled_bytes": est,
            "peak_hbm_bytes": peak if peak is not None else est,
            "peak_hbm_source": "memory_stats" if peak is not None else "memory_analysis",
            "stellax_ops": ops, "step_ms_all": [round(x, 3) for x in timed]}


def case_name(family: str, seq: int, batch: int) -> str:
    return f"{family} seq={seq} batch={batch}"


class Run:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.models = TINY if self.dry else CHIP
        self.cases = parse_cases(args.cases or (DRY_CASES if self.dry else MAIN_CASES), self.models)
        self.variants = [v for v in args.variants.split(",") if v]
        unknown = set(self.variants) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; expected a subset of {VARIANTS}")
        self.env = environment(self.dry)
        self.device = self.env["device_kind"]
        self.peak = V5E_PEAK if self.dry else BF16_PEAK.get(self.device)
        self.date = datetime.date.today().isoformat()
        self.rows: list[dict] = []
        self.agreement: list[dict] = []
        self.convergence: list[dict] = []
        self.out = Path(args.out)
        self.isolate = not (args.in_process or self.dry or self.env["platform"] == "cpu")
        self.compiling: dict = {}

    def save(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        models = {f: dict(dataclasses.asdict(c), family=f, params=c.total_params(), active_params=c.matmul_params())
                  for f, c in self.models.items() if any(case[0] == f for case in self.cases)}
        doc = {"format": "stellax-model-step", "version": 3, "environment": self.env, "models": models,
               "precision": "mixed: float32 params and AdamW moments, bfloat16 activations",
               "optimizer": f"clip_by_global_norm(1.0) + adamw({self.args.lr:g}, b1=0.9, b2=0.95, wd=0.1)",
               "remat": self.args.remat, "seconds": round(elapsed(), 1), "rows": self.rows,
               "loss_agreement": self.agreement, "convergence": self.convergence}
        self.out.write_text(json.dumps(doc, indent=1))

    def row(self, family, seq, batch, variant, measured: dict | None, error: str | None = None) -> dict:
        c = self.models[family]
        flops = c.flops_per_step(batch, seq)
        r = {"op": "model_train", "case": case_name(family, seq, batch), "pass": "fwd+bwd",
             "contender": variant, "default": variant == "stellax", "peer": variant != "stellax",
             "ms": None, "tflops": None, "pct_peak": None, "bound": "compute", "peak_hbm_bytes": None,
             "tokens_per_s": None, "mfu": None, "device": self.device, "date": self.date, "skipped": None,
             "error": error, "family": family, "batch": batch, "seq": seq, "params": c.total_params(),
             "active_params": c.matmul_params(), "flops_per_step": flops, "remat": self.args.remat}
        if measured:
            r.update(measured)
            s = measured["ms"] * 1e-3
            r["tflops"] = flops / s / 1e12
            r["tokens_per_s"] = batch * seq / s
            if self.peak:
                r["mfu"] = flops / s / self.peak
                r["pct_peak"] = 100.0 * r["mfu"]
        self.rows.append(r)
        if error:
            print(f"  {variant:8s} ERROR {error[:300]}", flush=True)
        elif measured:
            hbm = r["peak_hbm_bytes"]
            print(f"  {variant:8s} {r['ms']:10.2f} ms  {r['tokens_per_s']:10.0f} tok/s  {r['tflops']:7.2f} TFLOP/s  "
                  f"MFU {100 * (r['mfu'] or 0):5.1f}%  peak HBM {(hbm or 0) / 2**30:6.2f} GiB  "
                  f"loss {r['loss_first']:.4f} -> {r['loss_final']:.4f} ({r['steps']} steps, first call "
                  f"{r['compile_s']:.1f} s)  ops {r['stellax_ops']}", flush=True)
        return r

    def compile_all(self):
        """In process: every (case, variant) compiled at once, a thread each (XLA and Mosaic compile
        off the GIL), each in a copy of this context; ``{(family, seq, batch, variant): future}``."""
        import concurrent.futures
        import contextvars

        runs = [(f, s, b, v) for f, s, b in self.cases for v in self.variants if not unavailable(v)]
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(runs))
        self.compiling = {r: pool.submit(contextvars.copy_context().run, compile_variant, self.models[r[0]], r[3],
                                         r[1], r[2], remat=self.args.remat, lr=self.args.lr) for r in runs}
        pool.shutdown(wait=False)

    def measure(self, family, seq, batch, variant):
        why = unavailable(variant)
        if why:
            print(f"  {variant:8s} skipped: {why}", flush=True)
            r = self.row(family, seq, batch, variant, None)
            r["skipped"] = why
            return r
        if self.isolate:
            return self.measure_child(family, seq, batch, variant)
        try:
            future = self.compiling.get((family, seq, batch, variant))
            m = run_variant(self.models[family], variant, seq, batch, steps=self.args.steps,
                            warmup=self.args.warmup, remat=self.args.remat, lr=self.args.lr,
                            compiled=None if future is None else future.result())
            if self.rows and m["peak_hbm_source"] == "memory_stats":
                m["peak_hbm_source"] = "memory_stats: the process's peak so far (in process, earlier runs included)"
            return self.row(family, seq, batch, variant, m)
        except Exception as e:  # noqa: BLE001 - a variant that does not fit or compile is a row
            return self.row(family, seq, batch, variant, None,
                            error=f"{type(e).__name__}: {e}".replace("\n", " ")[:600])

    def measure_child(self, family, seq, batch, variant):
        """The run in a fresh process, so the device's peak memory is this run's own."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "child.json"
            argv = [sys.executable, "-m", "stellax.bench.model_train", "--out", str(out),
                    "--child", f"{family}:{seq}:{batch}:{variant}", "--reps", str(self.args.reps),
                    "--warmup", str(self.args.warmup), "--steps", str(self.args.steps), "--remat", self.args.remat,
                    "--lr", str(self.args.lr)]
            left = max(30.0, self.args.budget + GRACE_S - elapsed())
            try:
                proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=left)
                tail = (proc.stdout + proc.stderr)[-600:].replace("\n", " ")
            except subprocess.TimeoutExpired:
                return self.row(family, seq, batch, variant, None, error=f"timed out after {left:.0f} s")
            if proc.returncode != 0 or not out.exists():
                return self.row(family, seq, batch, variant, None, error=f"child exited {proc.returncode}: {tail}")
            doc = json.loads(out.read_text())
        if doc.get("error"):
            return self.row(family, seq, batch, variant, None, error=doc["error"])
        return self.row(family, seq, batch, variant, doc["measured"])

    def main(self):
        print(f"model train step on {self.device} ({'dry run, interpreted' if self.dry else 'native'}): cases "
              f"{self.cases}, variants {self.variants}, {self.args.steps} steps (warmup {self.args.warmup}), "
              f"remat {self.args.remat}, {'a process per run' if self.isolate else 'in process'}", flush=True)
        for f, c in self.models.items():
            print(f"  {f}: {c.total_params() / 1e6:.1f}M params, {c.matmul_params() / 1e6:.1f}M active in matmuls",
                  flush=True)
        if not self.isolate:
            self.compile_all()
        for family, seq, batch in self.cases:
            flops = self.models[family].flops_per_step(batch, seq)
            print(f"== {case_name(family, seq, batch)} ({flops / 1e12:.2f} TFLOP per step)", flush=True)
            for variant in self.variants:
                if elapsed() > self.args.budget:
                    print(f"budget of {self.args.budget:.0f} s spent: {variant} {family} seq {seq} not run", flush=True)
                    self.row(family, seq, batch, variant, None)["skipped"] = "budget"
                    continue
                self.measure(family, seq, batch, variant)
                self.save()
        self.compare()
        self.save()
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        bad = [a for a in self.agreement + self.convergence if not a["ok"]]
        return 1 if bad else 0

    def compare(self):
        """Per case and peer that ran: the first step's loss against stellax's (same init, same
        batch; `LOSS_RTOL`) and the final loss after training (the convergence check,
        ``CONVERGENCE_RTOL``)."""
        for case in dict.fromkeys(r["case"] for r in self.rows):
            got = {r["contender"]: r for r in self.rows if r["case"] == case and r.get("loss_first") is not None}
            s = got.get("stellax")
            for peer in PEERS:
                j = got.get(peer)
                if s is None or j is None:
                    continue
                d = abs(s["loss_first"] - j["loss_first"]) / abs(j["loss_first"])
                self.agreement.append({"case": case, "peer": peer, "stellax": s["loss_first"], "peer_loss": j["loss_first"],
                                       "rel_diff": d, "ok": d <= LOSS_RTOL, "what": "first train step"})
                d = abs(s["loss_final"] - j["loss_final"]) / abs(j["loss_final"])
                self.convergence.append({"case": case, "peer": peer, "steps": s["steps"], "stellax": s["loss_final"],
                                         "peer_loss": j["loss_final"], "loss_first": j["loss_first"], "rel_diff": d,
                                         "ok": d <= CONVERGENCE_RTOL})
                print(f"  convergence {case}: {s['steps']} steps, final loss stellax {s['loss_final']:.4f} {peer} "
                      f"{j['loss_final']:.4f} (from {j['loss_first']:.4f}), rel diff {d:.2e} "
                      f"({'ok' if d <= CONVERGENCE_RTOL else 'MISMATCH'})", flush=True)


def child(args) -> int:
    family, seq, batch, variant = args.child.split(":")
    doc = {}
    try:
        doc["measured"] = run_variant(CHIP[family], variant, int(seq), int(batch), steps=args.steps,
                                      warmup=args.warmup, remat=args.remat, lr=args.lr)
    except Exception as e:  # noqa: BLE001 - reported by the parent as an error row
        doc["error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:600]
    Path(args.out).write_text(json.dumps(doc))
    return 0


def summary(rows):
    print("\nsummary (step ms, tokens/s, MFU; x = stellax tokens/s over the peer's)", flush=True)
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["contender"]: r for r in rows if r["case"] == case}
        cells = []
        for v in VARIANTS:
            r = by.get(v)
            if r is None:
                continue
            cells.append(f"{v} " + (f"{r['ms']:.1f} ms {r['tokens_per_s']:.0f} tok/s {100 * (r['mfu'] or 0):.1f}%"
                                    if r.get("ms") else (r.get("skipped") or "error")))
        s = by.get("stellax")
        for peer in PEERS:
            j = by.get(peer)
            if s and j and s.get("ms") and j.get("ms"):
                cells.append(f"x {j['ms'] / s['ms']:.2f} vs {peer}")
        print(f"  {case}: " + ", ".join(cells), flush=True)


def compile_for_tpu(cfg, variant: str, seq: int, batch: int, *, remat: str, generation: str) -> dict:
    """The train step of ``variant`` compiled by libtpu for a compile-only ``generation`` device (no
    chip needed): ``{"compile_s", "compiled_bytes", "argument_bytes", "temp_bytes", "stellax_ops",
    "error"}``; the compiler's verdict (an out-of-memory or lowering error) is reported, not raised."""
    import stellax
    from stellax.core.selection import observe_calls
    from stellax.testing.tpu_compile import topology_device

    sharding = jax.sharding.SingleDeviceSharding(topology_device(generation))
    on_device = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    tx = make_optimizer()
    params = on_device(jax.eval_shape(lambda: init_params(cfg, 0)))
    opt_state = on_device(jax.eval_shape(tx.init, params))
    tokens = jax.ShapeDtypeStruct((batch, seq), jax.numpy.int32, sharding=sharding)
    step = make_step(functools.partial(LOSSES[variant], cfg, remat), tx)
    seen, out = OpObserver(), {"error": None}
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)   # a compile-only device's entry cannot be loaded back
    t0 = time.perf_counter()
    try:
        with stellax.lowering_target(generation), observe_calls(seen):
            compiled = step.lower(params, opt_state, tokens, tokens).compile()
        m = compiled.memory_analysis()
        out.update(compiled_bytes=compiled_bytes(compiled), argument_bytes=int(m.argument_size_in_bytes),
                   temp_bytes=int(m.temp_size_in_bytes))
    except Exception as e:  # noqa: BLE001 - the compiler's verdict is the result
        out["error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:600]
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    out.update(compile_s=round(time.perf_counter() - t0, 1), stellax_ops=dict(sorted(seen.seen.items())))
    return out


def tpu_compile_main(args) -> int:
    """``--tpu-compile GEN``: every (case, variant) train step compiled for a ``GEN`` chip on this
    machine (libtpu, ``JAX_PLATFORMS=cpu``), written as ``{"format": "stellax-model-compile",
    "generation", "compiled": [...]}``; exit status 1 if one failed."""
    models = TINY if args.dry_run else CHIP
    cases = parse_cases(args.cases or (DRY_CASES if args.dry_run else MAIN_CASES), models)
    results = []
    for family, seq, batch in cases:
        for variant in (v for v in args.variants.split(",") if v):
            why = unavailable(variant)
            if why:
                print(f"  {variant}: skipped, {why}", flush=True)
                continue
            r = {"case": case_name(family, seq, batch), "family": family, "contender": variant,
                 **compile_for_tpu(models[family], variant, seq, batch, remat=args.remat, generation=args.tpu_compile)}
            results.append(r)
            print(f"  {r['case']} {variant:8s} " + (f"ERROR {r['error'][:300]}" if r["error"] else
                  f"compiled in {r['compile_s']:.1f} s, {r['compiled_bytes'] / 2**30:.2f} GiB (arguments "
                  f"{r['argument_bytes'] / 2**30:.2f}, temporaries {r['temp_bytes'] / 2**30:.2f})  ops {r['stellax_ops']}"),
                  flush=True)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"format": "stellax-model-compile", "version": 1, "generation": args.tpu_compile,
                                       "remat": args.remat, "environment": environment(args.dry_run),
                                       "compiled": results}, indent=1))
    return 1 if any(r["error"] for r in results) else 0


def main(argv=None, prog: str | None = None) -> int:
    """The command line (module docstring); ``prog`` names it in help and errors."""
    args = parse_args(argv, prog)
    if args.child:
        return child(args)
    if args.tpu_compile:
        return tpu_compile_main(args)
    # A dry run dispatches as on a v5e (implementation=None picks the TPU kernels), interpreted on the CPU.
    return chip_run.run(Run, args, target="v5e")


if __name__ == "__main__":
    sys.exit(main())
