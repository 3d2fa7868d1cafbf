"""linear_cross_entropy on a TPU: stellax's Mosaic kernels against XLA, forward and forward+backward.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/loss_tpu.py --out $OUT/loss_tpu.json

Cases (issue 40): a language-model head in bfloat16, ``x [T, D]``, weights
``[V, D]`` (a Hugging Face ``lm_head.weight``, ``transpose_w=True``), a tenth of
the labels ``ignore_index``, the mean loss: (T, D, V) = (8192, 4096, 131072)
first, then (32768, 4096, 131072), (8192, 4096, 262144) and (32768, 4096,
262144) while the budget lasts. For each case and each pass (``fwd``: the
loss; ``fwd+bwd``: the loss and its gradients for x and w by
``jax.value_and_grad``), on the same data, in this order:

* ``xla:full_logits``: the formula as everyone writes it in ``jnp``: bf16
  logits matmul with float32 output, ``log_softmax``, the label's term, the
  masked mean, jitted, its gradients by JAX's autodiff. It materializes the
  ``[T, V]`` float32 logits (4 GiB at T=8192, V=131072), so past the first case
  it does not fit a 16 GiB v5e: the row then carries the compiler's or the
  runtime's error;
* ``stellax:xla_chunked``: the op's memory-linear XLA path (its heuristic chunks);
* ``stellax:mosaic_tpu``: `stellax.linear_cross_entropy` with
  ``implementation="mosaic_tpu"`` and the config stellax picks by itself
  (``config`` ``default``; the row's ``default`` is true when
  ``implementation=None`` would run the kernel too). Its ``fwd+bwd`` is the
  fused training sweep (a mean loss under differentiation: three matmuls,
  each logits tile computed once and kept in HBM per chunk of tokens;
  `stellax.ops.loss.mosaic_tpu`); then, ``fwd+bwd`` only, the kernels'
  recompute path on the same data (``config`` ``recompute``: the per-token
  losses, ``reduction="none"``, averaged outside, so the backward op runs,
  five matmuls: the path every mean loss took before the fused sweep); then
  explicit `LossTpuConfig` tiles (``--configs``; the forward and the backward
  op both take the explicit tiles and token chunk);
* ``tokamax:mosaic_tpu``: tokamax's Mosaic TPU loss
  (``linear_softmax_cross_entropy_loss``, mean), the peer issue 40 names.
  It takes weights ``[D, V]`` (transposed once, outside the timed program)
  and has no ``ignore_index`` (the ignored labels are read as 0), so its
  loss and gradients are not compared (``loss_rel_err`` None); a row with
  ``skipped`` when tokamax is not installed, and in the dry run.

Timing: each contender is compiled ahead of time (``compile_s``), run once,
then timed ``--reps`` times (``block_until_ready`` after each call; median
reported) after ``--warmup`` runs. ``tflops`` counts the same matmul work for
every contender of a case (``2·T·D·V`` forward, three times that forward and
backward: logits, dx, dw; the recompute path's recomputed logits are its own
overhead); ``pct_peak`` is that against the chip's bfloat16 peak (197 TFLOP/s
on a v5e); ``vs_xla`` is the full-logits XLA time over the row's.

Memory: ``temp_mib`` is the compiled program's temporaries and ``program_mib``
arguments + outputs + temporaries (``compiled.memory_analysis()``, no aliasing
counted), the HBM the program needs; ``device_peak_mib`` is the device's
``peak_bytes_in_use`` after the row (``memory_stats()``; a high-water mark of
the whole process, so it only rises: it bounds the row's peak from above and
is exact for the first row that raises it).

Errors: every row's loss and gradients are compared with the case's first
contender that ran (``xla:full_logits``, else ``stellax:xla_chunked``):
``loss_rel_err`` (relative error of the mean loss), ``rel_l2`` (the larger
relative L2 error of dx and dw; ``fwd+bwd`` only); ``reference`` names it.

The JSON (``--out``) holds ``{"format": "stellax-loss-tpu", "version": 1,
"environment": {...}, "rows": [ROW, ...]}`` with rows in the suite's results
schema (benchmarks/README.md: op, case, pass, contender, default, peer, ms,
tflops, pct_peak, bound, device, date, skipped, error) plus ``config``,
``vs_xla``, ``loss_rel_err``, ``rel_l2``, ``reference``, ``temp_mib``,
``program_mib``, ``device_peak_mib``, ``compile_s`` and ``model_ms`` (the fused
sweep's roofline time, `stellax.ops.loss.base.fused_sweep_cost` at the
chip's peak and HBM bandwidth: its ``fwd+bwd`` Mosaic rows only; 134 ms for
the first case on a v5e). It is rewritten after
every row, so a run cut short keeps what it measured. ``--budget`` seconds
(default 190): no new contender starts past it (skipped rows say so). The
first case is 17 compiles and timings (8 forward, 9 forward + backward):
12 took 90-120 s on a v5e host, so give it ``--budget 300`` to see them all.

``--dry-run`` runs the same code path on the CPU on a tiny ragged case (T=40,
V=300) with the Mosaic kernels interpreted (the test suite runs it so the
script cannot rot).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
import numpy as np
from stellax.bench.chip_run import ChipRun, elapsed, time_fn

#: bfloat16 MXU peak (TFLOP/s) by device kind; the dry run reports against a v5e's.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0, "TPU7x": 2307.0}
V5E_TFLOPS = 197.0
#: HBM bandwidth (GB/s) by device kind, for the fused sweep's roofline model (``model_ms``).
HBM_GBPS = {"TPU v5 lite": 819.0, "TPU v5e": 819.0, "TPU v5": 2765.0, "TPU v6 lite": 1640.0, "TPU7x": 7370.0}
V5E_GBPS = 819.0
MIB = 2**20
IGNORED = 0.1

#: (T, D, V): issue 40's headline case first.
CASES = [(8192, 4096, 131072), (32768, 4096, 131072), (8192, 4096, 262144), (32768, 4096, 262144)]
DRY_CASES = [(40, 128, 300)]
#: Explicit (block_t, block_v[, chunk_t]) tried after the default config (512x512, chunks of 2048).
CONFIGS = "1024x512,512x1024,512x512x4096,512x512x1024"
DRY_CONFIGS = "16x128x16"


#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 5), (0, 1)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=190.0, stops="contender",
                        dry="a tiny case", passes=True)
    p.add_argument("--configs", default=None,
                   help=f"explicit mosaic_tpu tiles BTxBV or BTxBVxCHUNK (tokens per chunk of the fused sweep), "
                        f"comma-separated (default {CONFIGS}; '' for none)")
    return p.parse_args(argv)


# -- inputs, contenders ----------------------------------------------------------------------
def make_inputs(seed: int, tokens: int, features: int, vocab: int, dtype):
    """``(x [T, D], w [V, D], labels [T])`` made on the device, logits of order 1, a tenth ignored."""
    kx, kw, ky, ki = jax.random.split(jax.random.PRNGKey(seed), 4)

    @jax.jit
    def build(kx, kw, ky, ki):
        x = jax.random.normal(kx, (tokens, features), dtype)
        w = (jax.random.normal(kw, (vocab, features), jnp.float32) * (2.0 / math.sqrt(features))).astype(dtype)
        labels = jax.random.randint(ky, (tokens,), 0, vocab, jnp.int32)
        labels = jnp.where(jax.random.uniform(ki, (tokens,)) < IGNORED, -100, labels)
        return x, w, labels

    return jax.block_until_ready(build(kx, kw, ky, ki))


def xla_full_logits(x, w, labels):
    """The mean cross-entropy from the full ``[T, V]`` float32 logits (``jnp``, as everyone writes it)."""
    logits = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = labels != -100
    nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def stellax_loss(implementation, x, w, labels):
    import stellax

    return stellax.linear_cross_entropy(x, w, labels, transpose_w=True, implementation=implementation)


def stellax_recompute_loss(x, w, labels):
    """The mean loss from stellax's per-token losses (``reduction="none"``): a per-token cotangent,
    so the Mosaic backward op recomputes the logits (the path before the fused sweep)."""
    import stellax

    per_token = stellax.linear_cross_entropy(x, w, labels, transpose_w=True, reduction="none",
                                             implementation="mosaic_tpu")
    return jnp.sum(per_token) / jnp.maximum(jnp.sum(labels != -100), 1)


def tokamax_loss(x, w_dv, labels):
    """tokamax's Mosaic TPU loss (weights ``[D, V]``, no ``ignore_index``: ignored labels read as 0)."""
    from stellax.core import tokamax_peer

    tokamax = tokamax_peer.load()     # absl flags marked parsed: this script's --out would fail tokamax's parse
    labels = jnp.where(labels == -100, 0, labels)
    return tokamax.linear_softmax_cross_entropy_loss(x, labels, w_dv, reduction="mean", implementation="mosaic_tpu")


