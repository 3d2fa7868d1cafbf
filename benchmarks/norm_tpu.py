"""rms_norm and layer_norm on a TPU: stellax's Mosaic kernels against XLA, forward and forward+backward.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/norm_tpu.py --out $OUT/norm_tpu.json

Cases (issue 40): ``rms_norm`` and ``layer_norm``, each without and with the
fused residual add, on bfloat16 rows (16384, 8192), (65536, 4096) and
(4096, 16384) (scale, and for layer_norm an offset, in bfloat16). For each case
and each pass (``fwd``: the outputs; ``fwd+bwd``: the outputs and, through
``jax.vjp`` with random cotangents for every output, the gradients of x,
residual, scale and offset), on the same data:

* ``stellax:xla``: the jnp formula (float32 statistics, as everyone writes it),
  jitted, its gradients by JAX's autodiff; the reference the other rows'
  errors are measured against;
* ``stellax:mosaic_tpu``: `stellax.layer_norm` with ``implementation="mosaic_tpu"``
  and the config stellax picks by itself (``config`` ``default``; the row's
  ``default`` is true when ``implementation=None`` would run the kernel too: the
  forward's and, for ``fwd+bwd``, the backward's choice), then with two explicit
  ``block_rows`` (half and twice the default, where the space has them).

Timing: each contender is compiled and run once, then timed ``--reps`` times
(``block_until_ready`` after each call; median reported) after ``--warmup``
runs. ``gbps`` counts the same bytes for every contender of a case, the ops'
byte models (``layer_norm`` forward: x (+ residual) and the vectors read, y
(+ h) written; backward: x, dy (+ dh) and the vectors read, dx and the vector
gradients written; ``fwd+bwd`` is their sum); ``pct_peak`` is that against the
chip's HBM bandwidth (819 GB/s on a v5e); ``vs_xla`` is XLA's time over the
row's. ``max_rel_err`` (``max|out - ref| / max|ref|`` over every output) and
``rel_l2`` (the largest relative L2 error of an output) compare with the XLA row.

The JSON (``--out``) holds ``{"format": "stellax-norm-tpu", "version": 1,
"environment": {...}, "rows": [ROW, ...]}`` with rows in the suite's results
schema (benchmarks/README.md: op, case, pass, contender, default, peer, ms,
gbps, pct_peak, bound, device, date, skipped, error) plus ``config``,
``vs_xla``, ``max_rel_err``, ``rel_l2`` and ``compile_s``. It is rewritten after
every case, so a run cut short keeps what it measured; ``--budget`` seconds
(default 140) stops starting new cases past it (a case is 8 compiles, about
5-12 s on a v5e host; the twelve cases fit in about 2 minutes).
``--no-explicit`` drops the explicit block sizes (half the compiles).

``--dry-run`` runs the same code path on the CPU on tiny shapes with the
Mosaic kernels interpreted (the test suite runs it so the script cannot rot).
"""

from __future__ import annotations

import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
from stellax.bench.chip_run import ChipRun, elapsed, errors, time_fn

#: HBM bandwidth (GB/s) by device kind; the dry run reports against a v5e's.
HBM_GBPS = {"TPU v5 lite": 819.0, "TPU v5e": 819.0, "TPU v5": 2765.0, "TPU v6 lite": 1640.0, "TPU7x": 7370.0}
V5E_GBPS = 819.0
EPSILON = 1e-6

#: (op, subtract_mean, residual, rows, features): issue 40's headline case first.
SHAPES = [(16384, 8192), (65536, 4096), (4096, 16384)]
KINDS = [("rms_norm", False, False), ("rms_norm", False, True), ("layer_norm", True, False),
         ("layer_norm", True, True)]
CASES = [(op, sm, res, r, d) for (r, d) in SHAPES for (op, sm, res) in KINDS]
DRY_CASES = [("rms_norm", False, False, 40, 384), ("layer_norm", True, True, 40, 384)]


#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 10), (0, 2)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=140.0)
    p.add_argument("--no-explicit", action="store_true", help="no explicit block sizes (default config only)")
    return p.parse_args(argv)


# -- inputs and the contenders ---------------------------------------------------------------
def make_inputs(seed: int, rows: int, features: int, subtract_mean: bool, residual: bool):
    """``(x, residual | None, scale, offset | None)`` and the cotangents ``(dy, dh | None)``,
    bfloat16, made on the device."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    dtype = jnp.bfloat16
    rand = jax.jit(lambda k, shape, scale, shift: (scale * jax.random.normal(k, shape, jnp.float32) + shift
                                                   ).astype(dtype), static_argnums=(1,))
    x = rand(keys[0], (rows, features), 1.0, 0.5)
    res = rand(keys[1], (rows, features), 1.0, 0.0) if residual else None
    scale = rand(keys[2], (features,), 0.2, 1.0)
    offset = rand(keys[3], (features,), 0.2, 0.0) if subtract_mean else None
    dy = rand(keys[4], (rows, features), 1.0, 0.0)
    dh = rand(keys[5], (rows, features), 1.0, 0.0) if residual else None
    return (x, res, scale, offset), (dy, dh)


def xla_norm(x, res, scale, offset, *, subtract_mean: bool):
    """The jnp formula: statistics in float32, outputs in x's dtype (``(y, h)`` with a residual)."""
    h = x.astype(jnp.float32) if res is None else x.astype(jnp.float32) + res.astype(jnp.float32)
    centered = h - jnp.mean(h, axis=-1, keepdims=True) if subtract_mean else h
    y = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + EPSILON)
    y = y * scale.astype(jnp.float32)
    if offset is not None:
        y = y + offset.astype(jnp.float32)
    y = y.astype(x.dtype)
    return y if res is None else (y, h.astype(x.dtype))


