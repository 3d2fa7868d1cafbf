"""layer_norm / rms_norm: Triton (interpreted) and XLA vs the float32 golden."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.norm import NormConfig, layer_norm_backward_op, layer_norm_op
from stellax.testing import (assert_close, assert_deterministic, assert_fits_smem, check_op_lowering,
                             compile_triton_to_ptx, lower_for_gpu, random_array, triton_compiler_available)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
LENGTHS = [1, 3, 127, 1000, 4097]


def _inputs(rows, features, dtype, seed=0):
    kx, ks, ko, kr = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = random_array(kx, (rows, features), dtype, offset=0.5)
    scale = random_array(ks, (features,), dtype, scale=0.2, offset=1.0)
    offset = random_array(ko, (features,), dtype, scale=0.2)
    residual = random_array(kr, (rows, features), dtype)
    return x, scale, offset, residual


def _check_forward_and_grads(impl, dtype, x, scale, offset, **kwargs):
    def run(x, scale, offset):
        return stellax.layer_norm(x, scale, offset, implementation=impl, **kwargs)

    def ref(x, scale, offset):
        f32 = lambda a: None if a is None else a.astype(jnp.float32)
        return layer_norm_op.reference(f32(x), f32(scale), f32(offset), **kwargs)

    out = jax.jit(run)(x, scale, offset)
    assert out.dtype == x.dtype
    assert_close(out, ref(x, scale, offset), dtype=dtype, name="y")
    cot = random_array(jax.random.PRNGKey(9), x.shape, jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)
    argnums = tuple(i for i, a in enumerate((x, scale, offset)) if a is not None)
    grads = jax.jit(jax.grad(loss(run), argnums=argnums))(x, scale, offset)
    ref_grads = jax.grad(loss(ref), argnums=argnums)(x, scale, offset)
    for name, g, r in zip(("dx", "dscale", "doffset"), grads, ref_grads):
        assert g.dtype == r.dtype
        assert_close(g, r, dtype=dtype, gradient=True, name=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("features", LENGTHS)
def test_triton_layer_norm_matches_golden(dtype, features):
    x, scale, offset, _ = _inputs(5, features, dtype)
    with stellax.interpret_mode():
        _check_forward_and_grads("triton", dtype, x, scale, offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("features", [3, 1000])
def test_triton_rms_norm_matches_golden(dtype, features):
    x, scale, _, _ = _inputs(7, features, dtype, seed=1)
    with stellax.interpret_mode():
        _check_forward_and_grads("triton", dtype, x, scale, None, subtract_mean=False)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("features", LENGTHS)
def test_layer_norm_all_rows_lengths_f32(impl, features):
    x, scale, offset, _ = _inputs(3, features, jnp.float32, seed=features)
    with stellax.interpret_mode():
        _check_forward_and_grads(impl, jnp.float32, x, scale, offset)


@pytest.mark.parametrize("config", [NormConfig(block_rows=1, num_warps=2, num_stages=1),
                                    NormConfig(block_rows=16, num_warps=8, num_stages=1)])
def test_block_rows_not_dividing_rows(config):
    x, scale, offset, _ = _inputs(37, 129, jnp.float32, seed=3)
    with stellax.interpret_mode():
        out = stellax.layer_norm(x, scale, offset, implementation="triton", config=config)
    assert_close(out, layer_norm_op.reference(x, scale, offset), name="y")


def test_other_axis_and_no_scale_offset():
    x = random_array(jax.random.PRNGKey(4), (6, 33, 4), jnp.float32)
    with stellax.interpret_mode():
        _check_forward_and_grads("triton", jnp.float32, x, None, None, axis=1)
        _check_forward_and_grads("triton", jnp.float32, x, random_array(jax.random.PRNGKey(5), (6,)), None,
                                 axis=0)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_fused_residual_add(impl, dtype):
    x, scale, offset, residual = _inputs(6, 333, dtype, seed=5)

    def run(x, residual, scale):
        return stellax.layer_norm(x, scale, offset, residual=residual, implementation=impl)

    def ref(x, residual, scale):
        f32 = lambda a: a.astype(jnp.float32)
        return layer_norm_op.reference(f32(x), f32(scale), f32(offset), residual=f32(residual))

    with stellax.interpret_mode():
        y, h = jax.jit(run)(x, residual, scale)
        y_ref, h_ref = ref(x, residual, scale)
        assert_close(y, y_ref, dtype=dtype, name="y")
        assert_close(h, h_ref, dtype=dtype, name="h")
        c1 = random_array(jax.random.PRNGKey(1), x.shape, jnp.float32)
        c2 = random_array(jax.random.PRNGKey(2), x.shape, jnp.float32)
        loss = lambda f: lambda *a: jnp.sum(f(*a)[0].astype(jnp.float32) * c1 + f(*a)[1].astype(jnp.float32) * c2)
        grads = jax.grad(loss(run), argnums=(0, 1, 2))(x, residual, scale)
        ref_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(x, residual, scale)
    for name, g, r in zip(("dx", "dresidual", "dscale"), grads, ref_grads):
        assert_close(g, r, dtype=dtype, gradient=True, name=name)


def test_deterministic_forward_and_backward():
    x, scale, offset, _ = _inputs(33, 1000, jnp.bfloat16, seed=6)

    def fwd_bwd(x, scale, offset):
        f = lambda x, s, o: jnp.sum(stellax.layer_norm(x, s, o, implementation="triton").astype(jnp.float32) ** 2)
        return jax.value_and_grad(f, argnums=(0, 1, 2))(x, scale, offset)

    with stellax.interpret_mode():
        assert_deterministic(jax.jit(fwd_bwd), x, scale, offset)


def test_rms_norm_helper_matches_formula():
    x = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32)
    scale = np.linspace(0.5, 1.5, 50).astype(np.float32)
    expected = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-6) * scale
    np.testing.assert_allclose(stellax.rms_norm(jnp.asarray(x), jnp.asarray(scale)), expected, rtol=2e-5, atol=2e-5)


# -- bad input -------------------------------------------------------------------
@pytest.mark.parametrize("call, error, pattern", [
    (lambda: stellax.layer_norm(jnp.float32(1.0)), ValueError, "x: expected rank"),
    (lambda: stellax.layer_norm(jnp.ones((2, 8)), jnp.ones(7)), ValueError, r"scale: expected shape \(8,\)"),
    (lambda: stellax.layer_norm(jnp.ones((2, 8)), None, jnp.ones((8, 1))), ValueError, "offset"),
    (lambda: stellax.layer_norm(jnp.ones((2, 8), jnp.int32)), TypeError, "x: expected a floating dtype"),
    (lambda: stellax.layer_norm(jnp.ones((2, 8)), axis=2), ValueError, "axis: expected an axis in"),
    (lambda: stellax.layer_norm(jnp.ones((2, 8)), epsilon=0.0), ValueError, "epsilon"),
    (lambda: stellax.layer_norm(jnp.ones((2, 8)), residual=jnp.ones((2, 7))), ValueError, "residual"),
    (lambda: stellax.layer_norm(jnp.ones((2, 8)), residual=jnp.ones((2, 8), jnp.bfloat16)), TypeError, "residual"),
    (lambda: stellax.layer_norm([[1.0, 2.0]]), TypeError, "x: expected an array"),
])
def test_bad_input_names_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


# -- lowering ----------------------------------------------------------------------
def test_cuda_lowering_default_config():
    """The default tier's lowering check (the extended tier lowers every config): the config
    dispatch resolves, forward with its gradient, the backward op, the fused residual."""
    x = jax.ShapeDtypeStruct((9, 127), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((127,), jnp.bfloat16)
    assert check_op_lowering(layer_norm_op, "triton", (x, s, s), configs=[None], grad=True) == 1
    rows = jax.ShapeDtypeStruct((9,), jnp.float32)
    assert check_op_lowering(layer_norm_backward_op, "triton", (x, x, s, s, rows, rows, x), configs=[None]) == 1
    assert check_op_lowering(layer_norm_op, "triton", (x, s, None), {"residual": x, "subtract_mean": False},
                             configs=[None]) == 1


@pytest.mark.parametrize("features", [127, 4097])
def test_cuda_lowering_every_config(features):
    x = jax.ShapeDtypeStruct((9, features), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((features,), jnp.bfloat16)
    assert check_op_lowering(layer_norm_op, "triton", (x, s, s), grad=True) > 1
    rows = jax.ShapeDtypeStruct((9,), jnp.float32)
    assert check_op_lowering(layer_norm_backward_op, "triton", (x, x, s, s, rows, rows, x)) > 1
    assert check_op_lowering(layer_norm_op, "triton", (x, s, None), {"residual": x, "subtract_mean": False}) > 1


@pytest.mark.ptx
@pytest.mark.parametrize("features", [128, 4097, 16384])
def test_ptx_compile_and_shared_memory(features):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    x = jax.ShapeDtypeStruct((64, features), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((features,), jnp.bfloat16)
    call = layer_norm_op.check(x, s, s)
    for config in layer_norm_op.implementations["triton"].config_space(call):
        def loss(x, s):
            with stellax.use_configs({("layer_norm", "triton"): config, ("layer_norm_backward", "triton"): config}):
                return jnp.sum(stellax.layer_norm(x, s, s).astype(jnp.float32))
        lowered = lower_for_gpu(jax.grad(loss, argnums=(0, 1)), x, s)
        for arch in ("8.0", "9.0"):
            assert_fits_smem(compile_triton_to_ptx(lowered, arch), arch)
