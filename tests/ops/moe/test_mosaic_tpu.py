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
from stellax.core import interpret_mode, lowering_target, observe_calls, use_configs
from stellax.ops.moe import configs
from stellax.ops.moe.mosaic_tpu import group_visits, max_visits, tile_visits
from stellax.ops.moe.schedule import group_bounds
from stellax.ops.moe.configs import TpuGroupedMatmulConfig, gmm_tpu_space, gmm_tpu_vmem
from stellax.testing.tpu_compile import _pallas_calls
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
    assert int(visits.count) == live.sum() == 6  # the kernel's grid extent: the real visits only


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


def test_space_fits_each_generations_vmem_budget_and_big_blocks_raise_the_limit():
    lhs = jax.ShapeDtypeStruct((16384, 7168), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((64, 7168, 4096), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
    op = stellax.registered_ops()["ragged_dot"]
    call = op.check(lhs, rhs, sizes)
    for generation, budget in (("v5e", 64 << 20), ("v5p", 32 << 20), ("v6e", 64 << 20), ("tpu7x", 32 << 20)):
        with lowering_target(generation):
            space = gmm_tpu_space(call)
            heuristic = op.implementations["mosaic_tpu"].heuristic(call)
        assert space and all(gmm_tpu_vmem(call, c) <= budget for c in space) and heuristic in space
        assert TpuGroupedMatmulConfig(512, 1024, 1024) in space  # megablox's best v5e tiling (issue 38)
    with lowering_target("v5e"):
        assert TpuGroupedMatmulConfig(1024, 2048, 2048) in gmm_tpu_space(call)

    def vmem_limit(config):  # the kernel's compiler params, as traced for a v5e
        with interpret_mode(), lowering_target("v5e"):
            jaxpr = jax.make_jaxpr(lambda a, b, s: op(a, b, s, implementation="mosaic_tpu", config=config))(
                lhs, rhs, sizes)
        (eqn,) = list(_pallas_calls(jaxpr.jaxpr))
        return eqn.params["compiler_params"].vmem_limit_bytes

    assert vmem_limit(TpuGroupedMatmulConfig(128, 256, 256)) is None  # fits v5e's 16 MiB default
    big = TpuGroupedMatmulConfig(512, 2048, 2048)  # about 40 MiB of blocks
    with lowering_target("v5e"):
        need = gmm_tpu_vmem(call, big)
    assert need > 16 << 20 and vmem_limit(big) >= need


def _bench_calls():
    """The forward, dlhs and tgmm calls of issue 38's first case (M=16384 K=7168 N=2048 G=64, bf16)."""
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    ops = stellax.registered_ops()
    sizes = s((64,), jnp.int32)
    forward = ops["ragged_dot"].check(s((16384, 7168), bf), s((64, 7168, 2048), bf), sizes)
    dlhs = ops["ragged_dot"].check(s((16384, 2048), bf), s((64, 7168, 2048), bf), sizes, transpose_rhs=True)
    drhs = ops["ragged_dot_tgmm"].check(s((16384, 7168), bf), s((16384, 2048), bf), sizes, transpose_lhs=True)
    return forward, dlhs, drhs


def test_heuristics_start_big_on_large_k_and_n():
    """On a v5e the heuristics pick (256+) x 1024+ x 1024+ blocks for issue 38's shape, which the
    cost model rates well ahead of the old 512-capped default (128, 512, 512)."""
    forward, dlhs, drhs = _bench_calls()
    old = TpuGroupedMatmulConfig(128, 512, 512)
    with lowering_target("v5e"):
        for call, heuristic, cost in ((forward, configs.gmm_tpu_heuristic, configs.gmm_tpu_cost),
                                      (dlhs, configs.gmm_tpu_heuristic, configs.gmm_tpu_cost),
                                      (drhs, configs.tgmm_tpu_heuristic, configs.tgmm_tpu_cost)):
            c = heuristic(call)
            assert c.block_k >= 1024 and c.block_n >= 1024, c
            assert cost(call, c) < 0.8 * cost(call, old), (c, cost(call, c), cost(call, old))
        fwd = configs.gmm_tpu_heuristic(forward)
        assert fwd.block_m == 256  # the mean group (256 rows): no tile computes two groups' rows
        assert configs.gmm_tpu_vmem(forward, fwd) <= configs.tpu_heuristic_budget() == 32 << 20
        # dlhs is its own call (K and N swapped): its own choice, not the forward's
        assert configs.gmm_tpu_heuristic(dlhs) != fwd
        # 128-row dlhs tiles ran 1.30x slower than 256-row ones on the v5e (the MXU fill), 128-row
        # tgmm tiles 1.25x slower (balanced) or as fast (skewed): both backward kernels take 256+
        assert configs.gmm_tpu_heuristic(dlhs).block_m >= 256
        assert configs.tgmm_tpu_heuristic(drhs).block_m >= configs.TGMM_MIN_ROWS == 256
    with lowering_target("v5p"):  # two TensorCores: at least two column blocks on the parallel axis
        c = configs.gmm_tpu_heuristic(forward)
        assert -(-2048 // c.block_n) >= 2


@pytest.mark.parametrize("m, k, n, g, measured_best", [
    (32768, 2048, 1408, 64, (256, 2048, 1408)),  # skewed: 2.44 ms; (256, 1024, 1408) 2.53, (512, 1024, 1408) 2.85
    (16384, 4096, 14336, 8, (512, 1024, 2048)),  # Mixtral-like: 11.58 ms; (256, 1024, 2048) 12.10
    (16384, 7168, 2048, 64, (256, 1024, 2048)),  # DeepSeek-like: 4.37 ms, the best of 8 tuned
])
def test_tgmm_heuristic_picks_the_v5e_measured_best(m, k, n, g, measured_best):
    """The tgmm heuristic (``block_n`` streamed, `tgmm_tpu_heuristic_budget`) picks what the v5e
    ran fastest (benchmarks/results/gmm_tpu-v5e-*.json, the suite's autotune); its VMEM need
    stays within the budget."""
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    call = stellax.registered_ops()["ragged_dot_tgmm"].check(s((m, k), bf), s((m, n), bf), s((g,), jnp.int32),
                                                              transpose_lhs=True)
    with lowering_target("v5e"):
        c = configs.tgmm_tpu_heuristic(call)
        assert (c.block_m, c.block_k, c.block_n) == measured_best
        assert configs.tgmm_tpu_vmem(call, c) <= configs.tgmm_tpu_heuristic_budget() == 40 << 20
    for generation, budget_mib in (("v5p", 20), ("tpu7x", 32)):  # capped by the tuning space's budget
        with lowering_target(generation):
            assert configs.tgmm_tpu_heuristic_budget() == budget_mib << 20


def _kernel_blocks(fn, *args):
    """``{kernel name: [block shapes of its operands]}`` of every Mosaic TPU kernel ``fn`` traces."""
    with interpret_mode(), lowering_target("v5e"):
        jaxpr = jax.make_jaxpr(fn)(*args)
    found = {}
    for eqn in _pallas_calls(jaxpr.jaxpr):
        shapes = [tuple(getattr(d, "block_size", d) for d in b.block_shape)
                  for b in eqn.params["grid_mapping"].block_mappings]
        found.setdefault(eqn.params["name"], []).append(shapes)
    return found


def test_backward_kernels_run_the_configs_resolved_for_their_own_calls():
    """The dlhs (a transposed-rhs ragged_dot) and drhs (tgmm) of the gradient each take the config
    resolved for their own call (here from a config lookup, as from the tuned cache), not the
    forward's: fails if the backward ignores its config or inherits the forward's."""
    lhs, rhs = _inputs(m=300, n=136)
    fwd_cfg, dlhs_cfg, tgmm_cfg = (TpuGroupedMatmulConfig(128, 128, 256), TpuGroupedMatmulConfig(256, 256, 128),
                                   TpuGroupedMatmulConfig(256, 128, 256))

    def lookup(op_name, implementation, call):
        if op_name == "ragged_dot_tgmm":
            return tgmm_cfg
        if op_name == "ragged_dot":
            return dlhs_cfg if call.transpose_rhs else fwd_cfg
        return None

    def grad(x, w):
        return jax.grad(lambda a, b: jnp.sum(stellax.ragged_dot(a, b, SIZES, implementation="mosaic_tpu")
                                             .astype(jnp.float32)), argnums=(0, 1))(x, w)

    with use_configs(lookup):
        found = _kernel_blocks(grad, lhs, rhs)
    forward, dlhs = found["stellax_ragged_dot_tpu"]  # in program order: forward, then dlhs
    assert forward[0] == (128, 128) and forward[1] == (1, 128, 256)  # lhs [bm, bk], rhs [1, bk, bn]
    assert dlhs[0] == (256, 256) and dlhs[1] == (1, 128, 256)  # dz [bm, bk], rhs [1, bn, bk] (transposed)
    (tgmm,) = found["stellax_ragged_dot_tgmm_tpu"]
    assert tgmm == [(256, 128), (256, 256), (1, 128, 256)]  # lhs [bm, bk], dz [bm, bn], out [1, bk, bn]
    # Numerics with those configs (interpreted) against the golden.
    with use_configs(lookup), interpret_mode():
        ours = grad(lhs, rhs)
    ref = jax.grad(lambda a, b: jnp.sum(stellax.registered_ops()["ragged_dot"].reference(a, b, SIZES)),
                   argnums=(0, 1))(lhs, rhs)
    for o, r in zip(ours, ref):
        assert _rel(o, r) < 2e-5


def test_default_backward_configs_are_the_backward_calls_own_heuristics():
    """Without tuned configs, at issue 38's shape the gradient's three kernels run three heuristic
    choices, each computed on its own call (the dlhs's differs from the forward's)."""
    forward, dlhs, drhs = _bench_calls()
    with lowering_target("v5e"):
        expected = [configs.gmm_tpu_heuristic(c) for c in (forward, dlhs)] + [configs.tgmm_tpu_heuristic(drhs)]
    s = jax.ShapeDtypeStruct

    def grad(x, w, sizes):
        return jax.grad(lambda a, b: jnp.sum(stellax.ragged_dot(a, b, sizes, implementation="mosaic_tpu")
                                             .astype(jnp.float32)), argnums=(0, 1))(x, w)

    found = _kernel_blocks(grad, s((16384, 7168), jnp.bfloat16), s((64, 7168, 2048), jnp.bfloat16),
                           s((64,), jnp.int32))
    (f_lhs, f_rhs, _), (d_lhs, d_rhs, _) = found["stellax_ragged_dot_tpu"]
    ((t_lhs, t_rhs, t_out),) = found["stellax_ragged_dot_tgmm_tpu"]
    got = [TpuGroupedMatmulConfig(f_lhs[0], f_lhs[1], f_rhs[2]), TpuGroupedMatmulConfig(d_lhs[0], d_lhs[1], d_rhs[1]),
           TpuGroupedMatmulConfig(t_lhs[0], t_out[1], t_out[2])]
    assert got == expected


@pytest.mark.parametrize("config", [TpuGroupedMatmulConfig(128, 128, 128), TpuGroupedMatmulConfig(256, 256, 128)])
def test_skewed_and_empty_groups_whole_and_partial_tiles_forward_and_gradients(config):
    """Group sizes with tile-aligned groups (visits that cover their whole tile: the unmasked
    paths), groups inside one tile, empty groups (one in the middle, one at the end) and rows
    past the sum: forward and both gradients against the golden."""
    sizes = jnp.array([256, 0, 384, 100, 28, 3, 130, 0], jnp.int32)  # 901 of 1000 rows
    lhs, rhs = _inputs(m=1000, k=192, n=160, g=8, seed=5)
    op = stellax.registered_ops()["ragged_dot"]

    def loss(fn):
        return lambda a, b: jnp.sum(jnp.sin(fn(a, b, sizes)))

    with interpret_mode():
        out = op(lhs, rhs, sizes, implementation="mosaic_tpu", config=config)
        with use_configs({("ragged_dot", "mosaic_tpu"): config, ("ragged_dot_tgmm", "mosaic_tpu"): config}):
            grads = jax.grad(loss(lambda a, b, s: op(a, b, s, implementation="mosaic_tpu")), argnums=(0, 1))(lhs, rhs)
    assert _rel(out, op.reference(lhs, rhs, sizes)) < 1e-5
    assert not np.asarray(out[901:]).any()
    ref = jax.grad(loss(op.reference), argnums=(0, 1))(lhs, rhs)
    for ours, golden_grad in zip(grads, ref):
        assert _rel(ours, golden_grad) < 2e-5
    assert not np.asarray(grads[1][1]).any() and not np.asarray(grads[1][7]).any()  # empty experts: exactly 0


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
        assert int(jax.jit(lambda s, o: group_visits(group_bounds(s, o, local, 300), m_padded, bm).count)(
            sizes, offset)) == live.sum()
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


# -- tier 2: every config of the spaces lowers for a TPU -------------------------------------
_BIG = 2048  # every tile of the spaces (up to 2048) is useful at this size


def _space_cases():
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    sizes = s((8,), jnp.int32)
    x = s((_BIG, _BIG), bf)
    return {
        "forward": ("ragged_dot", (x, s((8, _BIG, _BIG), bf), sizes), {}),
        "gated silu": ("ragged_dot", (x, s((8, _BIG, 2, _BIG), bf), sizes), {"activation": "silu"}),
        "dlhs (transpose_rhs)": ("ragged_dot", (x, s((8, _BIG, _BIG), bf), sizes), {"transpose_rhs": True}),
        "tgmm": ("ragged_dot_tgmm", (x, x, sizes), {"transpose_lhs": True}),
        # N = 1408 (no power of two): whole-dimension blocks and partial edge blocks in N (K for the dlhs)
        "forward N=1408": ("ragged_dot", (x, s((8, _BIG, 1408), bf), sizes), {}),
        "dlhs K=1408": ("ragged_dot", (s((_BIG, 1408), bf), s((8, _BIG, 1408), bf), sizes), {"transpose_rhs": True}),
        "tgmm N=1408": ("ragged_dot_tgmm", (x, s((_BIG, 1408), bf), sizes), {"transpose_lhs": True}),
    }


@pytest.mark.slow  # ~100 lowerings per case
@pytest.mark.parametrize("case", list(_space_cases()))
def test_every_config_of_the_space_lowers_for_tpu(case, generation="v5e"):
    """The whole v5e autotuning space (row tiles to 1024, K/N tiles to 2048, within 64 MiB of
    VMEM; v6e's is the same, v5p's and TPU7x's are subsets) lowers to a Mosaic custom call
    (block shapes obey the TPU tiling rules)."""
    from stellax.testing.lowering import lower_config

    name, args, kwargs = _space_cases()[case]
    op = stellax.registered_ops()[name]
    with lowering_target(generation):
        space = op.implementations["mosaic_tpu"].config_space(op.check(*args, **kwargs))
    assert len(space) >= 40 and max(c.block_k for c in space) == (1408 if "K=1408" in case else 2048)
    for config in space:
        lower_config(op, "mosaic_tpu", args, kwargs, config=config, platform="tpu", target=generation)


# -- edge blocks instead of padding copies (issue 38's skewed case: N = 1408) ------------------------
def _skewed_calls(n=1408, g=64):
    """The forward, dlhs and tgmm calls of issue 38's skewed case (M=32768 K=2048 N=1408 G=64, bf16;
    Qwen3-MoE-like with N=768 G=128)."""
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    ops = stellax.registered_ops()
    x, w, dy, sizes = s((32768, 2048), bf), s((g, 2048, n), bf), s((32768, n), bf), s((g,), jnp.int32)
    return {"forward": (ops["ragged_dot"], (x, w, sizes), {}),
            "dlhs": (ops["ragged_dot"], (dy, w, sizes), {"transpose_rhs": True}),
            "tgmm": (ops["ragged_dot_tgmm"], (x, dy, sizes), {"transpose_lhs": True})}


@pytest.mark.parametrize("name", ["forward", "dlhs", "tgmm"])
def test_operands_longer_than_their_blocks_are_not_padded(name):
    """N = 1408 is no multiple of 512 (nor K = 1408 of the dlhs): the kernels read the last block
    as a partial edge block, with no pad or slice copy of the 369 MB weights or of the output
    (a pad would cost about 1 ms of HBM traffic per call on a v5e)."""
    op, args, kwargs = _skewed_calls()[name]
    config = TpuGroupedMatmulConfig(256, 512, 512)
    with interpret_mode(), lowering_target("v5e"):
        jaxpr = jax.make_jaxpr(lambda *a: op(*a, implementation="mosaic_tpu", config=config, **kwargs))(*args)
    prims = set()

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name in ("pad", "slice", "dynamic_slice", "concatenate"):
                if any(int(np.prod(v.aval.shape)) >= 1 << 20 for v in eqn.outvars):
                    prims.add((eqn.primitive.name, tuple(eqn.outvars[0].aval.shape)))
            if eqn.primitive.name != "pallas_call":  # the kernel body slices refs, not arrays
                for sub in jax.core.jaxprs_in_params(eqn.params):
                    walk(sub)
    walk(jaxpr.jaxpr)
    assert not prims, prims


def test_partial_edge_blocks_in_every_dimension_match_the_golden():
    """M, K and N each longer than their block and no multiple of it (with an empty group and
    rows past the groups): the forward, dlhs and tgmm, interpreted (uninitialised VMEM is NaN:
    the K remainder must be masked in both operands), against the golden."""
    m, k, n = 1000, 328, 264
    lhs, rhs = _inputs(m=m, k=k, n=n, seed=5)
    sizes = jnp.array([300, 0, 417, 250], jnp.int32)  # 967 of 1000 rows
    dy = jax.random.normal(jax.random.PRNGKey(6), (m, n), jnp.float32)
    config = TpuGroupedMatmulConfig(256, 256, 256)
    op, tg = stellax.registered_ops()["ragged_dot"], stellax.registered_ops()["ragged_dot_tgmm"]
    with interpret_mode():
        y = op(lhs, rhs, sizes, implementation="mosaic_tpu", config=config)
        dx = op(dy, rhs, sizes, transpose_rhs=True, implementation="mosaic_tpu", config=config)
        dw = tg(lhs, dy, sizes, transpose_lhs=True, implementation="mosaic_tpu", config=config)
    assert _rel(y, op.reference(lhs, rhs, sizes)) < 1e-5
    assert _rel(dx, op.reference(dy, rhs, sizes, transpose_rhs=True)) < 1e-5
    assert _rel(dw, tg.reference(lhs, dy, sizes, transpose_lhs=True)) < 1e-5
    assert not np.asarray(dw[1]).any()  # the empty group's weight gradient is exactly zero


def test_single_k_step_and_whole_n_heuristics_on_the_skewed_case():
    """With ``block_k >= K`` consecutive visits of one group keep their ``rhs`` block (no copy):
    the cost model counts each group's weights once, so on issue 38's skewed case the forward
    takes the whole K (2048) in one step, the whole N (1408, `whole_tile`: no padded columns,
    ``lhs`` read once) and a row tile below 512 (each of the 63 group boundaries costs a whole
    extra tile), modelled ahead of the old choice (512, 2048, 512) by a sixth (the MXU fill,
    `configs.mxu_seconds`, favours long row tiles); the dlhs (K = 1408) takes its whole K as well."""
    calls = _skewed_calls()
    with lowering_target("v5e"):
        call = calls["forward"][0].check(*calls["forward"][1], **calls["forward"][2])
        c = configs.gmm_tpu_heuristic(call)
        assert (c.block_k, c.block_n) == (2048, 1408) and c.block_m < 512, c
        assert configs.gmm_tpu_cost(call, c) < 0.85 * configs.gmm_tpu_cost(call, TpuGroupedMatmulConfig(512, 2048, 512))
        dlhs = calls["dlhs"][0].check(*calls["dlhs"][1], **calls["dlhs"][2])
        assert configs.gmm_tpu_heuristic(dlhs).block_k == 1408
        tgmm = calls["tgmm"][0].check(*calls["tgmm"][1], **calls["tgmm"][2])
        assert {c.block_n for c in configs.tgmm_tpu_space(tgmm)} == {128, 256, 512, 1024, 1408}


def test_whole_tiles_are_multiples_of_128_only():
    assert configs.whole_tile(1408) == (1408,) and configs.whole_tile(768) == (768,)
    assert configs.whole_tile(1024) == () and configs.whole_tile(1400) == () and configs.whole_tile(4096) == ()
    with pytest.raises(ValueError, match="block_n: expected a multiple of 128"):
        TpuGroupedMatmulConfig(128, 256, 1400)
    with pytest.raises(ValueError, match="block_k"):
        TpuGroupedMatmulConfig(128, 2176, 256)


def test_whole_dimension_tiles_match_the_golden():
    """Blocks of a whole K (384) and N (640) that are no power of two, forward, dlhs and tgmm,
    interpreted, against the golden (an empty group, rows past the groups)."""
    m, k, n = 700, 384, 640
    lhs, rhs = _inputs(m=m, k=k, n=n, seed=7)
    sizes = jnp.array([200, 0, 301, 150], jnp.int32)
    dy = jax.random.normal(jax.random.PRNGKey(8), (m, n), jnp.float32)
    op, tg = stellax.registered_ops()["ragged_dot"], stellax.registered_ops()["ragged_dot_tgmm"]
    with interpret_mode():
        y = op(lhs, rhs, sizes, implementation="mosaic_tpu", config=TpuGroupedMatmulConfig(128, 384, 640))
        dx = op(dy, rhs, sizes, transpose_rhs=True, implementation="mosaic_tpu",
                config=TpuGroupedMatmulConfig(256, 640, 384))
        dw = tg(lhs, dy, sizes, transpose_lhs=True, implementation="mosaic_tpu",
                config=TpuGroupedMatmulConfig(128, 384, 640))
    assert _rel(y, op.reference(lhs, rhs, sizes)) < 1e-5
    assert _rel(dx, op.reference(dy, rhs, sizes, transpose_rhs=True)) < 1e-5
    assert _rel(dw, tg.reference(lhs, dy, sizes, transpose_lhs=True)) < 1e-5


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("n, g", [(1408, 64), (768, 128)])
def test_edge_and_whole_tile_heuristics_compile(generation, n, g):
    """The heuristic configs of the skewed case (N = 1408) and the Qwen3-MoE-like one (N = 768):
    whole-dimension blocks or partial last blocks in N (in K for the dlhs) compile with the
    real Mosaic compiler; so do explicit power-of-two tiles that leave partial edge blocks."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    for name, (op, args, kwargs) in _skewed_calls(n, g).items():
        for config in (None, TpuGroupedMatmulConfig(256, 512, 512)):
            result = compile_config(op, "mosaic_tpu", args, kwargs, generation=generation, config=config)
            assert result.ok, (name, config, result.describe())
