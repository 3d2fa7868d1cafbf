"""gated_linear_unit on a TPU: stellax's Mosaic kernels against XLA's two matmuls, forward and forward+backward.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/glu_tpu.py --out $OUT/glu_tpu.json

Cases (issue 40), SwiGLU in bfloat16, ``x [M, K]``, weights ``[K, 2, N]``
(gate and up): (M, K, N) = (8192, 4096, 14336) first, then (32768, 4096, 14336)
and (8192, 7168, 18432). For each case and each pass (``fwd``: the output;
``fwd+bwd``: the output and, through ``jax.vjp`` with a random cotangent, the
gradients of x and the weights), on the same data:

* ``xla:jnp``: what a user writes without stellax: ``silu(x @ w_gate) * (x @ w_up)``
  with float32 accumulation, jitted, gradients by JAX's autodiff; the
  reference the other rows' errors are measured against;
* ``stellax:mosaic_tpu``: `stellax.gated_linear_unit` with
  ``implementation="mosaic_tpu"`` and the config stellax picks by itself
  (``config`` ``default(...)``; the row's ``default`` is true when
  ``implementation=None`` would run the kernel too), then explicit
  `GluTpuConfig` tiles ``(block_m, block_n, block_k)`` (``--tiles``): the
  MXU-width tiles measured on 2026-12-05 and wide ones (the forward's static
  schedule is within 1-2 % of its MXU time at a 2048 K step, docs/norm_glu.md).

Timing: each contender is compiled and run once, then timed ``--reps`` times
(``block_until_ready`` after each call; median reported) after ``--warmup``
runs. ``tflops`` counts ``4·M·K·N`` forward (the two projections) and three
times that forward + backward, the same for every contender; ``pct_peak`` is
against the chip's bfloat16 peak (197 TFLOP/s on a v5e); ``vs_xla`` is XLA's
time over the row's. ``max_rel_err`` (``max|out - ref| / max|ref|``) and
``rel_l2`` (the largest relative L2 error of an output) compare with the XLA row.

The JSON (``--out``) holds ``{"format": "stellax-glu-tpu", "version": 1,
"environment": {...}, "rows": [ROW, ...]}`` with rows in the suite's results
schema (benchmarks/README.md) plus ``config``, ``vs_xla``, ``max_rel_err``,
``rel_l2`` and ``compile_s``. It is rewritten after every row; ``--budget``
seconds (default 200) stops starting new contenders.

``--weights pair`` passes the weights as two ``[K, N]`` arrays (made from the
same stacked draw) to every contender: stacked ``[K, 2, N]`` bf16 weights are
tiled ``(2, 128)`` in HBM, so every call relayouts them (forward) and
interleaves the weight gradient back (backward), in XLA's path and stellax's
alike (XLA's cost model in libtpu's v5e compile: 2.1M cycles forward, up to
2.1M + 5.6M more backward at K=4096 N=14336, docs/norm_glu.md); with a pair
neither pays it, so the rows compare the matmuls alone.

``--dry-run`` runs the same code path on the CPU on a tiny ragged case with the
Mosaic kernels interpreted (the test suite runs it so the script cannot rot).
"""

from __future__ import annotations

import math
import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
from stellax.bench.chip_run import ChipRun, elapsed, errors, mark_best, time_fn

#: bfloat16 MXU peak (TFLOP/s) by device kind; the dry run reports against a v5e's.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0, "TPU7x": 2307.0}
V5E_TFLOPS = 197.0

#: (M, K, N): issue 40's headline case first.
CASES = [(8192, 4096, 14336), (32768, 4096, 14336), (8192, 7168, 18432)]
DRY_CASES = [(200, 256, 384)]
#: Explicit (block_m, block_n, block_k) tried after the default config.
TILES = "512x256x256,1024x256x2048,512x1024x2048,1024x1024x1024"
DRY_TILES = "128x128x128"

