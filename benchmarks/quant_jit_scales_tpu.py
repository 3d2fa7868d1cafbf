"""The quantize kernel's scales under jax.jit on a TPU: Mosaic (jitted and eager) against the XLA path.

    PYTHONPATH=$PYTHONPATH:src python3 benchmarks/quant_jit_scales_tpu.py $OUT/quant_jit_scales.json

Issue 35: on a v5e (libtpu 0.0.42) every E8M0 scale of the Mosaic ``quantize``
kernel came out NaN under ``jax.jit`` (eager was exact), because XLA rewrote a
reshape of an ``f8e8m0fnu`` array into an add-reduce from zero, which E8M0
cannot hold (`stellax.ops.quant.formats.e8m0_from_codes` is the fix). For each
format this quantizes one ``[512, 1024]`` float32 array three ways (Mosaic under
``jit``, Mosaic eagerly, the XLA implementation under ``jit``) and writes, per
way, the number of NaN scales, the scales' sum and the relative L2 error of the
XLA dequantization against the input: the three must agree, with no NaN.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import stellax

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4", "int8", "fp8_e4m3")


def summarize(q, x) -> dict:
    scales = np.asarray(q.scales.astype(jnp.float32))
    back = np.asarray(jax.jit(lambda qq: stellax.dequantize(qq, jnp.float32, implementation="xla"))(q))
    ref = np.asarray(x)
    return dict(nan_scales=int(np.isnan(scales).sum()), scales=int(scales.size),
                rel_l2=float(np.linalg.norm(back - ref) / np.linalg.norm(ref)), scale_sum=float(np.nansum(scales)))


def main(out_path: str) -> int:
    x = jax.random.normal(jax.random.PRNGKey(0), (512, 1024), jnp.float32) * 3
    out = {}
    for fmt in FORMATS:
        ways = {"jit": jax.jit(lambda a, f=fmt: stellax.quantize(a, f, implementation="mosaic_tpu")),
                "eager": lambda a, f=fmt: stellax.quantize(a, f, implementation="mosaic_tpu"),
                "xla": jax.jit(lambda a, f=fmt: stellax.quantize(a, f, implementation="xla"))}
        row = {}
        for name, fn in ways.items():
            try:
                row[name] = summarize(fn(x), x)
            except Exception as e:  # noqa: BLE001 - a way that fails is reported, the others still run
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        out[fmt] = row
        print(fmt, row, flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    bad = [f for f, row in out.items() if any("error" in r or r["nan_scales"] for r in row.values())]
    print("NaN scales or errors in:", bad or "none", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "quant_jit_scales.json"))
