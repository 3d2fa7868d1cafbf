#!/usr/bin/env python3
"""Static schedules of the Mosaic TPU chunked linear-attention kernels per bfloat16 policy, on a CPU.

    PYTHONPATH=src python3 benchmarks/linear_attention_static_cpu.py --out static.json

For each kernel (GDN forward 128 × 4 and 64 × 4, KDA forward 64 × 4, GDN backward 128 × 4, KDA
backward 128 × 2: chunk × heads per step, bfloat16 ``q, k, v``, K = V = 128) and each ``--policies``
entry of `mxu.BF16_POLICIES`: the libtpu compile's final bundles, critical path, spills, per-unit
bundles and matmul issues of one grid step (`stellax.testing.llo_schedule` on
`linear_attention.tpu_cases.kernel_case`, ``--generation`` default v5e). Static numbers, not timings:
each compile runs libtpu in a fresh process (~10 s quiet).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stellax.testing.llo_schedule import kernel_schedules

#: (kind, chunk, heads per step, backward) of each kernel.
KERNELS = [("gdn", 128, 4, False), ("gdn", 64, 4, False), ("kda", 64, 4, False), ("gdn", 128, 4, True),
           ("kda", 128, 2, True)]


def schedule_row(kind, chunk, hb, backward, policy, generation) -> dict:
    """One kernel's static schedule at ``policy`` as a JSON row."""
    schedules = kernel_schedules("stellax.ops.linear_attention.tpu_cases:kernel_case", generation, kind=kind,
                                 chunk=chunk, heads_per_step=hb, backward=backward, policy=policy)
    (name, s), = [(n, s) for n, s in schedules.items() if n.startswith("linear_attention")]
    return {"kind": kind, "pass": "bwd" if backward else "fwd", "chunk": chunk, "heads_per_step": hb,
            "policy": policy, "kernel": name, "bundles": s.bundles, "critical_path": s.critical_path,
            "bound": s.bound, "cycles_per_head": s.bound / hb, "spills": s.spills, "unit_bundles": s.unit_bundles,
            "matmuls": s.matmuls}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--policies", default="three_pass,refined", help="names in mxu.BF16_POLICIES")
    p.add_argument("--generation", default="v5e")
    args = p.parse_args(argv)
    rows = []
    for kind, chunk, hb, backward in KERNELS:
        for policy in args.policies.split(","):
            rows.append(schedule_row(kind, chunk, hb, backward, policy, args.generation))
            r = rows[-1]
            print(f"{kind} {r['pass']} {chunk}x{hb} {policy}: {r['bundles']} bundles, critical path "
                  f"{r['critical_path']}, spills {r['spills']}", flush=True)
    doc = {"format": "stellax-linear-attention-static-schedule", "version": 1, "generation": args.generation,
           "note": "static (libtpu LLO dumps, heads = heads_per_step, 512 tokens), not measured", "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
