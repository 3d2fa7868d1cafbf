"""layer_norm / rms_norm Mosaic TPU kernels: interpret-mode numerics against the golden,
against jax's bundled Pallas norm kernels (the independent oracle), overflow safety,
determinism, configs per TPU generation, and lowering for tpu.

The generic tiers (every example and config, interpreted and lowered) run in
tests/test_registry_tiers.py; this file holds what is specific to the TPU kernels.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.gpu import layer_norm as jax_layer_norm
from jax.experimental.pallas.ops.gpu import rms_norm as jax_rms_norm

import stellax
from stellax.core.tpu import KERNEL_GENERATIONS, TPU_GENERATIONS
from stellax.ops.norm import NormTpuConfig, layer_norm_backward_op, layer_norm_op
from stellax.ops.norm.configs import (TPU_TARGET_BLOCK_BYTES, norm_tpu_vmem_bytes, tpu_block_rows, tpu_chunk_rows,
                                      tpu_padded_features, tpu_slab, tpu_vmem_cap, tpu_vmem_limit)
from stellax.testing import assert_close, lower_config, random_array

IMPL = "mosaic_tpu"


def _inputs(rows, features, dtype, seed=0):
    kx, ks, ko, kr = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = random_array(kx, (rows, features), dtype, offset=0.5)
    scale = random_array(ks, (features,), dtype, scale=0.2, offset=1.0)
    offset = random_array(ko, (features,), dtype, scale=0.2)
    residual = random_array(kr, (rows, features), dtype)
    return x, scale, offset, residual


def _f32(tree):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), tree)


def _loss(fn, cotangents):
    """A random projection of every output of ``fn`` (so every output's cotangent is exercised)."""
    def loss(*args):
        outs = jax.tree_util.tree_leaves(fn(*args))
        return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cotangents))
    return loss


def _check_against_golden(dtype, rows, features, *, subtract_mean, residual, config, seed=0, deterministic=False):
    """Forward outputs and the gradients of x, residual, scale, offset against the golden; with
    ``deterministic`` a second run of the same compiled functions must be bitwise equal."""
    x, scale, offset, res = _inputs(rows, features, dtype, seed)
    offset = offset if subtract_mean else None
    res = res if residual else None
    kwargs = dict(subtract_mean=subtract_mean)

    def run(x, res, scale, offset):
        with stellax.use_configs({("layer_norm", IMPL): config, ("layer_norm_backward", IMPL): config}):
            return stellax.layer_norm(x, scale, offset, residual=res, implementation=IMPL, **kwargs)

    def ref(x, res, scale, offset):
        return layer_norm_op.reference(x, scale, offset, residual=res, **kwargs)

    args = (x, res, scale, offset)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 2)
    cots = [random_array(k, x.shape, jnp.float32) for k in keys]
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    def loss_and_outputs(*a):
        return _loss(run, cots)(*a), run(*a)

    with stellax.interpret_mode():
        # One compiled program for the outputs and the gradients (interpreted kernels compile slowly).
        both = jax.jit(jax.grad(loss_and_outputs, argnums=argnums, has_aux=True))
        grads, out = both(*args)
        if deterministic:
            again = both(*args)
    expected = ref(*_f32(args))
    ref_grads = jax.grad(_loss(ref, cots), argnums=argnums)(*_f32(args))
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        assert o.dtype == x.dtype
        assert_close(o, r, dtype=dtype, name="y/h")
    names = [("dx", "dresidual", "dscale", "doffset")[i] for i in argnums]
    for name, g, r in zip(names, grads, ref_grads):
        assert_close(g, r, dtype=dtype, gradient=True, name=name)
    if deterministic:
        for a, b in zip(jax.tree_util.tree_leaves((grads, out)), jax.tree_util.tree_leaves(again)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), "two runs differ"


def test_layer_norm_residual_partial_blocks_and_determinism():
    """LayerNorm + residual, f32, 37 rows in blocks of 16 (a partial last block), D=200 padded
    to 256 lanes, against the golden; forward and backward bitwise deterministic."""
    _check_against_golden(jnp.float32, 37, 200, subtract_mean=True, residual=True,
                          config=NormTpuConfig(block_rows=16), deterministic=True)


