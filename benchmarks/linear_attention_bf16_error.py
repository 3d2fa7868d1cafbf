#!/usr/bin/env python3
"""Errors of the Mosaic TPU chunked kernels on bfloat16 inputs at long T, on a CPU.

    PYTHONPATH=src python3 benchmarks/linear_attention_bf16_error.py --out results.json --T 16384
    PYTHONPATH=src python3 benchmarks/linear_attention_bf16_error.py --dry-run --out /tmp/e.json

For `chunk_gated_delta_rule` (qk l2-norm, grouped heads), `chunk_kda` and `ssd` on bfloat16
inputs, dense and packed (``cu_seqlens`` with an empty sequence), each ``--decays`` scale:
the relative L2 error against the float32 golden (the op's XLA chunked path on the inputs
upcast to float32 at ``highest``: memory-linear, held to 1e-5 of the token recurrence by the
tests) of the output, the final state and the gradient of every input, for

* ``xla``: the op's XLA chunked path on the bfloat16 inputs (float32 inside, at the call's
  precision; its outputs and gradients rounded to bfloat16);
* the Mosaic TPU kernels' math, emulated by XLA (`stellax.ops.linear_attention.emulate`:
  the kernels' own chunk functions scanned over the chunks, bit-identical to the interpreted
  kernels), under each ``--variants`` product policy (`mxu.Products`): ``kernel`` (what the
  kernels run for bfloat16 inputs, `mxu.BF16_PRODUCTS`), ``three_pass`` / ``refined`` (the policies
  of `mxu.BF16_POLICIES`: the inverse at three passes; at one pass with a refined ``Δ``),
  ``solve_default`` / ``solve_highest``
  (the inverse at one bfloat16 pass / float32), ``sums_default`` (the log-decay span sums at
  one bfloat16 pass), ``all_default`` (every product one pass) and ``f32_highest`` (float32
  ``q, k, v`` and every product at ``highest``, as float32 inputs run).

The gradients are those of ``Σ out·cot`` for a fixed random cotangent of the output and the
final state. One row per (case, contender) with the errors and the seconds it took.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from stellax.bench.chip_run import environment
from stellax.core.precision import DEFAULT, HIGHEST
from stellax.ops.linear_attention import chunk_gated_delta_rule_op, chunk_kda_op, ssd_op
from stellax.ops.linear_attention.emulate import emulated_call
from stellax.ops.linear_attention.examples import make_inputs, make_ssd_inputs
from stellax.ops.linear_attention.mxu import BF16_POLICIES, BF16_PRODUCTS, EXACT, Products

F32, BF16 = jnp.float32, jnp.bfloat16
OPS = {"gdn": chunk_gated_delta_rule_op, "kda": chunk_kda_op, "ssd": ssd_op}
#: Product policies of the emulated kernels: ``(products, q/k/v dtype in the kernels)``.
VARIANTS = {
    "kernel": (BF16_PRODUCTS, BF16),
    "three_pass": (BF16_POLICIES["three_pass"], BF16),
    "refined": (BF16_POLICIES["refined"], BF16),
    "solve_default": (Products(DEFAULT, DEFAULT, EXACT), BF16),
    "solve_highest": (Products(DEFAULT, HIGHEST, EXACT), BF16),
    "sums_default": (Products(DEFAULT, BF16_PRODUCTS.solve, DEFAULT), BF16),
    "all_default": (Products.uniform(DEFAULT), BF16),
    "f32_highest": (Products.uniform(HIGHEST), F32),
}


def gdn_case(name, T, heads, decay, packed, dim, shared=0.0):
    """``(op, differentiable arrays, static keywords)`` of a GDN/KDA case: H = heads/2 query
    heads (grouped), qk l2-norm for GDN, ``g = −decay·softplus(N(0,1))``; ``shared``: every
    key gets that multiple of one common unit direction (before the l2-norm: cosines of
    about ``shared²/(1 + shared²)`` between keys, a worse-conditioned solve)."""
    per_channel = name == "kda"
    cu = [0, T // 3, T // 3, T - 5, T] if packed else None
    n = len(cu) - 1 if packed else 1
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(1), 1, T, max(1, heads // 2), heads, dim, dim,
                                       per_channel=per_channel, decay=decay, n_states=n, dtype=F32,
                                       normalized_keys=False)
    common = jax.random.normal(jax.random.PRNGKey(4), (dim,), F32)
    k = k / np.sqrt(dim) + shared * common / jnp.linalg.norm(common)
    if per_channel:  # KDA without the op's l2-norm: unit keys
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    q, k, v, g, beta = (x.astype(BF16) for x in (q, k, v, g, beta))
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    static = {"output_final_state": True, "use_qk_l2norm": not per_channel}
    if packed:
        static["cu_seqlens"] = jnp.array(cu, jnp.int32)
    return OPS[name], diff, static


def ssd_case(T, heads, decay, packed, dim):
    """An SSD case: P = dim/2, N = dim, one group per 4 heads; ``dt`` scaled by ``decay``
    (``g = dt·A``)."""
    cu = [0, T // 3, T // 3, T - 5, T] if packed else None
    n = len(cu) - 1 if packed else 1
    x, dt, A, B, C, D, _, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(2), 1, T, heads, dim // 2,
                                                        max(1, heads // 4), dim, n_states=n, dtype=BF16)
    dt = (jax.nn.softplus(dt.astype(F32) + dt_bias.astype(F32)) * decay).astype(BF16)
    diff = {"x": x, "dt": dt, "A": A.astype(F32), "B": B, "C": C, "D": D, "initial_states": h0}
    static = {"return_final_states": True}
    if packed:
        static["cu_seqlens"] = jnp.array(cu, jnp.int32)
    return ssd_op, diff, static


def value_and_grads(f, diff, cots):
    """``(outputs, gradients of Σ output·cot)``, jitted."""
    def loss(d):
        out = jax.tree_util.tree_leaves(f(d))
        return sum(jnp.sum(o.astype(F32) * c) for o, c in zip(out, cots)), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
    return out, grads


def rel_l2(a, b) -> float:
    a, b = np.asarray(jnp.asarray(a, F32), np.float64), np.asarray(jnp.asarray(b, F32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))


def contenders(op, static, variants, xla: bool = True, chunk: int = 64):
    """``name → f(diff)`` of the XLA path (``xla``) and the emulated kernel variants at ``chunk``
    (bfloat16 inputs)."""
    out = {"xla": lambda d: op(**d, **static, implementation="xla")} if xla else {}
    for name in variants:
        products, dtype = VARIANTS[name]
        out[name] = (lambda d, p=products, t=dtype: emulated_call(op, **d, **static, products=p, operand_dtype=t,
                                                                       chunk=chunk))
    return out


def run_case(label, op, diff, static, variants, xla: bool = True, chunk: int = 64) -> list[dict]:
    """The golden, then every contender's errors against it (the emulated kernels at ``chunk``)."""
    names = ["out", "final"]
    fns = contenders(op, static, variants, xla, chunk)
    shapes = jax.eval_shape(lambda d: op(**d, **static, implementation="xla"), diff)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    cots = [jax.random.normal(key, s.shape, F32) for key, s in zip(keys, jax.tree_util.tree_leaves(shapes))]
    t0 = time.perf_counter()
    golden = lambda d: op(**d, **static, implementation="xla", precision="highest")  # float32 in and out
    ref, ref_grads = value_and_grads(golden, {n: x.astype(F32) for n, x in diff.items()}, cots)
    print(f"{label}: golden {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for name, f in fns.items():
        t0 = time.perf_counter()
        out, grads = value_and_grads(f, diff, cots)
        errors = {n: rel_l2(o, r) for n, o, r in zip(names, out, ref)}
        errors.update({"d" + n: rel_l2(grads[n], ref_grads[n]) for n in diff})
        seconds = round(time.perf_counter() - t0, 1)
        rows.append({"case": label, "op": op.name, "contender": name, "seconds": seconds, "errors": errors,
                     "chunk": None if name == "xla" else chunk})
        print(f"  {name:14s} {seconds:6.1f} s  " + " ".join(f"{n}={e:.1e}" for n, e in errors.items()), flush=True)
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--dry-run", action="store_true",
                   help="GDN, T = 256, two heads of 32, one decay, dense, the kernel variant: a quick check")
    p.add_argument("--ops", default="gdn,kda,ssd", help="comma list of gdn, kda, ssd")
    p.add_argument("--T", type=int, default=16384, help="tokens (default 16384)")
    p.add_argument("--heads", type=int, default=2, help="value heads (default 2)")
    p.add_argument("--dim", type=int, default=128, help="K = V (GDN, KDA), N = 2P (SSD); default 128")
    p.add_argument("--decays", default="1.0,0.02", help="decay scales (default 1.0,0.02: strong, long memory)")
    p.add_argument("--layouts", default="dense,packed", help="dense and/or packed (cu_seqlens)")
    p.add_argument("--shared", default="0", help="GDN/KDA: common key components (default 0; 1.0: cosines ~0.5)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"emulated product policies ({', '.join(VARIANTS)})")
    p.add_argument("--no-xla", action="store_true", help="leave out the XLA path's row (the golden still runs)")
    p.add_argument("--chunk", type=int, default=64, help="the emulated kernels' chunk (default 64)")
    return p.parse_args(argv)


def cases(args, T: int, heads: int, dim: int):
    """``(label, op, diff, static)`` of every case the arguments name."""
    floats = lambda text: [float(x) for x in text.split(",") if x]
    for name in args.ops.split(","):
        shared = floats(args.shared) if name != "ssd" else [0.0]
        for decay, layout, common in itertools.product(floats(args.decays), args.layouts.split(","), shared):
            packed = layout == "packed"
            op, diff, static = (ssd_case(T, heads, decay, packed, dim) if name == "ssd"
                                else gdn_case(name, T, heads, decay, packed, dim, common))
            label = f"{name} T={T} HV={heads} dim={dim} decay={decay} shared={common} {layout}"
            yield label, op, diff, static


def main(argv=None) -> int:
    args = parse_args(argv)
    T, heads, dim = (256, 2, 32) if args.dry_run else (args.T, args.heads, args.dim)
    variants = [v for v in args.variants.split(",") if v]
    if args.dry_run:  # one case, one variant: the script works
        args.ops, args.decays, args.layouts, args.shared, variants = "gdn", "1.0", "dense", "0", ["kernel"]
    rows = []
    for label, op, diff, static in cases(args, T, heads, dim):
        rows += run_case(label, op, diff, static, variants, xla=not args.no_xla, chunk=args.chunk)
        doc = {"format": "stellax-linear-attention-bf16-error", "version": 1,
               "environment": environment(args.dry_run), "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
