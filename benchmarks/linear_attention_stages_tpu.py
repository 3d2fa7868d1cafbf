"""The Mosaic TPU chunked linear-attention pipeline stage by stage on a TPU (issue 39), beside `tpu_costs`' model.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/linear_attention_stages_tpu.py --out $OUT/la_stages.json
    ... --cases 0 --variants 128/128/1,128/128/4,64/128/4     # one case, explicit configs (chunk/block_v/heads)

Cases (bfloat16 inputs, B = 1, K = V = 128; the cases are listed at the start):

0. ``chunk_gated_delta_rule`` T = 16384, HV = 32 (H = 16, qk l2-norm), every stage;
1. ``ssd`` T = 16384, H = 32 (P = 64, N = 128, 8 groups): the forward kernel;
2. ``chunk_kda`` T = 4096, HV = 16: the forward kernel.

Every case's forward stages run first, then GDN's backward ones (so that ``--budget`` cuts the
backward first).

Stages, each timed alone on the inputs it receives (made on the device in the kernels' layout:
heads-major ``q, k [HV, Tp, 128]`` and ``v`` bfloat16, decays and ``β`` float32):

* ``kernel:fwd``: `mosaic_tpu.recurrence_forward` (output and final state);
* ``kernel:states``: the same kernel storing every chunk's initial state (the backward's first pass);
* ``kernel:bwd``: `mosaic_tpu_backward.backward_from_states` on those states (the reverse scan and
  every gradient);
* ``op:fwd`` / ``op:fwd+bwd``: the whole op (its XLA layout work around the kernels included:
  the difference to the kernels is that work).

Each row carries ``model_ms``, `tpu_costs.kernel_seconds` for the stage (``kernel:bwd``: the
backward model less the forward's; the ops: the kernels' sum), so that model and chip can be
compared stage by stage. ``--variants`` runs ``kernel:fwd`` again per explicit config
(``chunk/block_v/heads_per_step``; default: one head per step at the heuristic's chunk, the
config measured before issue 39's heads per step, and for GDN chunk 64). ``--bwd-heads`` (default
1) times ``kernel:bwd`` once more at that many heads per step (the backward ops' default batches the
most heads per step that fit since 2026-12-06; one was the default before). ``--policy`` (default
``three_pass``) times ``kernel:fwd`` and ``kernel:bwd`` once more at the default configs with that
bfloat16 policy of `mxu.BF16_POLICIES` (``policy=NAME(...)`` rows; the default is ``refined`` since
2026-12-07, the inverse at three passes before). ``tflops`` / ``pct_peak``
count the chunked algorithm's matmul FLOPs at chunk 64 (the op's ``flops``; ``fwd+bwd`` 3.5 times
the forward) for the op rows and the forward kernel.

The JSON (``--out``) holds ``{"format": "stellax-linear-attention-stages-tpu", "version": 1,
"environment", "rows": [ROW, ...]}``, rows in the suite's results schema (benchmarks/README.md)
plus ``stage``, ``config``, ``model_ms``, ``compile_s``; rewritten after every row. ``--budget``
seconds (default 85) stops starting new stages. ``--dry-run`` runs the same code on the CPU on
tiny cases with the kernels interpreted (the tests run it).
"""

from __future__ import annotations

import contextlib
import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
from stellax.bench.chip_run import ChipRun, time_fn
from linear_attention_tpu import case_inputs

PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0, "TPU7x": 2307.0}
V5E_TFLOPS = 197.0
#: (op, T, HV, every stage) per case; the dry run's tiny ones.
CASES = [("chunk_gated_delta_rule", 16384, 32, True), ("ssd", 16384, 32, False), ("chunk_kda", 4096, 16, False)]
DRY_CASES = [("chunk_gated_delta_rule", 128, 2, True), ("ssd", 128, 2, False), ("chunk_kda", 64, 2, False)]
REPS, WARMUP = (1, 5), (0, 1)
DIM = 128


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=85.0, stops="stage",
                        dry="tiny cases")
    p.add_argument("--variants", default=None,
                   help="kernel:fwd configs after the default, chunk/block_v/heads_per_step, comma-separated "
                        "(default: one head per step at the default chunk, and chunk 64 at the default heads; "
                        "'none' for no variant)")
    p.add_argument("--policy", default="three_pass",
                   help="after the default stages, kernel:fwd and kernel:bwd again at the default configs with this "
                        "bfloat16 policy of mxu.BF16_POLICIES (default three_pass, the default before the refined "
                        "solve; 'none': not)")
    p.add_argument("--bwd-heads", type=int, default=1,
                   help="after the default stages, kernel:bwd again with this many heads per step (default 1, the "
                        "backward's default before 2026-12-06; 0: not)")
    return p.parse_args(argv)


