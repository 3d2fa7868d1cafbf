"""`quantized_linear` (NVFP4 / MXFP8 training recipes): quantize steps, GEMMs,
straight-through gradients, stochastic rounding, errors, a few training steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.quant import training as T
from stellax.ops.quant.recipes import MXFP8, NVFP4, QuantRecipe, get_recipe
from stellax.ops.quant.reference import dequantize_reference

RECIPES = {
    "nvfp4": NVFP4,
    "nvfp4_no_hadamard": NVFP4.replace(hadamard=None),
    "nvfp4_no_sr": NVFP4.replace(stochastic_rounding=False),
    "nvfp4_plain": NVFP4.replace(hadamard=None, stochastic_rounding=False),
    "mxfp8": MXFP8,
}


def _inputs(m=64, k=64, n=96, dtype=jnp.float32, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.1).astype(dtype)
    dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
    return x, w, dy


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _same_qarray(a, b):
    assert (a.format, a.shape, a.block_shape, a.axis) == (b.format, b.shape, b.block_shape, b.axis)
    np.testing.assert_array_equal(_bits(a.values), _bits(b.values))
    np.testing.assert_array_equal(_bits(a.scales), _bits(b.scales))
    if b.tensor_scale is not None:
        np.testing.assert_array_equal(np.asarray(a.tensor_scale), np.asarray(b.tensor_scale))


# -- quantize steps ----------------------------------------------------------------------


def test_nvfp4_quantize_steps_bit_identical_to_quantize():
    """Every quantize step of the NVFP4 recipe is `stellax.quantize` with the recipe's layout:
    1×16 activations / gradients (E4M3 scales, FP32 tensor scale), 16×16 weights, Hadamard +
    SR as documented."""
    x, w, dy = _inputs()
    key = jax.random.key(3)
    kd, kw, kh = T._keys(key, NVFP4)
    xq, wq = T.forward_operands(x, w, NVFP4)
    _same_qarray(xq, stellax.quantize(x, "nvfp4", axis=1, block_size=16))
    _same_qarray(wq, stellax.quantize(w, "nvfp4", axis=0, block_size=(16, 16)))
    assert wq.block_shape == (16, 16) and xq.block_shape == (1, 16)
    assert np.dtype(xq.scales.dtype) == np.dtype(jnp.float8_e4m3fn) and xq.tensor_scale.dtype == jnp.float32
    dyq, wtq = T.dgrad_operands(dy, w, wq, NVFP4, kd)
    _same_qarray(dyq, stellax.quantize(dy, "nvfp4", axis=1, block_size=16, stochastic_rounding_key=kd))
    # the dgrad weight is the forward's quantized weight, transposed (no second quantization)
    np.testing.assert_array_equal(np.asarray(dequantize_reference(wtq)), np.asarray(dequantize_reference(wq)).T)
    np.testing.assert_array_equal(_bits(wtq.scales), _bits(wq.scales).T)
    assert wtq.axis == 0 and wtq.shape == (96, 64)  # along N, the dgrad contraction axis
    xtq, dyt = T.wgrad_operands(x, dy, NVFP4, kw, kh)
    _same_qarray(xtq, stellax.quantize(stellax.hadamard_transform(x.T, block_size=16, random_signs_key=kh),
                                       "nvfp4", axis=1, block_size=16))
    rot_dy = stellax.hadamard_transform(dy.T, block_size=16, random_signs_key=kh).T
    _same_qarray(dyt, stellax.quantize(rot_dy, "nvfp4", axis=0, block_size=16, stochastic_rounding_key=kw))
    assert xtq.rotation == 16 and dyt.rotation == 16


def test_mxfp8_quantize_steps_bit_identical_to_quantize():
    x, w, dy = _inputs()
    xq, wq = T.forward_operands(x, w, MXFP8)
    _same_qarray(xq, stellax.quantize(x, "mxfp8", axis=1))
    _same_qarray(wq, stellax.quantize(w, "mxfp8", axis=0))
    assert np.dtype(xq.scales.dtype) == np.dtype(jnp.float8_e8m0fnu) and xq.block_shape == (1, 32)
    dyq, wtq = T.dgrad_operands(dy, w, wq, MXFP8, None)
    _same_qarray(dyq, stellax.quantize(dy, "mxfp8", axis=1))
    _same_qarray(wtq, stellax.quantize(w.T, "mxfp8", axis=0))  # requantized along N
    xtq, dyt = T.wgrad_operands(x, dy, MXFP8, None, None)
    _same_qarray(xtq, stellax.quantize(x.T, "mxfp8", axis=1))
    _same_qarray(dyt, stellax.quantize(dy, "mxfp8", axis=0))


def test_transpose_qarray_odd_rows():
    w = jax.random.normal(jax.random.key(1), (32, 48), jnp.float32)
    q = stellax.quantize(w, "nvfp4", axis=0, block_size=(16, 16))
    for axis, packed in ((0, (24, 32)), (None, (48, 16))):
        t = T.transpose_qarray(q, axis=axis)
        assert t.shape == (48, 32) and t.axis == (1 if axis is None else 0) and t.values.shape == packed
        np.testing.assert_array_equal(np.asarray(dequantize_reference(t)), np.asarray(dequantize_reference(q)).T)
    q1 = stellax.quantize(w, "nvfp4", axis=0, block_size=16)
    with pytest.raises(ValueError, match="square 2-D blocks"):
        T.transpose_qarray(q1, axis=0)


# -- GEMMs, gradients ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,block,wblock", [("nvfp4", 16, (16, 16)), ("mxfp8", 32, 32)])
def test_xla_gemm_equals_dequantize_matmul(fmt, block, wblock):
    x, w, _ = _inputs(m=48)
    a = stellax.quantize(x, fmt, axis=1, block_size=block)
    b = stellax.quantize(w, fmt, axis=0, block_size=wblock)
    want = np.asarray(dequantize_reference(a), np.float64) @ np.asarray(dequantize_reference(b), np.float64)
    got = np.asarray(T.gemm(a, b, "xla"), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6


@pytest.mark.parametrize("name", [pytest.param("nvfp4", marks=pytest.mark.slow), "nvfp4_no_hadamard", "nvfp4_no_sr",
                                  "nvfp4_plain", "mxfp8"])
def test_gradients_equal_straight_through_reference(name):
    recipe = RECIPES[name]
    x, w, dy = _inputs(m=64, k=64, n=96, dtype=jnp.bfloat16)
    x3, dy3 = x.reshape(2, 32, 64), dy.reshape(2, 32, 96)
    key = jax.random.key(7)
    y, vjp = jax.vjp(lambda a, b: stellax.quantized_linear(a, b, recipe, key=key, implementation="xla"), x3, w)
    dx, dw = vjp(dy3)
    assert y.dtype == jnp.bfloat16 and dx.shape == x3.shape and dw.dtype == jnp.bfloat16
    yr, dxr, dwr = T.quantized_linear_reference(x3, w, dy3, recipe, key=key)
    for got, want, what in ((y, yr, "y"), (dx, dxr, "dx"), (dw, dwr, "dw")):
        got = np.asarray(got, np.float64)
        want = np.asarray(want, np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 1e-2, (what, err)  # bf16 outputs: within bf16 rounding of the f32 golden
    # and the quantization is really there: far from the unquantized product at 4 bits
    exact = np.asarray(x3, np.float64) @ np.asarray(w, np.float64)
    assert np.linalg.norm(np.asarray(y, np.float64) - exact) / np.linalg.norm(exact) > (
        0.05 if recipe.format == "nvfp4" else 0.01)


def test_gradients_f32_tight():
    """float32 in and out: the custom VJP equals the golden to float32 rounding."""
    x, w, dy = _inputs()
    key = jax.random.key(11)

    @jax.jit  # one program each (run op by op, their hundreds of small compiles took ~30 s)
    def grads(x, w, dy):
        _, vjp = jax.vjp(lambda a, b: stellax.quantized_linear(a, b, "nvfp4", key=key, implementation="xla"), x, w)
        return vjp(dy)

    dx, dw = grads(x, w, dy)
    _, dxr, dwr = jax.jit(lambda x, w, dy: T.quantized_linear_reference(x, w, dy, "nvfp4", key=key))(x, w, dy)
    assert float(jnp.linalg.norm(dx - dxr) / jnp.linalg.norm(dxr)) < 1e-6
    # wgrad: the fast and the dense Hadamard round differently (1 ulp), which can flip a code
    assert float(jnp.linalg.norm(dw - dwr) / jnp.linalg.norm(dwr)) < 1e-3


def test_bf16_recipe_and_opt_out():
    x, w, _ = _inputs(dtype=jnp.bfloat16)
    want = jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    for r in (None, "bf16"):
        np.testing.assert_array_equal(np.asarray(stellax.quantized_linear(x, w, r)), np.asarray(want))
    assert NVFP4.for_layer(0, 8) is None and NVFP4.for_layer(7, 8) is None and NVFP4.for_layer(3, 8) is NVFP4
    custom = NVFP4.replace(bf16_first=0, bf16_last=0, bf16_layers=("lm_head", 2))
    assert custom.for_layer("lm_head") is None and custom.for_layer(2) is None and custom.for_layer(0) is custom
    with pytest.raises(ValueError, match="num_layers"):
        NVFP4.for_layer(3)


# -- stochastic rounding --------------------------------------------------------------------


def _sr_stats(fmt, x, n_keys, key=None):
    """Dequantized samples of ``x [1, 32]`` under ``n_keys`` independent stochastic roundings
    (rows of one quantize call: each row repeats ``x``, so it has x's block scales)."""
    rows = jnp.tile(x, (n_keys, 1))
    q = stellax.quantize(rows, fmt, axis=1, block_size=16 if fmt == "nvfp4" else 32,
                         stochastic_rounding_key=key if key is not None else jax.random.key(42))
    return np.asarray(dequantize_reference(q), np.float64)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_stochastic_rounding_unbiased(fmt):
    """The mean over 4096 roundings is within 5 standard errors of x (per element; the
    exact Bernoulli variance from the two neighbouring grid points). Rounding to nearest
    fails the same bound, so the test can fail."""
    x = jax.random.normal(jax.random.key(5), (1, 32), jnp.float32) * 3.0
    n = 4096
    samples = _sr_stats(fmt, x, n)
    lo, hi = samples.min(0), samples.max(0)
    xv = np.asarray(x[0], np.float64)
    # each element takes at most the two grid neighbours of its scaled value
    assert all(len(np.unique(samples[:, j])) <= 2 for j in range(32))
    p = np.where(hi > lo, (xv - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
    se = np.sqrt(np.clip(p * (1 - p), 1e-12, None)) * (hi - lo) / np.sqrt(n)
    mean = samples.mean(0)
    on_grid = hi == lo
    assert np.all(np.abs(mean - xv)[~on_grid] <= 5 * se[~on_grid] + 1e-7)
    # the nearest-even rounding of the same x is biased beyond that bound somewhere
    rne = np.asarray(dequantize_reference(stellax.quantize(x, fmt, axis=1, block_size=16 if fmt == "nvfp4" else 32)),
                     np.float64)[0]
    assert np.any(np.abs(rne - xv)[~on_grid] > 5 * se[~on_grid] + 1e-7)


def test_stochastic_rounding_reproducible():
    x, w, dy = _inputs()

    def grads(seed):
        f = lambda a, b: stellax.quantized_linear(a, b, "nvfp4", key=jax.random.key(seed), implementation="xla")
        return jax.vjp(f, x, w)[1](dy)

    a, b, c = grads(1), grads(1), grads(2)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1]))
    # jitted: the same bits as eager
    jg = jax.jit(lambda a_, b_, k: jax.vjp(lambda p, q: stellax.quantized_linear(p, q, "nvfp4", key=k,
                                                                                   implementation="xla"), a_, b_)[1](dy))
    for u, v in zip(jg(x, w, jax.random.key(1)), a):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


