"""ragged_dot / ragged_dot_general / tgmm numerics: XLA and Triton (interpreted)
against a numpy loop and jax.lax.ragged_dot(_general), forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.moe import (XlaGroupedMatmulConfig, ragged_dot, ragged_dot_general, ragged_dot_op,
                             ragged_dot_tgmm)
from stellax.testing import assert_close, assert_deterministic, golden

from moe_helpers import SMALL, f64, inputs, numpy_ragged_dot, numpy_tgmm, sizes

IMPLS = ["xla", "triton"]
HI = jax.lax.Precision.HIGHEST

# (name, group sizes, rows used of M = 48): sizes not multiples of the 16-row blocks.
CASES = [
    ("balanced", [12, 12, 12, 12], 48),
    ("one group", [0, 0, 48, 0], 48),
    ("empty first", [0, 9, 17, 22], 48),
    ("empty middle", [13, 0, 0, 21], 34),
    ("empty last", [5, 30, 2, 0], 37),
    ("sum<M", [3, 7, 0, 5], 15),
    ("all empty", [0, 0, 0, 0], 0),
]


def _jit(impl, fn, **kwargs):
    """``fn`` jitted once for ``impl`` (group sizes are traced arguments, so every
    case of a shape reuses one compilation)."""
    kwargs = dict(kwargs, implementation=impl)
    if impl == "triton":
        kwargs.setdefault("config", SMALL)
    jitted = jax.jit(lambda *a: fn(*a, **kwargs))

    def run(*args):
        with stellax.interpret_mode(impl == "triton"):
            return jitted(*args)
    return run


def _run(impl, fn, *args, **kwargs):
    return _jit(impl, fn, **kwargs)(*args)


def golden_grad(args, *primals):
    """The golden (float32, highest precision) of ``jax.grad(*args)``, jitted."""
    return golden(jax.jit(jax.grad(*args)), *primals)


def _grad_fn(impl, fn, **kwargs):
    """``(lhs, rhs, group_sizes, cot) -> (dlhs, drhs)`` of ``sum(fn(...) * cot)``."""
    def loss(lhs, rhs, group_sizes, cot, **kw):
        return jnp.sum(fn(lhs, rhs, group_sizes, **kw).astype(jnp.float32) * cot)
    return _jit(impl, jax.grad(loss, (0, 1)), **kwargs)


def _grads(impl, fn, args, cot, **kwargs):
    return _grad_fn(impl, fn, **kwargs)(*args, cot)


@pytest.mark.parametrize("impl", IMPLS)
def test_forward_f32_matches_numpy_and_lax(impl):
    m = 48
    lhs, rhs = inputs(1, [(m, 24), (4, 24, 40)])
    run = _jit(impl, ragged_dot, precision=HI)
    for name, group_sizes, used in CASES:
        gs = sizes(group_sizes)
        out = run(lhs, rhs, gs)
        assert out.shape == (m, 40) and out.dtype == jnp.float32
        assert_close(out, numpy_ragged_dot(lhs, rhs, group_sizes), name=f"{name} vs numpy loop")
        assert_close(out, jax.lax.ragged_dot(lhs, rhs, gs, precision=HI), name=f"{name} vs jax.lax.ragged_dot")
        # Rows past sum(group_sizes) are exactly zero.
        assert np.all(np.asarray(out)[sum(group_sizes):] == 0), name


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_match_lax_including_empty_groups(impl):
    m = 48
    lhs, rhs, cot = inputs(2, [(m, 24), (4, 24, 40), (m, 40)])
    grad = _grad_fn(impl, ragged_dot)
    for name, group_sizes, _ in CASES:
        gs = sizes(group_sizes)
        dlhs, drhs = grad(lhs, rhs, gs, cot)
        ref = golden_grad((lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, gs) * cot), (0, 1)), lhs, rhs)
        if sum(group_sizes):
            assert_close(dlhs, ref[0], gradient=True, name=f"{name} dlhs")
            assert_close(drhs, ref[1], gradient=True, name=f"{name} drhs")
        for g, size in enumerate(group_sizes):
            if size == 0:  # an empty group gets exactly zero gradient
                assert np.all(np.asarray(drhs[g]) == 0), name
        assert np.all(np.asarray(dlhs)[sum(group_sizes):] == 0), name


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_forward_and_gradients(impl):
    lhs, rhs, cot = inputs(3, [(45, 32), (3, 32, 24), (45, 24)], jnp.bfloat16)
    group_sizes = [20, 0, 19]
    gs = sizes(group_sizes)
    out = _run(impl, ragged_dot, lhs, rhs, gs)
    assert out.dtype == jnp.bfloat16
    assert_close(out, numpy_ragged_dot(lhs, rhs, group_sizes), dtype=jnp.bfloat16)
    grads = _grads(impl, ragged_dot, (lhs, rhs, gs), cot.astype(jnp.float32))
    ref = golden_grad((lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, gs) * cot), (0, 1)), lhs, rhs)
    assert grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.bfloat16
    assert_close(grads[0], ref[0], dtype=jnp.bfloat16, gradient=True, name="dlhs")
    assert_close(grads[1], ref[1], dtype=jnp.bfloat16, gradient=True, name="drhs")


@pytest.mark.parametrize("impl", IMPLS)
def test_preferred_element_type(impl):
    lhs, rhs = inputs(4, [(30, 16), (2, 16, 20)], jnp.bfloat16)
    gs = sizes([14, 16])
    out = _run(impl, ragged_dot, lhs, rhs, gs, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    ref = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32, precision=HI)
    assert_close(out, ref, rel_l2_tolerance=1e-5)


@pytest.mark.parametrize("impl,activation", [("xla", "silu"), ("xla", "relu"), ("triton", "gelu"),
                                             ("triton", "sigmoid")])
def test_fused_activation_forward_and_gradients(impl, activation):
    lhs, rhs, cot = inputs(5, [(36, 16), (3, 16, 24), (36, 24)])
    group_sizes = [11, 0, 20]  # rows 31.. are past the sum: zero even for sigmoid
    gs = sizes(group_sizes)
    out = _run(impl, ragged_dot, lhs, rhs, gs, activation=activation, precision=HI)
    ref = golden(jax.jit(lambda a, b: ragged_dot_op.reference(a, b, gs, activation=activation)), lhs, rhs)
    assert_close(out, ref, rel_l2_tolerance=2e-5)
    if activation != "gelu":
        assert_close(out, numpy_ragged_dot(lhs, rhs, group_sizes, activation=activation), rel_l2_tolerance=2e-5)
    assert np.all(np.asarray(out)[31:] == 0)
    grads = _grads(impl, ragged_dot, (lhs, rhs, gs), cot, activation=activation, precision=HI)
    ref_grads = golden_grad((lambda a, b: jnp.sum(ragged_dot_op.reference(a, b, gs, activation=activation) * cot),
                                (0, 1)), lhs, rhs)
    assert_close(grads[0], ref_grads[0], gradient=True, rel_l2_tolerance=4e-5, name="dlhs")
    assert_close(grads[1], ref_grads[1], gradient=True, rel_l2_tolerance=4e-5, name="drhs")


@pytest.mark.parametrize("impl,activation", [("xla", "gelu_tanh"), ("xla", jax.nn.softplus), ("triton", None),
                                             ("triton", "silu"), ("triton", jax.nn.softplus)])
def test_fused_gate_up(impl, activation):
    lhs, rhs, cot = inputs(6, [(33, 24), (4, 24, 2, 20), (33, 20)])
    group_sizes = [0, 17, 9, 5]
    gs = sizes(group_sizes)
    out = _run(impl, ragged_dot, lhs, rhs, gs, activation=activation, precision=HI)
    assert out.shape == (33, 20)
    if not callable(activation):
        assert_close(out, numpy_ragged_dot(lhs, rhs, group_sizes, activation=activation), rel_l2_tolerance=2e-5)
    ref = golden(jax.jit(lambda a, b: ragged_dot_op.reference(a, b, gs, activation=activation)), lhs, rhs)
    assert_close(out, ref, rel_l2_tolerance=2e-5)
    grads = _grads(impl, ragged_dot, (lhs, rhs, gs), cot, activation=activation, precision=HI)
    ref_grads = golden_grad((lambda a, b: jnp.sum(ragged_dot_op.reference(a, b, gs, activation=activation) * cot),
                                (0, 1)), lhs, rhs)
    assert_close(grads[0], ref_grads[0], gradient=True, rel_l2_tolerance=4e-5, name="dlhs")
    assert_close(grads[1], ref_grads[1], gradient=True, rel_l2_tolerance=4e-5, name="drhs")
    assert np.all(np.asarray(grads[1][0]) == 0)  # empty first group


def _dims(contract, ragged, group):
    return jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(contract, ([], [])),
                                             lhs_ragged_dimensions=ragged, rhs_group_dimensions=group)


@pytest.mark.parametrize("impl", IMPLS)
def test_general_transposed_rhs(impl):
    lhs, rhs, cot = inputs(7, [(38, 20), (3, 28, 20), (38, 28)])
    group_sizes = [15, 0, 18]
    gs = sizes(group_sizes)
    dims = _dims(([1], [2]), [0], [0])
    out = _run(impl, lambda a, b, **k: ragged_dot_general(a, b, gs, dims, HI, **k), lhs, rhs)
    assert_close(out, numpy_ragged_dot(lhs, rhs, group_sizes, transpose_rhs=True))
    assert_close(out, jax.lax.ragged_dot_general(lhs, rhs, gs, dims, precision=HI))
    grads = _grads(impl, lambda a, b, g, **k: ragged_dot_general(a, b, g, dims, **k), (lhs, rhs, gs), cot)
    ref = golden_grad((lambda a, b: jnp.sum(jax.lax.ragged_dot_general(a, b, gs, dims) * cot), (0, 1)), lhs, rhs)
    assert_close(grads[0], ref[0], gradient=True, name="dlhs")
    assert_close(grads[1], ref[1], gradient=True, name="drhs")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lhs_km", [True, False], ids=["lhs[K,M]", "lhs[M,K]"])
def test_general_ragged_contraction_tgmm(impl, lhs_km):
    m, k, n = 41, 20, 24
    group_sizes = [0, 16, 0, 19]  # empty first and middle; sum < M
    gs = sizes(group_sizes)
    a_mk, b, cot = inputs(8, [(m, k), (m, n), (4, k, n)])
    lhs = a_mk.T if lhs_km else a_mk
    dims = _dims(([1], [0]), [1], []) if lhs_km else _dims(([0], [0]), [0], [])
    out = _run(impl, lambda x, y, **k: ragged_dot_general(x, y, gs, dims, HI, **k), lhs, b)
    assert out.shape == (4, k, n)
    assert_close(out, numpy_tgmm(a_mk, b, group_sizes))
    assert_close(out, jax.lax.ragged_dot_general(lhs, b, gs, dims, precision=HI))
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.asarray(out[2]) == 0)
    grads = _grads(impl, lambda x, y, g, **kw: ragged_dot_general(x, y, g, dims, **kw), (lhs, b, gs), cot)
    ref = golden_grad((lambda x, y: jnp.sum(ragged_dot_op_general_ref(x, y, gs, dims) * cot), (0, 1)), lhs, b)
    assert_close(grads[0], ref[0], gradient=True, name="dlhs")
    assert_close(grads[1], ref[1], gradient=True, name="drhs")


def ragged_dot_op_general_ref(lhs, rhs, gs, dims):
    """jax.lax.ragged_dot_general has no transpose rule for a ragged contraction:
    differentiate a masked einsum instead."""
    (lc, _), _ = dims.dot_dimension_numbers
    a = lhs.T if tuple(lc) == (1,) else lhs  # [M, K]
    ends = jnp.cumsum(gs)
    rows = jnp.arange(a.shape[0])
    masks = (rows[None] >= (ends - gs)[:, None]) & (rows[None] < ends[:, None])
    return jnp.einsum("gm,mk,mn->gkn", masks.astype(a.dtype), a, rhs)


@pytest.mark.parametrize("impl", IMPLS)
def test_group_offset_forward_and_gradients(impl):
    """A shard holding groups [2, 4) of 6: other groups' rows give zeros and no gradient."""
    group_sizes = [4, 6, 7, 0, 9, 5]
    gs = sizes(group_sizes)
    lhs, rhs, cot = inputs(9, [(35, 16), (2, 16, 24), (35, 24)])
    out = _run(impl, ragged_dot, lhs, rhs, gs, precision=HI, group_offset=2)
    expected = numpy_ragged_dot(lhs, rhs, group_sizes, offset=2)
    assert_close(out, expected)
    assert np.all(np.asarray(out)[:10] == 0) and np.all(np.asarray(out)[17:] == 0)
    # Equal to the unsharded result restricted to the shard's rows.
    full_rhs = jnp.concatenate([jnp.ones((2, 16, 24)), rhs, jnp.ones((2, 16, 24))])
    full = jax.lax.ragged_dot(lhs, full_rhs, gs, precision=HI)
    assert_close(out[10:17], full[10:17])
    dlhs, drhs = _grads(impl, lambda a, b, g, **kw: ragged_dot(a, b, g, group_offset=jnp.asarray([2]), **kw),
                        (lhs, rhs, gs), cot)
    lhs64, rhs64, cot64 = f64(lhs), f64(rhs), f64(cot)
    assert_close(dlhs[10:17], cot64[10:17] @ rhs64[0].T, gradient=True)  # rows of group 2 = local group 0
    assert np.all(np.asarray(dlhs)[:10] == 0) and np.all(np.asarray(dlhs)[17:] == 0)
    assert_close(drhs[0], lhs64[10:17].T @ cot64[10:17], gradient=True)
    assert np.all(np.asarray(drhs[1]) == 0)  # group 3 is empty