def kernel_inputs(op_name: str, t: int, hv: int):
    """The kernels' operands for ``hv`` heads of ``t`` tokens (``t`` a multiple of 128): ``(q, k, v, g,
    beta, h0, do, dfinal)``, ``q, k, v`` bfloat16 ``[HV, T, 128]`` (unit-norm key rows, ``q`` scaled),
    log decays float32 ``[HV, T]`` (``[HV, T, 128]`` per channel), ``β`` float32 or ``None`` (SSD),
    zero ``h0``, the cotangents float32."""
    keys = jax.random.split(jax.random.PRNGKey(7 + t + hv), 8)

    @jax.jit
    def make(keys):
        unit = lambda key: jax.nn.standardize(jax.random.normal(key, (hv, t, DIM)), axis=-1) / DIM ** 0.5
        q, k = DIM ** -0.5 * unit(keys[0]), unit(keys[1])
        v = jax.random.normal(keys[2], (hv, t, DIM))
        shape = (hv, t, DIM) if op_name == "chunk_kda" else (hv, t)
        g = -0.05 * jax.nn.softplus(jax.random.normal(keys[3], shape))
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (hv, t)))
        do = jax.random.normal(keys[5], (hv, t, DIM))
        dfinal = jax.random.normal(keys[6], (hv, DIM, DIM))
        bf = lambda x: x.astype(jnp.bfloat16)
        return bf(q), bf(k), bf(v), g, beta, jnp.zeros((hv, DIM, DIM), jnp.float32), do, dfinal

    q, k, v, g, beta, h0, do, dfinal = make(keys)
    return q, k, v, g, None if op_name == "ssd" else beta, h0, do, dfinal


