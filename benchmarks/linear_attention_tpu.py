"""Chunked linear attention on a TPU (issue 39): stellax's Mosaic kernels against its XLA chunked path.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/linear_attention_tpu.py --out $OUT/la_tpu.json
    ... --ops chunk_gated_delta_rule --cases 0,1      # a subset (the cases are listed at the start)

Cases (issue 39), bfloat16 inputs, B = 1, K = V = 128: `chunk_gated_delta_rule` (qk l2-norm,
H = HV/2 query/key heads, as Qwen3-Next) and `chunk_kda` (H = HV) at T = 4096, 16384, 65536
and HV = 16, 32; `ssd` (P = 64, N = 128, 8 groups) at the same T with H = 16, 32. For each
case and pass (``fwd``: output and final state; ``fwd+bwd``: with the gradients of every
input through ``jax.vjp`` of a random cotangent), on the same data:

* ``xla:chunked``: the op's XLA chunked path (``implementation="xla"``), the peer;
* ``stellax:mosaic_tpu``: the Mosaic TPU kernels with the config stellax picks by itself
  (``default(chunk/block_v)``: shipped cache, then the heuristic of `tpu_costs`), then each
  config of the autotuning space (``--configs``); bfloat16 inputs run the bfloat16-operand
  products (`mxu.BF16_PRODUCTS`: one MXU pass for the input-like products and the inverse, exact
  decay sums, the delta rule's residuals by one refinement step at three passes);
* ``stellax:mosaic_tpu[f32]``: the same kernels on the inputs upcast to float32 (every
  product at ``highest``, as bfloat16 inputs ran before issue 39; the inverse is merged by
  blocks since, with as many matmuls);
* ``stellax:mosaic_tpu[policy=three_pass]`` (``--no-experiments`` to leave it out): the
  bfloat16 policy before the refined solve, the inverse at three passes (`mxu.BF16_POLICIES`;
  what the refined default gains on the chip; the static schedules and CPU errors of both:
  docs/linear_attention.md).

``tflops`` counts the chunked algorithm's matmul FLOPs (the op's ``flops``, chunk 64;
``fwd+bwd`` 3.5 times the forward), the same for every contender; ``pct_peak`` against the
chip's bfloat16 peak; ``vs_xla`` is XLA's time over the row's. ``rel_l2`` is the largest
relative L2 error of an output, final state or gradient against the XLA path on the inputs
upcast to float32 at ``precision="highest"`` (None where that golden does not fit).

The JSON (``--out``) holds ``{"format": "stellax-linear-attention-tpu", "version": 1,
"environment": {...}, "rows": [ROW, ...]}``, rows in the suite's results schema
(benchmarks/README.md) plus ``config``, ``vs_xla``, ``max_rel_err``, ``rel_l2``,
``compile_s``; rewritten after every row. ``--budget`` seconds (default 540) stops starting
new contenders. ``--dry-run`` runs the same code on the CPU on tiny cases with the kernels
interpreted (the tests run it).
"""

from __future__ import annotations

import contextlib
import functools
import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
from stellax.bench.chip_run import ChipRun, elapsed, errors, mark_best, time_fn

#: bfloat16 MXU peak (TFLOP/s) by device kind; the dry run reports against a v5e's.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0, "TPU7x": 2307.0}
V5E_TFLOPS = 197.0
OPS = ("chunk_gated_delta_rule", "chunk_kda", "ssd")
#: (T, HV) per op, in this order; the dry run's tiny cases.
SHAPES = [(t, hv) for t in (4096, 16384, 65536) for hv in (16, 32)]
DRY_SHAPES = [(100, 2)]
#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 5), (0, 1)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=540.0, stops="contender",
                        dry="tiny cases", passes=True)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)} (default all)")
    p.add_argument("--configs", default=None, help="explicit configs after the default: 'all' (the space; the "
                                                    "default), 'none' (the dry run's default), or chunk/block_v "
                                                    "pairs such as 64/128,128/128")
    p.add_argument("--no-experiments", action="store_true",
                   help="leave out the policy=three_pass row (the bfloat16 policy before the refined solve)")
    return p.parse_args(argv)