@pytest.mark.parametrize("dtype, rows, features, subtract_mean, residual", [
    (jnp.bfloat16, 100, 1100, True, True),     # 4 chunks per block, 2 blocks (2 column-sum splits, one partial), 9 slabs of 128
    (jnp.float32, 70, 1536, False, False),    # 3 slabs of 512, float32 read in place, blocks 64 + 6
])
def test_chunks_slabs_and_splits(dtype, rows, features, subtract_mean, residual):
    """Blocks of 64 rows walked in 16-row chunks and lane slabs, the backward's column sums
    accumulated over the ``arbitrary`` axis per split: against the golden, deterministic."""
    _check_against_golden(dtype, rows, features, subtract_mean=subtract_mean, residual=residual,
                          config=NormTpuConfig(block_rows=64), seed=rows, deterministic=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("rows, features, block_rows", [(5, 127, 16), (50, 384, 32)])
def test_matches_golden_sweep(dtype, subtract_mean, residual, rows, features, block_rows):
    _check_against_golden(dtype, rows, features, subtract_mean=subtract_mean, residual=residual,
                          config=NormTpuConfig(block_rows=block_rows), seed=rows)


@pytest.mark.slow
def test_bfloat16_rms_norm_residual():
    _check_against_golden(jnp.bfloat16, 40, 1000, subtract_mean=False, residual=True,
                          config=NormTpuConfig(block_rows=16), seed=3)


@pytest.mark.slow
def test_no_scale_no_offset_other_axis():
    x = random_array(jax.random.PRNGKey(4), (6, 33, 4), jnp.float32)
    with stellax.interpret_mode():
        out = stellax.layer_norm(x, axis=1, implementation=IMPL)
        grad = jax.grad(lambda x: jnp.sum(jnp.sin(stellax.layer_norm(x, axis=1, implementation=IMPL))))(x)
    assert_close(out, layer_norm_op.reference(x, axis=1), name="y")
    ref_grad = jax.grad(lambda x: jnp.sum(jnp.sin(layer_norm_op.reference(x, axis=1))))(x)
    assert_close(grad, ref_grad, gradient=True, name="dx")


# -- overflow safety ----------------------------------------------------------------------
@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
def test_statistics_do_not_overflow_at_1e30(subtract_mean):
    """Rows of magnitude ~1e30 (squares overflow float32) and ~1e-30 (squares underflow), and a
    zero row: the kernel's statistics are scaled by the row's max |h| (a power of two); the
    backward on those statistics is finite and matches float64 too."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(16, 256)) + (0.5 if subtract_mean else 0.0)
    magnitudes = np.array([1e30] * 6 + [1e-30] * 4 + [1.0] * 5 + [0.0])[:, None]
    x64 = base * magnitudes
    x64[-1] = 0.0
    x = jnp.asarray(x64, jnp.float32)
    dy64 = rng.normal(size=(16, 256))
    with stellax.interpret_mode():
        y, h, mean, rstd = _forward_rows(x, subtract_mean)
        dx, dscale, _ = _backward_rows(jnp.asarray(dy64, jnp.float32), x, mean, rstd, subtract_mean)
    mean64 = x64.mean(axis=1) if subtract_mean else np.zeros(16)
    var64 = ((x64 - mean64[:, None]) ** 2).mean(axis=1)
    rstd64 = 1 / np.sqrt(var64 + 1e-6)
    y64 = (x64 - mean64[:, None]) * rstd64[:, None]
    for name, got in (("y", y), ("mean", mean), ("rstd", rstd)):
        assert np.all(np.isfinite(np.asarray(got))), f"{name}: non-finite values"
    np.testing.assert_allclose(np.asarray(y), y64, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(mean), mean64, rtol=2e-5, atol=1e-35)
    np.testing.assert_allclose(np.asarray(rstd), rstd64, rtol=2e-5)
    xhat64 = (x64 - mean64[:, None]) * rstd64[:, None]
    dx64 = dy64 - xhat64 * (dy64 * xhat64).mean(axis=1, keepdims=True)
    if subtract_mean:
        dx64 = dx64 - dy64.mean(axis=1, keepdims=True)
    dx64 = dx64 * rstd64[:, None]
    assert np.all(np.isfinite(np.asarray(dx))) and np.all(np.isfinite(np.asarray(dscale)))
    # Per row, relative to the row's largest |dx| (rows of 1e30 have dx ~1e-30).
    row_error = np.abs(np.asarray(dx) - dx64).max(axis=1) / np.maximum(np.abs(dx64).max(axis=1), 1e-300)
    assert np.all(row_error < 1e-4), row_error
    np.testing.assert_allclose(np.asarray(dscale), (dy64 * xhat64).sum(axis=0), rtol=1e-4, atol=1e-4)


def _backward_rows(dy, x, mean, rstd, subtract_mean):
    from stellax.ops.norm import mosaic_tpu

    ones = jnp.ones((x.shape[1],), jnp.float32)
    return mosaic_tpu.norm_backward(dy, x, ones, None, mean, rstd, None, subtract_mean=subtract_mean,
                                    config=NormTpuConfig(block_rows=16))


def _forward_rows(x, subtract_mean):
    from stellax.ops.norm import mosaic_tpu

    y, h, mean, rstd = mosaic_tpu.norm_forward(x, None, None, None, epsilon=1e-6, subtract_mean=subtract_mean,
                                               config=NormTpuConfig(block_rows=16))
    return y, h, mean, rstd


# -- the independent oracle: jax's bundled Pallas norm kernels -----------------------------------
def _oracle_case(subtract_mean):
    x, scale, offset, _ = _inputs(16, 200, jnp.float32, seed=11)
    x3 = x.reshape(2, 8, 200)
    jax_norm = jax_layer_norm.layer_norm if subtract_mean else jax_rms_norm.rms_norm
    oracle = lambda x, s, o: jax_norm(x, s, o, eps=1e-6, interpret=True)
    ours = lambda x, s, o: stellax.layer_norm(x, s, o, subtract_mean=subtract_mean, implementation=IMPL)
    return (x3, scale, offset), oracle, ours


def test_forward_matches_jax_bundled_pallas_layer_norm():
    """jax 0.10.2 ships no TPU norm kernel; its Pallas GPU layer_norm, run with interpret=True on
    identical inputs, is the independent oracle (backward and rms_norm: the slow test below)."""
    args, oracle, ours = _oracle_case(True)
    with stellax.interpret_mode():
        out = jax.jit(ours)(*args)
    assert_close(out, oracle(*args), name="y vs jax pallas layer_norm")


@pytest.mark.slow
@pytest.mark.parametrize("subtract_mean", [True, False], ids=["layer", "rms"])
def test_matches_jax_bundled_pallas_norm_kernels(subtract_mean):
    """Forward and backward against jax's Pallas GPU layer_norm / rms_norm (with a bias),
    interpreted, on identical inputs."""
    args, oracle, ours = _oracle_case(subtract_mean)
    cot = random_array(jax.random.PRNGKey(3), args[0].shape, jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
    expected = oracle(*args)
    expected_grads = jax.grad(loss(oracle), argnums=(0, 1, 2))(*args)
    with stellax.interpret_mode():
        out = jax.jit(ours)(*args)
        grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(*args)
    assert_close(out, expected, name="y vs jax pallas")
    for name, g, r in zip(("dx", "dscale", "doffset"), grads, expected_grads):
        assert_close(g, r, gradient=True, name=f"{name} vs jax pallas")


# -- configs per generation -------------------------------------------------------------
def _call(rows, features, dtype=jnp.bfloat16, residual=True):
    x = jax.ShapeDtypeStruct((rows, features), dtype)
    vec = jax.ShapeDtypeStruct((features,), dtype)
    return layer_norm_op.check(x, vec, vec, residual=x if residual else None)


@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_heuristic_is_in_the_space_and_asks_for_its_vmem(generation):
    """The heuristic's block is in the space, its row-blocked operands are at most
    `TPU_TARGET_BLOCK_BYTES`, and the VMEM it needs beyond the scoped default is asked for."""
    impl = layer_norm_op.implementations[IMPL]
    with stellax.lowering_target(generation):
        for rows, features in ((8192, 4096), (4096, 16384), (7, 1000), (100, 65536)):
            for residual in (False, True):
                call = _call(rows, features, residual=residual)
                config = impl.default_config(call)
                space = impl.config_space(call)
                assert config in space, (generation, rows, features, config, space)
                need = norm_tpu_vmem_bytes(call, config.block_rows)
                limit = tpu_vmem_limit(need)
                assert limit is None and need <= TPU_GENERATIONS[generation].scoped_vmem_bytes or limit >= need
                assert all(norm_tpu_vmem_bytes(call, c.block_rows) <= tpu_vmem_cap() for c in space)
                if config != space[0]:
                    assert config.block_rows * tpu_padded_features(features) * 2 <= TPU_TARGET_BLOCK_BYTES


@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_heuristic_on_the_chip_benchmark_shapes(generation):
    """bfloat16 (16384, 8192), (65536, 4096), (4096, 16384): 4 MiB blocks (few grid steps),
    forward with a residual and backward with ``dh`` within every generation's VMEM cap."""
    fwd = layer_norm_op.implementations[IMPL]
    bwd = layer_norm_backward_op.implementations[IMPL]
    with stellax.lowering_target(generation):
        for (rows, features), block in (((16384, 8192), 256), ((65536, 4096), 512), ((4096, 16384), 128)):
            call = _call(rows, features, residual=True)
            assert fwd.default_config(call).block_rows == block
            x = jax.ShapeDtypeStruct((rows, features), jnp.bfloat16)
            vec = jax.ShapeDtypeStruct((features,), jnp.bfloat16)
            stat = jax.ShapeDtypeStruct((rows,), jnp.float32)
            back = layer_norm_backward_op.check(x, x, vec, vec, stat, stat, x)
            assert bwd.default_config(back).block_rows == block
            assert norm_tpu_vmem_bytes(back, block) <= tpu_vmem_cap()


def test_block_rows_and_chunks():
    """Blocks of ``block_rows`` rows; fewer rows fill whole 16-row tiles (the last block
    partial); fewer than 16 rows are one block; chunks are 16 rows; slabs divide Dp."""
    assert tpu_block_rows(16384, 256) == 256
    assert tpu_block_rows(1000, 1024) == 992
    assert tpu_block_rows(37, 64) == 32
    assert tpu_block_rows(7, 16) == 7
    assert tpu_chunk_rows(256) == 16 and tpu_chunk_rows(7) == 7
    assert (tpu_slab(8192), tpu_slab(1152), tpu_slab(768), tpu_slab(128)) == (512, 128, 256, 128)


def test_requirements_reject_rows_no_block_fits_and_float16():
    impl = layer_norm_op.implementations[IMPL]
    with stellax.lowering_target("v5p"):
        huge = _call(64, 1 << 21, jnp.float32)
        support = impl.supported(huge)
        assert not support and "VMEM" in support.reason and "v5p" in support.reason
        assert impl.supported(_call(64, 4096))
        float16 = impl.supported(_call(64, 4096, jnp.float16))
        assert not float16 and "x: the Mosaic TPU norm kernels take float32 or bfloat16, got float16" in float16.reason


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="NormTpuConfig.block_rows: expected a multiple of 16, got 24"):
        NormTpuConfig(block_rows=24)
    with pytest.raises(ValueError, match="NormTpuConfig.block_rows: expected a positive int"):
        NormTpuConfig(block_rows=0)


