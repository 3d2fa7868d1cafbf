"""Host memory of a bare JAX process on the default device: the floor under `stellax check`'s.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/host_memory_tpu.py --out $OUT/host_memory.json

Issue 35 asks the quick check to stay under 4 GB of host memory on a v5e. This
starts the backend (``jax.devices()``) and runs one tiny computation, importing
nothing of stellax before measuring, then records the process's memory as
`stellax.testing.process_memory.host_memory` counts it for the check: ``peak_rss`` (the
most it held), ``device_mapped`` (the accelerator's memory mapped into the
process, part of the RSS) and ``peak_host`` (their difference: host RAM). On a
v5e (2026-12-07) the bare process alone peaked at 6.0 GB of host memory, more
than the quick check's 5.3 GB: the runtime, not stellax, sets that floor.

The JSON (``--out``) holds ``{"format": "stellax-host-memory", "version": 1,
"device", "date", "backend_seconds", "ru_maxrss_kb", "host_memory": {...}}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import sys
import time


def measure() -> dict:
    """Start the backend, run one tiny computation, return the process's memory figures."""
    import jax
    import jax.numpy as jnp

    start = time.perf_counter()
    device = jax.devices()[0]
    (jnp.ones(4) + 1).block_until_ready()
    backend_seconds = time.perf_counter() - start
    maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # before stellax is imported
    from stellax.testing.process_memory import host_memory

    return {"format": "stellax-host-memory", "version": 1, "device": device.device_kind,
            "date": datetime.date.today().isoformat(), "backend_seconds": round(backend_seconds, 2),
            "ru_maxrss_kb": maxrss_kb, "host_memory": host_memory()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    result = measure()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    memory = result["host_memory"]
    print(f"{result['device']}: backend up in {result['backend_seconds']} s; peak RSS "
          f"{memory.get('peak_rss', 0) / 1e9:.2f} GB, device-mapped {memory.get('device_mapped', 0) / 1e9:.2f} GB, "
          f"host {memory.get('peak_host', memory.get('peak_rss', 0)) / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
