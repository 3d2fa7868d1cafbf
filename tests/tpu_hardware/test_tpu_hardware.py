"""The hardware tier: every Mosaic TPU kernel natively on a TPU against the golden.

``pytest -m tpu_hardware -p no:xdist tests/tpu_hardware`` on a TPU host (one
process holds the chip: no xdist). Every op with a ``mosaic_tpu``
implementation, on each of its built-in examples — small shapes and odd ones:
lengths that are not multiples of 128 or of the blocks, GQA and MQA, masks,
windows, segments, soft-cap and sinks, empty and skewed groups, ragged pages,
quantized caches — in float32 (``precision="highest"``, held to 1e-5 relative
to the float32 golden) and bfloat16, forward and gradients
(`stellax.testing.validation.check_example`, which also runs each twice and
requires bitwise-equal results).

The checks are compile-bound, so the session computes them all at once in
threads (XLA compiles outside the GIL; the device runs what is ready), then
each test reports its own result. Without a TPU every case is skipped, saying so.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import pytest

import stellax
from stellax.core import current_platform

pytestmark = pytest.mark.tpu_hardware

PLATFORM = current_platform()
ON_TPU = PLATFORM.backend == "tpu" and PLATFORM.tpu is not None and PLATFORM.tpu.kernels
NO_TPU = f"needs a TPU v5e or newer (this device is {PLATFORM.describe()}): run it on a TPU host"
DTYPES = ("float32", "bfloat16")


def _cases() -> list[tuple[str, str, int]]:
    """(op, dtype, example index) for every Mosaic TPU op; examples are only counted on a TPU."""
    if not ON_TPU:
        return []
    from stellax.testing.validation import examples_of

    ops = stellax.registered_ops()
    return [(name, dtype, index) for name in sorted(ops) if "mosaic_tpu" in ops[name].implementations
            for dtype in DTYPES for index in range(len(examples_of(ops[name], dtype)))]


CASES = _cases()


@pytest.fixture(scope="session")
def results(request):
    """The row (`stellax.testing.report.row_of`) of every case this session selected (``-k``
    narrows it), computed in threads."""
    from stellax.testing import report
    from stellax.testing.plan import CheckJob

    selected = [item.callspec.params["case"] for item in request.session.items
                if hasattr(item, "callspec") and "case" in item.callspec.params]
    ops = stellax.registered_ops()
    jobs = [CheckJob(ops[name], "mosaic_tpu", dtype, index, bool(ops[name].differentiable))
            for name, dtype, index in selected]
    threads = max(1, min(12, (os.cpu_count() or 2) - 1))
    run = report.run_quietly(jobs, platform=PLATFORM.describe(), mode="tpu_hardware", threads=threads)
    return dict(zip(selected, run.rows))  # rows come back in the jobs' order


@pytest.mark.skipif(not ON_TPU, reason=NO_TPU)
@pytest.mark.parametrize("case", CASES, ids=[f"{n}-{d}-ex{i}" for n, d, i in CASES])
def test_mosaic_tpu_kernel_on_the_chip(case, results):
    row = results[case]
    if row["result"] == "skip":
        pytest.skip(f"{case[0]} example {case[2]}: {row['detail']}")
    assert row["result"] == "ok", (f"{case[0]} mosaic_tpu {case[1]} {row['example']!r}: rel L2 {row['rel_l2']} "
                                   f"(tolerance {row['tolerance']}) {row['detail']}")


@pytest.mark.skipif(ON_TPU, reason="on a TPU the cases above run")
def test_tier_needs_a_tpu():
    pytest.skip(NO_TPU)
