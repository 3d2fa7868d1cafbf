"""Dispatch of the norm ops on TPUs: the backward op's default rule apart from the forward's.

A Mosaic TPU backward measured slower than XLA on a generation (`TPU_BACKWARD_SLOWER_THAN_XLA`)
is passed over by the default chain there while the forward kernel stays the default; an
explicit ``implementation="mosaic_tpu"`` still runs both kernels; `stellax info` says why.
Lowered for tpu on the CPU (the kernels' names in the HLO say which ones run)."""

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.core import lowering_target
from stellax.core.op import backward_implementation
from stellax.ops.norm import configs, layer_norm_backward_op, layer_norm_op

MEASURED = "rms_norm 16384x8192 bf16: 0.64x XLA in a test"


@pytest.fixture
def slower_on_v5e(monkeypatch):
    monkeypatch.setattr(configs, "TPU_BACKWARD_SLOWER_THAN_XLA", {"v5e": MEASURED})


def _shapes(rows=64, features=256, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct((rows, features), dtype), jax.ShapeDtypeStruct((features,), dtype)


def _kernels_in_gradient(generation, implementation=None, residual=False):
    """Names of the norm kernels in the tpu lowering of ``grad(sum(rms_norm(x)·c))`` on ``generation``."""
    x, scale = _shapes()

    def loss(x, scale, res):
        out = stellax.rms_norm(x, scale, residual=res, implementation=implementation)
        y = out[0] if residual else out
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32)))

    with lowering_target(generation):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2) if residual else (0, 1))).trace(
            x, scale, x if residual else None).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    return {name for name in ("stellax_norm_forward_tpu", "stellax_norm_backward_tpu") if name in text}


def test_backward_defers_to_xla_apart_from_the_forward(slower_on_v5e):
    x, scale = _shapes()
    call = layer_norm_op.check(x, scale, subtract_mean=False)
    stat = jax.ShapeDtypeStruct((x.shape[0],), jnp.float32)
    back = layer_norm_backward_op.check(x, x, scale, None, stat, stat, subtract_mean=False)
    with lowering_target("v5e"):
        assert layer_norm_op.select(call).name == "mosaic_tpu"        # the forward stays the default
        assert layer_norm_backward_op.select(back).name == "xla"      # the backward defers
        assert layer_norm_backward_op.select(back, "mosaic_tpu").name == "mosaic_tpu"  # on request
        assert backward_implementation(layer_norm_backward_op, "mosaic_tpu", explicit=False)[-1] == "xla"
        assert "mosaic_tpu" not in backward_implementation(layer_norm_backward_op, "mosaic_tpu", explicit=False)
        assert backward_implementation(layer_norm_backward_op, "mosaic_tpu", explicit=True) == ("mosaic_tpu",)
        assert backward_implementation(layer_norm_backward_op, "mosaic_tpu") == ("mosaic_tpu",)
    with lowering_target("v6e"):  # not measured slower there: both kernels are the default
        assert layer_norm_backward_op.select(back).name == "mosaic_tpu"
        assert backward_implementation(layer_norm_backward_op, "mosaic_tpu", explicit=False) == ("mosaic_tpu",)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_gradient_runs_xla_backward_by_default_and_the_kernel_on_request(slower_on_v5e, residual):
    assert _kernels_in_gradient("v5e", residual=residual) == {"stellax_norm_forward_tpu"}
    assert _kernels_in_gradient("v5e", "mosaic_tpu", residual) == {"stellax_norm_forward_tpu",
                                                                   "stellax_norm_backward_tpu"}
    assert _kernels_in_gradient("v6e", residual=residual) == {"stellax_norm_forward_tpu",
                                                              "stellax_norm_backward_tpu"}


def test_nothing_defers_without_a_measurement():
    """The shipped table is what decides: with no generation in it, the default gradient on a
    v5e runs both kernels."""
    with lowering_target("v5e") as platform:
        assert configs.norm_tpu_backward_defers_to_xla(platform) is None
        for generation in configs.TPU_BACKWARD_SLOWER_THAN_XLA:
            assert configs.TPU_BACKWARD_SLOWER_THAN_XLA[generation]  # each entry says what was measured
    expected = {"stellax_norm_forward_tpu", "stellax_norm_backward_tpu"}
    if "v5e" not in configs.TPU_BACKWARD_SLOWER_THAN_XLA:
        assert _kernels_in_gradient("v5e") == expected


def test_info_says_why(slower_on_v5e, capsys, monkeypatch):
    from stellax.cli import main

    with lowering_target("v5e"):
        assert main(["info"]) == 0
    with_entry = capsys.readouterr().out
    monkeypatch.setattr(configs, "TPU_BACKWARD_SLOWER_THAN_XLA", {})
    with lowering_target("v5e"):
        assert main(["info"]) == 0
    without = capsys.readouterr().out
    phrase = "measured slower than XLA on a v5e"
    assert with_entry.count(phrase) == without.count(phrase) + 1
