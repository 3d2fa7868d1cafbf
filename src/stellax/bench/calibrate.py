"""Measure the device's two ceilings: a large matmul and a device-to-device copy."""

from __future__ import annotations

import jax.numpy as jnp

from ..core.platform import current_platform
from . import roofline as roofline_lib
from .measurement import benchmark


def sizes(backend: str, quick: bool = False) -> dict:
    """Problem sizes per backend (``quick``: for dry runs and tests)."""
    if quick:
        return {"matmul_n": 256, "matmul_dtype": "float32", "copy_bytes": 4 << 20}
    if backend == "cpu":
        return {"matmul_n": 768, "matmul_dtype": "float32", "copy_bytes": 32 << 20}
    return {"matmul_n": 8192, "matmul_dtype": "bfloat16", "copy_bytes": 2 << 30}


def calibrate(*, quick: bool = False, save: bool = True, timer: str = "auto") -> dict:
    """Measure the matmul rate (FLOP/s) and copy bandwidth (bytes/s, read +
    write) of the current device, remember them for this process and (with
    ``save``) for later runs (``<cache dir>/peaks/``). Returns the measurement
    with the datasheet values beside it."""
    platform = current_platform()
    size = sizes(platform.backend, quick)
    n, dtype = size["matmul_n"], jnp.dtype(size["matmul_dtype"])
    a = jnp.ones((n, n), dtype)
    mm = benchmark(lambda x, y: jnp.matmul(x, y, preferred_element_type=dtype), a, a, timer=timer,
                   flops=2.0 * n**3, bytes_accessed=3.0 * n * n * dtype.itemsize, name=f"matmul {n}^3 {dtype.name}",
                   peaks=roofline_lib.Peaks("none", {}, None))
    count = size["copy_bytes"] // 4
    x = jnp.ones((count,), jnp.float32)
    copy = benchmark(lambda v: v + 1.0, x, timer=timer, flops=float(count), bytes_accessed=2.0 * count * 4,
                     name=f"copy {size['copy_bytes'] >> 20} MiB", peaks=roofline_lib.Peaks("none", {}, None))
    measurement = {
        "matmul": {"n": n, "dtype": dtype.name, "median_ms": mm.median_ms, "timer": mm.timer,
                   "flops_per_s": 2.0 * n**3 / (mm.median_ms / 1e3)},
        "copy": {"bytes": 2 * size["copy_bytes"], "median_ms": copy.median_ms, "timer": copy.timer,
                 "bytes_per_s": 2.0 * size["copy_bytes"] / (copy.median_ms / 1e3)},
        "quick": quick,
    }
    roofline_lib.remember_measurement(measurement, platform)
    if save and not quick:
        measurement["saved_to"] = roofline_lib.save_measured(measurement, platform)
    sheet = roofline_lib.datasheet_peaks(platform.device_kind)
    if sheet is not None:
        measurement["datasheet"] = {"name": sheet.name, "flops_per_s": sheet.flops_for(dtype),
                                    "bytes_per_s": sheet.memory_bandwidth}
    return measurement


def describe(measurement: dict) -> str:
    mm, cp = measurement["matmul"], measurement["copy"]
    text = (f"matmul {mm['n']}^3 {mm['dtype']}: {mm['flops_per_s'] / 1e12:.4g} TFLOP/s ({mm['timer']}); "
            f"copy {cp['bytes'] / 2**20:.0f} MiB read+write: {cp['bytes_per_s'] / 1e9:.4g} GB/s")
    sheet = measurement.get("datasheet")
    if sheet and sheet.get("flops_per_s") and sheet.get("bytes_per_s"):
        text += (f"; datasheet {sheet['name']}: {sheet['flops_per_s'] / 1e12:.4g} TFLOP/s "
                 f"({100 * mm['flops_per_s'] / sheet['flops_per_s']:.0f}%), {sheet['bytes_per_s'] / 1e9:.4g} GB/s "
                 f"({100 * cp['bytes_per_s'] / sheet['bytes_per_s']:.0f}%)")
    return text
