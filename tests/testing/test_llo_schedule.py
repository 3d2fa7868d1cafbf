"""The static schedule tool (`stellax.testing.llo_schedule`) on the real TPU compiler's dumps
(libtpu, no TPU): the linear-attention forward kernel (`linear_attention.tpu_cases`) compiled for a
v5e, its matmul issues against `tpu_costs`' inventory, and the overlap of the heads of a grid step."""

from __future__ import annotations

import pytest

from stellax.ops.linear_attention.mxu import BF16_PRODUCTS
from stellax.ops.linear_attention.tpu_costs import chunk_matmul_issues
from stellax.testing.llo_schedule import kernel_schedules, main, parse_dump
from stellax.testing.tpu_compile import libtpu_available

LIBTPU, WHY_NOT = libtpu_available()
needs_libtpu = pytest.mark.skipif(not LIBTPU, reason=WHY_NOT)
BUILDER = "stellax.ops.linear_attention.tpu_cases:kernel_case"


def _forward(**kwargs):
    schedules = kernel_schedules(BUILDER, "v5e", heads=2, tokens=128, **kwargs)
    (name, schedule), = [(n, s) for n, s in schedules.items() if "forward" in n]
    return name, schedule


@needs_libtpu
def test_gdn_forward_schedule_counts_the_models_matmuls():
    """bfloat16 GDN at chunk 64, one head per step: every MXU issue is a bfloat16 one (no float32
    operand reaches the MXU), as many as `tpu_costs` counts for the chunk step, and a critical path
    and per-unit bundle counts are read."""
    name, s = _forward(kind="gdn", chunk=64, heads_per_step=1)
    assert name.startswith("linear_attention_scalar_forward"), name
    assert set(s.matmuls) == {"bf16"}, s.matmuls
    want = chunk_matmul_issues(64, 128, 128, per_channel=False, delta=True, products=BF16_PRODUCTS)
    assert abs(s.matmuls["bf16"] - want) <= 0.05 * want, (s.matmuls, want)
    assert s.bundles > s.count("vmatmul") / 4 and s.critical_path > 0, s.describe()
    assert {"MXU", "VALU", "VSTORE"} <= set(s.unit_bundles), s.unit_bundles


@needs_libtpu
def test_heads_of_a_step_overlap():
    """Two heads per step take less than 1.5 times one head's critical path (the batched chunk
    function: written head after head, the compiler chained the heads, 1.9-3.7 times)."""
    _, one = _forward(kind="gdn", chunk=64, heads_per_step=1)
    _, two = _forward(kind="gdn", chunk=64, heads_per_step=2)
    assert two.count("vmatmul") == 2 * one.count("vmatmul"), (one.matmuls, two.matmuls)
    assert two.critical_path < 1.5 * one.critical_path, (one.describe(), two.describe())


def test_parse_dump_of_an_empty_directory(tmp_path):
    assert parse_dump(str(tmp_path)) == {}


def test_builder_must_name_a_function():
    with pytest.raises(ValueError, match="module:function"):
        main(["stellax.ops.linear_attention.tpu_cases", "--dump=/nonexistent"])