def tokamax_args(args):
    """tokamax's operands: the weights transposed to ``[D, V]`` once, outside the timed program."""
    x, w, labels = args
    return x, jax.block_until_ready(jnp.asarray(w.T)), labels


def parse_configs(text: str):
    from stellax.ops.loss import LossTpuConfig

    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        sizes = [int(n) for n in item.lower().split("x")]
        if len(sizes) not in (2, 3):
            raise ValueError(f"--configs: expected BTxBV or BTxBVxCHUNK, got {item!r}")
        out.append(LossTpuConfig(**dict(zip(("block_t", "block_v", "chunk_t"), sizes))))
    return out


def config_label(config) -> str:
    from stellax.ops.loss import LossTpuConfig

    label = f"block_t={config.block_t},block_v={config.block_v}"
    return label if config.chunk_t == LossTpuConfig.chunk_t else f"{label},chunk_t={config.chunk_t}"


def contenders(configs, kind: str):
    """``(contender, config label, loss function, config or None, peer)`` in run order for pass ``kind``."""
    mosaic = functools.partial(stellax_loss, "mosaic_tpu")
    out = [("xla:full_logits", "-", xla_full_logits, None, True),
           ("stellax:xla_chunked", "default", functools.partial(stellax_loss, "xla_chunked"), None, False),
           ("stellax:mosaic_tpu", "default", mosaic, None, False)]
    if kind == "fwd+bwd":
        out.append(("stellax:mosaic_tpu", "recompute", stellax_recompute_loss, None, False))
    out += [("stellax:mosaic_tpu", config_label(config), mosaic, config, False) for config in configs]
    out.append(("tokamax:mosaic_tpu", "-", tokamax_loss, None, True))
    return out