@pytest.mark.parametrize("impl", IMPLS)
def test_tgmm_group_offset(impl):
    group_sizes = [3, 12, 0, 9]
    a, b = inputs(10, [(30, 16), (30, 20)])
    out = _run(impl, ragged_dot_tgmm, a, b, sizes(group_sizes), None, None, 1, num_local_groups=2, transpose_lhs=True)
    assert out.shape == (2, 16, 20)
    assert_close(out, numpy_tgmm(a, b, group_sizes, offset=1, count=2))


def test_jit_clamps_group_sizes():
    """Under jit sizes are not checked: negative counts as 0, a group past M is cut at M
    (the same rows jax.lax.ragged_dot computes for sum > M)."""
    lhs, rhs = inputs(11, [(20, 8), (3, 8, 12)])
    clamp = jax.jit(lambda gs: ragged_dot(lhs, rhs, gs))
    out = clamp(sizes([8, 30, 5]))
    expected = numpy_ragged_dot(lhs, rhs, [8, 12, 0])
    assert_close(out, expected)
    assert_close(out, jax.lax.ragged_dot(lhs, rhs, sizes([8, 30, 5]), precision=HI))
    assert_close(clamp(sizes([-4, 10, 3])), numpy_ragged_dot(lhs, rhs, [0, 10, 3]))