def stellax_norm(x, res, scale, offset, *, subtract_mean: bool, config=None):
    import stellax

    table = {} if config is None else {("layer_norm", "mosaic_tpu"): config,
                                       ("layer_norm_backward", "mosaic_tpu"): config}
    with stellax.use_configs(table):
        return stellax.layer_norm(x, scale, offset, epsilon=EPSILON, subtract_mean=subtract_mean, residual=res,
                                  implementation="mosaic_tpu")


def program(norm, pass_: str, residual: bool):
    """A jitted ``f(x, res, scale, offset, dy, dh)``: the outputs (``fwd``), or the outputs and
    the gradients of every operand for the cotangents ``dy`` (and ``dh``) (``fwd+bwd``)."""
    if pass_ == "fwd":
        return jax.jit(lambda x, res, scale, offset, dy, dh: norm(x, res, scale, offset))

    def fwd_bwd(x, res, scale, offset, dy, dh):
        out, pullback = jax.vjp(lambda *a: norm(*a), x, res, scale, offset)
        return out, pullback((dy, dh) if residual else dy)

    return jax.jit(fwd_bwd)


def explicit_configs(call, dry: bool):
    """Two explicit block sizes around the default: half and twice it, where the space has them."""
    from stellax.ops.norm import layer_norm_op

    impl = layer_norm_op.implementations["mosaic_tpu"]
    default, space = impl.default_config(call), impl.config_space(call)
    sizes = [c.block_rows for c in space]
    picked = [b for b in (default.block_rows // 2, default.block_rows * 2) if b in sizes]
    for b in sorted(sizes, key=lambda b: abs(b - default.block_rows)):  # fill up to two from the nearest
        if len(picked) >= 2:
            break
        if b != default.block_rows and b not in picked:
            picked.append(b)
    return [c for c in space if c.block_rows in picked][:2], default


# -- measuring -----------------------------------------------------------------------------------
def byte_model(args, cots) -> dict[str, float]:
    """Bytes each pass must move, from the ops' byte models (the same for every contender)."""
    from stellax.ops.norm import layer_norm_backward_op, layer_norm_op

    x, res, scale, offset = args
    dy, dh = cots
    fwd = float(layer_norm_op.bytes_accessed(layer_norm_op.check(x, scale, offset, residual=res)))
    rows = x.shape[0]
    stat = jax.ShapeDtypeStruct((rows,), jnp.float32)
    back = layer_norm_backward_op.check(dy, x, scale, offset, stat, stat, dh)
    return {"fwd": fwd, "fwd+bwd": fwd + float(layer_norm_backward_op.bytes_accessed(back))}


class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-norm-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_GBPS if self.dry else HBM_GBPS.get(self.device)

    def row(self, op, case, pass_, contender, config, *, default, nbytes, ms=None, xla_ms=None,
            errs=(None, None), compile_s=None, error=None):
        gbps = None if ms is None or not ms == ms else nbytes / (ms * 1e-3) / 1e9
        pct = None if gbps is None or self.peak is None else 100.0 * gbps / self.peak
        r = {"op": op, "case": case, "pass": pass_, "contender": contender, "config": config, "default": default,
             "peer": contender == "stellax:xla", "ms": ms, "gbps": gbps, "pct_peak": pct, "bound": "memory",
             "vs_xla": None if ms is None or xla_ms is None else xla_ms / ms,
             "max_rel_err": errs[0], "rel_l2": errs[1], "compile_s": compile_s,
             "device": self.device, "date": self.date, "skipped": None, "error": error}
        self.rows.append(r)
        if error:
            print(f"  {pass_:8s} {contender:20s} {config:16s} ERROR {error[:200]}", flush=True)
        else:
            ratio = "" if r["vs_xla"] is None else f" {r['vs_xla']:5.2f}x XLA"
            print(f"  {pass_:8s} {contender:20s} {config:16s} {ms:8.4f} ms {gbps:7.1f} GB/s {pct or 0:5.1f}%"
                  f"{ratio} max_rel_err {errs[0]:.1e} rel_l2 {errs[1]:.1e} (first call {compile_s:.1f} s)",
                  flush=True)
        return r

    def defaults(self, args, cots, subtract_mean) -> dict[str, bool]:
        """Whether ``implementation=None`` runs the kernel: the forward, and forward and backward."""
        if self.dry:  # dispatch never picks an interpreted kernel on a CPU; the dry run stands for a TPU
            return {"fwd": True, "fwd+bwd": True}
        from stellax.core.op import backward_implementation
        from stellax.ops.norm import layer_norm_backward_op, layer_norm_op

        x, res, scale, offset = args
        try:
            fwd = layer_norm_op.select(layer_norm_op.check(x, scale, offset, subtract_mean=subtract_mean,
                                                           residual=res)).name == "mosaic_tpu"
            bwd = backward_implementation(layer_norm_backward_op, "mosaic_tpu", explicit=False)[0] == "mosaic_tpu"
        except Exception:  # noqa: BLE001
            return {"fwd": False, "fwd+bwd": False}
        return {"fwd": fwd, "fwd+bwd": fwd and bwd}

    def run_case(self, seed, op, subtract_mean, residual, rows, features):
        from stellax.ops.norm import layer_norm_op

        case = f"{op} {rows}x{features} bf16" + (" +residual" if residual else "")
        print(f"== {case}", flush=True)
        args, cots = make_inputs(seed, rows, features, subtract_mean, residual)
        nbytes = byte_model(args, cots)
        x, res, scale, offset = args
        call = layer_norm_op.check(x, scale, offset, subtract_mean=subtract_mean, residual=res)
        explicit, default_config = explicit_configs(call, self.dry)
        if self.args.no_explicit:
            explicit = []
        picked = self.defaults(args, cots, subtract_mean)
        operands = (*args, *cots)
        for pass_ in ("fwd", "fwd+bwd"):
            xla = program(lambda *a: xla_norm(*a, subtract_mean=subtract_mean), pass_, residual)
            ref = xla_ms = None
            try:
                first, xla_ms, ref = time_fn(xla, operands, self.reps, self.warmup)
                self.row(op, case, pass_, "stellax:xla", "jnp", default=False, nbytes=nbytes[pass_], ms=xla_ms,
                         xla_ms=xla_ms, errs=(0.0, 0.0), compile_s=first)
            except Exception as e:  # noqa: BLE001 - a contender that does not run is a row
                self.row(op, case, pass_, "stellax:xla", "jnp", default=False, nbytes=nbytes[pass_],
                         error=f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
            for config in [None, *explicit]:
                label = "default" if config is None else f"block_rows={config.block_rows}"
                fn = program(lambda *a, config=config: stellax_norm(*a, subtract_mean=subtract_mean, config=config),
                             pass_, residual)
                try:
                    first, ms, out = time_fn(fn, operands, self.reps, self.warmup)
                    errs = errors(out, ref) if ref is not None else (None, None)
                    self.row(op, case, pass_, "stellax:mosaic_tpu", label if config else
                             f"default(block_rows={default_config.block_rows})",
                             default=config is None and picked[pass_], nbytes=nbytes[pass_], ms=ms, xla_ms=xla_ms,
                             errs=errs, compile_s=first)
                except Exception as e:  # noqa: BLE001
                    self.row(op, case, pass_, "stellax:mosaic_tpu", label, default=False, nbytes=nbytes[pass_],
                             error=f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
                del fn
            del ref
        del args, cots, operands

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        picked = self.picked_cases(len(cases))
        print(f"norms on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), {len(picked)} cases, "
              f"reps {self.reps}, warmup {self.warmup}", flush=True)
        self.run_cases(picked, lambda i: self.run_case(i, *cases[i]))
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def summary(rows):
    """Per case and pass: XLA, stellax's default and best (ms, % of HBM peak, ratio to XLA)."""
    print("\nsummary (ms, % of HBM peak, x = XLA's time / stellax's)", flush=True)
    keys = list(dict.fromkeys((r["case"], r["pass"]) for r in rows))
    for case, pass_ in keys:
        rs = [r for r in rows if (r["case"], r["pass"]) == (case, pass_) and r["error"] is None]
        xla = next((r for r in rs if r["contender"] == "stellax:xla"), None)
        mosaic = [r for r in rs if r["contender"] == "stellax:mosaic_tpu"]
        default = next((r for r in mosaic if r["config"].startswith("default")), None)
        best = min(mosaic, key=lambda r: r["ms"]) if mosaic else None
        cells = []
        for label, r in (("xla", xla), ("default", default), ("best", best)):
            if r is None:
                cells.append(f"{label} -")
                continue
            ratio = "" if r["vs_xla"] is None or label == "xla" else f", {r['vs_xla']:.2f}x"
            cells.append(f"{label} {r['ms']:.3f} ({r['pct_peak'] or 0:.0f}%{ratio})"
                         + (f" [{r['config']}]" if label == "best" else ""))
        print(f"  {case:36s} {pass_:8s} " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