def program(loss, kind: str):
    return loss if kind == "fwd" else jax.value_and_grad(loss, argnums=(0, 1))


def configured(config):
    """Both loss ops on ``config`` (the backward op, called from the forward's VJP, would take its heuristic)."""
    import stellax

    if config is None:
        return contextlib.nullcontext()
    return stellax.use_configs({("linear_cross_entropy", "mosaic_tpu"): config,
                                ("linear_cross_entropy_backward", "mosaic_tpu"): config})


# -- measuring --------------------------------------------------------------------------------
@jax.jit
def _rel_l2(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)


def errors(out, ref, kind: str):
    """``(loss_rel_err, rel_l2 of the gradients or None)`` against the reference's outputs."""
    loss, ref_loss = (out, ref) if kind == "fwd" else (out[0], ref[0])
    loss_err = abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30)
    if kind == "fwd":
        return loss_err, None
    grads = [float(_rel_l2(g, r)) for g, r in zip(out[1], ref[1])]
    return loss_err, (max(grads) if all(np.isfinite(grads)) else math.inf)


def memory(compiled) -> tuple[float | None, float | None]:
    """``(temporaries, arguments + outputs + temporaries)`` in MiB from the compiled program."""
    try:
        m = compiled.memory_analysis()
        temp = m.temp_size_in_bytes
        return temp / MIB, (m.argument_size_in_bytes + m.output_size_in_bytes + temp) / MIB
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None, None


def device_peak() -> float | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        return None
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / MIB