def test_xla_block_sizes_agree_and_are_deterministic():
    lhs, rhs = inputs(12, [(70, 16), (5, 16, 24)])
    gs = sizes([0, 33, 1, 0, 30])
    ref = numpy_ragged_dot(lhs, rhs, [0, 33, 1, 0, 30])
    for block in (8, 32, 128):
        out = ragged_dot(lhs, rhs, gs, precision=HI, config=XlaGroupedMatmulConfig(block_m=block))
        assert_close(out, ref, name=f"block_m={block}")
    assert_deterministic(jax.jit(lambda a, b: ragged_dot(a, b, gs)), lhs, rhs)
    with stellax.interpret_mode():
        assert_deterministic(jax.jit(lambda a, b: ragged_dot(a, b, gs, implementation="triton", config=SMALL)),
                             lhs, rhs)


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap(impl):
    lhs, rhs = inputs(13, [(2, 20, 16), (2, 2, 16, 16)])
    gs = sizes([[9, 11], [0, 15]])
    out = _run(impl, lambda a, b, g, **kw: jax.vmap(lambda x, y, z: ragged_dot(x, y, z, **kw))(a, b, g), lhs, rhs, gs)
    for i in range(2):
        assert_close(out[i], numpy_ragged_dot(lhs[i], rhs[i], np.asarray(gs[i])))


