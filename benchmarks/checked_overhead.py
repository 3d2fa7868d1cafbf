"""What checked mode (`stellax.checked`, issue 43) costs under ``jax.jit`` on this machine.

    python benchmarks/checked_overhead.py [--repeats 30] [--no-write]

For each op on a small but real shape (float32, the platform's default implementation) it compiles

* ``off``: ``jax.jit(f)`` with checks off (the default; the program has no check);
* ``checkify_off``: ``jax.jit(checkify.checkify(f))`` traced with checks off — the ``checkify``
  wrapper alone, with nothing to check (should cost what ``off`` costs);
* ``on``: ``jax.jit(checkify.checkify(f))`` traced inside ``stellax.checked()``, each call followed
  by ``err.throw()`` (the error value read back to the host, as a user of checked mode does);
* ``on_unread``: the same program, the error value left on the device (the checks' own compute,
  without the read-back);

and reports the compile time of each and the median wall time per call over ``--repeats`` rounds
(after a warm-up; the three programs interleaved in every round so that load on a shared machine
hits them alike; a round times enough calls to last ``--min-round`` seconds). The ops:

* ``dot_product_attention_varlen``: 8 packed causal sequences, 2048 tokens, 8 query / 2 KV heads of
  64 (checks: ``cu_seqlens_q``, ``cu_seqlens_k``);
* ``ragged_dot``: ``M = 4096, K = N = 512``, 16 groups with traced sizes (checks: sizes >= 0, their
  sum <= M);
* ``paged_attention`` decode: 8 sequences of 512 tokens, pages of 16, 8 query / 2 KV heads of 64
  (checks: lengths, live block-table entries);
* ``chunk_gated_delta_rule``: 4 packed sequences, 2048 tokens, 4 heads, K = V = 64 (checks: g <= 0,
  ``cu_seqlens``);
* ``update_kv_cache``: a decode step writing 8 tokens into a 4096-slot pool (checks: slots in
  range, no repeat).

Writes ``benchmarks/results/checked_overhead_<platform>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

import stellax
from stellax.ops.paged_attention import paged_inputs

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
F32 = jnp.float32


def _varlen_case():
    rng = np.random.default_rng(0)
    lengths = np.array([64, 512, 128, 320, 256, 384, 192, 192])
    total = int(lengths.sum())
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((total, 8, 64)), F32)
    k = jnp.asarray(rng.standard_normal((total, 2, 64)), F32)
    v = jnp.asarray(rng.standard_normal((total, 2, 64)), F32)
    f = lambda q, k, v, cu_q, cu_k: stellax.dot_product_attention_varlen(q, k, v, cu_q, cu_k, 512, 512,
                                                                         is_causal=True)
    return f, (q, k, v, cu, cu), f"total={total} seqs=8 N=8 K=2 H=64 causal"


def _ragged_dot_case():
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((4096, 512)), F32)
    rhs = jnp.asarray(rng.standard_normal((16, 512, 512)) / 22.6, F32)
    sizes = jnp.asarray(rng.multinomial(4096, np.full(16, 1 / 16)), jnp.int32)
    f = lambda lhs, rhs, sizes: stellax.ragged_dot(lhs, rhs, sizes)
    return f, (lhs, rhs, sizes), "M=4096 K=512 N=512 G=16"


def _paged_case():
    q, kp, vp, tables, lengths = paged_inputs(0, lengths=[512] * 8, page_size=16, kv_heads=2, q_heads=8,
                                              head_dim=64, dtype=F32)
    f = lambda q, kp, vp, t, l: stellax.paged_attention(q, kp, vp, t, l)
    return f, (q, kp, vp, tables, lengths), "decode B=8 ctx=512 page=16 N=8 K=2 H=64"


def _gdn_case():
    rng = np.random.default_rng(2)
    t, h, d = 2048, 4, 64
    q = jnp.asarray(rng.standard_normal((1, t, h, d)), F32)
    k = jnp.asarray(rng.standard_normal((1, t, h, d)) / 8, F32)
    v = jnp.asarray(rng.standard_normal((1, t, h, d)), F32)
    g = -jnp.asarray(rng.random((1, t, h)), F32)
    beta = jnp.asarray(rng.random((1, t, h)), F32)
    cu = jnp.asarray([0, 300, 1100, 1500, t], jnp.int32)
    f = lambda q, k, v, g, beta, cu: stellax.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu,
                                                                    output_final_state=True)
    return f, (q, k, v, g, beta, cu), f"T={t} seqs=4 H={h} K=V={d} chunk=64"


def _update_case():
    rng = np.random.default_rng(3)
    kp, vp = stellax.init_kv_cache(256, 16, 2, 64, dtype=F32)
    new = jnp.asarray(rng.standard_normal((8, 2, 64)), F32)
    slots = jnp.asarray(rng.choice(256 * 16, 8, replace=False), jnp.int32)
    f = lambda kp, vp, new, slots: stellax.update_kv_cache(kp, vp, new, new, slots)
    return f, (kp, vp, new, slots), "pool 256x16 slots, K=2 H=64, 8 new tokens"


CASES = {"dot_product_attention_varlen": _varlen_case, "ragged_dot": _ragged_dot_case,
         "paged_attention": _paged_case, "chunk_gated_delta_rule": _gdn_case, "update_kv_cache": _update_case}


def _programs(f, args) -> tuple[dict, dict]:
    """The three compiled variants (see the module doc) and their compile seconds."""
    variants = {}
    with stellax.checked(False):
        variants["off"] = jax.jit(lambda *a: f(*a))
        variants["checkify_off"] = jax.jit(checkify.checkify(lambda *a: f(*a)))
    with stellax.checked():
        variants["on"] = jax.jit(checkify.checkify(lambda *a: f(*a)))
    compiled, compile_s = {}, {}
    for name, fn in variants.items():
        start = time.perf_counter()
        with stellax.checked(name == "on"):
            compiled[name] = fn.lower(*args).compile()
        compile_s[name] = time.perf_counter() - start
    compiled["on_unread"] = compiled["on"]
    return compiled, compile_s


def _call(name, program, args):
    out = program(*args)
    if name == "off":
        jax.block_until_ready(out)
        return
    err, out = out
    jax.block_until_ready(out)
    if name != "on_unread":
        err.throw()   # reads the error state back; raises if a check failed (none does here)


def _measure(compiled, args, repeats: int, min_round: float) -> dict:
    for name, program in compiled.items():   # warm-up, and the number of calls per round
        _call(name, program, args)
    start = time.perf_counter()
    _call("on", compiled["on"], args)
    calls = max(1, int(min_round / max(time.perf_counter() - start, 1e-6)))
    times = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, program in compiled.items():
            start = time.perf_counter()
            for _ in range(calls):
                _call(name, program, args)
            times[name].append((time.perf_counter() - start) / calls)
    return {"calls_per_round": calls, "seconds_per_call": times}


def _machine() -> str:
    return (f"{platform.machine()} {jax.devices()[0].platform.upper()}, {os.cpu_count()} cores (shared), "
            f"{platform.platform()}; load average {os.getloadavg()[0]:.1f} at the start")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--min-round", type=float, default=0.05, help="seconds each round of one program lasts")
    parser.add_argument("--ops", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    report = {"machine": _machine(), "versions": {"jax": jax.__version__, "stellax": stellax.__version__},
              "repeats": args.repeats, "ops": {}}
    for op in args.ops.split(","):
        f, inputs, shape = CASES[op]()
        compiled, compile_s = _programs(f, inputs)
        measured = _measure(compiled, inputs, args.repeats, args.min_round)
        median = {name: statistics.median(t) for name, t in measured["seconds_per_call"].items()}
        quartiles = {name: statistics.quantiles(t, n=4)[::2] for name, t in measured["seconds_per_call"].items()}
        row = {"shape": shape, "compile_seconds": compile_s, **measured, "median_seconds": median,
               "quartile_seconds": quartiles, "on_minus_off_seconds": median["on"] - median["off"],
               "on_over_off": median["on"] / median["off"],
               "checkify_off_over_off": median["checkify_off"] / median["off"]}
        report["ops"][op] = row
        print(f"{op:30s} off {median['off'] * 1e3:9.3f} ms  checkify(off) {median['checkify_off'] * 1e3:9.3f} ms  "
              f"on {median['on'] * 1e3:9.3f} ms (unread {median['on_unread'] * 1e3:9.3f})  on/off {row['on_over_off']:.3f}  "
              f"compile off/on {compile_s['off']:.1f}/{compile_s['on']:.1f} s", flush=True)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"checked_overhead_{jax.devices()[0].platform}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