# -- lowering for tpu ---------------------------------------------------------------------
def _vmem_limits(module) -> list[int]:
    """The scoped-VMEM sizes the module's Mosaic calls ask for (none: the generation's default)."""
    return [int(size) for size in re.findall(r"scoped_memory_configs\\22: \[\{[^]]*?size\\22: (\d+)", module.as_text())]


def test_lowers_for_tpu_every_config():
    """Every config of the space lowers to tpu_custom_calls (the heuristic's with its gradient);
    a config that needs more than three quarters of the scoped VMEM asks for more, one that
    does not asks for nothing."""
    x, scale, offset, res = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _inputs(512, 8192, jnp.float32))
    impl = layer_norm_op.implementations[IMPL]
    with stellax.lowering_target("v5e"):
        call = layer_norm_op.check(x, scale, offset, residual=res)
        space, heuristic = impl.config_space(call), impl.default_config(call)
    assert len(space) >= 3
    scoped = TPU_GENERATIONS["v5e"].scoped_vmem_bytes
    for config in space:
        (module,) = lower_config(layer_norm_op, IMPL, (x, scale, offset), {"residual": res}, config=config,
                                 target="v5e")
        need = norm_tpu_vmem_bytes(call, config.block_rows)
        limits = _vmem_limits(module)
        if need <= scoped * 3 // 4:
            assert limits == [], (config, need, limits)
        else:
            assert limits and limits[0] >= need > scoped * 3 // 4, (config, need, limits)
    assert _vmem_limits(lower_config(layer_norm_op, IMPL, (x, scale, offset), {"residual": res},
                                     config=space[-1], target="v5e")[0])[0] > scoped
    modules = lower_config(layer_norm_op, IMPL, (x, scale, offset), {"residual": res}, grad=True, target="v5e")
    assert modules[1].as_text().count("tpu_custom_call") >= 2  # forward (recomputed residuals) + backward
    del heuristic


def test_backward_op_lowers_for_tpu():
    dy = jax.ShapeDtypeStruct((300, 1000), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((1000,), jnp.bfloat16)
    stat = jax.ShapeDtypeStruct((300,), jnp.float32)
    (module,) = lower_config(layer_norm_backward_op, IMPL, (dy, dy, vec, vec, stat, stat, dy), {"subtract_mean": True})
    assert "tpu_custom_call" in module.as_text()