# -- errors ------------------------------------------------------------------------------------


def test_errors_name_the_argument():
    x, w, _ = _inputs()
    with pytest.raises(ValueError, match="recipe: expected one of"):
        stellax.quantized_linear(x, w, "nvfp8")
    with pytest.raises(TypeError, match="recipe"):
        stellax.quantized_linear(x, w, 4)
    with pytest.raises(ValueError, match=r"x: .*K = 40.*not divisible by 16"):
        stellax.quantized_linear(x[:, :40], w[:40], "nvfp4")
    with pytest.raises(ValueError, match=r"w: .*N = 48.*not divisible by 32"):
        stellax.quantized_linear(x, w[:, :48], "mxfp8")
    with pytest.raises(ValueError, match=r"x: .*token count M = 40"):
        stellax.quantized_linear(x[:40], w, "nvfp4")
    with pytest.raises(ValueError, match=r"x: expected shape \[\.\.\., 64\]"):
        stellax.quantized_linear(x[:, :32], w, "nvfp4")
    with pytest.raises(ValueError, match="key: recipe nvfp4"):
        jax.grad(lambda a: stellax.quantized_linear(a, w, "nvfp4").sum())(x)
    with pytest.raises(ValueError, match="implementation"):
        stellax.quantized_linear(x, w, "nvfp4", implementation="cuda")
    with pytest.raises(ValueError, match="QuantRecipe.block"):
        QuantRecipe("bad", "nvfp4", 32, (16, 16))
    with pytest.raises(ValueError, match="QuantRecipe.format"):
        QuantRecipe("bad", "int8", 32, 32)
    with pytest.raises(ValueError, match="QuantRecipe.hadamard"):
        NVFP4.replace(hadamard=12)
    assert get_recipe("NVFP4") is NVFP4 and get_recipe(None) is None


