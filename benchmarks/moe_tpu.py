"""MoE layer and int8 expert weights on a TPU: stellax's `moe_mlp` against the same layer in `jax.lax.ragged_dot` + jnp, and int8 `QArray` weights against bfloat16, in one process.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/moe_tpu.py --out $OUT/moe_tpu.json

Two kinds of case (issue 38), bfloat16 activations and weights:

* ``layer`` cases (op ``moe_mlp``): route (softmax, top-k, renormalised weights), permute,
  the gated grouped matmul ``silu(x @ w_gate) · (x @ w_up)``, the down projection, unpermute
  (the routing-weighted sum of each token's copies). Contenders: ``stellax:moe_mlp`` (its
  own configs; ``default`` true when the op picks ``mosaic_tpu`` by itself) and
  ``jax:ragged_dot_layer``, the same layer written with `jax.lax.top_k`, ``argsort``,
  `jax.lax.ragged_dot` and jnp (`reference_layer`). Passes ``fwd`` (the output) and
  ``fwd+bwd`` (output and the gradients of ``x``, the router logits and both weights for a
  fixed cotangent). Errors: against the float32 layer of the same inputs on the first
  ``--check-tokens`` tokens (the routing is the same: computed in float32 by both).
* ``int8`` cases (op ``ragged_dot_quantized``): ``y = x @ w[g]`` with ``w`` a per-channel
  int8 `QArray` (``stellax.quantize(w, "int8", axis=1)``) against the bfloat16 ``w`` through
  `stellax.ragged_dot` (both ``mosaic_tpu``); pass ``fwd``; a compute-bound prefill shape and a
  weight-bound decode-like one (few rows per expert). Errors: against the float32 product of
  the dequantized weights (int8) or of the bfloat16 ones.

Without ``--cases`` the main set `MAIN_CASES` runs (about 60 s on a v5e). Timing: compile and
one run, ``--warmup`` runs, then the median of ``--reps`` (``block_until_ready`` each).
``tflops`` counts the grouped matmuls' ``2·T·k·D·3F`` (layer; three times that with the
backward) or ``2·M·K·N`` (int8); ``pct_peak`` against 197 TFLOP/s (v5e bfloat16).

The JSON (``--out``) holds ``{"format": "stellax-moe-tpu", "version": 1, "environment", "seconds",
"rows"}``, rows in the suite's results schema (benchmarks/README.md) plus ``config``,
``rel_l2``, ``max_rel_err`` and ``compile_s``; ``--dry-run`` runs tiny shapes on the CPU with
the kernels interpreted (a test runs it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
import numpy as np
from stellax.bench.chip_run import ChipRun, elapsed, time_fn

V5E_TFLOPS = 197.0
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0, "TPU7x": 2307.0}
REPS, WARMUP = (1, 10), (0, 2)


@dataclasses.dataclass(frozen=True)
class Layer:
    """A `moe_mlp` case: ``T`` tokens of width ``D``, ``E`` experts of hidden width ``F``, top-``k``."""

    label: str
    t: int
    d: int
    f: int
    e: int
    top_k: int

    @property
    def name(self) -> str:
        return f"{self.label} T={self.t} D={self.d} F={self.f} E={self.e} top-{self.top_k}"


@dataclasses.dataclass(frozen=True)
class Int8:
    """A quantized `ragged_dot` case: ``M`` rows, ``[G, K, N]`` weights, balanced groups."""

    label: str
    m: int
    k: int
    n: int
    g: int

    @property
    def name(self) -> str:
        return f"{self.label} M={self.m} K={self.k} N={self.n} G={self.g}"


CASES = [Layer("Qwen3-MoE-like", 4096, 2048, 768, 128, 8),
         Int8("Mixtral-like prefill, int8 per-channel weights", 8192, 4096, 14336, 8),
         Int8("Mixtral-like decode, int8 per-channel weights", 256, 4096, 14336, 8),
         Int8("Qwen3-MoE-like, int8 per-channel weights", 32768, 2048, 768, 128),
         Layer("Qwen3-MoE-like, long batch", 8192, 2048, 768, 128, 8)]
MAIN_CASES = (0, 1, 2)
DRY_CASES = [Layer("tiny", 64, 256, 128, 8, 2), Int8("tiny int8", 256, 256, 256, 4)]


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=90.0, stops="contender",
                        passes=True)
    p.add_argument("--check-tokens", type=int, default=512, help="tokens compared with the float32 layer")
    return p.parse_args(argv)


# -- the layer written with jax.lax.ragged_dot and jnp -------------------------------------------------
def reference_layer(x, logits, w_gate_up, w_down, top_k: int, *, precision=None):
    """The MoE MLP of `stellax.moe_mlp` (softmax scores, top-k, weights renormalised to sum 1,
    SwiGLU experts) in plain JAX: ``x [T, D]``, ``logits [T, E]``, ``w_gate_up [E, D, 2, F]``,
    ``w_down [E, F, D]`` → ``[T, D]`` in ``x.dtype``. Copies are sorted by expert (stable
    ``argsort``), the experts run as two `jax.lax.ragged_dot` calls, and the copies are summed
    back into their tokens weighted by their routing weight (float32)."""
    tokens, d = x.shape
    experts, _, _, f = w_gate_up.shape
    scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, ids = jax.lax.top_k(jax.lax.stop_gradient(scores), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // top_k
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    rows = x[token_of]
    out_dtype = x.dtype if precision is None else jnp.float32
    h = jax.lax.ragged_dot(rows, w_gate_up.reshape(experts, d, 2 * f), sizes, precision=precision,
                           preferred_element_type=out_dtype)
    gate, up = h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32)
    act = (jax.nn.silu(gate) * up).astype(out_dtype)
    y = jax.lax.ragged_dot(act, w_down, sizes, precision=precision, preferred_element_type=out_dtype)
    contrib = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros((tokens, d), jnp.float32).at[token_of].add(contrib).astype(x.dtype)


def layer_inputs(seed: int, c: Layer):
    """``(x, logits, w_gate_up, w_down, cotangent)`` in bfloat16 (logits float32), made on the device."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)

    @jax.jit
    def make(ks):
        x = jax.random.normal(ks[0], (c.t, c.d), jnp.float32).astype(jnp.bfloat16)
        logits = jax.random.normal(ks[1], (c.t, c.e), jnp.float32)
        wgu = (jax.random.normal(ks[2], (c.e, c.d, 2, c.f), jnp.float32) / math.sqrt(c.d)).astype(jnp.bfloat16)
        wd = (jax.random.normal(ks[3], (c.e, c.f, c.d), jnp.float32) / math.sqrt(c.f)).astype(jnp.bfloat16)
        dy = jax.random.normal(ks[4], (c.t, c.d), jnp.float32).astype(jnp.bfloat16)
        return x, logits, wgu, wd, dy
    return make(ks)


