"""The Mosaic TPU chunked linear-attention forward kernel with stages left out, on a TPU (issue 39):
the differences of the times attribute a grid step's time to its stages.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/linear_attention_ablation_tpu.py --out $OUT/la_ablation.json
    ... --list                 # the cases, the main set marked
    ... --cases 0,1,7          # some cases

Each case times `mosaic_tpu.recurrence_forward` (bfloat16 ``q, k, v [HV, T, 128]`` in the kernels'
layout, decays and ``β`` float32; made on the device by `linear_attention_stages_tpu.kernel_inputs`) at
one config ``chunk/block_v/heads_per_step`` with the stages named by ``skip`` left out through the
kernel's private seam ``_skip`` (`mosaic_tpu.STAGES`; the results are then wrong and not checked):

* ``spans``: the decay spans ``D`` taken as 0 (GDN: no 0/1-mask matmul; KDA: plain causal scores
  instead of the sub-block channel scores);
* ``solve``: ``T = I`` (no inverse: its ``2·log2(C/2)`` dependent products at three passes);
* ``state``: no products with the chunk's initial state (``W S``, ``(Γ⊙Q) S``);
* ``update``: no state update product ``K̃ᵀ Δ``;
* ``all``: every one of them (what is left: the loads, the scores, ``U``, ``P Δ``, the stores).

Main set (about 100 s on a v5e, compiles included): GDN T = 16384, HV = 32 at 128/128/4 with each stage
left out, everything left out and nothing; the same at one head per step (nothing left out); KDA
T = 4096, HV = 16 at 64/128/4 with nothing and ``spans`` left out. Every row carries ``model_ms``
(`tpu_costs.kernel_seconds` of the whole kernel, the same for every ``skip`` of a config) and, for
nothing left out, ``tflops`` / ``pct_peak`` of the op's chunked matmul FLOPs.

The JSON (``--out``) holds ``{"format": "stellax-linear-attention-ablation-tpu", "version": 1,
"environment", "rows": [ROW, ...]}``, rows in the suite's results schema (benchmarks/README.md) plus
``stage`` (``kernel:fwd``), ``skip`` and ``model_ms``; rewritten after every row. ``--budget``
seconds (default 150) stops starting new cases. ``--dry-run`` runs every case on the CPU at tiny
shapes with the kernel interpreted (the tests run it).
"""

from __future__ import annotations

import dataclasses
import sys

from stellax.bench import chip_run
import jax
from stellax.bench.chip_run import ChipRun, time_fn
from linear_attention_stages_tpu import DIM, PEAK_TFLOPS, V5E_TFLOPS, kernel_inputs

REPS, WARMUP = (1, 5), (0, 1)
EVERY = ("spans", "solve", "state", "update")


@dataclasses.dataclass(frozen=True)
class Case:
    op: str            # chunk_gated_delta_rule, chunk_kda or ssd
    t: int
    hv: int
    config: tuple      # (chunk, block_v, heads_per_step)
    skip: tuple = ()

    def label(self) -> str:
        left = "+".join(self.skip) if self.skip else "nothing"
        return f"{self.op} T={self.t} HV={self.hv} config {'/'.join(map(str, self.config))}, left out: {left}"


def _cases(op, t, hv, config, skips):
    return [Case(op, t, hv, config, skip) for skip in skips]


GDN_SKIPS = [(), ("spans",), ("solve",), ("state",), ("update",), EVERY]
CASES = (_cases("chunk_gated_delta_rule", 16384, 32, (128, 128, 4), GDN_SKIPS)
         + _cases("chunk_gated_delta_rule", 16384, 32, (128, 128, 1), [()])
         + _cases("chunk_kda", 4096, 16, (64, 128, 4), [(), ("spans",)])
         + _cases("chunk_gated_delta_rule", 16384, 32, (64, 128, 4), [(), ("solve",)])
         + _cases("chunk_kda", 4096, 16, (64, 128, 4), [("solve",), ("state",)])
         + _cases("ssd", 16384, 32, (128, 128, 4), [(), ("spans",), ("state",)]))
