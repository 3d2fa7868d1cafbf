"""The shared Pallas toolkit: named operands (absent ones included), scalar
prefetch, and the helpers every family uses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from stellax.core import interpret_mode
from stellax.core.pallas import (cdiv, dot, dot_nt, dot_tn, kernel_call, nbytes, operand, output, pad_axis,
                                 padded_dim, square_iota, triton_kernel_call)


def _axpy(x, y=None, *, with_sum=True):
    """``out = 2x (+ y)`` and optionally ``total = Σ out`` per block, with absent operands."""

    def kernel(*, x, y, out, total):
        acc = 2.0 * x[...]
        if y is not None:
            acc = acc + y[...]
        out[...] = acc
        if total is not None:
            total[...] = jnp.sum(acc, keepdims=True)

    spec = pl.BlockSpec((8,), lambda i: (i,))
    n = x.shape[0] // 8
    return triton_kernel_call(
        kernel, grid=(n,), inputs=dict(x=operand(x, spec), y=operand(y, spec)),
        outputs=dict(out=output(x.shape, x.dtype, spec),
                     total=output((n,), x.dtype, pl.BlockSpec((1,), lambda i: (i,))) if with_sum else None),
        num_warps=1, num_stages=1, name="axpy")


@pytest.mark.parametrize("with_y", [False, True])
@pytest.mark.parametrize("with_sum", [False, True])
def test_named_operands_and_absent_ones(with_y, with_sum):
    x = jnp.arange(16.0)
    y = jnp.full((16,), 0.5) if with_y else None
    with interpret_mode():
        outs = _axpy(x, y, with_sum=with_sum)
    expected = 2 * np.arange(16.0) + (0.5 if with_y else 0.0)
    np.testing.assert_array_equal(outs.out, expected)
    assert set(outs) == {"out", "total"}
    if with_sum:
        np.testing.assert_array_equal(outs["total"], expected.reshape(2, 8).sum(1))
    else:
        assert outs.total is None


def test_named_operands_lower_for_cuda():
    specs = (jax.ShapeDtypeStruct((16,), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.float32))
    with interpret_mode(False):
        text = jax.jit(lambda x, y: _axpy(x, y).out).trace(*specs).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_scalar_prefetch_operands_reach_index_maps_and_kernel():
    """A gather of rows by a prefetched table (the shape of a paged/grouped TPU kernel)."""

    def kernel(*, table, x, out):
        out[...] = x[...] + table[pl.program_id(0)].astype(jnp.float32)

    table = jnp.array([3, 0, 2, 1], jnp.int32)
    x = jnp.arange(4 * 8 * 128, dtype=jnp.float32).reshape(4, 8, 128)
    spec_in = pl.BlockSpec((1, 8, 128), lambda i, table: (table[i], 0, 0))
    spec_out = pl.BlockSpec((1, 8, 128), lambda i, table: (i, 0, 0))
    outs = kernel_call(kernel, grid=(4,), scalar_prefetch=dict(table=table), inputs=dict(x=operand(x, spec_in)),
                       outputs=dict(out=output(x.shape, x.dtype, spec_out)),
                       interpret=pltpu.InterpretParams(), name="gather_rows")
    expected = np.asarray(x)[np.asarray(table)] + np.asarray(table)[:, None, None]
    np.testing.assert_array_equal(outs.out, expected)


def test_kernel_call_needs_an_output():
    with pytest.raises(ValueError, match="outputs"):
        kernel_call(lambda **_: None, grid=(1,), inputs={}, outputs=dict(o=None), name="none")


def test_helpers():
    assert cdiv(17, 8) == 3 and cdiv(16, 8) == 2
    assert padded_dim(1) == 16 and padded_dim(80) == 128 and padded_dim(128) == 128
    assert padded_dim(5, minimum=1) == 8
    x = jnp.ones((3, 5))
    assert pad_axis(x, 1, 8, value=-1).shape == (3, 8) and float(pad_axis(x, 1, 8, value=-1)[0, 7]) == -1
    assert pad_axis(x, 0, 2) is x
    assert nbytes(None) == 0 and nbytes(jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)) == 64
    a = jax.random.normal(jax.random.PRNGKey(0), (4, 6))
    b = jax.random.normal(jax.random.PRNGKey(1), (6, 5))
    np.testing.assert_allclose(dot(a, b), np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dot_nt(a, b.T), np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dot_tn(a.T, b), np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5)
    assert dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)).dtype == jnp.float32
    rows, cols = square_iota(3)
    np.testing.assert_array_equal(rows, np.arange(3)[:, None] * np.ones(3, int))
    np.testing.assert_array_equal(cols, np.arange(3)[None, :] * np.ones((3, 1), int))


def test_tpu_kernel_call_interprets_with_nan_uninitialized_memory():
    """Interpreted TPU kernels see NaN in memory no step wrote: a kernel that
    reads scratch it never initialized produces NaN, not a silent zero."""
    from jax.experimental.pallas import tpu as pltpu

    from stellax.core.pallas import tpu_kernel_call

    x = jnp.ones((8, 128), jnp.float32)
    spec = pl.BlockSpec((8, 128), lambda i: (0, 0))

    def launch(initialize: bool):
        def kernel(*, x, y, acc):
            if initialize:
                acc[...] = jnp.zeros_like(acc)
            y[...] = x[...] + acc[...]
        return tpu_kernel_call(kernel, grid=(1,), inputs=dict(x=operand(x, spec)),
                               outputs=dict(y=output(x.shape, x.dtype, spec)),
                               scratch=dict(acc=pltpu.VMEM((8, 128), jnp.float32)),
                               dimension_semantics=("arbitrary",), name="reads_scratch").y

    with interpret_mode():
        assert bool(jnp.all(launch(True) == 1.0))
        assert bool(jnp.all(jnp.isnan(launch(False))))


def test_tpu_kernel_call_needs_one_semantics_per_grid_axis():
    from stellax.core.pallas import tpu_kernel_call

    x = jnp.ones((8, 128), jnp.float32)
    with pytest.raises(ValueError, match="dimension_semantics: expected 2 entries"):
        tpu_kernel_call(lambda **refs: None, grid=(1, 1), inputs=dict(x=operand(x)),
                        outputs=dict(y=output(x.shape, x.dtype)), dimension_semantics=("parallel",), name="k")


def _accumulate_in_place(running, update, rows: int):
    """``running += update`` by blocks of ``rows`` rows, ``running``'s buffer written in place."""
    from stellax.core.pallas import tpu_kernel_call

    def kernel(*, running, update, out):
        out[...] = running[...] + update[...]

    spec = pl.BlockSpec((rows, 128), lambda i: (i, 0))
    return tpu_kernel_call(kernel, grid=(pl.cdiv(running.shape[0], rows),),
                           inputs=dict(running=operand(running, spec), update=operand(update, spec)),
                           outputs=dict(out=output(running.shape, running.dtype, spec)), aliases=dict(running="out"),
                           dimension_semantics=("parallel",), name="accumulate").out