def _with_pass(layer, kind: str):
    """A jitted ``(x, logits, wgu, wd, dy) -> {"y"[, "dx", "dlogits", "dwgu", "dwd"]}`` of ``layer``."""
    if kind == "fwd":
        return jax.jit(lambda x, lg, wgu, wd, dy: {"y": layer(x, lg, wgu, wd)})

    def fn(x, lg, wgu, wd, dy):
        y, pull = jax.vjp(layer, x, lg, wgu, wd)
        dx, dlg, dwgu, dwd = pull(dy)
        return {"y": y, "dx": dx, "dlogits": dlg, "dwgu": dwgu, "dwd": dwd}
    return jax.jit(fn)


def layer_errors(out: dict, ref: dict, tokens: int) -> tuple[float, float]:
    """``(rel_l2, max_rel_err)``: the worst over the outputs, on the first ``tokens`` tokens
    (rows of ``y``, ``dx``, ``dlogits``; every weight gradient whole)."""
    worst_l2 = worst_max = 0.0
    for name, want in ref.items():
        got = out[name]
        if name in ("y", "dx", "dlogits"):
            got, want = got[:tokens], want[:tokens]
        o, w = np.asarray(got, np.float32).ravel(), np.asarray(want, np.float32).ravel()
        if not np.all(np.isfinite(o)):
            return math.inf, math.inf
        worst_l2 = max(worst_l2, float(np.linalg.norm(o - w)) / (float(np.linalg.norm(w)) or 1.0))
        worst_max = max(worst_max, float(np.max(np.abs(o - w))) / (float(np.max(np.abs(w))) or 1.0))
    return worst_l2, worst_max