# -- training ------------------------------------------------------------------------------------


def test_training_steps_decrease_loss():
    """A few SGD steps of a 2-layer MLP regression with every linear through the NVFP4 recipe."""
    kx, k1, k2, kt = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (64, 32), jnp.float32)
    target = jnp.tanh(x @ jax.random.normal(kt, (32, 32)) * 0.3)
    params = {"w1": jax.random.normal(k1, (32, 64)) * 0.2, "w2": jax.random.normal(k2, (64, 32)) * 0.2}

    def loss(p, key):
        k_a, k_b = jax.random.split(key)
        h = jax.nn.gelu(stellax.quantized_linear(x, p["w1"], "nvfp4", key=k_a))
        return jnp.mean((stellax.quantized_linear(h, p["w2"], "nvfp4", key=k_b) - target) ** 2)

    step = jax.jit(lambda p, key: jax.tree.map(lambda a, g: a - 0.5 * g, p, jax.grad(loss)(p, key)))
    evaluate = jax.jit(loss)  # not op by op: that compiled every primitive (~8 s)
    first = float(evaluate(params, jax.random.key(100)))
    for s in range(6):
        params = step(params, jax.random.key(s))
    last = float(evaluate(params, jax.random.key(100)))
    assert last < 0.8 * first, (first, last)