# -- inputs --------------------------------------------------------------------------------------
def case_inputs(op_name: str, t: int, hv: int, dim: int):
    """``(args, kwargs)`` of one call in bfloat16 (made on the device), decays of a long memory."""
    keys = jax.random.split(jax.random.PRNGKey(t + hv), 8)
    normal = lambda key, shape, scale=1.0: jax.jit(
        lambda k: (scale * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16))(key)
    if op_name == "ssd":
        p, n, g = dim // 2, dim, min(8, hv)
        x, b, c = normal(keys[0], (1, t, hv, p)), normal(keys[1], (1, t, g, n), n ** -0.5), normal(keys[2], (1, t, g, n), n ** -0.5)
        dt = jax.jit(lambda k: jax.nn.softplus(jax.random.normal(k, (1, t, hv)) - 3.0).astype(jnp.bfloat16))(keys[3])
        a = -jnp.exp(jnp.linspace(0.0, 2.0, hv, dtype=jnp.float32))
        return (x, dt, a, b, c), {"return_final_states": True}
    h = hv // 2 if op_name == "chunk_gated_delta_rule" else hv
    q, k, v = normal(keys[0], (1, t, h, dim)), normal(keys[1], (1, t, h, dim)), normal(keys[2], (1, t, hv, dim))
    shape = (1, t, hv, dim) if op_name == "chunk_kda" else (1, t, hv)
    g = jax.jit(lambda key: (-0.05 * jax.nn.softplus(jax.random.normal(key, shape))).astype(jnp.bfloat16))(keys[3])
    beta = jax.jit(lambda key: jax.nn.sigmoid(jax.random.normal(key, (1, t, hv))).astype(jnp.bfloat16))(keys[4])
    return (q, k, v, g, beta), {"output_final_state": True, "use_qk_l2norm": True}


# -- the contenders --------------------------------------------------------------------------------
def at_policy(name: str):
    """A context in which kernels traced run `mxu.BF16_POLICIES` [``name``] for bfloat16 inputs."""
    from stellax.ops.linear_attention import mxu

    return functools.partial(mxu.bf16_policy, name)


def contender_fn(op, kwargs, *, implementation, config=None, upcast=False, context=contextlib.nullcontext):
    """``f(*args)`` running ``op`` with ``implementation`` (and ``config`` for the forward and
    backward ops, ``upcast``: inputs as float32, ``context`` around the call)."""
    import stellax

    backward = "kda_recurrence_backward" if op.name == "chunk_kda" else "gated_recurrence_backward"
    table = {} if config is None else {(op.name, "mosaic_tpu"): config, (backward, "mosaic_tpu"): config}

    def f(*args):
        args = [a.astype(jnp.float32) if upcast and jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
        with stellax.use_configs(table), context():
            return op(*args, **kwargs, implementation=implementation)
    return f


def program(fn, pass_: str, n_args: int):
    """A jitted ``g(*args, cot)``: the outputs (``fwd``), or with the gradients of every float input."""
    if pass_ == "fwd":
        return jax.jit(lambda *a: fn(*a[:n_args]))

    def fwd_bwd(*a):
        args, cot = a[:n_args], a[n_args]
        floats = [i for i, x in enumerate(args) if jnp.issubdtype(x.dtype, jnp.floating)]

        def f(*diff):
            full = list(args)
            for i, x in zip(floats, diff):
                full[i] = x
            return fn(*full)
        out, pullback = jax.vjp(f, *(args[i] for i in floats))
        cots = [c.astype(o.dtype) for c, o in zip(cot, jax.tree_util.tree_leaves(out))]
        return out, pullback(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out), cots))
    return jax.jit(fwd_bwd)


