"""Paged-attention benchmarks.

    python benchmarks/paged_attention.py quant-error   # CPU: error vs bf16 cache per format, bytes/token
    python benchmarks/paged_attention.py decode        # GPU: bytes moved per decode step → GB/s, % of copy BW

``quant-error`` prints a markdown table (the one in docs/paged_attention.md):
for every cache format, with and without the random-sign Hadamard rotation,
the relative L2 error of the `paged_attention` output against the same
attention on the bf16 cache, on keys and values with outlier channels (4 of
128 channels 20x larger), and the cache bytes per token and kv head.

``decode`` times bf16 and quantized decode at 8k–128k context with the
Triton kernels, the XLA path and (bf16) jax's own Pallas GPU paged attention
on the same data in its head-major layout, converts the bytes the step must read
(`Op.bytes_accessed`) into GB/s and compares with a measured device-to-device
copy bandwidth. It needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def quant_error(batch=4, context=1024, kv_heads=4, q_heads=16, head_dim=128, page_size=16, outliers=4, seed=0):
    from stellax.ops.paged_attention import KVQuant, paged_attention, quantize_pages
    from stellax.ops.paged_attention import paged_inputs

    q, k, v, tables, lengths = paged_inputs(seed, lengths=[context] * batch, page_size=page_size,
                                            kv_heads=kv_heads, q_heads=q_heads, head_dim=head_dim,
                                            dtype=jnp.bfloat16)
    # Outlier channels (the same few channels of every token, as in real keys).
    idx = jnp.asarray(np.random.default_rng(seed).choice(head_dim, outliers, replace=False))
    k = k.at[..., idx].multiply(20.0)
    v = v.at[..., idx].multiply(20.0)
    attend = jax.jit(lambda q, k, v: paged_attention(q, k, v, tables, lengths, implementation="xla"))
    exact = attend(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    base = attend(q, k, v).astype(jnp.float32)
    bf16_err = float(jnp.linalg.norm(base - exact) / jnp.linalg.norm(exact))
    rows = [("bf16", "-", "-", bf16_err, bf16_err, 2.0 * head_dim)]
    formats = [
        ("fp8 (e4m3)", KVQuant("fp8"), KVQuant("fp8"), "per token·head"),
        ("int8", KVQuant("int8"), KVQuant("int8"), "per token·head"),
        ("int4", KVQuant("int4", group_size=32), KVQuant("int4", group_size=32), "32 channels"),
        ("int4 KIVI", KVQuant("int4", group_axis="token", group_size=16), KVQuant("int4", group_size=32),
         "K: 16 tokens/channel, V: 32 ch"),
        ("int2", KVQuant("int2", group_size=32), KVQuant("int2", group_size=32), "32 channels"),
        ("int2 KIVI", KVQuant("int2", group_axis="token", group_size=16), KVQuant("int2", group_size=32),
         "K: 16 tokens/channel, V: 32 ch"),
        ("int2 + windows", KVQuant("int2", group_size=32, sink_tokens=32, recent_tokens=128),
         KVQuant("int2", group_size=32, sink_tokens=32, recent_tokens=128), "32 ch, 32 sink + 128 recent bf16"),
    ]
    for name, kspec, vspec, grouping in formats:
        errs = []
        for rotation in (False, True):
            import dataclasses
            ks = dataclasses.replace(kspec, rotation=rotation)
            vs = dataclasses.replace(vspec, rotation=rotation)
            kq = quantize_pages(k, ks, block_tables=tables, lengths=lengths)
            vq = quantize_pages(v, vs, block_tables=tables, lengths=lengths)
            out = attend(q, kq, vq).astype(jnp.float32)
            errs.append(float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact)))
        per_token = (kspec.bytes_per_token(head_dim) + vspec.bytes_per_token(head_dim)) / 2
        rows.append((name, grouping, kspec.scale_dtype.name, errs[0], errs[1], per_token))
    lines = ["| format | groups | scale dtype | rel. L2 error vs exact | with rotation | bytes / token / head (K, V avg) |",
             "|---|---|---|---|---|---|"]
    for name, grouping, sdt, e0, e1, nbytes in rows:
        lines.append(f"| {name} | {grouping} | {sdt} | {e0:.2e} | {e1:.2e} | {nbytes:.1f} |")
    meta = (f"B={batch}, context={context}, K={kv_heads}, N={q_heads}, H={head_dim}, page={page_size}, "
            f"{outliers}/{head_dim} channels of K and V ×20; error of the bf16-query output against the float32 "
            f"cache (the bf16 row is the bf16 cache itself)")
    return "\n".join(lines), meta


def _time(fn, *args, warmup=3, runs=20):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth(nbytes=2 * 1024**3):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1)  # read + write
    return 2 * nbytes / _time(f, x)


def decode(out_path=None):
    from stellax.ops.paged_attention import KVQuant, paged_attention_op
    from stellax.ops.paged_attention import paged_inputs

    bw = copy_bandwidth()
    results = {"device": jax.devices()[0].device_kind, "copy_GBps": bw / 1e9, "rows": []}
    print(f"device-to-device copy: {bw / 1e9:.0f} GB/s")
    for batch, context in ((8, 8192), (4, 32768), (1, 131072)):
        for quant in (None, KVQuant("fp8"), KVQuant("int8"), KVQuant("int4", group_size=32),
                      KVQuant("int2", group_size=32)):
            args = paged_inputs(0, lengths=[context] * batch, page_size=16, kv_heads=8, q_heads=64, head_dim=128,
                                dtype=jnp.bfloat16, quant=quant)
            call = paged_attention_op.check(*args)
            nbytes = paged_attention_op.bytes_accessed(call)
            for impl in ("triton", "xla"):
                fn = jax.jit(lambda *a, impl=impl: paged_attention_op(*a, implementation=impl))
                try:
                    t = _time(fn, *args)
                except Exception as e:  # report, keep going
                    print(f"{impl} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                row = dict(batch=batch, context=context, format="bf16" if quant is None else quant.format,
                           impl=impl, us=t * 1e6, GBps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / bw)
                results["rows"].append(row)
                print(f"B={batch:2d} ctx={context:6d} {row['format']:5s} {impl:6s} {row['us']:9.1f} us "
                      f"{row['GBps']:7.0f} GB/s {row['pct_copy']:5.1f}% of copy")
            if quant is None:  # what the machine offers: jax's own Pallas GPU paged attention (head-major pages)
                try:
                    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged
                    q, kp, vp, tables, lengths = args
                    kt, vt = kp.transpose(2, 0, 1, 3), vp.transpose(2, 0, 1, 3)  # layout change, not timed
                    fn = jax.jit(lambda q, k, v, t, l: jax_paged(q, k, v, t, l))
                    t = _time(fn, q, kt, vt, tables, lengths)
                    row = dict(batch=batch, context=context, format="bf16", impl="jax.pallas.gpu", us=t * 1e6,
                               GBps=nbytes / t / 1e9, pct_copy=100 * nbytes / t / bw)
                    results["rows"].append(row)
                    print(f"B={batch:2d} ctx={context:6d} bf16  jax-pallas {row['us']:9.1f} us {row['GBps']:7.0f} GB/s "
                          f"{row['pct_copy']:5.1f}% of copy")
                except Exception as e:  # not installed / layout limits
                    print(f"jax.experimental.pallas.ops.gpu.paged_attention unavailable: {type(e).__name__}: {str(e)[:160]}")
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("quant-error", "decode"))
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.what == "quant-error":
        table, meta = quant_error()
        print(meta)
        print(table)
    else:
        decode(args.out)


if __name__ == "__main__":
    main()
