"""Dispatch on TPUs: mosaic_tpu first on v5e and newer, XLA on v4 and off TPUs."""

import pytest

import stellax
from stellax.core import Platform, lowering_target
from stellax.core.op import backend_support
from stellax.testing.validation import abstract_examples_of

# Dispatch reads shapes, dtypes and metadata only: the abstract examples (built at collection,
# `abstract_examples_of`) select exactly what the concrete ones do, without computing every op's
# random inputs (that took ~100 s of this file's time on the 2-core CPU).
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
    example = abstract_examples_of(op, "float32")[0]
    call = op.check(*example.args, **example.kwargs)
    for generation in ("v5e", "v6e", "tpu7x"):
        with lowering_target(generation) as platform:
            kernel = op.implementations["mosaic_tpu"]
            if kernel.supported(call):
                deferred = kernel.defers_to_xla is not None and kernel.defers_to_xla(platform)
                assert (op.select(call).name != "mosaic_tpu") == bool(deferred), (name, generation)
                assert op.select(call, "mosaic_tpu").name == "mosaic_tpu"  # an explicit request runs it
    with lowering_target("v4"):
        chosen = op.select(call).name
    assert chosen != "mosaic_tpu" and chosen in names, (name, chosen)
    assert "xla_chunked" not in names or names.index("xla_chunked") < names.index("xla")


def test_cpu_never_picks_tpu_kernels_by_default():
    for name, op in TPU_OPS:
        example = abstract_examples_of(op, "float32")[0]
        call = op.check(*example.args, **example.kwargs)
        assert op.select(call).name != "mosaic_tpu", name


def test_a_kernel_measured_slower_than_xla_is_not_the_default_there(capsys):
    """The GLU kernels lost to XLA on a v5e (measured): the default chain passes them over there,
    for the forward and the backward op, says why, and still runs them on request; on the
    generations where they were not measured slower they stay the default."""
    glu = stellax.registered_ops()["gated_linear_unit"]
    example = abstract_examples_of(glu, "bfloat16")[0]
    call = glu.check(*example.args, **example.kwargs)
    for name in ("gated_linear_unit", "gated_linear_unit_backward"):
        kernel = stellax.registered_ops()[name].implementations["mosaic_tpu"]
        with lowering_target("v5e") as platform:
            assert "slower than XLA on a v5e" in kernel.defers_to_xla(platform)
        with lowering_target("v6e") as platform:
            assert kernel.defers_to_xla(platform) is None
    with lowering_target("v5e"):
        assert glu.select(call).name == "xla"
        assert glu.select(call, ("mosaic_tpu", "xla")).name == "mosaic_tpu"
    with lowering_target("v6e"):
        assert glu.select(call).name == "mosaic_tpu"
    paged = stellax.registered_ops()["paged_attention"]  # its head-group decode kernel beats XLA on a v5e
    example = abstract_examples_of(paged, "bfloat16")[0]
    call = paged.check(*example.args, **example.kwargs)
    with lowering_target("v5e"):
        assert paged.select(call).name == "mosaic_tpu"
    from stellax.cli import main

    with lowering_target("v5e"):
        assert main(["info"]) == 0
    assert "explicit request only: measured slower than XLA on a v5e" in capsys.readouterr().out



@pytest.mark.parametrize("name", ["fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "ssd_step"])
def test_decode_kernels_measured_slower_than_xla_on_a_v5e_are_not_its_default(name):
    """The TPU suite's bench stage timed the decode kernels at 0.21-0.81x XLA on a v5e (one state
    per grid step): the default chain runs XLA there and says why; the kernel still runs on
    request, and stays the default where it was not measured."""
    op = stellax.registered_ops()[name]
    example = abstract_examples_of(op, "bfloat16")[0]
    call = op.check(*example.args, **example.kwargs)
    kernel = op.implementations["mosaic_tpu"]
    with lowering_target("v5e") as platform:
        assert "measured slower than XLA on a v5e" in kernel.defers_to_xla(platform)
        assert op.select(call).name == "xla"
        assert op.select(call, "mosaic_tpu").name == "mosaic_tpu"
    with lowering_target("v6e") as platform:
        assert kernel.defers_to_xla(platform) is None and op.select(call).name == "mosaic_tpu"
