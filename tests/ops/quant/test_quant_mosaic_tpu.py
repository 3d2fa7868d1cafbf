"""Mosaic TPU quantization kernels (interpret mode): quantize / dequantize codes
and scales bit-identical to the XLA path for every format (awkward values
included), the Hadamard transform and its inverse against the golden,
quantized_matmul against the golden per format and int8 × int8, and the
generation gates.

The generic tiers (examples and configs interpreted, lowered for tpu, compiled
with libtpu) run in tests/test_registry_tiers.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import interpret_mode
from stellax.core.tpu import KERNEL_GENERATIONS, TPU_GENERATIONS
from stellax.ops.quant import dequantize_op, hadamard_op, quantize_op, quantized_matmul_op
from stellax.ops.quant import configs as C
from stellax.ops.quant.configs import QMatmulTpuConfig
from stellax.ops.quant.base import flatten_operands, resolve_block_shape
from stellax.ops.quant.examples import quantize_example
from stellax.ops.quant.formats import get_format
from stellax.ops.quant.hadamard import random_signs
from stellax.ops.quant.qarray import qarray_fields
from stellax.testing import assert_close

IMPL = "mosaic_tpu"


def _awkward_rows(k: int, fmt: str) -> np.ndarray:
    """``[16, k]`` float32 rows of random values with the cases that trip
    quantizers: all-zero blocks, subnormals, signed zeros, ties at half grid
    steps, NaN and ±Inf inside a block, float32 extremes, a saturating amax."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, k)).astype(np.float32) * 3
    x[1] = 0.0
    x[2, : k // 2] = -0.0
    x[3] = rng.standard_normal(k).astype(np.float32) * np.float32(1e-40)  # subnormal float32
    el = get_format(fmt).element
    top = np.float32(el.max_value)
    # ties: the block max is the element max, so the scale is 1 (or a power of two) and x sits on half steps
    x[4] = (np.arange(k) % 7).astype(np.float32) + 0.5
    x[4, ::8] = top if el.kind == "int" else 1.0
    x[5] = np.where(np.arange(k) % 2 == 0, 1.0625, -1.1875).astype(np.float32)
    x[5, ::16] = top
    x[6, 3] = np.nan
    x[7, 5] = np.inf
    x[7, 6] = -np.inf
    x[8] = np.float32(3.0e38) * np.where(np.arange(k) % 2 == 0, 1, -1)
    x[9, 1] = np.float32(1e30)  # amax far above the rest: everything else rounds to 0 or saturates
    x[10] = np.float32(2.0 ** -126) * (np.arange(k) % 5)  # smallest normals
    return x


def _bits(a):
    a = np.asarray(a)
    if a.dtype.kind in "iub":
        return a
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_identical(name, got, want):
    """Bitwise equality; NaN positions must agree (their payloads may differ)."""
    if want is None:
        assert got is None, name
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype, got.shape, want.shape)
    same = _bits(got) == _bits(want)
    if want.dtype.kind not in "iub":
        gnan, wnan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
        assert np.array_equal(gnan, wnan), f"{name}: NaN positions differ"
        same |= gnan
    bad = np.argwhere(~same)
    assert bad.size == 0, f"{name}: {len(bad)} elements differ, first at {bad[0].tolist()}: " \
                          f"{got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


def _check_format(fmt, block, k):
    x = jnp.asarray(_awkward_rows(k, fmt))
    f = get_format(fmt)
    block_shape = resolve_block_shape(f, x.shape, 1, block)
    kwargs = dict(format=fmt, axis=1, block_shape=block_shape)
    want = quantize_op(x, **kwargs, implementation="xla")
    with interpret_mode(True):
        got = quantize_op(x, **kwargs, implementation=IMPL)
    for field in ("values", "scales", "zero_points", "tensor_scale"):
        _assert_identical(f"{fmt} {field}", getattr(got, field), getattr(want, field))
    arrays, options = qarray_fields(want)
    with interpret_mode(True):
        y = dequantize_op(*arrays.values(), **options, dtype="float32", implementation=IMPL)
    _assert_identical(f"{fmt} dequantize", y, dequantize_op(*arrays.values(), **options, dtype="float32",
                                                             implementation="xla"))


#: (format, block, K): K not a multiple of the block where the format allows.
DEFAULT_FORMATS = [("nvfp4", 16, 48)]
SLOW_FORMATS = [("fp8_e4m3", "channel", 72), ("int4", 32, 80), ("mxfp4", 32, 96), ("int8", "channel", 72), ("int8", 32, 80), ("int8_asym", 64, 96), ("int4", "channel", 71),
                ("int4_asym", 32, 64), ("fp8_e4m3", 32, 80), ("fp8_e5m2", 64, 128), ("mxfp8_e4m3", 32, 96),
                ("mxfp8_e5m2", 32, 64), ("nvfp4", 16, 40)]


