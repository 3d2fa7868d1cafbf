#!/usr/bin/env python3
"""CPU attention benchmark: the issue's reference call and xla_chunked memory.

    PYTHONPATH=src JAX_PLATFORMS=cpu python benchmarks/attention_cpu.py [--lengths 1024,2048,4096,8192]

1. Time B=1, T=S=2048, N=8, H=64, causal, float32 (forward, and forward +
   backward) for stellax's default (``xla_chunked``), the golden ``xla`` and
   `jax.nn.dot_product_attention` (tokamax too when installed).
2. Peak temporaries (``compiled.memory_analysis().temp_size_in_bytes``) of
   ``xla_chunked`` vs ``xla`` at growing sequence length: linear vs quadratic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import stellax  # noqa: E402


def timed(fn, *args, reps=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[0] * 1e3, times[len(times) // 2] * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (1, 2048, 8, 64), jnp.float32) for kk in keys)
    contenders = {
        "stellax (default)": lambda q, k, v: stellax.dot_product_attention(q, k, v, is_causal=True),
        "stellax xla (golden)": lambda q, k, v: stellax.dot_product_attention(q, k, v, is_causal=True,
                                                                               implementation="xla"),
        "jax.nn.dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    }
    try:
        import tokamax
        contenders["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True)
    except Exception:
        pass
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cpus")
    print("B=1 T=S=2048 N=8 H=64 causal float32: min / median ms")
    for name, fn in contenders.items():
        fwd = timed(jax.jit(fn), q, k, v, reps=args.reps)
        grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
        bwd = timed(grad, q, k, v, reps=max(3, args.reps // 2))
        print(f"  {name:32s} forward {fwd[0]:8.1f} / {fwd[1]:8.1f}   forward+backward {bwd[0]:8.1f} / {bwd[1]:8.1f}")
    print("peak temporaries (MiB), causal float32 N=8 H=64: forward | forward+backward")
    for t in (int(x) for x in args.lengths.split(",")):
        sd = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)
        row = []
        for impl in ("xla_chunked", "xla"):
            f = lambda q, k, v, impl=impl: stellax.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
            g = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
            fm = jax.jit(f).lower(sd, sd, sd).compile().memory_analysis().temp_size_in_bytes / 2**20
            gm = jax.jit(g).lower(sd, sd, sd).compile().memory_analysis().temp_size_in_bytes / 2**20
            row.append(f"{impl} {fm:8.1f} | {gm:8.1f}")
        print(f"  T={t:6d}: " + "    ".join(row))


if __name__ == "__main__":
    main()
