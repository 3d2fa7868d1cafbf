"""The op framework: dispatch, fallback chains, configs, interpret mode, poisoning."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import (Call, Implementation, KernelConfig, Op, TritonConfig, UnsupportedError,
                          interpret_enabled, interpret_mode, lowering_target, observe_calls, product_space,
                          use_configs)
from stellax.core.pallas import operand, output, triton_kernel_call
from stellax.ops.norm import NormConfig, layer_norm_op


def test_default_on_cpu_is_xla():
    x = jnp.ones((2, 8))
    call = layer_norm_op.check(x)
    assert layer_norm_op.select(call).name == "xla"
    with interpret_mode():  # interpreted kernels are never the CPU default
        assert layer_norm_op.select(call).name == "xla"


def test_explicit_kernel_on_cpu_needs_interpret_mode():
    x = jnp.ones((2, 8))
    with interpret_mode(False):
        with pytest.raises(UnsupportedError, match="needs a GPU.*interpret"):
            stellax.layer_norm(x, implementation="triton")
    with interpret_mode():
        y = stellax.layer_norm(x, implementation="triton")
    assert y.shape == x.shape


def test_sequence_falls_back_in_order():
    x = jnp.ones((2, 8))
    call = layer_norm_op.check(x)
    with interpret_mode(False):
        assert layer_norm_op.select(call, ("triton", "xla")).name == "xla"
    with interpret_mode():
        assert layer_norm_op.select(call, ("triton", "xla")).name == "triton"


def test_unknown_implementation_named():
    with pytest.raises(ValueError, match="implementation.*'cuda_magic'"):
        stellax.layer_norm(jnp.ones((2, 8)), implementation="cuda_magic")


def test_interpret_env_variable(monkeypatch):
    monkeypatch.setenv("STELLAX_INTERPRET", "1")
    assert interpret_enabled()
    with interpret_mode(False):
        assert not interpret_enabled()
    monkeypatch.setenv("STELLAX_INTERPRET", "0")
    assert not interpret_enabled()


def test_lowering_target_selects_kernel_without_interpret():
    call = layer_norm_op.check(jnp.ones((2, 8)))
    with lowering_target("h100") as platform:
        assert platform.compute_capability == (9, 0)
        assert not interpret_enabled()
        assert layer_norm_op.select(call).name == "triton"
    with pytest.raises(ValueError, match="target"):
        with lowering_target("tpu_v99"):
            pass


def test_op_requires_xla_implementation():
    with pytest.raises(ValueError, match="'xla' implementation"):
        Op("no_xla", check=lambda x: Call({"x": x}, {}), reference=lambda c: c.x,
           implementations=[Implementation("triton", lambda c, cfg: c.x, backend="triton")])


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="NormConfig.block_rows.*power of two.*3"):
        NormConfig(block_rows=3)
    with pytest.raises(ValueError, match="num_warps"):
        NormConfig(num_warps=3)
    cfg = NormConfig(block_rows=8, num_warps=4, num_stages=1)
    assert NormConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        NormConfig.from_dict({"block_rows": 2, "bogus": 1})


def test_product_space_drops_invalid():
    space = product_space(NormConfig, block_rows=(1, 3, 4), num_warps=(4,), num_stages=(1,))
    assert [c.block_rows for c in space] == [1, 4]


def test_config_precedence_explicit_context_heuristic():
    x = jnp.ones((4, 16))
    call = layer_norm_op.check(x)
    impl = layer_norm_op.implementations["triton"]
    seen = []

    def observer(op, implementation, call, config):
        seen.append((op.name, implementation.name, config))

    explicit = NormConfig(block_rows=2, num_warps=2, num_stages=1)
    context = NormConfig(block_rows=4, num_warps=8, num_stages=1)
    with interpret_mode(), observe_calls(observer):
        stellax.layer_norm(x, implementation="triton")
        with use_configs({("layer_norm", "triton"): context}):
            stellax.layer_norm(x, implementation="triton")
            stellax.layer_norm(x, implementation="triton", config=explicit)
    assert seen[0][2] == impl.heuristic(call)
    assert seen[1][2] == context
    assert seen[2][2] == explicit
    with pytest.raises(TypeError, match="NormConfig"):
        with interpret_mode():
            stellax.layer_norm(x, implementation="triton", config=TritonConfig())


def test_observer_sees_backward_op_under_grad():
    x = jnp.ones((4, 16)) * jnp.arange(16.0)
    names = []
    with observe_calls(lambda op, impl, call, cfg: names.append(op.name)):
        jax.grad(lambda x: jnp.sum(stellax.layer_norm(x) ** 2))(x)
    assert "layer_norm" in names and "layer_norm_backward" in names


def test_call_signature_is_abstract():
    a = layer_norm_op.check(jnp.ones((4, 16)), epsilon=1e-5)
    b = layer_norm_op.check(jnp.zeros((4, 16)), epsilon=1e-5)
    c = layer_norm_op.check(jnp.zeros((4, 16)), epsilon=1e-6)
    assert a.signature() == b.signature() != c.signature()
    hash(a.signature())


def test_poisoned_outputs_catch_unwritten_elements():
    from jax.experimental import pallas as pl

    def half_kernel(*, x, o):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o[...] = x[...]

    def run(x):
        spec = pl.BlockSpec((8,), lambda i: (i,))
        return triton_kernel_call(half_kernel, grid=(2,), inputs=dict(x=operand(x, spec)),
                                  outputs=dict(o=output(x.shape, x.dtype, spec)), num_warps=1, num_stages=1,
                                  name="half").o

    with interpret_mode():
        y = np.asarray(run(jnp.arange(16.0)))
    assert np.array_equal(y[:8], np.arange(8.0))
    assert np.isnan(y[8:]).all()


def test_kernels_work_under_vmap_and_jit():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 33))
    with interpret_mode():
        batched = jax.jit(jax.vmap(lambda r: stellax.layer_norm(r, implementation="triton")))(x)
    ref = layer_norm_op.reference(x)
    np.testing.assert_allclose(batched, ref, atol=1e-5, rtol=1e-5)