@pytest.mark.parametrize("fmt,block,k", DEFAULT_FORMATS)
def test_quantize_dequantize_bit_identical(fmt, block, k):
    _check_format(fmt, block, k)


@pytest.mark.slow
@pytest.mark.parametrize("fmt,block,k", SLOW_FORMATS)
def test_quantize_dequantize_bit_identical_more_formats(fmt, block, k):
    _check_format(fmt, block, k)


@pytest.mark.slow
def test_quantize_bfloat16_input_bit_identical():
    x = jnp.asarray(_awkward_rows(64, "mxfp8_e4m3")).astype(jnp.bfloat16)
    kwargs = dict(format="mxfp8_e4m3", axis=1, block_shape=(1, 32))
    want = quantize_op(x, **kwargs, implementation="xla")
    with interpret_mode(True):
        got = quantize_op(x, **kwargs, implementation=IMPL)
    _assert_identical("values", got.values, want.values)
    _assert_identical("scales", got.scales, want.scales)


def test_quantize_requirements_fall_back():
    """2-D blocks, a non-last axis, stochastic rounding and non-float32 scales are not
    for the kernel: an explicit request raises naming the reason; dispatch takes XLA."""
    x = jnp.ones((8, 64), jnp.float32)
    impl = quantize_op.implementations[IMPL]
    with stellax.lowering_target("v6e"):
        for kwargs, word in ((dict(format="fp8_e4m3", axis=1, block_shape=(8, 64)), "1-D blocks"),
                             (dict(format="int8", axis=0, block_shape=(8, 1)), "last axis"),
                             (dict(format="int8", axis=1, block_shape=(1, 64), scale_dtype="bfloat16"),
                              "float32 scales")):
            support = impl.supported(quantize_op.check(x, **kwargs))
            assert not support and word in support.reason
        assert impl.supported(quantize_op.check(x, format="fp8_e5m2", axis=1, block_shape=(1, 64)))
    with pytest.raises(stellax.UnsupportedError, match="1-D blocks"), interpret_mode(True):
        quantize_op(x, format="fp8_e4m3", axis=1, block_shape=(8, 64), implementation=IMPL)