# -- the run ------------------------------------------------------------------------------------------
class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-moe-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)

    def row(self, op, case, kind, contender, config, *, default, peer, flops, ms=None, errs=(None, None),
            compile_s=None, error=None, skipped=None):
        tflops = None if ms is None or not ms == ms else flops / (ms * 1e-3) / 1e12
        pct = None if tflops is None or self.peak is None else 100.0 * tflops / self.peak
        r = {"op": op, "case": case, "pass": kind, "contender": contender, "config": config, "default": default,
             "peer": peer, "ms": ms, "tflops": tflops, "pct_peak": pct, "bound": "compute", "rel_l2": errs[0],
             "max_rel_err": errs[1], "compile_s": compile_s, "device": self.device, "date": self.date,
             "skipped": skipped, "error": error}
        self.rows.append(r)
        self.save()
        head = f"  {kind:7s} {contender:28s} {config:10s}"
        if skipped or error:
            print(f"{head} {'skipped: ' + skipped if skipped else 'ERROR ' + error[:200]}", flush=True)
        else:
            print(f"{head} {ms:9.3f} ms {tflops:7.1f} TFLOP/s {pct or 0:5.1f}% rel_l2 {errs[0]:.2e} "
                  f"max_rel_err {errs[1]:.2e} (first call {compile_s:.1f} s)", flush=True)
        return r

    def measure(self, op, case, kind, contender, config, fn, args, check, flops, *, default, peer):
        row = functools.partial(self.row, op, case, kind, contender, config, default=default, peer=peer,
                                flops=flops)
        if self.over_budget():
            return row(skipped=f"budget of {self.args.budget:.0f} s spent")
        try:
            first, ms, out = time_fn(fn, args, self.reps, self.warmup)
            errs = check(out)
            del out
            return row(ms=ms, errs=errs, compile_s=first)
        except Exception as e:  # noqa: BLE001 - a contender that does not compile or run is a row
            return row(error=f"{type(e).__name__}: {e}".replace("\n", " ")[:400])

    def picks_mosaic(self, name: str, *args, **kwargs) -> bool:
        """Whether op ``name`` picks ``mosaic_tpu`` by itself for these arguments (a dry run stands for a TPU)."""
        if self.dry:
            return True
        import stellax
        op = stellax.registered_ops()[name]
        try:
            return op.select(op.check(*args, **kwargs)).name == "mosaic_tpu"
        except Exception:  # noqa: BLE001
            return False

    def run_layer(self, index: int, c: Layer):
        import stellax

        print(f"== {c.name}", flush=True)
        args = layer_inputs(index, c)
        n = min(self.args.check_tokens, c.t)
        layer = functools.partial(stellax.moe_mlp, top_k=c.top_k, implementation="mosaic_tpu")
        default = self.picks_mosaic("moe_mlp", *args[:4], top_k=c.top_k)
        peer = functools.partial(reference_layer, top_k=c.top_k)
        exact = functools.partial(reference_layer, top_k=c.top_k, precision=jax.lax.Precision.HIGHEST)
        f32 = tuple(a.astype(jnp.float32) for a in args)
        for kind in self.passes:
            flops = 2.0 * c.t * c.top_k * c.d * 3 * c.f * (1 if kind == "fwd" else 3)
            ref = jax.device_get(_with_pass(exact, kind)(*f32))
            check = functools.partial(layer_errors, ref=ref, tokens=n)
            self.measure("moe_mlp", c.name, kind, "stellax:moe_mlp", "default", _with_pass(layer, kind), args,
                         check, flops, default=default, peer=False)
            self.measure("moe_mlp", c.name, kind, "jax:ragged_dot_layer", "default", _with_pass(peer, kind), args,
                         check, flops, default=False, peer=True)
            del ref

    def run_int8(self, index: int, c: Int8):
        import stellax
        from stellax.ops.moe.quantized import ragged_dot_quantized

        print(f"== {c.name}", flush=True)
        if "fwd" not in self.passes:
            return
        kx, kw = jax.random.split(jax.random.PRNGKey(index))
        x = jax.jit(lambda k: jax.random.normal(k, (c.m, c.k), jnp.float32).astype(jnp.bfloat16))(kx)
        w = jax.jit(lambda k: (jax.random.normal(k, (c.g, c.k, c.n), jnp.float32) / math.sqrt(c.k)
                               ).astype(jnp.bfloat16))(kw)
        sizes = jnp.full((c.g,), c.m // c.g, jnp.int32).at[0].add(c.m - c.g * (c.m // c.g))
        q = jax.jit(lambda w: stellax.quantize(w, "int8", axis=1))(w)
        rows = slice(0, min(c.m, 256))  # the first group(s)' rows: compared with float32 products

        def check(out, weights):
            first = np.asarray(np.cumsum(np.asarray(sizes)))
            got, want = [], []
            start = 0
            for g, end in enumerate(first):
                lo, hi = max(start, rows.start), min(end, rows.stop)
                if lo < hi:
                    want.append(np.asarray(jnp.dot(x[lo:hi].astype(jnp.float32), weights(g),
                                                   precision=jax.lax.Precision.HIGHEST)))
                    got.append(np.asarray(out["y"][lo:hi], np.float32))
                start = end
            o, r = np.concatenate(got).ravel(), np.concatenate(want).ravel()
            if not np.all(np.isfinite(o)):
                return math.inf, math.inf
            return (float(np.linalg.norm(o - r) / (np.linalg.norm(r) or 1.0)),
                    float(np.max(np.abs(o - r)) / (np.max(np.abs(r)) or 1.0)))

        deq = jax.jit(lambda q: stellax.dequantize(q, jnp.float32))(q)

        def weights_int8(g):
            return deq[g]

        def weights_bf16(g):
            return w[g].astype(jnp.float32)

        flops = 2.0 * c.m * c.k * c.n
        bf16 = jax.jit(lambda x, w, s: {"y": stellax.ragged_dot(x, w, s, implementation="mosaic_tpu")})
        int8 = jax.jit(lambda x, q, s: {"y": ragged_dot_quantized(x, q, s, implementation="mosaic_tpu")})
        self.measure("ragged_dot_quantized", c.name, "fwd", "stellax:mosaic_tpu bf16 weights", "default", bf16,
                     (x, w, sizes), functools.partial(check, weights=weights_bf16), flops,
                     default=self.picks_mosaic("ragged_dot", x, w, sizes), peer=False)
        self.measure("ragged_dot_quantized", c.name, "fwd", "stellax:mosaic_tpu int8 weights", "default", int8,
                     (x, q, sizes), functools.partial(check, weights=weights_int8), flops,
                     default=self.picks_mosaic("ragged_dot_quantized", x, q, sizes), peer=False)

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        picked = self.picked_cases(len(cases), MAIN_CASES)
        print(f"MoE layer and int8 weights on {self.device} ({'dry run' if self.dry else 'native'}), "
              f"{len(picked)} cases, passes {self.passes}, budget {self.args.budget:.0f} s", flush=True)
        for i in picked:
            c = cases[i]
            (self.run_layer if isinstance(c, Layer) else self.run_int8)(i, c)
        self.save()
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def summary(rows):
    """Per case and pass: the time ratio the issue asks for (goal 1.5): the peer layer over
    stellax's (``moe_mlp``), bfloat16 weights over int8 ones (``ragged_dot_quantized``)."""
    print("\nsummary (ms; x = the other's time / stellax's, goal >= 1.5)", flush=True)
    for key in dict.fromkeys((r["op"], r["case"], r["pass"]) for r in rows):
        rs = {r["contender"]: r for r in rows if (r["op"], r["case"], r["pass"]) == key
              and r.get("ms") is not None and r.get("error") is None}
        if key[0] == "moe_mlp":
            ours, other = rs.get("stellax:moe_mlp"), rs.get("jax:ragged_dot_layer")
        else:
            ours, other = rs.get("stellax:mosaic_tpu int8 weights"), rs.get("stellax:mosaic_tpu bf16 weights")
        cells = [f"{name} {r['ms']:.3f}" for name, r in rs.items()]
        if ours and other:
            cells.append(f"x {other['ms'] / ours['ms']:.2f}")
        print(f"  {key[1]} [{key[2]}]: " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
