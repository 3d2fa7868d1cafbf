"""Peak rates per device kind and the roofline of a measurement.

`DATASHEET` holds vendor numbers (dense, no sparsity) for the devices stellax
targets; `stellax bench --calibrate` measures the two ceilings that matter on
the device at hand (a large matmul, a device-to-device copy) and saves them,
and measured peaks are preferred when present. Rates are FLOP/s per compute
dtype and bytes/s of device memory.

Dtype conventions: ``float32`` is the rate a float32 matmul gets at JAX's
default precision (TF32 tensor cores on NVIDIA, bf16 passes on TPU), so
``% of peak`` never exceeds 100 for well-formed float32 matmuls.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Mapping

import numpy as np

from .._files import atomic_write_text, slug, user_cache_root
from ..core.platform import Platform, current_platform

T = 1e12
G = 1e9


@dataclasses.dataclass(frozen=True)
class Peaks:
    """Peak rates of one device: ``flops[dtype]`` in FLOP/s and
    ``memory_bandwidth`` in bytes/s; ``sources`` says where each came from."""

    name: str
    flops: Mapping[str, float]
    memory_bandwidth: float | None
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def flops_for(self, dtype) -> float | None:
        key = compute_dtype(dtype)
        for candidate in (key, "bfloat16" if key == "float16" else None):
            if candidate and candidate in self.flops:
                return float(self.flops[candidate])
        return None

    def source_of(self, what: str) -> str:
        return self.sources.get(what, "datasheet")

    def to_json(self) -> dict:
        return {"name": self.name, "flops": dict(self.flops), "memory_bandwidth": self.memory_bandwidth,
                "sources": dict(self.sources)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Peaks":
        return cls(data["name"], dict(data.get("flops", {})), data.get("memory_bandwidth"),
                   dict(data.get("sources", {})))


def _nv(name, bf16, fp8, tf32, fp32, hbm_tbs, fp4=None):
    flops = {"bfloat16": bf16 * T, "float16": bf16 * T, "float8": fp8 * T, "int8": fp8 * T,
             "float32": tf32 * T, "float32_simt": fp32 * T}
    if fp4:
        flops["float4"] = fp4 * T
    return Peaks(name, flops, hbm_tbs * T)


def _tpu(name, bf16, int8, hbm_gbs, fp8=None):
    flops = {"bfloat16": bf16 * T, "float16": bf16 * T, "float32": bf16 * T, "int8": int8 * T}
    if fp8:
        flops["float8"] = fp8 * T
    return Peaks(name, flops, hbm_gbs * G)


#: (substrings of the lower-cased device kind, peaks); first match wins.
DATASHEET: list[tuple[tuple[str, ...], Peaks]] = [
    (("h100", "pcie"), _nv("H100 PCIe", 756, 1513, 378, 51.2, 2.0)),
    (("h100", "nvl"), _nv("H100 NVL", 835, 1671, 418, 60, 3.9)),
    (("h100",), _nv("H100 SXM", 989.4, 1978.9, 494.7, 66.9, 3.35)),
    (("h200", "nvl"), _nv("H200 NVL", 835, 1671, 418, 60, 4.8)),
    (("h200",), _nv("H200 SXM", 989.4, 1978.9, 494.7, 66.9, 4.8)),
    (("gh200",), _nv("GH200", 989.4, 1978.9, 494.7, 66.9, 4.0)),
    (("b200",), _nv("B200", 2250, 4500, 1100, 75, 8.0, fp4=9000)),
    (("b100",), _nv("B100", 1750, 3500, 875, 60, 8.0, fp4=7000)),
    (("a100", "40gb"), _nv("A100 40GB", 312, 624, 156, 19.5, 1.555)),
    (("a100", "pcie"), _nv("A100 PCIe 80GB", 312, 624, 156, 19.5, 1.935)),
    (("a100",), _nv("A100 SXM 80GB", 312, 624, 156, 19.5, 2.039)),
    (("tpu v5 lite",), _tpu("TPU v5e", 197, 394, 819)),
    (("tpu v5e",), _tpu("TPU v5e", 197, 394, 819)),
    (("tpu v5p",), _tpu("TPU v5p", 459, 918, 2765)),
    (("tpu v5",), _tpu("TPU v5p", 459, 918, 2765)),
    (("tpu v6",), _tpu("TPU v6e", 918, 1836, 1640)),
    (("tpu7",), _tpu("TPU v7", 2307, 4614, 7370, fp8=4614)),
    (("tpu v7",), _tpu("TPU v7", 2307, 4614, 7370, fp8=4614)),
    (("tpu v4",), _tpu("TPU v4", 275, 275, 1228)),
]


def compute_dtype(dtype) -> str:
    """Which peak applies to arithmetic in ``dtype``."""
    if dtype is None:
        return "float32"
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name.startswith("float8"):
        return "float8"
    if name.startswith("float4"):
        return "float4"
    if name in ("int8", "uint8", "int4", "uint4"):
        return "int8"
    if name in ("bfloat16", "float16", "float32", "float64"):
        return name
    return "float32"


def datasheet_peaks(device_kind: str) -> Peaks | None:
    kind = device_kind.lower()
    for needles, peaks in DATASHEET:
        if all(n in kind for n in needles):
            return peaks
    return None


# -- measured peaks ------------------------------------------------------------
def _peaks_path(platform: Platform):
    return user_cache_root() / "peaks" / f"{slug(platform.device_kind)}.json"


def load_measured(platform: Platform | None = None) -> dict | None:
    platform = platform or current_platform()
    path = _peaks_path(platform)
    try:
        data = json.loads(path.read_text())
        if data.get("device_kind") != platform.device_kind:
            return None
        return data
    except (OSError, ValueError, AttributeError):
        return None


def save_measured(measurement: Mapping[str, Any], platform: Platform | None = None) -> str:
    platform = platform or current_platform()
    data = dict(measurement)
    data["device_kind"] = platform.device_kind
    data.setdefault("created", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    path = _peaks_path(platform)
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    return str(path)


def peaks_from_measurement(measurement: Mapping[str, Any], base: Peaks | None, name: str) -> Peaks:
    """Datasheet peaks with the measured matmul rate and bandwidth put in."""
    flops = dict(base.flops) if base else {}
    sources = {k: "datasheet" for k in flops}
    matmul = measurement.get("matmul") or {}
    if matmul.get("flops_per_s"):
        key = compute_dtype(matmul.get("dtype", "bfloat16"))
        flops[key] = float(matmul["flops_per_s"])
        sources[key] = "measured"
        if key == "bfloat16" and base is None:
            flops.setdefault("float16", flops[key])
    bandwidth = base.memory_bandwidth if base else None
    copy = measurement.get("copy") or {}
    if copy.get("bytes_per_s"):
        bandwidth = float(copy["bytes_per_s"])
        sources["memory_bandwidth"] = "measured"
    elif base:
        sources["memory_bandwidth"] = "datasheet"
    return Peaks(name, flops, bandwidth, sources)


_SESSION_MEASURED: dict[str, dict] = {}


def remember_measurement(measurement: Mapping[str, Any], platform: Platform | None = None) -> None:
    """Use ``measurement`` for the rest of this process (without saving it)."""
    platform = platform or current_platform()
    _SESSION_MEASURED[platform.device_kind] = dict(measurement)


def device_peaks(platform: Platform | None = None, *, measured: bool = True) -> Peaks | None:
    """Peaks of ``platform``: measured ones (this process's or saved by
    ``stellax bench --calibrate``) over the datasheet; ``None`` when unknown."""
    platform = platform or current_platform()
    base = datasheet_peaks(platform.device_kind)
    if measured:
        data = _SESSION_MEASURED.get(platform.device_kind) or load_measured(platform)
        if data:
            return peaks_from_measurement(data, base, (base.name if base else platform.device_kind))
    return base


# -- roofline of one measurement ----------------------------------------------
def analyze(flops: float | None, bytes_accessed: float | None, seconds: float | None, dtype=None,
            peaks: Peaks | None = None) -> dict[str, Any]:
    """Achieved rates and where a measurement sits under the roofline.

    Returns ``tflops``, ``gbps``, ``intensity`` (FLOP/byte) and, with
    ``peaks``: ``pct_peak_flops``, ``pct_peak_bandwidth``, ``bound``
    (``"compute"``/``"memory"``), ``floor_ms`` (the roofline time) and
    ``pct_roofline`` (floor over measured time, 100 = at the roofline)."""
    out: dict[str, Any] = {"tflops": None, "gbps": None, "intensity": None, "pct_peak_flops": None,
                           "pct_peak_bandwidth": None, "bound": None, "floor_ms": None, "pct_roofline": None}
    if not seconds or seconds <= 0 or not np.isfinite(seconds):
        return out
    flops = float(flops or 0.0)
    bytes_accessed = float(bytes_accessed or 0.0)
    if flops > 0:
        out["tflops"] = flops / seconds / T
    if bytes_accessed > 0:
        out["gbps"] = bytes_accessed / seconds / G
    if flops > 0 and bytes_accessed > 0:
        out["intensity"] = flops / bytes_accessed
    if peaks is None:
        return out
    peak_flops = peaks.flops_for(dtype)
    peak_bw = peaks.memory_bandwidth
    t_compute = flops / peak_flops if peak_flops and flops > 0 else 0.0
    t_memory = bytes_accessed / peak_bw if peak_bw and bytes_accessed > 0 else 0.0
    if peak_flops and flops > 0:
        out["pct_peak_flops"] = 100.0 * flops / seconds / peak_flops
    if peak_bw and bytes_accessed > 0:
        out["pct_peak_bandwidth"] = 100.0 * bytes_accessed / seconds / peak_bw
    floor = max(t_compute, t_memory)
    if floor > 0:
        out["bound"] = "compute" if t_compute >= t_memory else "memory"
        out["floor_ms"] = floor * 1e3
        out["pct_roofline"] = 100.0 * floor / seconds
    return out