#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 10), (0, 2)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=200.0, stops="contender",
                        dry="a tiny GLU case", passes=True)
    p.add_argument("--weights", choices=("stacked", "pair"), default="stacked",
                   help="stacked [K, 2, N] weights (default) or a (gate, up) pair of [K, N] arrays")
    p.add_argument("--tiles", default=None,
                   help=f"explicit mosaic_tpu tiles MxNxK, comma-separated (default {TILES}; '' for none)")
    return p.parse_args(argv)


def parse_tiles(text: str):
    from stellax.ops.glu import GluTpuConfig

    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        bm, bn, bk = (int(v) for v in item.lower().split("x"))
        out.append(GluTpuConfig(block_m=bm, block_n=bn, block_k=bk))
    return out


# -- inputs and the contenders ---------------------------------------------------------------
def make_inputs(seed: int, m: int, k: int, n: int, weights: str = "stacked"):
    """``(x [M, K], w, dy [M, N])`` in bfloat16, made on the device (unit-variance outputs); ``w``
    stacked ``[K, 2, N]``, or with ``weights="pair"`` the same values as two ``[K, N]`` arrays."""
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.jit(lambda key: jax.random.normal(key, (m, k), jnp.bfloat16))(kx)
    w = jax.jit(lambda key: (jax.random.normal(key, (k, 2, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16))(kw)
    if weights == "pair":
        w = jax.jit(lambda w: (w[:, 0], w[:, 1]))(w)
    dy = jax.jit(lambda key: jax.random.normal(key, (m, n), jnp.bfloat16))(kd)
    return x, w, dy


def xla_glu(x, w):
    """SwiGLU as written in ``jnp``: two bf16 matmuls accumulating in float32, ``silu(gate) * up``
    (``w``: stacked ``[K, 2, N]`` or a ``(gate, up)`` pair)."""
    w_gate, w_up = w if isinstance(w, tuple) else (w[:, 0], w[:, 1])
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def stellax_glu(x, w, *, config=None):
    import stellax

    table = {} if config is None else {("gated_linear_unit", "mosaic_tpu"): config,
                                       ("gated_linear_unit_backward", "mosaic_tpu"): config}
    with stellax.use_configs(table):
        return stellax.gated_linear_unit(x, w, activation="silu", implementation="mosaic_tpu")


def program(glu, pass_: str):
    """A jitted ``f(x, w, dy)``: the output (``fwd``), or the output and the gradients of x and w (``fwd+bwd``)."""
    if pass_ == "fwd":
        return jax.jit(lambda x, w, dy: glu(x, w))

    def fwd_bwd(x, w, dy):
        out, pullback = jax.vjp(glu, x, w)
        return out, pullback(dy)

    return jax.jit(fwd_bwd)


# -- the run ---------------------------------------------------------------------------------------
class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-glu-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)
        self.tiles = parse_tiles(args.tiles if args.tiles is not None else (DRY_TILES if self.dry else TILES))

    def row(self, case, pass_, contender, config, *, default, flops, **result):
        """One contender's row (`ChipRun.compute_row`; ``result``: its ``ms``, ``xla_ms``, ``errs``,
        ``compile_s``, ``error`` or ``skipped``)."""
        fields = {"op": "gated_linear_unit", "case": case, "pass": pass_, "contender": contender, "config": config,
                  "default": default, "peer": contender == "xla:jnp"}
        return self.compute_row(fields, f"  {pass_:8s} {contender:20s} {config:36s}", flops=flops, peak=self.peak,
                                **result)

    def measure(self, case, pass_, contender, config, fn, operands, flops, *, default, xla_ms, ref):
        if self.over_budget():
            return self.row(case, pass_, contender, config, default=default, flops=flops,
                            skipped=f"budget of {self.args.budget:.0f} s spent"), None
        try:
            first, ms, out = time_fn(fn, operands, self.reps, self.warmup)
            errs = errors(out, ref) if ref is not None else (None, None)
            return self.row(case, pass_, contender, config, default=default, flops=flops, ms=ms,
                            xla_ms=ms if contender == "xla:jnp" else xla_ms, errs=errs, compile_s=first), out
        except Exception as e:  # noqa: BLE001 - a contender that does not compile, fit or run is a row
            return self.row(case, pass_, contender, config, default=default, flops=flops,
                            error=f"{type(e).__name__}: {e}".replace("\n", " ")[:400]), None

    def picks_kernel(self, x, w) -> bool:
        """Whether ``implementation=None`` runs the Mosaic kernel on this call (the forward's choice)."""
        if self.dry:  # dispatch never picks an interpreted kernel on a CPU; the dry run stands for a TPU
            return True
        from stellax.ops.glu import gated_linear_unit_op

        try:
            return gated_linear_unit_op.select(gated_linear_unit_op.check(x, w, activation="silu")).name == "mosaic_tpu"
        except Exception:  # noqa: BLE001
            return False

    def run_case(self, seed, m, k, n):
        from stellax.ops.glu import gated_linear_unit_op

        weights = self.args.weights
        case = f"SwiGLU M={m} K={k} N={n} bf16" + (" pair" if weights == "pair" else "")
        print(f"== {case}", flush=True)
        x, w, dy = make_inputs(seed, m, k, n, weights)
        operands = (x, w, dy)
        impl = gated_linear_unit_op.implementations["mosaic_tpu"]
        default_config = impl.default_config(gated_linear_unit_op.check(x, w, activation="silu"))
        default_label = (f"default({default_config.block_m}x{default_config.block_n}x{default_config.block_k})")
        picked = self.picks_kernel(x, w)
        for pass_ in self.passes:
            flops = 4.0 * m * k * n * (1 if pass_ == "fwd" else 3)
            xla_row, ref = self.measure(case, pass_, "xla:jnp", "-", program(xla_glu, pass_), operands, flops,
                                        default=False, xla_ms=None, ref=None)
            if xla_row["ms"] is not None:
                xla_row["max_rel_err"], xla_row["rel_l2"] = 0.0, 0.0
            rows = []
            for config in [None, *self.tiles]:
                label = default_label if config is None else f"{config.block_m}x{config.block_n}x{config.block_k}"
                fn = program(lambda a, b, config=config: stellax_glu(a, b, config=config), pass_)
                r, _ = self.measure(case, pass_, "stellax:mosaic_tpu", label, fn, operands, flops,
                                    default=config is None and picked, xla_ms=xla_row["ms"], ref=ref)
                rows.append(r)
            mark_best(rows)
            self.save()
            del ref
        del x, w, dy, operands

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        picked = self.picked_cases(len(cases))
        print(f"gated_linear_unit on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), "
              f"{len(picked)} cases, reps {self.reps}, warmup {self.warmup}, budget {self.args.budget:.0f} s",
              flush=True)
        for i in picked:
            self.run_case(i, *cases[i])
        self.save()
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def summary(rows):
    """Per case and pass: XLA, stellax's default and best (ms, % of peak, ratio to XLA)."""
    print("\nsummary (ms, % of bf16 peak, x = XLA's time / stellax's)", flush=True)
    for case, pass_ in dict.fromkeys((r["case"], r["pass"]) for r in rows):
        rs = [r for r in rows if (r["case"], r["pass"]) == (case, pass_) and r["ms"] is not None]
        xla = next((r for r in rs if r["peer"]), None)
        mosaic = [r for r in rs if not r["peer"]]
        default = next((r for r in mosaic if r["config"].startswith("default")), None)
        best = min(mosaic, key=lambda r: r["ms"]) if mosaic else None
        cells = []
        for label, r in (("xla", xla), ("default", default), ("best", best)):
            if r is None:
                cells.append(f"{label} -")
                continue
            ratio = "" if label == "xla" or r["vs_xla"] is None else f", {r['vs_xla']:.2f}x"
            cells.append(f"{label} {r['ms']:.3f} ({r['pct_peak'] or 0:.0f}%{ratio})"
                         + (f" [{r['config']}]" if label == "best" else ""))
        print(f"  {case:34s} {pass_:8s} " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
