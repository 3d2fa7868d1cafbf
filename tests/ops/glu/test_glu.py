"""gated_linear_unit: fused Triton kernels (interpreted) and XLA vs the float32 golden."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.glu import GluConfig, gated_linear_unit_backward_op, gated_linear_unit_op
from stellax.ops.glu.activations import ACTIVATIONS
from stellax.testing import (assert_close, assert_deterministic, assert_fits_smem, check_op_lowering,
                             compile_triton_to_ptx, lower_for_gpu, random_array, triton_compiler_available)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SMALL = GluConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)


def _inputs(m, k, n, dtype, stacked=True, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = random_array(kx, (m, k), dtype)
    w = random_array(kw, (k, 2, n), jnp.float32, scale=1 / np.sqrt(k)).astype(dtype)
    return x, (w if stacked else (w[:, 0], w[:, 1]))


def _check(impl, dtype, x, weights, activation="silu", config=None):
    def run(x, weights):
        return stellax.gated_linear_unit(x, weights, activation=activation, implementation=impl, config=config)

    def ref(x, weights):
        up = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), (x, weights))
        return gated_linear_unit_op.reference(*up, activation=activation)

    out = jax.jit(run)(x, weights)
    assert out.dtype == x.dtype
    assert_close(out, ref(x, weights), dtype=dtype, name="y")
    cot = random_array(jax.random.PRNGKey(3), out.shape, jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * cot)
    gx, gw = jax.jit(jax.grad(loss(run), argnums=(0, 1)))(x, weights)
    rx, rw = jax.grad(loss(ref), argnums=(0, 1))(x, weights)
    assert_close(gx, rx, dtype=dtype, gradient=True, name="dx")
    for g, r in zip(jax.tree_util.tree_leaves(gw), jax.tree_util.tree_leaves(rw)):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(g, r, dtype=dtype, gradient=True, name="dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("m, k, n", [(1, 3, 5), (33, 127, 20), (40, 64, 70)])
def test_triton_matches_golden(dtype, m, k, n):
    x, w = _inputs(m, k, n, dtype, seed=m)
    with stellax.interpret_mode():
        _check("triton", dtype, x, w, config=SMALL)


@pytest.mark.parametrize("activation", sorted(set(ACTIVATIONS) - {"swish"}))
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "pair"])
def test_every_activation_and_weight_form(activation, stacked):
    x, w = _inputs(20, 24, 40, jnp.float32, stacked=stacked, seed=2)
    with stellax.interpret_mode():
        _check("triton", jnp.float32, x, w, activation=activation, config=SMALL)
        _check("xla", jnp.float32, x, w, activation=activation)


def test_callable_activation_and_leading_dims():
    x = random_array(jax.random.PRNGKey(0), (2, 3, 16), jnp.float32)
    _, w = _inputs(1, 16, 8, jnp.float32)
    act = lambda g: g * jnp.tanh(g)
    with stellax.interpret_mode():
        y = stellax.gated_linear_unit(x, w, activation=act, implementation="triton", config=SMALL)
    assert y.shape == (2, 3, 8)
    expected = act(x @ w[:, 0]) * (x @ w[:, 1])
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_default_heuristic_config_on_larger_shape():
    x, w = _inputs(130, 96, 72, jnp.bfloat16, seed=4)
    with stellax.interpret_mode():
        _check("triton", jnp.bfloat16, x, w)


def test_deterministic():
    x, w = _inputs(40, 50, 60, jnp.bfloat16, seed=5)

    def fwd_bwd(x, w):
        f = lambda x, w: jnp.sum(stellax.gated_linear_unit(x, w, implementation="triton", config=SMALL)
                                 .astype(jnp.float32) ** 2)
        return jax.value_and_grad(f, argnums=(0, 1))(x, w)

    with stellax.interpret_mode():
        assert_deterministic(jax.jit(fwd_bwd), x, w)


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: stellax.gated_linear_unit(jnp.ones((2, 8)), jnp.ones((8, 3, 4))), ValueError, r"weights: expected shape \(8, 2, \*\)"),
    (lambda: stellax.gated_linear_unit(jnp.ones((2, 8)), jnp.ones((7, 2, 4))), ValueError, "weights"),
    (lambda: stellax.gated_linear_unit(jnp.ones((2, 8)), (jnp.ones((8, 4)), jnp.ones((8, 5)))), ValueError, r"weights\[1\]"),
    (lambda: stellax.gated_linear_unit(jnp.ones((2, 8)), (jnp.ones((8, 4)),)), ValueError, "pair"),
    (lambda: stellax.gated_linear_unit(jnp.ones((2, 8), jnp.int8), jnp.ones((8, 2, 4))), TypeError, "x: expected a floating"),
    (lambda: stellax.gated_linear_unit(jnp.ones((2, 8)), jnp.ones((8, 2, 4)), activation="tanhh"), ValueError, "activation"),
    (lambda: stellax.gated_linear_unit(jnp.float32(1), jnp.ones((8, 2, 4))), ValueError, "x: expected rank"),
    (lambda: gated_linear_unit_backward_op(jnp.ones((2, 4)), jnp.ones((2, 8)), jnp.ones((8, 2, 4)), None,
                                           jnp.ones((2, 4))), ValueError, "gate, up: pass both"),
    (lambda: gated_linear_unit_backward_op(jnp.ones((2, 4)), jnp.ones((2, 8)), jnp.ones((8, 2, 4)), None,
                                           jnp.ones((2, 5)), jnp.ones((2, 4))), ValueError, r"gate: expected shape \(2, 4\)"),
])
def test_bad_input_names_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


def test_cuda_lowering_every_config():
    x = jax.ShapeDtypeStruct((100, 200), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((200, 2, 300), jnp.bfloat16)
    assert check_op_lowering(gated_linear_unit_op, "triton", (x, w), grad=True) == 7
    dy = jax.ShapeDtypeStruct((100, 300), jnp.bfloat16)
    assert check_op_lowering(gated_linear_unit_backward_op, "triton", (dy, x, w, None)) == 7
    wp = jax.ShapeDtypeStruct((200, 300), jnp.float32)
    xf = jax.ShapeDtypeStruct((100, 200), jnp.float32)
    assert check_op_lowering(gated_linear_unit_op, "triton", (xf, (wp, wp)), {"activation": "gelu"}) == 7


@pytest.mark.ptx
def test_ptx_compile_and_shared_memory():
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 2, 768), jnp.bfloat16)
    call = gated_linear_unit_op.check(x, w)
    for config in gated_linear_unit_op.implementations["triton"].config_space(call):
        table = {("gated_linear_unit", "triton"): config, ("gated_linear_unit_backward", "triton"): config}

        def loss(x, w):
            with stellax.use_configs(table):
                return jnp.sum(stellax.gated_linear_unit(x, w).astype(jnp.float32))

        kernels = compile_triton_to_ptx(lower_for_gpu(jax.value_and_grad(loss, argnums=(0, 1)), x, w), "9.0")
        assert len(kernels) == 3  # forward (keeping gate/up), dx, dW: no recompute kernel
        assert_fits_smem(kernels, "9.0")


def test_vmap_and_grad_of_kernel():
    x = random_array(jax.random.PRNGKey(0), (3, 20, 16), jnp.float32)
    _, w = _inputs(1, 16, 24, jnp.float32, seed=1)
    run = lambda impl: lambda a: stellax.gated_linear_unit(a, w, implementation=impl, config=SMALL if impl == "triton" else None)
    with stellax.interpret_mode():
        y = jax.vmap(run("triton"))(x)
        g = jax.vmap(jax.grad(lambda a: jnp.sum(run("triton")(a) ** 2)))(x)
    assert_close(y, jax.vmap(run("xla"))(x), name="vmap y")
    assert_close(g, jax.vmap(jax.grad(lambda a: jnp.sum(run("xla")(a) ** 2)))(x), gradient=True, name="vmap dx")


@pytest.mark.parametrize("stacked", [True, False])
def test_gradient_starts_from_the_saved_preactivations(stacked):
    """Differentiated, the forward keeps gate/up and the backward multiplies only for dx and dW:
    the XLA path's gradient has the forward's product(s) and the gradients', no recompute."""
    x, w = _inputs(16, 32, 24, jnp.float32, seed=3)
    weights = w if stacked else (w[:, 0], w[:, 1])
    loss = lambda x, weights: jnp.sum(stellax.gated_linear_unit(x, weights, implementation="xla") ** 2)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, weights))
    forward_products = 1 if stacked else 2
    gradient_products = 2 if stacked else 4  # dx and dW against the [K, 2N] panel, or per weight
    assert jaxpr.count("dot_general") == forward_products + gradient_products
    want = jax.grad(lambda x, w: jnp.sum(stellax.gated_linear_unit(x, w, implementation="xla") ** 2),
                    argnums=(0, 1))(x, w)
    got = jax.grad(loss, argnums=(0, 1))(x, weights)
    assert_close(got[0], want[0], gradient=True, name="dx")
