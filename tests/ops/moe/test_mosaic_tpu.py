"""The Mosaic TPU grouped matmul (`ops/moe/mosaic_tpu.py`), interpreted on the
CPU: against the golden and, as an independent oracle, jax's bundled megablox
``gmm`` on identical inputs (an empty group, group sizes summing to less
than M, expert-parallel group offsets)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import interpret_mode, lowering_target, observe_calls
from stellax.ops.moe.mosaic_tpu import group_visits, max_visits, tile_visits
from stellax.ops.moe.schedule import group_bounds
from stellax.ops.moe.configs import TpuGroupedMatmulConfig, gmm_tpu_space, gmm_tpu_vmem
from stellax.testing.numerics import compare, golden

# The module (the package re-exports a custom-VJP function under the same name).
megablox_gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
CFG = TpuGroupedMatmulConfig(128, 128, 128)
SIZES = jnp.array([50, 0, 130, 90], jnp.int32)  # an empty group; 270 of 300 rows


def _inputs(m=300, k=200, n=136, g=4, dtype=jnp.float32, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(k1, (m, k), jnp.float32).astype(dtype),
            (jax.random.normal(k2, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def test_visits_cover_every_row_once_and_skip_empty_groups():
    m_padded, bm = 384, 128
    visits = tile_visits(group_bounds(SIZES, None, 4, 300), m_padded, bm)
    live = np.asarray(visits.live) > 0
    assert visits.group.shape[0] == max_visits(3, 4)
    covered = np.zeros(m_padded, int)
    for lo, hi in zip(np.asarray(visits.lo)[live], np.asarray(visits.hi)[live]):
        covered[lo:hi] += 1
    assert (covered == 1).all()
    assert 1 not in set(np.asarray(visits.group)[live])  # the empty group is never visited
    tiles = np.asarray(visits.tile)[live]
    assert (np.diff(tiles) >= 0).all()  # the visits of a tile are consecutive


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dimensions_that_are_not_block_multiples(dtype):
    lhs, rhs = _inputs(dtype=dtype)  # M = 300, K = 200, N = 136 with 128-tiles: padded inside
    with interpret_mode():
        ours = stellax.ragged_dot(lhs, rhs, SIZES, implementation="mosaic_tpu", config=CFG)
    golden = stellax.registered_ops()["ragged_dot"].reference(lhs, rhs, SIZES)
    assert ours.shape == (300, 136) and _rel(ours, golden) < (1e-5 if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_megablox_and_the_golden(dtype):
    lhs, rhs = _inputs(m=384, dtype=dtype)  # megablox needs M to be a multiple of its row tile
    with interpret_mode():
        ours = stellax.ragged_dot(lhs, rhs, SIZES, implementation="mosaic_tpu", config=CFG)
        theirs = megablox_gmm.gmm(lhs, rhs, SIZES, preferred_element_type=jnp.float32, tiling=(128, 128, 128),
                                  interpret=True)
    golden = stellax.registered_ops()["ragged_dot"].reference(lhs, rhs, SIZES)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert _rel(ours, golden) < tol
    # megablox leaves the rows past sum(group_sizes) unspecified; compare the grouped rows.
    assert _rel(ours[:270], theirs[:270]) < tol
    assert not np.asarray(ours[270:]).any()


def test_group_offset_writes_zeros_outside_the_local_groups():
    lhs, rhs = _inputs(m=384)
    local = rhs[2:]
    with interpret_mode():
        ours = stellax.ragged_dot(lhs, local, SIZES, group_offset=jnp.int32(2), implementation="mosaic_tpu",
                                  config=CFG)
        theirs = megablox_gmm.gmm(lhs, local, SIZES, preferred_element_type=jnp.float32, tiling=(128, 128, 128),
                                  group_offset=jnp.int32(2), interpret=True)
    golden = stellax.registered_ops()["ragged_dot"].reference(lhs, local, SIZES, group_offset=jnp.int32(2))
    assert _rel(ours, golden) < 1e-5
    assert _rel(ours[50:270], theirs[50:270]) < 1e-5
    assert not np.asarray(ours[:50]).any() and not np.asarray(ours[270:]).any()


@pytest.mark.slow  # 55 s interpreted; the default tier's registry cases run the plain and gated forms with
# gradients, and the TPU backward (test_grad_of_ragged_dot_runs_the_tpu_backward) runs the transposed form.
def test_transposed_gated_and_activation_forms_and_gradients():
    lhs, rhs = _inputs(n=128)
    op = stellax.registered_ops()["ragged_dot"]
    gated = jax.random.normal(jax.random.PRNGKey(3), (4, 200, 2, 128)) / 14
    cases = [((lhs, jnp.swapaxes(rhs, 1, 2), SIZES), dict(transpose_rhs=True)),
             ((lhs, gated, SIZES), dict(activation="silu")),
             ((lhs, rhs, SIZES), dict(activation="gelu"))]
    for args, kwargs in cases:  # the op itself: transpose_rhs is the dlhs form, not public API
        with interpret_mode():
            ours = op(*args, implementation="mosaic_tpu", config=CFG, **kwargs)
            grads = jax.grad(lambda a, b: jnp.sum(op(a, b, SIZES, implementation="mosaic_tpu", config=CFG,
                                                     **kwargs) ** 2), argnums=(0, 1))(*args[:2])
        assert _rel(ours, op.reference(*args, **kwargs)) < 1e-5, kwargs
        ref_grads = jax.grad(lambda a, b: jnp.sum(op.reference(a, b, SIZES, **kwargs) ** 2), argnums=(0, 1))(*args[:2])
        for ours_g, ref_g in zip(grads, ref_grads):
            assert _rel(ours_g, ref_g) < 2e-5, kwargs


def test_deterministic():
    lhs, rhs = _inputs()
    with interpret_mode():
        a = stellax.ragged_dot(lhs, rhs, SIZES, implementation="mosaic_tpu", config=CFG)
        b = stellax.ragged_dot(lhs, rhs, SIZES, implementation="mosaic_tpu", config=CFG)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_space_fits_each_generations_scoped_vmem():
    lhs = jax.ShapeDtypeStruct((16384, 7168), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((64, 7168, 4096), jnp.bfloat16)
    call = stellax.registered_ops()["ragged_dot"].check(lhs, rhs, jax.ShapeDtypeStruct((64,), jnp.int32))
    for generation, budget in (("v5e", 16 << 20), ("v6e", 32 << 20)):
        with lowering_target(generation):
            space = gmm_tpu_space(call)
            heuristic = stellax.registered_ops()["ragged_dot"].implementations["mosaic_tpu"].heuristic(call)
        assert space and all(gmm_tpu_vmem(call, c) <= budget for c in space) and heuristic in space


# -- ragged_dot_tgmm (the weight gradient) and the TPU backward -----------------------------------
def _tgmm_inputs(m=384, k=200, n=136, seed=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k1, (m, k), jnp.float32), jax.random.normal(k2, (m, n), jnp.float32)


def test_group_visits_cover_the_local_rows_once_and_visit_empty_groups():
    sizes = jnp.array([50, 0, 130, 90, 0], jnp.int32)
    m_padded, bm = 384, 128
    for offset, local in ((None, 5), (jnp.int32(1), 3), (jnp.int32(4), 3)):  # the last: no group in range

        def visits_of(s, o, n=local):  # jitted: one compile instead of one per eager op
            bounds = group_bounds(s, o, n, 300)
            v = group_visits(bounds, m_padded, bm)
            return bounds.begin, bounds.end, v.group, v.lo, v.hi, v.live

        begin, end, group, lo, hi, live = map(np.asarray, jax.jit(visits_of)(sizes, offset))
        assert group.shape[0] == 3 + local - 1
        live = live > 0
        groups = group[live]
        assert sorted(set(groups)) == list(range(local))  # every local group, empty ones too
        assert (np.diff(groups) >= 0).all()  # a group's visits are consecutive
        covered = np.zeros(m_padded, int)
        for a, b in zip(lo[live], hi[live]):
            covered[a:b] += 1
        begin, end = int(begin), int(end)
        assert (covered[begin:end] == 1).all() and not covered[:begin].any() and not covered[end:].any()


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_tgmm_matches_megablox_and_the_golden(dtype):
    a, b = _tgmm_inputs()
    a, b = a.astype(dtype), b.astype(dtype)  # megablox needs M (384) to be a multiple of its row tile
    op = stellax.registered_ops()["ragged_dot_tgmm"]
    with interpret_mode():  # lhs [K, M]: an empty group, 270 of 384 rows in groups
        ours = op(a.T, b, SIZES, implementation="mosaic_tpu", config=CFG)
        theirs = megablox_gmm.tgmm(a.T, b, SIZES, preferred_element_type=dtype, tiling=(128, 128, 128),
                                   interpret=True)
    golden = op.reference(a.T, b, SIZES)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert ours.shape == (4, 200, 136) and ours.dtype == dtype
    assert _rel(ours, golden) < tol and _rel(ours, theirs) < tol
    assert not np.asarray(ours[1]).any()  # the empty group's block is zeros


def test_tgmm_group_offset_and_rows_outside_the_local_groups_match_megablox():
    # Local groups 1 (empty) and 2 of SIZES: rows [50, 180). The other rows (other groups, past
    # sum(group_sizes)) hold NaN in our inputs: a kernel that reads them unmasked gives NaN.
    a, b = _tgmm_inputs()
    rows = np.arange(384)[:, None]
    outside = (rows < 50) | (rows >= 180)
    a_nan, b_nan = jnp.where(outside, jnp.nan, a), jnp.where(outside, jnp.nan, b)
    op = stellax.registered_ops()["ragged_dot_tgmm"]
    offset = jnp.int32(1)
    kwargs = dict(group_offset=offset, num_local_groups=2, transpose_lhs=True)
    with interpret_mode():
        ours = op(a_nan, b_nan, SIZES, implementation="mosaic_tpu", config=CFG, **kwargs)
        theirs = megablox_gmm.tgmm(a.T, b, SIZES, preferred_element_type=jnp.float32, tiling=(128, 128, 128),
                                   group_offset=offset, num_actual_groups=2, interpret=True)
    golden = op.reference(a, b, SIZES, **kwargs)
    assert ours.shape == (2, 200, 136) and np.isfinite(np.asarray(ours)).all()
    assert _rel(ours, golden) < 1e-5 and _rel(ours, theirs) < 1e-5
    assert not np.asarray(ours[0]).any()  # the empty local group


def test_grad_of_ragged_dot_runs_the_tpu_backward():
    lhs, rhs = _inputs(m=300, n=128)  # K = 200: padded inside (dlhs writes [M, K])
    op = stellax.registered_ops()["ragged_dot"]
    offset = jnp.int32(1)
    local = rhs[1:3]
    seen = []

    def loss(fn):
        return lambda x, w: jnp.sum(jnp.sin(fn(x, w, SIZES, group_offset=offset, activation="gelu")))

    with interpret_mode(), observe_calls(lambda o, impl, call, cfg: seen.append((o.name, impl.name))):
        grads = jax.grad(loss(lambda *a, **k: op(*a, implementation="mosaic_tpu", config=CFG, **k)),
                         argnums=(0, 1))(lhs, local)
    assert ("ragged_dot_backward", "mosaic_tpu") in seen and ("ragged_dot_tgmm", "mosaic_tpu") in seen
    assert all(impl == "mosaic_tpu" for _, impl in seen), seen
    ref = jax.grad(loss(op.reference), argnums=(0, 1))(lhs, local)
    for ours, golden in zip(grads, ref):
        assert _rel(ours, golden) < 2e-5
    assert not np.asarray(grads[0][:50]).any() and not np.asarray(grads[0][180:]).any()


def test_float32_precision_contract_numerics():
    """precision='default' is one bfloat16 pass in the kernel (interpret mode reproduces it: a
    bf16-like error), 'high' three (float32-like), for the forward and the weight gradient (tgmm);
    `stellax.core.precision`."""
    lhs, rhs = _inputs()
    cot = jax.random.normal(jax.random.PRNGKey(9), (300, 136), jnp.float32)
    op = stellax.registered_ops()["ragged_dot"]
    expected = golden(lambda a, b: op.reference(a, b, SIZES), lhs, rhs)
    expected_drhs = golden(jax.grad(lambda b: jnp.sum(op.reference(lhs, b, SIZES) * cot)), rhs)
    errors = {}
    for precision in ("default", "high"):
        def loss(b):
            out = stellax.ragged_dot(lhs, b, SIZES, precision, implementation="mosaic_tpu", config=CFG)
            return jnp.sum(out * cot), out
        with interpret_mode():
            drhs, out = jax.grad(loss, has_aux=True)(rhs)
        errors[precision] = (compare(out, expected).rel_l2, compare(drhs, expected_drhs).rel_l2)
    assert all(1e-4 < e < 3e-2 for e in errors["default"]), errors
    assert all(e < 1e-4 for e in errors["high"]), errors
