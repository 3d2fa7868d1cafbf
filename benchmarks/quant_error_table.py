#!/usr/bin/env python3
"""Quantization error table: relative L2 error vs float32 of every format on
Gaussian and outlier-heavy data, with and without a Hadamard rotation, plus
(``--time``) CPU throughput of quantize/dequantize and quantized matmul.

    PYTHONPATH=src python benchmarks/quant_error_table.py [--time] [--out FILE]

Data (seeded, float32, 1024 × 4096, quantized along the last axis):
* gaussian: N(0, 1);
* outliers: N(0, 1) with 0.1% of entries × 100 and whole channels (4 of
  4096 columns) × 20 — the activation outliers of LLMs.
The matmul columns quantize ``x`` (activations, axis 1) and/or ``w`` (a
4096 × 1024 Gaussian weight, axis 0) and report the error of ``x @ w``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import stellax  # noqa: E402
from stellax.ops.quant import dequantize, quantize, quantized_matmul  # noqa: E402

FORMATS = [
    ("int8", "channel"), ("int8", 128), ("int8_asym", 128), ("int4", 128), ("int4", 32), ("int4_asym", 32),
    ("fp8_e4m3", "tensor"), ("fp8_e4m3", "channel"), ("fp8_e4m3", 128), ("fp8_e5m2", 128),
    ("mxfp8_e4m3", 32), ("mxfp8_e5m2", 32), ("mxfp4", 32), ("nvfp4", 16),
]


def data(kind: str, shape=(1024, 4096), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "outliers":
        mask = rng.random(shape) < 1e-3
        x = np.where(mask, x * 100, x)
        cols = rng.choice(shape[1], 4, replace=False)
        x[:, cols] *= 20
    return jnp.asarray(x)


def rel_l2(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def error_rows():
    rows = []
    xs = {k: data(k) for k in ("gaussian", "outliers")}
    for fmt, block in FORMATS:
        row = [f"{fmt}", str(block)]
        for kind, x in xs.items():
            row.append(rel_l2(dequantize(quantize(x, fmt, block_size=block)), x))
            if fmt in ("int4", "mxfp4", "nvfp4", "fp8_e4m3", "int8"):
                q = quantize(x, fmt, block_size=block, rotate=(128, jax.random.PRNGKey(1)))
                back = stellax.hadamard_transform(dequantize(q), block_size=128,
                                                  random_signs_key=jax.random.PRNGKey(1), inverse=True)
                row.append(rel_l2(back, x))
            else:
                row.append(None)
        rows.append(row)
    return rows


def matmul_rows():
    x = data("outliers", (256, 4096), seed=1)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((4096, 1024)).astype(np.float32) / 64)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    out = []
    for label, xq, wq in (
        ("bf16 x · int8 w (channel)", x.astype(jnp.bfloat16), quantize(w, "int8", axis=0)),
        ("bf16 x · int4 w (g128)", x.astype(jnp.bfloat16), quantize(w, "int4", axis=0)),
        ("bf16 x · mxfp4 w", x.astype(jnp.bfloat16), quantize(w, "mxfp4", axis=0)),
        ("bf16 x · nvfp4 w", x.astype(jnp.bfloat16), quantize(w, "nvfp4", axis=0)),
        ("fp8 x (1×128) · fp8 w (128×128)", quantize(x, "fp8_e4m3", axis=1, block_size=128),
         quantize(w, "fp8_e4m3", axis=0, block_size=(128, 128))),
        ("int8 x · int8 w (channel)", quantize(x, "int8", axis=1), quantize(w, "int8", axis=0)),
        ("mxfp8 x · mxfp8 w", quantize(x, "mxfp8", axis=1), quantize(w, "mxfp8", axis=0)),
    ):
        y = quantized_matmul(xq, wq, preferred_element_type=jnp.float32)
        out.append((label, rel_l2(y, ref)))
    return out


def _median_time(fn, *args, reps=5):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def timing_rows():
    x = data("gaussian", (2048, 4096)).astype(jnp.bfloat16)
    out = []
    for fmt, block in (("int8", "channel"), ("fp8_e4m3", 128), ("mxfp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16)):
        q = quantize(x, fmt, block_size=block)
        tq = _median_time(jax.jit(lambda x: quantize(x, fmt, block_size=block)), x)
        td = _median_time(jax.jit(lambda q: dequantize(q, jnp.bfloat16)), q)
        nbytes_in = x.size * 2
        out.append((fmt, (nbytes_in + q.nbytes) / tq / 1e9, (nbytes_in + q.nbytes) / td / 1e9))
    return out


def fmt_err(v):
    return "—" if v is None else f"{v:.2e}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--time", action="store_true", help="also time quantize/dequantize on this machine")
    p.add_argument("--out", default=None, help="write the markdown here too")
    args = p.parse_args()
    lines = ["| format | block | gaussian | gaussian + Hadamard(128) | outliers | outliers + Hadamard(128) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for fmt, block, g, gr, o, orr in error_rows():
        lines.append(f"| {fmt} | {block} | {fmt_err(g)} | {fmt_err(gr)} | {fmt_err(o)} | {fmt_err(orr)} |")
    lines += ["", "| matmul (x: outlier-heavy 256×4096, w: 4096×1024) | rel L2 vs float32 |", "| --- | --- |"]
    for label, e in matmul_rows():
        lines.append(f"| {label} | {e:.2e} |")
    if args.time:
        lines += ["", f"| format ({jax.devices()[0].device_kind}, XLA) | quantize GB/s | dequantize GB/s |",
                  "| --- | --- | --- |"]
        for fmt, gq, gd in timing_rows():
            lines.append(f"| {fmt} | {gq:.2f} | {gd:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
