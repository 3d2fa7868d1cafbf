"""Dispatch on TPUs: mosaic_tpu first on v5e and newer, XLA on v4 and off TPUs."""

import jax.numpy as jnp
import pytest

import stellax
from stellax.core import Platform, lowering_target
from stellax.core.op import backend_support
from stellax.testing.validation import examples_of

TPU_OPS = sorted((name, op) for name, op in stellax.registered_ops().items() if "mosaic_tpu" in op.implementations)


def test_backend_support_by_generation():
    assert backend_support("mosaic_tpu", Platform("tpu", "TPU v6 lite"))
    assert backend_support("mosaic_tpu", Platform("tpu", "TPU7x"))
    old = backend_support("mosaic_tpu", Platform("tpu", "TPU v4"))
    assert not old and "v5e or newer" in old.reason and "TPU v4 (v4)" in old.reason
    assert not backend_support("mosaic_tpu", Platform("tpu", "TPU v9 mystery"))
    assert not backend_support("mosaic_tpu", Platform("gpu", "NVIDIA H200", (9, 0), "nvidia"))


@pytest.mark.skipif(not TPU_OPS, reason="no op has a mosaic_tpu implementation yet")
@pytest.mark.parametrize("name,op", TPU_OPS, ids=[n for n, _ in TPU_OPS])
def test_tpu_default_chain_starts_with_mosaic_tpu(name, op):
    names, explicit = op.candidates(None)
    assert not explicit and names[0] == "mosaic_tpu" and names[-1] == "xla", names
    example = examples_of(op, "float32")[0]
    call = op.check(*example.args, **example.kwargs)
    for generation in ("v5e", "v6e", "tpu7x"):
        with lowering_target(generation):
            if op.implementations["mosaic_tpu"].supported(call):
                assert op.select(call).name == "mosaic_tpu", (name, generation)
    with lowering_target("v4"):
        chosen = op.select(call).name
    assert chosen != "mosaic_tpu" and chosen in names, (name, chosen)
    assert "xla_chunked" not in names or names.index("xla_chunked") < names.index("xla")


def test_cpu_never_picks_tpu_kernels_by_default():
    for name, op in TPU_OPS:
        example = examples_of(op, "float32")[0]
        call = op.check(*example.args, **example.kwargs)
        assert op.select(call).name != "mosaic_tpu", name
