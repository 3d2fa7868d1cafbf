"""Every format vs the independent numpy spec (quant_spec.py): codes and scales
bit-exact on random data, outliers, zeros, NaN/Inf, element subnormals and
exact ties; round-trip error bounds; stochastic rounding unbiased."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import quant_spec as S
from stellax.ops.quant import QArray, dequantize, quantize

F32 = np.float32


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).astype(np.int64)


def _data(kind, shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(F32)
    if kind == "outliers":
        mask = rng.random(shape) < 0.02
        x = np.where(mask, x * 1000, x).astype(F32)
    elif kind == "wide":  # many binades: exercises element subnormals inside a block
        x = (x * np.exp2(rng.integers(-20, 10, shape))).astype(F32)
    elif kind == "zeros":
        x[..., :64] = 0  # whole blocks of zeros
        x[0] = 0
    elif kind == "nonfinite":
        x[0, 3] = np.nan
        x[1, 40] = np.inf
        x[2, 70] = -np.inf
        x[3, 5] = np.nan
        x[3, 6] = np.inf
    return x


KINDS = ["normal", "outliers", "wide", "zeros", "nonfinite"]
SHAPE = (6, 200)  # 200 is not a multiple of 16, 32, 64 or 128


# -- tables --------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2),
                                        ("e2m1", ml_dtypes.float4_e2m1fn)])
def test_spec_tables_agree_with_ml_dtypes(name, dtype):
    """Sanity check of the test's own tables (built from bit fields)."""
    n = len(S.TABLES[name])
    ref = np.arange(n, dtype=np.uint8).view(dtype) if n == 256 else np.array(
        [ml_dtypes.float4_e2m1fn(v) for v in S.TABLES[name]])
    np.testing.assert_array_equal(np.asarray(ref, np.float64), S.TABLES[name])


# -- int ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [64, "channel"])
def test_int8_symmetric_bit_exact(kind, block):
    x = _data(kind, SHAPE)
    q = quantize(jnp.asarray(x), "int8", block_size=block)
    b = 64 if block == 64 else SHAPE[1]
    codes, s = S.quantize_int_sym(x, b, 127)
    assert q.values.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(q.values).astype(np.int64), codes)
    np.testing.assert_array_equal(np.asarray(q.scales), s)


@pytest.mark.parametrize("kind", KINDS)
def test_int8_asymmetric_bit_exact(kind):
    x = _data(kind, SHAPE, seed=1) + F32(0.7)
    q = quantize(jnp.asarray(x), "int8_asym", block_size=32)
    codes, s, zp = S.quantize_int_asym(x, 32, -128, 127)
    np.testing.assert_array_equal(np.asarray(q.values).astype(np.int64), codes)
    np.testing.assert_array_equal(np.asarray(q.scales), s)
    np.testing.assert_array_equal(np.asarray(q.zero_points).astype(np.int64), zp)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["int4", "int4_asym"])
def test_int4_packed_bit_exact(kind, fmt):
    x = _data(kind, (5, 201), seed=2)  # odd length: the last byte has one nibble
    q = quantize(jnp.asarray(x), fmt, block_size=32)
    assert q.values.dtype == jnp.uint8 and q.values.shape == (5, 101)
    nib = S.unpack_nibbles_last(q.values, 201)
    got = np.where(nib >= 8, nib - 16, nib)
    if fmt == "int4":
        codes, s = S.quantize_int_sym(x, 32, 7)
    else:
        codes, s, zp = S.quantize_int_asym(x, 32, -8, 7)
        np.testing.assert_array_equal(np.asarray(q.zero_points).astype(np.int64), zp)
    np.testing.assert_array_equal(got, codes)
    np.testing.assert_array_equal(np.asarray(q.scales), s)
    assert np.all(S.unpack_nibbles_last(q.values, 202)[:, 201] == 0)