# -- the Triton kernel (interpret mode) ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt,block,wblock", [("nvfp4", 16, (16, 16)), ("mxfp8", 32, 32)])
def test_triton_dual_quantized_matmul_interpret(fmt, block, wblock):
    from stellax.ops.quant.triton_training import dual_quantized_matmul, fused_quantize_matmul
    x, w, _ = _inputs(m=40, k=64, n=48)  # M and N not multiples of the 32-tiles: masked edges
    a = stellax.quantize(x, fmt, axis=1, block_size=block)
    b = stellax.quantize(w, fmt, axis=0, block_size=wblock)
    key = jax.random.key(9)
    a_sr = stellax.quantize(x, fmt, axis=1, block_size=block, stochastic_rounding_key=key)
    deq = lambda q: np.asarray(dequantize_reference(q), np.float64)
    with stellax.interpret_mode():
        y = dual_quantized_matmul(a, b)
        yf = fused_quantize_matmul(x, b, format=b.format)
        ys = fused_quantize_matmul(x, b, format=b.format, noise=jax.random.uniform(key, x.shape, jnp.float32))
    assert not np.any(np.isnan(np.asarray(y)))
    for got, want in ((y, deq(a) @ deq(b)), (yf, deq(a) @ deq(b)), (ys, deq(a_sr) @ deq(b))):
        err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert err < 1e-6, err  # float32 summation order only: one differing code would be ~1e-2


@pytest.mark.slow
def test_triton_quantized_linear_interpret():
    """The whole custom VJP on the Triton path (interpreted) equals the XLA path."""
    x, w, dy = _inputs(m=32, k=32, n=32)
    key = jax.random.key(4)
    outs = {}
    for impl in ("xla", "triton"):
        f = lambda a, b: stellax.quantized_linear(a, b, "nvfp4", key=key, implementation=impl)
        with stellax.interpret_mode():
            y, vjp = jax.vjp(f, x, w)
            outs[impl] = (y, *vjp(dy))
    for got, want in zip(outs["triton"], outs["xla"]):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-6


def test_nnx_quantized_linear():
    nnx = pytest.importorskip("flax.nnx")  # optional dependency: stellax[nn]
    from stellax.nn import QuantizedLinear
    recipe = NVFP4.replace(hadamard=None)  # stochastic rounding: the key comes from the rngs
    layer = QuantizedLinear(64, 32, recipe=recipe, use_bias=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 16, 64), jnp.float32)
    y = layer(x)
    want = stellax.quantized_linear(x, layer.kernel[...], recipe) + layer.bias[...]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)  # draws its key from the rngs
    assert grads.kernel[...].shape == (64, 32) and bool(jnp.all(jnp.isfinite(grads.kernel[...])))
    with pytest.raises(ValueError, match="in_features=64"):
        layer(x[..., :32])
    assert QuantizedLinear(64, 32, recipe=None, rngs=nnx.Rngs(0)).recipe is None
