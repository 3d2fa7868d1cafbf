"""hadamard_transform: orthogonality, inverse, dense-matrix equality (numpy,
built here by Sylvester's construction), random signs, errors; Triton
(interpreted) and XLA; cuda lowering of every config; PTX tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.quant import hadamard_op, hadamard_transform
from stellax.testing import (assert_fits_smem, check_op_lowering, compile_triton_to_ptx, lower_for_gpu,
                             triton_compiler_available)

IMPLS = ["xla", "triton"]


def sylvester(n):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / np.sqrt(n)


def _run(impl, x, **kw):
    with stellax.interpret_mode():
        return hadamard_transform(x, implementation=impl, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n,block", [(16, None), (256, None), (256, 32), (384, 128), (96, 16)])
def test_matches_dense_hadamard(impl, n, block):
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(n), (5, 3, n)), np.float64)
    b = n if block is None else block
    y = np.asarray(_run(impl, jnp.asarray(x, jnp.float32), block_size=block))
    want = (x.reshape(-1, b) @ sylvester(b).T).reshape(x.shape)
    np.testing.assert_allclose(y, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_orthogonal_and_self_inverse(impl):
    n = 64
    eye = jnp.eye(n, dtype=jnp.float32)
    h = np.asarray(_run(impl, eye))  # rows: H applied to basis vectors
    np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-5)
    x = jax.random.normal(jax.random.PRNGKey(1), (7, n))
    y = _run(impl, x)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(_run(impl, y, inverse=True)), np.asarray(x), atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_random_signs_forward_inverse(impl):
    x = jax.random.normal(jax.random.PRNGKey(2), (9, 512))
    key = jax.random.PRNGKey(3)
    y = _run(impl, x, block_size=128, random_signs_key=key)
    back = _run(impl, y, block_size=128, random_signs_key=key, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), atol=2e-5)
    # the signed transform differs from the plain one, and equals H·diag(d)
    plain = _run(impl, x, block_size=128)
    assert not np.allclose(np.asarray(plain), np.asarray(y))
    d = np.asarray(stellax.ops.quant.hadamard.random_signs(key, 128))
    want = (np.asarray(x, np.float64).reshape(-1, 128) * d) @ sylvester(128).T
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 128), want, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_dtypes(dtype):
    x = jax.random.normal(jax.random.PRNGKey(4), (33, 256)).astype(dtype)
    for impl in IMPLS:
        y = _run(impl, x, block_size=64)
        assert y.dtype == dtype
        want = hadamard_op.reference(x.astype(jnp.float32), None, block=64)
        rel = float(jnp.linalg.norm(y.astype(jnp.float32) - want) / jnp.linalg.norm(want))
        assert rel < 1e-2


def test_rejects_non_power_of_two():
    with pytest.raises(ValueError, match=r"power-of-two size, got 100"):
        hadamard_transform(jnp.ones((2, 100)))
    with pytest.raises(ValueError, match=r"power-of-two size, got 24"):
        hadamard_transform(jnp.ones((2, 96)), block_size=24)
    with pytest.raises(ValueError, match=r"must divide the last axis"):
        hadamard_transform(jnp.ones((2, 96)), block_size=64)
    with pytest.raises(stellax.UnsupportedError, match=r"blocks of 16–256"):
        with stellax.interpret_mode():
            hadamard_transform(jnp.ones((2, 512)), implementation="triton")


def test_rows_not_multiple_of_block_rows():
    x = jax.random.normal(jax.random.PRNGKey(5), (37, 32))
    cfg = stellax.ops.quant.HadamardConfig(block_rows=64, num_warps=4, num_stages=1)
    with stellax.interpret_mode():
        y = hadamard_transform(x, implementation="triton", config=cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x, np.float64) @ sylvester(32).T, atol=2e-5)


def test_cuda_lowering_every_config():
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    n = check_op_lowering(hadamard_op, "triton", (x, jnp.ones((64,), jnp.float32)), {"block": 64})
    assert n == len(hadamard_op.implementations["triton"].config_space(
        hadamard_op.check(x, None, block=64)))


@pytest.mark.ptx
@pytest.mark.parametrize("block", [16, 256])
def test_ptx_compiles_and_fits_smem(block):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    lowered = lower_for_gpu(lambda x: hadamard_transform(x, block_size=block, implementation="triton"), x)
    assert_fits_smem(compile_triton_to_ptx(lowered))
