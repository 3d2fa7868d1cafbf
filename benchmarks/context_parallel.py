"""Context-parallel attention on a simulated CPU mesh: communication volume
and per-device memory per strategy vs sequence length.

Nothing runs: every configuration is lowered and compiled for the simulated
devices; collective traffic is read from the jaxpr
(`stellax.parallel.collective_traffic`), per-device memory from
``compiled.memory_analysis()`` (`stellax.parallel.memory_report`). Writes a
markdown table (stdout, and ``--out``).

    python benchmarks/context_parallel.py --devices 8 --seq-lens 4096 16384 65536 --out table.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--strategies", nargs="+", default=["single", "all_gather", "ulysses", "ring", "usp"])
    ap.add_argument("--no-train", action="store_true", help="forward only (skip the fwd+bwd compile)")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main():
    args = _parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import stellax
    from stellax.parallel import attention_traffic_model, collective_traffic, context_parallel_attention, memory_report

    p = args.devices
    dtype = jnp.dtype(args.dtype)
    devices = np.array(jax.devices()[:p])
    mesh1 = Mesh(devices, ("cp",))
    uly = 4 if p % 4 == 0 and p > 4 else 2
    mesh2 = Mesh(devices.reshape(p // uly, uly), ("ring", "uly"))
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    mib = lambda x: x / 2**20
    rows = []
    for t in args.seq_lens:
        for strategy in args.strategies:
            if strategy == "single":
                mesh, seq = Mesh(devices[:1], ("cp",)), "cp"
                fn = lambda q, k, v: stellax.dot_product_attention(q, k, v, is_causal=True,
                                                                   implementation="xla_chunked")
            else:
                mesh = mesh2 if strategy == "usp" else mesh1
                seq = ("ring", "uly") if strategy == "usp" else "cp"
                kw = dict(ulysses_axis="uly", ring_axis="ring") if strategy == "usp" else dict(axis_name="cp")
                fn = (lambda s, kw: lambda q, k, v: context_parallel_attention(
                    q, k, v, mesh=mesh, strategy=s, load_balance="zigzag", is_causal=True,
                    implementation="xla_chunked", **kw))(strategy, kw)
            sh = NamedSharding(mesh, P(None, seq, None, None))
            q = jax.ShapeDtypeStruct((b, t, n, h), dtype, sharding=sh)
            k = jax.ShapeDtypeStruct((b, t, kh, h), dtype, sharding=sh)

            def train(q, k, v, do, fn=fn):
                loss = lambda q, k, v: jnp.sum((fn(q, k, v) * do).astype(jnp.float32))
                return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

            start = time.perf_counter()
            lowered = jax.jit(fn).lower(q, k, k)
            fwd_traffic = collective_traffic(fn, q, k, k)
            fwd_mem = memory_report(lowered.compile())
            row = {"strategy": strategy, "T": t, "fwd_comm": mib(fwd_traffic.total), "fwd_peak": mib(fwd_mem["peak"])}
            if strategy != "single":
                model_kw = dict(batch=b, seq_len=t, heads=n, kv_heads=kh, head_dim=h, axis_size=p,
                                itemsize=dtype.itemsize, ulysses_size=uly)
                row["model_fwd"] = mib(attention_traffic_model(strategy, **model_kw))
            if not args.no_train:
                lowered_t = jax.jit(train).lower(q, k, k, q)
                row["train_comm"] = mib(collective_traffic(train, q, k, k, q).total)
                row["train_peak"] = mib(memory_report(lowered_t.compile())["peak"])
            row["compile_s"] = time.perf_counter() - start
            rows.append(row)
            print(row, file=sys.stderr, flush=True)

    header = (f"Causal self-attention, zigzag layout, {args.dtype}, B={b}, N={n}, K={kh}, H={h}, "
              f"{p} simulated devices (usp: {p // uly} ring × {uly} Ulysses); local attention `xla_chunked`. "
              f"Communication is per device (from the collectives in the jaxpr); memory is the per-device peak "
              f"(arguments + outputs + temporaries, `memory_analysis`).\n")
    cols = ["strategy", "T", "fwd comm (MiB)", "model (MiB)", "fwd peak mem (MiB)"]
    if not args.no_train:
        cols += ["fwd+bwd comm (MiB)", "fwd+bwd peak mem (MiB)"]
    lines = [header, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["strategy"], str(r["T"]), f"{r['fwd_comm']:.1f}",
                 f"{r['model_fwd']:.1f}" if "model_fwd" in r else "–", f"{r['fwd_peak']:.1f}"]
        if not args.no_train:
            cells += [f"{r['train_comm']:.1f}", f"{r['train_peak']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