def test_default_is_xla_on_cpu_and_triton_needs_gpu():
    lhs, rhs = inputs(14, [(8, 16), (2, 16, 16)])
    call = ragged_dot_op.check(lhs, rhs, sizes([4, 4]))
    assert ragged_dot_op.select(call).name == "xla"
    with pytest.raises(stellax.UnsupportedError, match="GPU"):
        ragged_dot(lhs, rhs, sizes([4, 4]), implementation="triton")


_L, _R = jnp.zeros((10, 8)), jnp.zeros((3, 8, 4))


@pytest.mark.parametrize("call,error,match", [
    (lambda: ragged_dot(_L, _R, sizes([5, 5])), ValueError, "group_sizes: expected length 3"),
    (lambda: ragged_dot(_L, _R, jnp.asarray([5.0, 5.0, 0.0])), TypeError, "group_sizes: expected an integer"),
    (lambda: ragged_dot(_L, _R, sizes([[5, 5, 0]])), ValueError, "group_sizes: expected rank 1"),
    (lambda: ragged_dot(_L, _R, sizes([6, -1, 5])), ValueError, "non-negative"),
    (lambda: ragged_dot(_L, _R, sizes([6, 4, 1])), ValueError, r"sum\(group_sizes\) <= 10"),
    (lambda: ragged_dot(_L, jnp.zeros((3, 7, 4)), sizes([5, 5, 0])), ValueError, "rhs: expected shape"),
    (lambda: ragged_dot(_L, _R.astype(jnp.bfloat16), sizes([5, 5, 0])), TypeError, "rhs: expected dtype float32"),
    (lambda: ragged_dot(_L.astype(jnp.int32), _R, sizes([5, 5, 0])), TypeError, "lhs"),
    (lambda: ragged_dot(_L, _R, sizes([1, 2, 3, 4]), group_offset=2), ValueError, "group_offset: expected a value in"),
    (lambda: ragged_dot(_L, _R, sizes([1, 2, 3, 4]), group_offset=1.0), TypeError, "group_offset"),
    (lambda: ragged_dot(_L, _R, sizes([5, 5, 0]), activation="tanhh"), ValueError, "activation"),
    (lambda: ragged_dot(_L, _R, sizes([5, 5, 0]), preferred_element_type=jnp.int8), TypeError,
     "preferred_element_type"),
    (lambda: ragged_dot_tgmm(_L, jnp.zeros((10, 4)), sizes([5, 5]), transpose_lhs=True, group_offset=0), ValueError,
     "num_local_groups"),
    (lambda: ragged_dot_general(_L, _R, sizes([5, 5, 0]), _dims(([1], [1]), [1], [0])), ValueError,
     "ragged_dot_dimension_numbers"),
])
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_cost_models_count_local_rows():
    lhs, rhs = jnp.zeros((40, 8)), jnp.zeros((2, 8, 6))
    call = ragged_dot_op.check(lhs, rhs, sizes([3, 10, 12, 5]), group_offset=1)
    assert ragged_dot_op.flops(call) == 2.0 * (10 + 12) * 8 * 6
    gated = ragged_dot_op.check(lhs, jnp.zeros((4, 8, 2, 6)), sizes([3, 10, 12, 5]), activation="silu")
    assert ragged_dot_op.flops(gated) == 2.0 * 30 * 8 * 12 + 30 * 12
    tgmm = stellax.ops.moe.ragged_dot_tgmm_op.check(jnp.zeros((8, 40)), jnp.zeros((40, 6)), sizes([3, 10, 0, 5]))
    assert stellax.ops.moe.ragged_dot_tgmm_op.flops(tgmm) == 2.0 * 18 * 8 * 6


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_general_layouts(impl):
    m, k, n = 37, 24, 20
    group_sizes = [0, 20, 11]
    gs = sizes(group_sizes)
    a, w_t, b = inputs(15, [(m, k), (3, n, k), (m, n)], jnp.bfloat16)
    layouts = [(_dims(([1], [2]), [0], [0]), a, w_t), (_dims(([1], [0]), [1], []), a.T, b),
               (_dims(([0], [0]), [0], []), a, b)]
    for dims, lhs, rhs in layouts:
        out = _run(impl, lambda x, y, **kw: ragged_dot_general(x, y, gs, dims, **kw), lhs, rhs)
        assert out.dtype == jnp.bfloat16
        ref = golden(jax.jit(lambda x, y: jax.lax.ragged_dot_general(x, y, gs, dims)), lhs, rhs)
        assert_close(out, ref, dtype=jnp.bfloat16, name=str(dims.dot_dimension_numbers))


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_random_group_sizes_sweep(impl, dtype):
    """Random sizes (many empty groups, sum ≤ M), several tile configs, forward and gradients."""
    from stellax.ops.moe import GroupedMatmulConfig
    rng = np.random.default_rng(0)
    m, k, n, g = 75, 40, 36, 6
    lhs, rhs, cot = inputs(16, [(m, k), (g, k, n), (m, n)], dtype)
    configs = ([GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk) for bm, bn, bk in
                ((16, 16, 16), (32, 64, 16), (64, 32, 32))] if impl == "triton"
               else [XlaGroupedMatmulConfig(block_m=b) for b in (8, 16, 64)])
    for config in configs:
        run = _jit(impl, ragged_dot, config=config)
        grad = _grad_fn(impl, ragged_dot, config=config)
        for _ in range(4):
            group_sizes = rng.multinomial(rng.integers(0, m + 1), rng.dirichlet(np.full(g, 0.3)))
            gs = sizes(group_sizes)
            assert_close(run(lhs, rhs, gs), numpy_ragged_dot(lhs, rhs, group_sizes), dtype=dtype,
                         name=f"{config} {group_sizes}")
            dlhs, drhs = grad(lhs, rhs, gs, cot.astype(jnp.float32))
            ref = golden_grad((lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, gs) * cot.astype(jnp.float32)), (0, 1)),
                              lhs, rhs)
            if group_sizes.sum():
                assert_close(dlhs, ref[0], dtype=dtype, gradient=True, name=f"dlhs {config} {group_sizes}")
                assert_close(drhs, ref[1], dtype=dtype, gradient=True, name=f"drhs {config} {group_sizes}")