# -- the run ---------------------------------------------------------------------------------------
class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-linear-attention-stages-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)

    def row(self, op, case, stage, config, *, model_ms, flops=None, ms=None, compile_s=None, error=None,
            skipped=None):
        tflops = None if ms is None or flops is None else flops / (ms * 1e-3) / 1e12
        pct = None if tflops is None or self.peak is None else 100.0 * tflops / self.peak
        r = {"op": op, "case": case, "pass": "fwd+bwd" if stage in ("op:fwd+bwd", "kernel:bwd") else "fwd",
             "stage": stage, "contender": "stellax:mosaic_tpu", "config": config,
             "default": config.startswith("default"), "peer": False, "ms": ms, "model_ms": model_ms,
             "tflops": tflops, "pct_peak": pct, "bound": "compute", "compile_s": compile_s,
             "device": self.device, "date": self.date, "skipped": skipped, "error": error}
        self.rows.append(r)
        self.save()
        label = f"  {stage:14s} {config:26s} model {model_ms:8.3f} ms"
        if skipped or error:
            print(f"{label}  {'skipped: ' + skipped if skipped else 'ERROR ' + error[:300]}", flush=True)
        else:
            rate = "" if tflops is None else f" {tflops:6.2f} TFLOP/s {pct or 0:5.1f}%"
            print(f"{label}  chip {ms:9.3f} ms{rate} (first call {compile_s:.1f} s)", flush=True)
        return r

    def measure(self, key, config, fn, operands, *, model_ms, flops=None):
        op, case, stage = key
        if self.over_budget():
            return self.row(op, case, stage, config, model_ms=model_ms,
                            skipped=f"budget of {self.args.budget:.0f} s spent"), None
        try:
            first, ms, out = time_fn(fn, operands, self.reps, self.warmup)
            return self.row(op, case, stage, config, model_ms=model_ms, flops=flops, ms=ms, compile_s=first), out
        except Exception as e:  # noqa: BLE001 - a stage that does not compile, fit or run is a row
            return self.row(op, case, stage, config, model_ms=model_ms,
                            error=f"{type(e).__name__}: {e}".replace("\n", " ")[:400]), None

    def variants(self, default, every_stage):
        from stellax.ops.linear_attention.configs import TpuLinearAttentionConfig

        spec = self.args.variants
        if spec is None:
            out = [default.replace(heads_per_step=1)] + ([default.replace(chunk=64)] if every_stage else [])
            return [c for c in dict.fromkeys(out) if c != default]
        if spec == "none":
            return []
        configs = []
        for item in spec.split(","):
            parts = item.split("/")
            if len(parts) != 3:
                raise SystemExit(f"--variants: expected chunk/block_v/heads_per_step items, got {item!r}")
            config = TpuLinearAttentionConfig(*(int(x) for x in parts))
            config.validate()
            configs.append(config)
        return configs

    def run_case(self, index, op_name, t, hv, every_stage, phase):
        """The forward stages (``phase`` 0) or, for a case with ``every_stage``, the backward's (1)."""
        from stellax.core.precision import HIGHEST
        from stellax.ops.linear_attention import (
            chunk_gated_delta_rule_op,
            chunk_kda_op,
            mosaic_tpu,
            mosaic_tpu_backward,
            mxu,
            ssd_op,
        )
        from stellax.core import Call
        from stellax.ops.linear_attention.configs import linear_attention_tpu_backward_heuristic, tpu_products
        from stellax.ops.linear_attention.tpu_costs import kernel_seconds

        op = {"chunk_gated_delta_rule": chunk_gated_delta_rule_op, "chunk_kda": chunk_kda_op, "ssd": ssd_op}[op_name]
        per_channel, delta = op_name == "chunk_kda", op_name != "ssd"
        case = f"T={t} HV={hv} K=V={DIM} bf16" if op_name != "ssd" else f"T={t} H={hv} P={DIM // 2} N={DIM} bf16"
        args, kwargs = case_inputs(op_name, t, hv, DIM)  # the op benchmark's inputs
        call = op.check(*args, **kwargs)
        config = op.implementations["mosaic_tpu"].default_config(call)
        # The backward op's own heuristic on a dense batch of these heads (`configs`: whole chunks of 128,
        # the most heads per step that fit).
        heads_major = jax.ShapeDtypeStruct((1, hv, t, DIM), jnp.bfloat16)
        rows = jax.ShapeDtypeStruct((1, hv, t) + ((DIM,) if per_channel else ()), jnp.float32)
        bwd_call = Call({"q": heads_major, "k": heads_major, "v": heads_major, "g": rows, "do": heads_major,
                         "beta": None if op_name == "ssd" else jax.ShapeDtypeStruct((1, hv, t), jnp.float32),
                         "first": None}, {"precision": HIGHEST})
        bwd_config = linear_attention_tpu_backward_heuristic(bwd_call)
        products = tpu_products(call)
        flops = op.flops(call) or None
        print(f"case {index}: {op_name} {case}, forward {config}, backward {bwd_config}"
              f"{'' if phase == 0 else ' (backward stages)'}", flush=True)

        policy = None if self.args.policy == "none" else self.args.policy

        def model(c, backward=False, policy_products=None):
            """Modelled ms of the forward kernel, or (``backward``) of the backward kernel alone."""
            seconds = lambda bwd: kernel_seconds(hv, t, DIM, DIM, c.chunk, c.block_v, per_channel=per_channel,
                                                 delta=delta, products=policy_products or products,
                                                 heads_per_step=c.heads_per_step, backward=bwd)
            return 1e3 * (seconds(True) - seconds(False) if backward else seconds(False))

        name = lambda c, default=True: ("default" if default else "explicit") + \
            f"({c.chunk}/{c.block_v}/{c.heads_per_step})"
        q, k, v, g, beta, h0, do, dfinal = kernel_inputs(op_name, t, hv)
        common = dict(heads=hv, per_channel=per_channel, precision=HIGHEST)
        layout = (q, k, v, g, beta, h0)

        def traced(fn, at_policy=None):
            """``jax.jit(fn)``, traced under the bfloat16 policy ``at_policy`` (`mxu.bf16_policy`)."""
            def run(*a):
                with mxu.bf16_policy(at_policy) if at_policy else contextlib.nullcontext():
                    return fn(*a)
            return jax.jit(run)

        def forward(c, with_states=False, at_policy=None):
            return traced(lambda *a: mosaic_tpu.recurrence_forward(*a, None, config=c, with_states=with_states,
                                                                   **common), at_policy)

        key = lambda stage: (op_name, case, stage)
        if phase == 0:
            self.measure(key("kernel:fwd"), name(config), forward(config), layout, model_ms=model(config),
                         flops=flops)
            for c in self.variants(config, every_stage):
                self.measure(key("kernel:fwd"), name(c, False), forward(c), layout, model_ms=model(c), flops=flops)
            if policy and delta:
                self.measure(key("kernel:fwd"), f"policy={policy}" + name(config)[len("default"):],
                             forward(config, at_policy=policy), layout,
                             model_ms=model(config, policy_products=mxu.BF16_POLICIES[policy]), flops=flops)
            if every_stage:
                self.measure(key("op:fwd"), name(config),
                             jax.jit(lambda *a: op(*a, **kwargs, implementation="mosaic_tpu")), args,
                             model_ms=model(config), flops=flops)
            return
        _, out = self.measure(key("kernel:states"), name(bwd_config), forward(bwd_config, with_states=True), layout,
                              model_ms=model(bwd_config))
        if out is not None:
            backward = jax.jit(lambda *a: mosaic_tpu_backward.backward_from_states(*a, None, config=bwd_config,
                                                                                   **common))
            self.measure(key("kernel:bwd"), name(bwd_config), backward, layout + (out[0], do, dfinal),
                         model_ms=model(bwd_config, backward=True))
            if policy and delta:
                backward = traced(lambda *a: mosaic_tpu_backward.backward_from_states(*a, None, config=bwd_config,
                                                                                      **common), policy)
                self.measure(key("kernel:bwd"), f"policy={policy}" + name(bwd_config)[len("default"):], backward,
                             layout + (out[0], do, dfinal),
                             model_ms=model(bwd_config, backward=True, policy_products=mxu.BF16_POLICIES[policy]))
        cot_key = jax.random.PRNGKey(3)

        def fwd_bwd(*a):
            floats = [i for i, x in enumerate(a) if jnp.issubdtype(x.dtype, jnp.floating)]

            def f(*diff):
                full = list(a)
                for i, x in zip(floats, diff):
                    full[i] = x
                return op(*full, **kwargs, implementation="mosaic_tpu")
            out, pullback = jax.vjp(f, *(a[i] for i in floats))
            leaves, tree = jax.tree_util.tree_flatten(out)
            cots = [jax.random.normal(jax.random.fold_in(cot_key, i), x.shape).astype(x.dtype)
                    for i, x in enumerate(leaves)]
            return out, pullback(jax.tree_util.tree_unflatten(tree, cots))

        self.measure(key("op:fwd+bwd"), name(config), jax.jit(fwd_bwd), args,
                     model_ms=model(config) + model(bwd_config) + model(bwd_config, backward=True),
                     flops=None if flops is None else 3.5 * flops)
        if self.args.bwd_heads > 0:  # the backward kernel at another number of heads per step (explicit)
            c = bwd_config.replace(heads_per_step=self.args.bwd_heads)
            if out is not None and c != bwd_config:
                backward = jax.jit(lambda *a: mosaic_tpu_backward.backward_from_states(*a, None, config=c, **common))
                self.measure(key("kernel:bwd"), name(c, False), backward, layout + (out[0], do, dfinal),
                             model_ms=model(c, backward=True))

    def main(self) -> int:
        cases = DRY_CASES if self.dry else CASES
        for i, c in enumerate(cases):
            print(f"[{i}] {c[0]} T={c[1]} HV={c[2]}{' (every stage)' if c[3] else ''}", flush=True)
        picked = self.picked_cases(len(cases))
        for phase in (0, 1):  # every case's forward first, then the backward stages
            for i in picked:
                if phase == 0 or cases[i][3]:
                    self.run_case(i, *cases[i], phase)
        self.save()
        return 0


if __name__ == "__main__":
    sys.exit(chip_run.run(Run, parse_args()))