def test_int8_ties_round_half_even():
    # amax = 127 → scale 1: x = k + 0.5 are exact ties.
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49999]], F32)
    q = quantize(jnp.asarray(x), "int8")
    assert float(q.scales[0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(q.values)[0], [127, 0, 2, 2, 0, -2, -2, 126, -126, 3])


# -- fp8 ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt,name", [("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")])
@pytest.mark.parametrize("block", [128, "channel"])
def test_fp8_bit_exact(kind, fmt, name, block):
    x = _data(kind, SHAPE, seed=3)
    q = quantize(jnp.asarray(x), fmt, block_size=block)
    b = 128 if block == 128 else SHAPE[1]
    codes, s = S.quantize_fp8(x, b, name)
    np.testing.assert_array_equal(_bits(q.values), codes)
    np.testing.assert_array_equal(np.asarray(q.scales), s)


@pytest.mark.parametrize("fmt,name", [("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")])
def test_fp8_per_tensor_and_2d_blocks(fmt, name):
    x = _data("outliers", (300, 260), seed=4)
    q = quantize(jnp.asarray(x), fmt, block_size="tensor")
    codes, s = S.quantize_fp8(x.reshape(1, -1), x.size, name)
    np.testing.assert_array_equal(_bits(q.values).reshape(1, -1), codes)
    np.testing.assert_array_equal(np.asarray(q.scales).reshape(-1), s.reshape(-1))
    q2 = quantize(jnp.asarray(x), fmt, axis=0, block_size=(128, 128))
    assert q2.scales.shape == (3, 3) and q2.block_shape == (128, 128)
    for bi in range(3):
        for bj in range(3):
            tile = x[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
            c, s = S.quantize_fp8(tile.reshape(1, -1), tile.size, name)
            assert float(q2.scales[bi, bj]) == float(s[0, 0])
            np.testing.assert_array_equal(
                _bits(q2.values[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]).reshape(1, -1), c)


@pytest.mark.parametrize("name,fmt", [("e4m3", "fp8_e4m3"), ("e5m2", "fp8_e5m2")])
def test_fp8_ties_subnormals_saturation(name, fmt):
    table = S.TABLES[name]
    pos = np.sort(table[:len(table) // 2][np.isfinite(table[:len(table) // 2])])
    mids = (pos[:-1] + pos[1:]) / 2  # exact ties (all representable in float32)
    vmax = pos[-1]
    x = np.concatenate([[vmax], mids, -mids, pos[:8], [vmax * 1.01, -vmax * 1.5]]).astype(F32)[None]
    q = quantize(jnp.asarray(x), fmt, block_size="tensor")
    # amax is 1.5·vmax, so the scale is 1.5: compare against the spec.
    codes, s = S.quantize_fp8(x, x.shape[1], name)
    np.testing.assert_array_equal(_bits(q.values), codes)
    # Scale exactly 1: ties land exactly on midpoints.
    x1 = np.concatenate([[vmax], mids, -mids, pos[:8]]).astype(F32)[None]
    q1 = quantize(jnp.asarray(x1), fmt, block_size="tensor")
    assert float(q1.scales[0, 0]) == 1.0
    got = _bits(q1.values)[0]
    want = S.encode_rne(x1[0], name)
    np.testing.assert_array_equal(got, want)
    # every tie went to the even code
    tie_codes = got[1:1 + len(mids)]
    assert np.all(tie_codes % 2 == 0)


def test_fp8_saturates_inf_and_keeps_nan():
    x = np.array([[1.0, np.inf, -np.inf, np.nan, 2.0]], F32)
    q = quantize(jnp.asarray(x), "fp8_e5m2", block_size="channel")
    d = np.asarray(dequantize(q))
    assert d[0, 1] == 2.0 and d[0, 2] == -2.0 and np.isnan(d[0, 3]) and d[0, 4] == 2.0


# -- MX -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt,name", [("mxfp8_e4m3", "e4m3"), ("mxfp8_e5m2", "e5m2"), ("mxfp4", "e2m1")])
def test_mx_bit_exact(kind, fmt, name):
    x = _data(kind, SHAPE, seed=5)
    q = quantize(jnp.asarray(x), fmt)
    codes, scale_codes = S.quantize_mx(x, name)
    assert q.scales.dtype == jnp.float8_e8m0fnu and q.scales.shape == (6, 7)
    np.testing.assert_array_equal(_bits(q.scales), scale_codes)
    got = S.unpack_nibbles_last(q.values, 200) if name == "e2m1" else _bits(q.values)
    np.testing.assert_array_equal(got, codes)


@pytest.mark.parametrize("fmt,name,lo", [("mxfp8_e4m3", "e4m3", 256.0), ("mxfp4", "e2m1", 4.0)])
def test_mx_ties_and_subnormals(fmt, name, lo):
    """amax in [2^emax, 2^(emax+1)) gives X = 1, so midpoints are exact ties."""
    table = S.TABLES[name]
    pos = np.sort(table[:len(table) // 2][np.isfinite(table[:len(table) // 2])])
    mids = (pos[:-1] + pos[1:]) / 2
    vals = np.concatenate([mids, -mids, pos])[:31]
    block = np.concatenate([[lo * 1.9], vals]).astype(F32)  # 1.9·lo > max normal for e4m3: saturates
    x = block[None]
    q = quantize(jnp.asarray(x), fmt)
    assert int(_bits(q.scales)[0, 0]) == 127  # X = 2^0
    codes, _ = S.quantize_mx(x, name)
    got = S.unpack_nibbles_last(q.values, x.shape[1]) if name == "e2m1" else _bits(q.values)
    np.testing.assert_array_equal(got, codes)
    np.testing.assert_array_equal(got[0, 1:], S.encode_rne(vals, name))


def test_mx_nonfinite_block_gets_nan_scale_and_zero_block_min_scale():
    x = np.ones((2, 64), F32)
    x[0, 5] = np.inf
    x[1, 32:] = 0
    q = quantize(jnp.asarray(x), "mxfp8_e4m3")
    sc = _bits(q.scales)
    assert sc[0, 0] == 255 and sc[1, 1] == 0 and sc[0, 1] == 127 - 8
    d = np.asarray(dequantize(q))
    assert np.isnan(d[0, :32]).all() and (d[0, 32:] == 1).all() and (d[1, 32:] == 0).all()


# -- NVFP4 ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_bit_exact(kind):
    x = _data(kind, SHAPE, seed=6)
    q = quantize(jnp.asarray(x), "nvfp4")
    codes, sb_codes, t = S.quantize_nvfp4(x)
    assert q.scales.dtype == jnp.float8_e4m3fn and q.scales.shape == (6, 13)
    assert float(q.tensor_scale) == float(t)
    np.testing.assert_array_equal(_bits(q.scales), sb_codes)
    np.testing.assert_array_equal(S.unpack_nibbles_last(q.values, 200), codes)
    # block scales fit E4M3: the largest is at most 448
    sb = S.decode(sb_codes, "e4m3")
    assert np.nanmax(sb) <= 448


def test_nvfp4_2d_blocks_match_spec_on_tiles():
    x = _data("outliers", (40, 48), seed=7)
    q = quantize(jnp.asarray(x), "nvfp4", axis=0, block_size=(16, 16))
    assert q.scales.shape == (3, 3) and q.values.shape == (20, 48)
    # the 2-D quantizer equals the 1-D spec run on each flattened 16×16 tile,
    # with the same (global) tensor scale
    _, _, t = S.quantize_nvfp4(x)
    assert float(q.tensor_scale) == float(t)
    codes_all = np.stack([np.asarray(q.values) & 0xF, np.asarray(q.values) >> 4], axis=1).reshape(40, 48)
    for bi in range(3):
        for bj in range(3):
            tile = x[bi * 16:(bi + 1) * 16, bj * 16:(bj + 1) * 16]
            bamax = F32(np.max(np.abs(tile)))
            sb_code = S.encode_rne(np.array([F32(bamax / F32(6)) / t]), "e4m3")[0]
            assert int(_bits(q.scales)[bi, bj]) == sb_code
            denom = F32(S.decode(sb_code, "e4m3") * t)
            want = S.encode_rne((tile * (F32(1) / denom)).astype(F32).reshape(-1), "e2m1")
            np.testing.assert_array_equal(codes_all[bi * 16:(bi + 1) * 16, bj * 16:(bj + 1) * 16].reshape(-1), want)


# -- round trips -------------------------------------------------------------------------

BOUNDS = {"int8": 0.01, "int8_asym": 0.01, "int4": 0.15, "int4_asym": 0.15, "fp8_e4m3": 0.04, "fp8_e5m2": 0.08,
          "mxfp8_e4m3": 0.05, "mxfp8_e5m2": 0.09, "mxfp4": 0.2, "nvfp4": 0.15}


@pytest.mark.parametrize("fmt", sorted(BOUNDS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_round_trip_error_bounds(fmt, dtype):
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 320), jnp.float32).astype(dtype)
    q = quantize(x, fmt)
    d = dequantize(q, jnp.float32)
    xf = np.asarray(x.astype(jnp.float32))
    rel = np.linalg.norm(np.asarray(d) - xf) / np.linalg.norm(xf)
    assert rel < BOUNDS[fmt], rel
    assert dequantize(q, dtype).dtype == dtype


@pytest.mark.parametrize("fmt,qmax", [("int8", 127), ("int4", 7)])
def test_int_elementwise_error_at_most_half_step(fmt, qmax):
    x = _data("outliers", (8, 256), seed=8)
    q = quantize(jnp.asarray(x), fmt, block_size=64)
    d = np.asarray(dequantize(q))
    step = np.repeat(np.asarray(q.scales), 64, axis=1)
    assert np.all(np.abs(d - x) <= step / 2 * (1 + 1e-6))


def test_float32_subnormal_inputs_flush_to_zero_or_match():
    """XLA on CPU flushes float32 subnormals; such inputs quantize to 0."""
    x = np.array([[1e-40, -3e-42, 1.0]], F32)
    d = np.asarray(dequantize(quantize(jnp.asarray(x), "fp8_e4m3")))
    assert d[0, 2] == 1.0 and abs(d[0, 0]) <= 1e-38 and abs(d[0, 1]) <= 1e-38


# -- stochastic rounding -------------------------------------------------------------------


@pytest.mark.parametrize("fmt,block", [("fp8_e4m3", "tensor"), ("fp8_e5m2", "tensor"), ("mxfp4", 32),
                                       ("mxfp8_e4m3", 32), ("nvfp4", 16), ("int8", "tensor")])
def test_stochastic_rounding_unbiased(fmt, block):
    rng = np.random.default_rng(9)
    base = rng.uniform(-1, 1, 32).astype(F32)
    base[0] = 1.0  # fixes amax, so every row shares the scale
    draws = 4000
    x = np.tile(base, (draws, 1))
    q = quantize(jnp.asarray(x), fmt, block_size=block, stochastic_rounding_key=jax.random.PRNGKey(3))
    d = np.asarray(dequantize(q)).astype(np.float64)
    nearest = np.asarray(dequantize(quantize(jnp.asarray(base[None]), fmt, block_size=block)))[0]
    # each draw is one of the two grid neighbours
    lo = np.minimum(d.min(0), nearest)
    hi = np.maximum(d.max(0), nearest)
    assert np.all((d == lo) | (d == hi))
    step = np.maximum(hi - lo, 1e-12)
    mean_err = d.mean(0) - base
    bound = 5 * step / (2 * np.sqrt(draws)) + 1e-7
    assert np.all(np.abs(mean_err) <= bound), (mean_err, bound)
    # round-to-nearest is biased on the same data; stochastic rounding is not
    assert np.abs(mean_err).mean() < np.abs(nearest - base).mean()


def test_stochastic_rounding_deterministic_per_key():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 64))
    a = quantize(x, "mxfp4", stochastic_rounding_key=jax.random.PRNGKey(1))
    b = quantize(x, "mxfp4", stochastic_rounding_key=jax.random.PRNGKey(1))
    c = quantize(x, "mxfp4", stochastic_rounding_key=jax.random.PRNGKey(2))
    assert np.array_equal(np.asarray(a.values), np.asarray(b.values))
    assert not np.array_equal(np.asarray(a.values), np.asarray(c.values))