class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-loss-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)
        self.bandwidth = V5E_GBPS if self.dry else HBM_GBPS.get(self.device)
        text = args.configs if args.configs is not None else (DRY_CONFIGS if self.dry else CONFIGS)
        self.configs = parse_configs(text)

    def model_ms(self, kind, label, config, tokens, features, vocab) -> float | None:
        """The fused sweep's roofline time (`base.fused_sweep_cost` at the chip's peak and HBM
        bandwidth, the sum of its three kernels) for a ``fwd+bwd`` Mosaic row that runs it."""
        if kind != "fwd+bwd" or label == "recompute" or self.peak is None or self.bandwidth is None:
            return None
        import stellax
        from stellax.ops.loss import LossTpuConfig, linear_cross_entropy_op
        from stellax.ops.loss.base import fused_sweep_cost

        with contextlib.ExitStack() as stack:
            if self.dry:  # on a CPU, size the dw slices as for the v5e the figures stand for
                stack.enter_context(stellax.lowering_target("v5e"))
            if config is None:
                x = jax.ShapeDtypeStruct((tokens, features), jnp.bfloat16)
                call = linear_cross_entropy_op.check(x, jax.ShapeDtypeStruct((vocab, features), jnp.bfloat16),
                                                     jax.ShapeDtypeStruct((tokens,), jnp.int32), transpose_w=True)
                config = linear_cross_entropy_op.implementations["mosaic_tpu"].default_config(call)
            assert isinstance(config, LossTpuConfig)
            costs = fused_sweep_cost(tokens, features, vocab, 2, config)
        return 1e3 * sum(k.seconds(self.peak * 1e12, self.bandwidth * 1e9) for k in costs)

    def row(self, case, kind, contender, config, *, default, peer, flops, ms=None, errs=(None, None),
            reference=None, mem=(None, None), compile_s=None, error=None, skipped=None, model_ms=None):
        tflops = None if ms is None or not ms == ms else flops / (ms * 1e-3) / 1e12
        pct = None if tflops is None or self.peak is None else 100.0 * tflops / self.peak
        xla = ms if contender == "xla:full_logits" else next(
            (r["ms"] for r in self.rows if r["case"] == case and r["pass"] == kind
             and r["contender"] == "xla:full_logits" and r["ms"] is not None), None)
        r = {"op": "linear_cross_entropy", "case": case, "pass": kind, "contender": contender, "config": config,
             "default": default, "peer": peer, "ms": ms, "tflops": tflops, "pct_peak": pct, "bound": "compute",
             "vs_xla": None if xla is None or ms is None else xla / ms, "loss_rel_err": errs[0],
             "rel_l2": errs[1], "reference": reference, "temp_mib": mem[0], "program_mib": mem[1],
             "device_peak_mib": device_peak(), "compile_s": compile_s, "model_ms": model_ms, "device": self.device,
             "date": self.date, "skipped": skipped, "error": error}
        self.rows.append(r)
        self.save()
        label = f"  {kind:7s} {contender:20s} {config:28s}"
        if skipped:
            print(f"{label} skipped: {skipped}", flush=True)
        elif error:
            print(f"{label} ERROR {error[:240]}", flush=True)
        else:
            grads = "" if errs[1] is None else f" grads rel_l2 {errs[1]:.2e}"
            vs = "" if r["vs_xla"] is None else f" {r['vs_xla']:.2f}x xla"
            err = "not compared" if errs[0] is None else f"{errs[0]:.1e}"
            model = "" if model_ms is None else f" (model {model_ms:.1f} ms)"
            print(f"{label} {ms:9.3f} ms{model} {tflops:6.1f} TFLOP/s {pct or 0:5.1f}%{vs} temp {mem[0] or 0:9.1f} "
                  f"MiB program {mem[1] or 0:9.1f} MiB loss rel_err {err}{grads} (compile {compile_s:.1f} s)",
                  flush=True)
        return r

    def measure(self, case, kind, contender, config_label, loss, config, args, flops, *, default, peer, ref,
                compare=True, model_ms=None):
        """One contender: compile, time, compare (unless ``compare`` is false); returns its outputs (or None)."""
        if self.over_budget():
            self.row(case, kind, contender, config_label, default=default, peer=peer, flops=flops,
                     skipped=f"budget of {self.args.budget:.0f} s spent")
            return None
        try:
            with configured(config):
                t0 = time.perf_counter()
                compiled = jax.jit(program(loss, kind)).lower(*args).compile()
                compile_s = time.perf_counter() - t0
            _, ms, out = time_fn(compiled, args, self.reps, self.warmup)
            reference, target = ref if ref is not None else (contender, out)
            errs = errors(out, target, kind) if compare else (None, None)
            reference = reference if compare else None
            self.row(case, kind, contender, config_label, default=default, peer=peer, flops=flops, ms=ms,
                     errs=errs, reference=reference, mem=memory(compiled), compile_s=compile_s, model_ms=model_ms)
            return out
        except Exception as e:  # noqa: BLE001 - a contender that does not compile, fit or run is a row
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")
            self.row(case, kind, contender, config_label, default=default, peer=peer, flops=flops, error=msg[:600])
            return None

    def measure_tokamax(self, case, kind, args, flops):
        """tokamax's Mosaic TPU loss, timed like the others; its loss and gradients are not compared
        (it has no ignore_index, so it computes another mean, and its weight gradient is ``[D, V]``)."""
        contender = "tokamax:mosaic_tpu"
        why = None
        if self.dry:
            why = "dry run: tokamax's kernel is Mosaic TPU only (no interpret mode here)"
        else:
            try:
                from stellax.core import tokamax_peer

                tokamax_peer.load()
            except ImportError as e:  # tokamax itself, or one of its dependencies
                why = f"tokamax does not import (optional peer: pip install tokamax): {e}"
        if why is not None:
            self.row(case, kind, contender, "-", default=False, peer=True, flops=flops, skipped=why)
            return
        self.measure(case, kind, contender, "-", tokamax_loss, None, tokamax_args(args), flops, default=False,
                     peer=True, ref=None, compare=False)

    def default_implementation(self, args) -> str | None:
        if self.dry:  # on a CPU dispatch never picks an interpreted kernel; the dry run stands for a TPU
            return "mosaic_tpu"
        from stellax.ops.loss import linear_cross_entropy_op
        try:
            return linear_cross_entropy_op.select(linear_cross_entropy_op.check(*args, transpose_w=True)).name
        except Exception:  # noqa: BLE001
            return None

    def run_case(self, index, tokens, features, vocab):
        case = f"T={tokens} D={features} V={vocab} bf16 w=[V,D]"
        print(f"== {case}", flush=True)
        args = make_inputs(index, tokens, features, vocab, jnp.bfloat16)
        picked = self.default_implementation(args)
        for kind in self.passes:
            flops = 2.0 * tokens * features * vocab * (1 if kind == "fwd" else 3)
            ref = None
            for contender, label, loss, config, peer in contenders(self.configs, kind):
                impl = contender.split(":", 1)[1]
                default = bool(label == "default" and not peer and picked == impl)
                if contender.startswith("tokamax"):
                    self.measure_tokamax(case, kind, args, flops)
                    continue
                model = (self.model_ms(kind, label, config, tokens, features, vocab)
                         if contender == "stellax:mosaic_tpu" else None)
                out = self.measure(case, kind, contender, label, loss, config, args, flops, default=default,
                                   peer=peer, ref=ref, model_ms=model)
                if ref is None and out is not None:
                    ref = (contender, out)
                del out
            del ref
        del args

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        picked = self.picked_cases(len(cases))
        print(f"linear_cross_entropy on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), "
              f"{len(picked)} cases, reps {self.reps}, warmup {self.warmup}, budget {self.args.budget:.0f} s",
              flush=True)
        self.run_cases(picked, lambda i: self.run_case(i, *cases[i]))
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def summary(rows):
    """Per case and pass: each contender's best time, vs full-logits XLA, and its program memory."""
    print("\nsummary (ms; x = full-logits XLA time / row's; program MiB)", flush=True)
    keys = list(dict.fromkeys((r["case"], r["pass"]) for r in rows))
    for case, kind in keys:
        rs = [r for r in rows if r["case"] == case and r["pass"] == kind and r["ms"] is not None]
        cells = []
        for r in rs:
            vs = "" if r["vs_xla"] is None else f" {r['vs_xla']:.2f}x"
            mem = "" if r["program_mib"] is None else f" {r['program_mib']:.0f} MiB"
            cells.append(f"{r['contender'].split(':')[1]}[{r['config']}] {r['ms']:.2f}{vs}{mem}")
        print(f"  {case} {kind}: " + "; ".join(cells), flush=True)


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