# -- the run ---------------------------------------------------------------------------------------
class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-linear-attention-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)
        self.dim = 32 if self.dry else 128
        if args.configs is None:
            args.configs = "none" if self.dry else "all"

    def row(self, op, case, pass_, contender, config, *, flops, **result):
        """One contender's row (`ChipRun.compute_row`; ``result``: its ``ms``, ``xla_ms``, ``errs``,
        ``compile_s``, ``error`` or ``skipped``)."""
        fields = {"op": op, "case": case, "pass": pass_, "contender": contender, "config": config,
                  "default": config.startswith("default"), "peer": contender == "xla:chunked"}
        return self.compute_row(fields, f"  {pass_:8s} {contender:36s} {config:18s}", flops=flops, peak=self.peak,
                                **result)

    def measure(self, key, contender, config, fn, operands, *, xla_ms=None, ref=None):
        op, case, pass_, flops = key
        if self.over_budget():
            return self.row(op, case, pass_, contender, config, flops=flops,
                            skipped=f"budget of {self.args.budget:.0f} s spent"), None
        try:
            first, ms, out = time_fn(fn, operands, self.reps, self.warmup)
            errs = errors(out, ref) if ref is not None else (None, None)
            return self.row(op, case, pass_, contender, config, flops=flops, ms=ms, xla_ms=xla_ms, errs=errs,
                            compile_s=first), out
        except Exception as e:  # noqa: BLE001 - a contender that does not compile, fit or run is a row
            return self.row(op, case, pass_, contender, config, flops=flops,
                            error=f"{type(e).__name__}: {e}".replace("\n", " ")[:400]), None

    def golden(self, op, kwargs, pass_, operands, n_args):
        """The XLA path on the inputs as float32 at ``highest``, float32 gradients (None when it
        fails, e.g. out of memory)."""
        fn = program(contender_fn(op, dict(kwargs, precision="highest"), implementation="xla"), pass_, n_args)
        upcast = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in operands[:n_args]]
        try:
            return jax.block_until_ready(fn(*upcast, operands[n_args]))
        except Exception as e:  # noqa: BLE001
            print(f"  {pass_:8s} golden (XLA, float32, highest) failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return None

    def configs(self, op, call):
        """The explicit configs after the default (``--configs``)."""
        from stellax.ops.linear_attention.configs import TpuLinearAttentionConfig

        if self.args.configs == "none":
            return []
        if self.args.configs == "all":
            return op.implementations["mosaic_tpu"].config_space(call)
        return [TpuLinearAttentionConfig(*(int(x) for x in item.split("/"))) for item in self.args.configs.split(",")]

    def contenders(self, op, call, kwargs):
        """``(contender, config label, fn)`` in order (`contender_fn`)."""
        impl = op.implementations["mosaic_tpu"]
        from stellax.core import selection

        chosen, _ = selection.resolve_config(op.name, impl, call)
        out = [("xla:chunked", "-", contender_fn(op, kwargs, implementation="xla")),
               ("stellax:mosaic_tpu", f"default({chosen.chunk}/{chosen.block_v})",
                contender_fn(op, kwargs, implementation="mosaic_tpu"))]
        out += [("stellax:mosaic_tpu", f"{c.chunk}/{c.block_v}",
                 contender_fn(op, kwargs, implementation="mosaic_tpu", config=c)) for c in self.configs(op, call)]
        out.append(("stellax:mosaic_tpu[f32]", f"default({chosen.chunk}/{chosen.block_v})",
                    contender_fn(op, kwargs, implementation="mosaic_tpu", upcast=True)))
        if not self.args.no_experiments:
            out.append(("stellax:mosaic_tpu[policy=three_pass]", f"default({chosen.chunk}/{chosen.block_v})",
                        contender_fn(op, kwargs, implementation="mosaic_tpu", context=at_policy("three_pass"))))
        return out

    def run_case(self, op, t, hv):
        args, kwargs = case_inputs(op.name, t, hv, self.dim)
        call = op.check(*args, **kwargs)
        case = f"T={t} HV={hv} K=V={self.dim} bf16" if op.name != "ssd" else f"T={t} H={hv} P={self.dim // 2} N={self.dim} bf16"
        print(f"== {op.name} {case}", flush=True)
        fwd_flops = op.flops(call)
        out_shapes = jax.eval_shape(lambda *a: op(*a, **kwargs, implementation="xla"), *args)
        cot = [jax.random.normal(jax.random.PRNGKey(i), s.shape, jnp.float32)
               for i, s in enumerate(jax.tree_util.tree_leaves(out_shapes))]
        operands = (*args, cot)
        for pass_ in self.passes:
            key = (op.name, case, pass_, fwd_flops * (1.0 if pass_ == "fwd" else 3.5))
            ref = self.golden(op, kwargs, pass_, operands, len(args))
            rows, xla_ms = [], None
            for contender, config, fn in self.contenders(op, call, kwargs):
                r, _ = self.measure(key, contender, config, program(fn, pass_, len(args)), operands, xla_ms=xla_ms,
                                    ref=ref)
                if contender == "xla:chunked":
                    xla_ms = r["ms"]
                    r["vs_xla"] = 1.0 if xla_ms is not None else None
                elif contender == "stellax:mosaic_tpu":
                    rows.append(r)
            mark_best(rows)
            self.save()
            del ref

    def main(self):
        import stellax.ops.linear_attention as la

        ops = {"chunk_gated_delta_rule": la.chunk_gated_delta_rule_op, "chunk_kda": la.chunk_kda_op, "ssd": la.ssd_op}
        shapes = DRY_SHAPES if self.dry else SHAPES
        cases = [(ops[name], t, hv) for name in self.args.ops.split(",") if name for t, hv in shapes]
        picked = self.picked_cases(len(cases))
        print(f"linear attention on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), "
              f"{len(picked)} of {len(cases)} cases: "
              + ", ".join(f"{i}: {op.name} T={t} HV={hv}" for i, (op, t, hv) in enumerate(cases)), flush=True)
        for i in picked:
            self.run_case(*cases[i])
        self.save()
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
