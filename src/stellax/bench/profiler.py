"""`--profile DIR`: a ``jax.profiler`` trace of the benchmark run.

The trace (``DIR/plugins/profile/<run>/*.xplane.pb`` and a Perfetto
``*.trace.json.gz``) opens in XProf/TensorBoard or at ui.perfetto.dev; each
measurement is a named ``stellax.bench ...`` annotation. CUPTI allows one
subscriber, so while profiling, GPU times come from the batched wall clock.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import jax


@contextlib.contextmanager
def profile(directory: str | None):
    """Trace everything inside the block into ``directory`` (no-op for ``None``)."""
    if not directory:
        yield None
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    try:
        jax.profiler.start_trace(str(path), create_perfetto_trace=True)
    except TypeError:  # older signature
        jax.profiler.start_trace(str(path))
    try:
        yield path
    finally:
        jax.profiler.stop_trace()


def trace_files(directory: str) -> list[str]:
    root = Path(directory)
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and (
        p.name.endswith(".xplane.pb") or p.name.endswith(".trace.json.gz") or p.name.endswith(".json.gz")))