MAIN = tuple(range(9))
#: The dry run: the same cases at tiny shapes (T = 128, two heads; hb = 4 becomes 2).
DRY_T, DRY_HV = 128, 2


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=150.0, dry="tiny shapes")
    p.add_argument("--list", action="store_true", help="list the cases (main set marked) and exit")
    return p.parse_args(argv)


class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-linear-attention-ablation-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)
        self.inputs = {}

    def shape(self, case: Case) -> tuple[int, int, tuple]:
        if not self.dry:
            return case.t, case.hv, case.config
        chunk, bv, hb = case.config
        return DRY_T, DRY_HV, (min(chunk, 64), bv, min(hb, DRY_HV))

    def flops(self, op_name, t, hv):
        """The op's chunked matmul FLOPs for ``hv`` heads of ``t`` tokens (its ``flops`` count)."""
        from linear_attention_tpu import case_inputs
        from stellax.ops.linear_attention import chunk_gated_delta_rule_op, chunk_kda_op, ssd_op

        op = {"chunk_gated_delta_rule": chunk_gated_delta_rule_op, "chunk_kda": chunk_kda_op, "ssd": ssd_op}[op_name]
        args, kwargs = case_inputs(op_name, t, hv, DIM)
        return op.flops(op.check(*args, **kwargs)) or None

    def run_one(self, index: int) -> None:
        from stellax.core.precision import HIGHEST
        from stellax.ops.linear_attention import mosaic_tpu
        from stellax.ops.linear_attention.configs import TpuLinearAttentionConfig
        from stellax.ops.linear_attention.mxu import BF16_PRODUCTS
        from stellax.ops.linear_attention.tpu_costs import kernel_seconds

        case = CASES[index]
        t, hv, (chunk, bv, hb) = self.shape(case)
        per_channel, delta = case.op == "chunk_kda", case.op != "ssd"
        config = TpuLinearAttentionConfig(chunk=chunk, block_v=bv, heads_per_step=hb)
        if (case.op, t, hv) not in self.inputs:
            self.inputs = {(case.op, t, hv): kernel_inputs(case.op, t, hv)}  # one case's inputs held at a time
        q, k, v, g, beta, h0, _, _ = self.inputs[case.op, t, hv]
        model_ms = 1e3 * kernel_seconds(hv, t, DIM, DIM, chunk, bv, per_channel=per_channel, delta=delta,
                                        products=BF16_PRODUCTS, heads_per_step=hb)
        flops = None if case.skip else self.flops(case.op, t, hv)
        fn = jax.jit(lambda *a: mosaic_tpu.recurrence_forward(*a, None, heads=hv, per_channel=per_channel,
                                                              config=config, precision=HIGHEST, _skip=case.skip))
        fields = {"op": case.op, "case": f"T={t} HV={hv} K=V={DIM} bf16", "pass": "fwd", "stage": "kernel:fwd",
                  "skip": "+".join(case.skip), "contender": "stellax:mosaic_tpu",
                  "config": f"explicit({chunk}/{bv}/{hb})", "default": False, "peer": False, "model_ms": model_ms}
        shape = dataclasses.replace(case, t=t, hv=hv, config=(chunk, bv, hb))
        label = f"[{index}] {shape.label()}: model {model_ms:8.3f} ms"
        try:
            first, ms, _ = time_fn(fn, (q, k, v, g, beta, h0), self.reps, self.warmup)
        except Exception as e:  # noqa: BLE001 - a case that does not compile or run is a row
            self.compute_row(fields, label, flops=0.0, peak=self.peak,
                             error=f"{type(e).__name__}: {e}".replace("\n", " ")[:400])
            return
        self.compute_row(fields, label, flops=flops or 0.0, peak=self.peak if flops else None, ms=ms,
                         compile_s=first)
        if not flops:
            self.rows[-1]["tflops"] = None

    def main(self) -> int:
        for i, case in enumerate(CASES):
            print(f"[{i}]{' main' if i in MAIN else '     '} {case.label()}", flush=True)
        self.run_cases(self.picked_cases(len(CASES), MAIN), self.run_one)
        return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        return chip_run.list_cases(CASES, MAIN)
    return chip_run.run(Run, args)


if __name__ == "__main__":
    sys.exit(main())