@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_fp8_formats_run_on_every_generation(generation):
    """fp8 codes are built from bits (no fp8 vector dtype in the kernels), so the fp8 and
    MXFP8 formats are supported on every generation, with or without fp8 in the MXU."""
    x = jnp.ones((8, 64), jnp.float32)
    with stellax.lowering_target(generation):
        for fmt in ("fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "nvfp4"):
            call = quantize_op.check(x, format=fmt, axis=1, block_shape=(1, 16 if fmt == "nvfp4" else 32))
            assert quantize_op.implementations[IMPL].supported(call)


# -- hadamard --------------------------------------------------------------------------
HADAMARD_CASES = [((6, 64), 16), ((3, 256), 64), ((4, 512), 256)]


def _hadamard_roundtrip(shape, block):
    """Forward against the golden (random signs), inverse of the forward back to x."""
    kx, ks = jax.random.split(jax.random.PRNGKey(block))
    x = jax.random.normal(kx, shape, jnp.float32)
    signs = random_signs(ks, block)
    with interpret_mode(True):
        y = hadamard_op(x, signs, block=block, inverse=False, implementation=IMPL)
        back = hadamard_op(y, signs, block=block, inverse=True, implementation=IMPL)
    assert_close(y, hadamard_op.reference(x, signs, block=block, inverse=False), dtype=jnp.float32)
    assert_close(back, x, dtype=jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("shape,block", HADAMARD_CASES)
def test_hadamard_forward_inverse(shape, block):
    _hadamard_roundtrip(shape, block)


@pytest.mark.slow
def test_hadamard_bfloat16_and_odd_sizes():
    x = jax.random.normal(jax.random.PRNGKey(0), (5, 3, 96), jnp.float32).astype(jnp.bfloat16)
    with interpret_mode(True):
        y = hadamard_op(x, None, block=32, inverse=False, implementation=IMPL)
    assert_close(y, hadamard_op.reference(x, None, block=32, inverse=False), dtype=jnp.bfloat16)


def test_hadamard_block_range():
    x = jnp.ones((2, 512), jnp.float32)
    impl = hadamard_op.implementations[IMPL]
    with stellax.lowering_target("v5e"):
        assert not impl.supported(hadamard_op.check(x, None, block=512))
        assert not impl.supported(hadamard_op.check(x, None, block=8))
        assert impl.supported(hadamard_op.check(x, None, block=256))


# -- quantized matmul --------------------------------------------------------------------
def _matmul_case(x, w, out="float32", config=None):
    args, kwargs = flatten_operands(x, w)
    kwargs["preferred_element_type"] = out
    with interpret_mode(True):
        y = quantized_matmul_op(*args, **kwargs, implementation=IMPL, config=config)
    assert_close(y, quantized_matmul_op.reference(*args, **kwargs), dtype=jnp.dtype(out))
    return y


def _operands(m, k, n, dtype=jnp.float32, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
    return x.astype(dtype), w


DEFAULT_WEIGHTS = [("int4", 128)]
SLOW_WEIGHTS = [("nvfp4", 16), ("fp8_e5m2", "channel"), ("int8", "channel"), ("int8", 64), ("int8_asym", 128), ("int4_asym", 32), ("int4", "channel"),
                ("fp8_e4m3", (128, 128)), ("mxfp8_e4m3", 32), ("mxfp8_e5m2", 32), ("mxfp4", 32),
                ("nvfp4", (16, 16))]


@pytest.mark.parametrize("fmt,block", DEFAULT_WEIGHTS)
def test_weight_only_matmul(fmt, block):
    """K = 300 in steps of 256 (128 packed byte rows): two steps, the second a masked tail."""
    x, w = _operands(8, 300, 130)
    _matmul_case(x, quantize_example(w, fmt, 0, block), config=QMatmulTpuConfig(32, 128, 256))


@pytest.mark.slow
@pytest.mark.parametrize("fmt,block", SLOW_WEIGHTS)
def test_weight_only_matmul_more_formats(fmt, block):
    x, w = _operands(40, 1100, 200)
    _matmul_case(x, quantize_example(w, fmt, 0, block))


@pytest.mark.slow
@pytest.mark.parametrize("fmt,block", [("int4", 128), ("mxfp4", 32), ("int8", "channel")])
def test_weight_only_matmul_bfloat16(fmt, block):
    x, w = _operands(3 * 5, 384, 256, jnp.bfloat16)
    _matmul_case(x.reshape(3, 5, 384), quantize_example(w, fmt, 0, block), out="bfloat16")


def _int8_case(block):
    x, w = _operands(40, 700, 160)
    y = _matmul_case(quantize_example(x, "int8", 1, block), quantize_example(w, "int8", 0, block),
                     config=QMatmulTpuConfig(32, 128, 512))
    assert y.dtype == jnp.float32


def test_int8_matmul():
    """int8 × int8 on the MXU int8 path, per-channel scales (int32 accumulator), K tail masked."""
    _int8_case("channel")


@pytest.mark.slow
def test_int8_matmul_k_blocks():
    """K blocks of 256: float32 accumulation of scaled int32 step products."""
    _int8_case(256)


@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_int8_matmul_generation_gate(generation):
    """int8 × int8 runs where the MXU multiplies int8 (`TpuGeneration.matmul_dtypes`); elsewhere
    an explicit request raises UnsupportedError naming the generation and dispatch falls back."""
    x, w = _operands(8, 256, 128)
    args, kwargs = flatten_operands(quantize_example(x, "int8", 1, "channel"), quantize_example(w, "int8", 0, "channel"))
    call = quantized_matmul_op.check(*args, **kwargs)
    with stellax.lowering_target(generation):
        support = quantized_matmul_op.implementations[IMPL].supported(call)
        if TPU_GENERATIONS[generation].has_dtype("int8"):
            assert support
        else:
            assert not support and generation in support.reason
            with pytest.raises(stellax.UnsupportedError, match=generation):
                quantized_matmul_op(*args, **kwargs, implementation=IMPL)
            assert quantized_matmul_op.select(call, None).name == "xla"


def test_matmul_requirements():
    x, w = _operands(8, 256, 128)
    impl = quantized_matmul_op.implementations[IMPL]
    cases = [((quantize_example(x, "fp8_e4m3", 1, "channel"), quantize_example(w, "fp8_e4m3", 0, "channel")),
              "weight-only"),
             ((quantize_example(x, "int8", 1, 64), quantize_example(w, "int8", 0, 64)), "multiples of 128"),
             ((x.astype(jnp.float16), quantize_example(w, "int8", 0, "channel")), "float32/bfloat16")]
    with stellax.lowering_target("v6e"):
        for (a, b), word in cases:
            args, kwargs = flatten_operands(a, b)
            support = impl.supported(quantized_matmul_op.check(*args, **kwargs))
            assert not support and word in support.reason


# -- configs -------------------------------------------------------------------------------
@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_configs_fit_the_generation(generation):
    """Heuristics pick from their spaces; every config's VMEM estimate fits half the scoped default."""
    budget = TPU_GENERATIONS[generation].scoped_vmem_bytes // 2
    x = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    w = jax.eval_shape(lambda a: quantize_example(a, "int4", 0, 128), jnp.zeros((8192, 8192), jnp.float32))
    args, kwargs = flatten_operands(x, w)
    with stellax.lowering_target(generation):
        qcall = quantize_op.check(jnp.zeros((64, 4096), jnp.bfloat16), format="mxfp4", axis=1, block_shape=(1, 32))
        space = C.quantize_tpu_space(qcall)
        assert C.quantize_tpu_heuristic(qcall) in space
        assert all(C.quant_tpu_vmem(32, 2, 1, c.block_rows) <= budget for c in space)
        mcall = quantized_matmul_op.check(*args, **kwargs)
        mspace = C.qmatmul_tpu_space(mcall)
        heuristic = C.qmatmul_tpu_heuristic(mcall)
        assert heuristic in mspace and all(C.qmm_tpu_vmem(mcall, c) <= budget for c in mspace)
        assert heuristic.block_n >= TPU_GENERATIONS[generation].mxu
        hcall = hadamard_op.check(jnp.zeros((256, 4096), jnp.bfloat16), None, block=32)
        assert C.hadamard_lanes(256 * 4096, 32) == TPU_GENERATIONS[generation].mxu
        assert C.hadamard_tpu_heuristic(hcall) in C.hadamard_tpu_space(hcall)


@pytest.mark.slow
def test_float16_paths():
    """Mosaic has no float16 vectors: float16 inputs are upcast (exactly) before the kernel and
    float16 outputs cast after it, so the results stay bit-identical / as accurate."""
    x = jnp.asarray(_awkward_rows(64, "mxfp4")).astype(jnp.float16)
    kwargs = dict(format="mxfp4", axis=1, block_shape=(1, 32))
    want = quantize_op(x, **kwargs, implementation="xla")
    with interpret_mode(True):
        got = quantize_op(x, **kwargs, implementation=IMPL)
    _assert_identical("values", got.values, want.values)
    _assert_identical("scales", got.scales, want.scales)
    arrays, options = qarray_fields(want)
    with interpret_mode(True):
        y = dequantize_op(*arrays.values(), **options, dtype="float16", implementation=IMPL)
        h = hadamard_op(x[:4], None, block=64, inverse=False, implementation=IMPL)
    _assert_identical("dequantize", y, dequantize_op(*arrays.values(), **options, dtype="float16",
                                                     implementation="xla"))
    assert_close(h, hadamard_op.reference(x[:4], None, block=64, inverse=False), dtype=jnp.float16)


def test_float32_precision_contract_numerics():
    """precision='default' is one bfloat16 pass in the Hadamard and weight-only matmul kernels
    (interpret mode reproduces it: a bf16-like error), 'high' three (float32-like);
    `stellax.core.precision`."""
    from stellax.testing.numerics import compare, golden
    x = jax.random.normal(jax.random.PRNGKey(5), (64, 256), jnp.float32)
    signs = random_signs(jax.random.PRNGKey(6), 128)
    xq, w = _operands(16, 256, 128)
    args, kwargs = flatten_operands(xq, quantize_example(w, "int8", 0, "channel"))
    kwargs = {**kwargs, "preferred_element_type": "float32"}
    cases = {
        "hadamard": (lambda p: hadamard_op(x, signs, block=128, inverse=False, precision=p, implementation=IMPL),
                     golden(lambda a: hadamard_op.reference(a, signs, block=128, inverse=False), x)),
        "matmul": (lambda p: quantized_matmul_op(*args, **kwargs, precision=p, implementation=IMPL,
                                                 config=QMatmulTpuConfig(32, 128, 256)),
                   quantized_matmul_op.reference(*args, **kwargs)),
    }
    for name, (run, expected) in cases.items():
        with interpret_mode(True):
            errors = {p: compare(run(p), expected).rel_l2 for p in ("default", "high")}
        assert 1e-4 < errors["default"] < 3e-2, (name, errors)
        assert errors["high"] < 1e-4, (name, errors)
