"""QArray construction and bad inputs: clear errors naming the field."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.quant import QArray, dequantize, quantize


def _ok_int8():
    return dict(values=jnp.zeros((4, 64), jnp.int8), scales=jnp.ones((4, 2), jnp.float32), format="int8",
                shape=(4, 64), block_shape=(1, 32), axis=1)


def _make(**changes):
    kw = {**_ok_int8(), **changes}
    return QArray(kw.pop("values"), kw.pop("scales"), kw.pop("zero_points", None), kw.pop("tensor_scale", None), **kw)


def test_by_hand_valid_and_dequantizes():
    q = _make(values=jnp.full((4, 64), 3, jnp.int8), scales=jnp.full((4, 2), 0.5, jnp.float32))
    np.testing.assert_array_equal(np.asarray(dequantize(q)), np.full((4, 64), 1.5, np.float32))


@pytest.mark.parametrize("changes,error,match", [
    (dict(scales=jnp.ones((4, 3), jnp.float32)), ValueError, r"QArray.scales: expected shape \(4, 2\)"),
    (dict(scales=jnp.ones((2,), jnp.float32)), ValueError, r"QArray.scales: expected shape"),
    (dict(values=jnp.zeros((4, 63), jnp.int8)), ValueError, r"QArray.values: expected shape \(4, 64\)"),
    (dict(values=jnp.zeros((4, 64), jnp.uint8)), TypeError, r"QArray.values: expected dtype int8"),
    (dict(scales=jnp.ones((4, 2), jnp.int32)), TypeError, r"QArray.scales: expected dtype"),
    (dict(block_shape=(1,)), ValueError, r"QArray.block_shape: expected 2"),
    (dict(block_shape=(1, 128)), ValueError, r"QArray.block_shape: expected each block size"),
    (dict(axis=2), ValueError, r"QArray.axis"),
    (dict(zero_points=jnp.zeros((4, 2), jnp.int8)), ValueError, r"symmetric and takes no zero points"),
    (dict(format="int8_asym"), ValueError, r"QArray.zero_points: format int8_asym needs zero points"),
    (dict(format="nope"), ValueError, r"format: expected one of"),
])
def test_by_hand_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _make(**changes)


def test_packed_and_mx_and_nvfp4_validation():
    # int4: values packed along axis → (4, 32) bytes for 64 elements
    QArray(jnp.zeros((4, 32), jnp.uint8), jnp.ones((4, 2)), format="int4", shape=(4, 64), block_shape=(1, 32), axis=1)
    with pytest.raises(ValueError, match=r"packed two per byte"):
        QArray(jnp.zeros((4, 64), jnp.uint8), jnp.ones((4, 2)), format="int4", shape=(4, 64), block_shape=(1, 32),
               axis=1)
    with pytest.raises(ValueError, match=r"blocks of \[32\]"):
        QArray(jnp.zeros((4, 64), jnp.float8_e4m3fn), jnp.ones((4, 4), jnp.float8_e8m0fnu), format="mxfp8_e4m3",
               shape=(4, 64), block_shape=(1, 16), axis=1)
    with pytest.raises(ValueError, match=r"tensor_scale: format nvfp4 needs"):
        QArray(jnp.zeros((4, 32), jnp.uint8), jnp.ones((4, 4), jnp.float8_e4m3fn), format="nvfp4", shape=(4, 64),
               block_shape=(1, 16), axis=1)
    with pytest.raises(ValueError, match=r"tensor_scale: expected a scalar"):
        QArray(jnp.zeros((4, 32), jnp.uint8), jnp.ones((4, 4), jnp.float8_e4m3fn), None, jnp.ones((1,)),
               format="nvfp4", shape=(4, 64), block_shape=(1, 16), axis=1)


def test_quantize_bad_arguments():
    x = jnp.ones((4, 64))
    with pytest.raises(ValueError, match=r"block_size: format mxfp4 takes blocks of \[32\]"):
        quantize(x, "mxfp4", block_size=16)
    with pytest.raises(ValueError, match=r"block_size: format nvfp4"):
        quantize(x, "nvfp4", block_size=32)
    with pytest.raises(ValueError, match=r"scale_dtype: format mxfp8_e4m3 has fixed e8m0 scales"):
        quantize(x, "mxfp8", scale_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"format: expected one of"):
        quantize(x, "int3")
    with pytest.raises(TypeError, match=r"x: expected a floating dtype"):
        quantize(jnp.ones((4, 64), jnp.int32), "int8")
    with pytest.raises(ValueError, match=r"axis"):
        quantize(x, "int8", axis=3)
    with pytest.raises(ValueError, match=r"block_size: expected"):
        quantize(x, "int8", block_size="rows")
    with pytest.raises(TypeError, match=r"qx: expected a QArray"):
        dequantize(x)


def test_block_not_dividing_axis_is_zero_padded():
    """A trailing partial block behaves like a zero-padded block."""
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 50))
    q = quantize(x, "int8", block_size=32)
    assert q.scales.shape == (3, 2) and q.values.shape == (3, 50)
    padded = jnp.concatenate([x, jnp.zeros((3, 14))], axis=1)
    qp = quantize(padded, "int8", block_size=32)
    np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(qp.scales))
    np.testing.assert_array_equal(np.asarray(q.values), np.asarray(qp.values)[:, :50])


def test_pytree_jit_and_scale_dtypes():
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 256))
    q = quantize(x, "fp8_e4m3", block_size=128, scale_dtype=jnp.bfloat16)
    assert q.scales.dtype == jnp.bfloat16
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 2
    out = jax.jit(lambda q: dequantize(q))(q)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dequantize(q)))
    q8 = quantize(x, "fp8_e4m3", block_size=128, scale_dtype=jnp.float8_e8m0fnu)
    s = np.asarray(q8.scales.astype(jnp.float32))
    amax = np.abs(np.asarray(x)).reshape(8, 2, 128).max(-1)
    # power-of-two scales rounded up: amax / s fits in e4m3's 448, within 2x
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    assert np.all(amax / s <= 448) and np.all(amax / s > 224)


def test_rotation_is_recorded_and_invertible():
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 256))
    key = jax.random.PRNGKey(5)
    q = quantize(x, "fp8_e4m3", rotate=(64, key))
    assert q.rotation == 64
    back = stellax.ops.quant.hadamard_transform(dequantize(q), block_size=64, random_signs_key=key, inverse=True)
    rel = np.linalg.norm(np.asarray(back) - np.asarray(x)) / np.linalg.norm(np.asarray(x))
    assert rel < 0.05


def test_rotation_helps_outliers_for_mxfp4():
    x = np.array(jax.random.normal(jax.random.PRNGKey(1), (64, 256)))
    x[:, ::32] *= 50  # one big outlier per block
    x = jnp.asarray(x)
    plain = dequantize(quantize(x, "mxfp4"))
    rotated = quantize(x, "mxfp4", rotate=32)
    back = stellax.ops.quant.hadamard_transform(dequantize(rotated), block_size=32, inverse=True)
    err = lambda y: float(jnp.linalg.norm(y - x) / jnp.linalg.norm(x))
    assert err(back) < err(plain)