def test_tpu_kernel_call_aliases_an_output_to_an_input():
    """``aliases`` writes an output into an input's buffer (``input_output_aliases``), also when
    the last block is partial (interpreted, that alias is dropped: jax 0.10.2's interpreter
    would return the padded buffer), and lowers with the alias for a TPU."""
    from stellax.core import lowering_target
    from stellax.core.pallas import tpu_kernel_call

    for n in (32, 20):
        running, update = jnp.arange(n * 128.0).reshape(n, 128), jnp.ones((n, 128))
        with interpret_mode():
            out = jax.jit(lambda r, u: _accumulate_in_place(r, u, 8))(running, update)
        np.testing.assert_array_equal(out, running + 1.0)
    shape = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    with lowering_target("v5e"):
        text = jax.jit(lambda r, u: _accumulate_in_place(r, u, 8)).trace(shape, shape).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "output_operand_alias<output_tuple_indices = [], operand_index = 0" in text
    with pytest.raises(ValueError, match="aliases: 'running' \\(32, 128\\) float32 cannot hold 'out'"):
        tpu_kernel_call(lambda **refs: None, grid=(1,), inputs=dict(running=operand(shape)),
                        outputs=dict(out=output((32, 256), jnp.float32)), aliases=dict(running="out"),
                        dimension_semantics=("parallel",), name="k")


def test_tf32x3_dot_emulation_rounds_like_three_tensor_core_passes():
    """Interpreted, a `TF32X3` dot is ``a_hi·b_hi + a_hi·b_lo + a_lo·b_hi``
    with TF32 roundings: about float32 accuracy (far better than one TF32
    pass), but not IEEE float32 — the test can tell the three apart."""
    from stellax.core.pallas import TF32X3

    a = jax.random.normal(jax.random.PRNGKey(1), (64, 64), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(2), (64, 32), jnp.float32)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    with interpret_mode():
        x3 = np.asarray(dot(a, b, precision=TF32X3))
        x3_nt = np.asarray(dot_nt(a, b.T, precision=TF32X3))
    np.testing.assert_array_equal(x3, x3_nt)
    # One TF32 pass (10 mantissa bits) errs ~1e-3 relative; three passes ~1e-6.
    a_hi = np.asarray(a).view(np.uint32)
    a_hi = ((a_hi + 0x1000) & 0xFFFFE000).view(np.float32)
    b_hi = ((np.asarray(b).view(np.uint32) + 0x1000) & 0xFFFFE000).view(np.float32)
    one_pass = np.abs(a_hi.astype(np.float64) @ b_hi.astype(np.float64) - exact).max()
    three_pass = np.abs(x3 - exact).max()
    assert three_pass < 2e-5 and one_pass > 20 * three_pass, (three_pass, one_pass)
    assert np.abs(x3 - np.asarray(dot(a, b))).max() > 0  # not silently IEEE float32


def test_tf32x3_dot_lowers_to_a_tf32x3_triton_dot():
    """The Triton IR names ``tf32x3`` (tensor cores); a `HIGHEST` float32 dot
    names nothing, which is IEEE (``tt.dot``'s default), i.e. FMA."""
    from stellax.core.pallas import HIGHEST, TF32X3
    from stellax.testing.ptx_analysis import ir_text, parse_dots, triton_sources

    spec = pl.BlockSpec((32, 32), lambda i: (0, 0))
    s = jax.ShapeDtypeStruct((32, 32), jnp.float32)

    def ir_dot(precision):
        def kernel(*, a, b, c):
            c[...] = dot(a[...], b[...], precision=precision)

        def f(a, b):
            return triton_kernel_call(kernel, grid=(1,), inputs=dict(a=operand(a, spec), b=operand(b, spec)),
                                      outputs=dict(c=output((32, 32), jnp.float32, spec)), num_warps=4,
                                      num_stages=1, name="tf32x3").c

        with interpret_mode(False):
            lowered = jax.jit(f).trace(s, s).lower(lowering_platforms=("cuda",))
        (source,) = triton_sources(lowered)
        (found,) = parse_dots(ir_text(source))
        return found

    fast, ieee = ir_dot(TF32X3), ir_dot(HIGHEST)
    assert (fast.lhs, fast.precision, fast.tc_dtype) == ("f32", "tf32x3", "tf32"), fast
    assert (ieee.lhs, ieee.precision, ieee.tc_dtype) == ("f32", "", None), ieee
