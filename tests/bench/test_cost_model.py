"""The analytic cost model: its counts against brute force, its ranking, the
heuristic check and the autotuner's use of the ranking (abstract calls only:
nothing runs)."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.autotune.search import select_configs
from stellax.bench import cost_model as cm
from stellax.core import lowering_target

OPS = stellax.registered_ops()


def _attention_call(t=16384, n=16, d=128, causal=False):
    s = jax.ShapeDtypeStruct((1, t, n, d), jnp.bfloat16)
    with lowering_target("h200"):
        return OPS["attention"].check(s, s, s, is_causal=causal)


@pytest.mark.parametrize("t,s,bq,bk", [(256, 256, 64, 32), (200, 328, 64, 64), (128, 64, 32, 64)])
def test_visited_blocks_match_a_brute_force_count(t, s, bq, bk):
    """A (query block, key block) pair is computed when any of its pairs is visible (bottom-right causal)."""
    offset = s - t
    expected = sum(1 for i, j in itertools.product(range(math.ceil(t / bq)), range(math.ceil(s / bk)))
                   if any(jj <= ii + offset for ii in range(i * bq, min(t, (i + 1) * bq))
                          for jj in range(j * bk, min(s, (j + 1) * bk))))
    assert cm._visited_blocks(t, s, bq, bk, True) == expected
    assert cm._visited_blocks(t, s, bq, bk, False) == math.ceil(t / bq) * math.ceil(s / bk)


def test_attention_estimate_counts():
    op = OPS["attention"]
    call = _attention_call()
    config = op.implementations["triton"].config_type(block_q=128, block_k=64, num_warps=8, num_stages=2)
    e = cm.estimate(op, "triton", call, config)
    assert e.tiles == 16 * 16384 // 128
    assert e.flops == pytest.approx(op.flops(call))  # non-causal: no masked blocks
    # Each query block reads all of K and V once: (T / bq) × S × 2·D × 2 bytes per head, plus q, o, lse.
    assert e.bytes > 16 * (16384 // 128) * 16384 * 256 * 2
    assert e.bound() == "compute" and 0 < e.fraction <= 1
    causal = cm.estimate(op, "triton", _attention_call(causal=True), config)
    assert causal.flops > op.flops(_attention_call(causal=True))  # the diagonal blocks' masked half


def test_ragged_dot_pads_each_group_to_the_row_block():
    op = OPS["ragged_dot"]
    lhs = jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 512, 256), jnp.bfloat16)
    sizes = jnp.asarray([1, 499, 0, 500], jnp.int32)
    with lowering_target("h200"):
        call = op.check(lhs, rhs, sizes)
    config = op.implementations["triton"].config_type(block_m=128, block_n=128, block_k=64, num_warps=8,
                                                      num_stages=3)
    e = cm.estimate(op, "triton", call, config)
    row_blocks = 1 + 4 + 0 + 4
    assert e.tiles == row_blocks * 2
    assert e.flops == 2.0 * row_blocks * 128 * 512 * 256
    assert e.useful_flops == pytest.approx(2.0 * 1000 * 512 * 256)


def test_wave_quantization_and_mma_efficiency():
    one_wave_and_a_bit = cm.Estimate(tiles=133, resident=1, flops=1e12, bytes=1.0, useful_flops=1e12, min_bytes=1.0)
    assert one_wave_and_a_bit.waves == 2
    assert one_wave_and_a_bit.wave_efficiency == pytest.approx(133 / 264)
    full = cm.Estimate(tiles=132, resident=1, flops=1e12, bytes=1.0, useful_flops=1e12, min_bytes=1.0)
    assert full.time_s() < one_wave_and_a_bit.time_s()
    assert cm._mma_efficiency(16, 4) == pytest.approx(0.25) and cm._mma_efficiency(128, 8) == 1.0


def test_rank_space_orders_by_predicted_time_and_keeps_ties():
    op = OPS["attention"]
    call = _attention_call()
    space = op.implementations["triton"].config_space(call)
    ranked = cm.rank_space(op, "triton", call, space)
    assert sorted(map(repr, ranked)) == sorted(map(repr, space))
    flagged = cm.flagged_configs("attention", "triton")
    from stellax.testing.registry import config_id

    kept = [c for c in ranked if config_id(c) not in flagged]
    assert ranked[:len(kept)] == kept  # flagged configs (if any are in this space) come last
    times = [cm.estimate(op, "triton", call, c).time_s() for c in kept]
    assert times == sorted(times)
    # Ops without a model keep the space's order, the static tier's flagged configs last.
    norm = OPS["layer_norm"]
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    with lowering_target("h200"):
        ncall = norm.check(x, jax.ShapeDtypeStruct((4096,), jnp.bfloat16), None)
    nspace = norm.implementations["triton"].config_space(ncall)
    nflagged = cm.flagged_configs("layer_norm", "triton")
    assert cm.rank_space(norm, "triton", ncall, nspace) == (
        [c for c in nspace if config_id(c) not in nflagged] + [c for c in nspace if config_id(c) in nflagged])


def test_flagged_configs_rank_last(monkeypatch):
    op = OPS["attention"]
    call = _attention_call()
    space = op.implementations["triton"].config_space(call)
    best = cm.rank_space(op, "triton", call, space)[0]
    from stellax.testing.registry import config_id

    table = {("attention", "triton", config_id(best)): {"failures": ["k: register spills"], "blocks_per_sm": 1}}
    monkeypatch.setattr(cm, "_static_table", lambda: table)
    assert cm.rank_space(op, "triton", call, space)[-1] == best


def test_flagged_configs_rank_last_without_a_model(monkeypatch):
    from stellax.testing.registry import config_id

    norm = OPS["layer_norm"]
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    with lowering_target("h200"):
        call = norm.check(x, jax.ShapeDtypeStruct((4096,), jnp.bfloat16), None)
    space = norm.implementations["triton"].config_space(call)
    table = {("layer_norm", "triton", config_id(space[0])): {"failures": ["k: register spills"], "blocks_per_sm": 1}}
    monkeypatch.setattr(cm, "_static_table", lambda: table)
    assert cm.rank_space(norm, "triton", call, space) == space[1:] + space[:1]


def test_heuristic_check_flags_a_bad_heuristic():
    op = OPS["attention"]
    call = _attention_call()
    check = cm.heuristic_check(op, "triton", call)
    assert check.slowdown >= 1.0
    # The same check with a threshold below the measured slowdown of a deliberately small tile flags it.
    impl = op.implementations["triton"]
    small = impl.config_type(block_q=64, block_k=32, num_warps=4, num_stages=2)
    slow = cm.estimate(op, "triton", call, small).time_s() / check.best_estimate.time_s()
    assert slow > 1.2
    bad = cm.HeuristicCheck(small, check.best, cm.estimate(op, "triton", call, small), check.best_estimate, 1.2)
    assert bad.flagged


def test_select_configs_takes_the_ranked_head():
    space = [{"i": i} for i in range(10)]
    assert select_configs(space, space[5], 4, ranked=True) == [space[i] for i in (5, 0, 1, 2)]
    thinned = select_configs(space, space[5], 4)
    assert thinned[0] == space[5] and len(thinned) == 4 and thinned != [space[i] for i in (5, 0, 1, 2)]


def test_group_sizes_default_to_balanced_when_abstract():
    class FakeCall:
        arrays = {"group_sizes": jax.ShapeDtypeStruct((4,), jnp.int32)}
    assert np.array_equal(cm._group_sizes(FakeCall(), 100, 4), [25, 25, 25, 25])


def _gdn_call(t=4096, heads=4, k=128, v=128, name="chunk_gated_delta_rule"):
    op = OPS[name]
    with lowering_target("h200"):
        if name == "ssd":  # x [B,T,H,P], dt [B,T,H], A [H], B, C [B,T,G,N]
            x = jax.ShapeDtypeStruct((1, t, heads, v), jnp.bfloat16)
            dt = jax.ShapeDtypeStruct((1, t, heads), jnp.bfloat16)
            a = jax.ShapeDtypeStruct((heads,), jnp.float32)
            bc = jax.ShapeDtypeStruct((1, t, 1, k), jnp.bfloat16)
            return op, op.check(x, dt, a, bc, bc)
        qk = jax.ShapeDtypeStruct((1, t, heads, k), jnp.bfloat16)
        vv = jax.ShapeDtypeStruct((1, t, heads, v), jnp.bfloat16)
        g = jax.ShapeDtypeStruct((1, t, heads), jnp.float32)
        return op, op.check(qk, qk, vv, g, g)


def test_gdn_forward_pipeline_counts_its_three_kernels():
    op, call = _gdn_call()
    config = op.implementations["triton"].config_type(block_v=32, num_warps=4, num_stages=1)
    e = cm.estimate(op, "triton", call, config)
    stages = dict(e.stages)
    assert list(stages) == ["wy", "state", "output"]
    nt, c = 4096 // 64, 64
    assert stages["wy"].tiles == nt * 4 and stages["state"].tiles == 4 * (128 // 32)
    assert stages["output"].tiles == nt * 4 * (128 // 32)
    assert stages["wy"].flops == nt * 4 * (2.0 * c * c * 3 * 128 + 20.0 * c ** 3)  # A, U, W and ten C³ products
    assert stages["state"].flops == 4 * nt * 4.0 * c * 128 * 128  # W·S and K̃ᵀ·Δ per chunk
    assert e.time_s() == pytest.approx(sum(s.time_s() for s in stages.values()))
    assert e.stages[0][1].mma_efficiency == pytest.approx(cm.TF32X3_RATE)  # float32 matmuls, 64-row tiles
    assert 0 < e.fraction < 1 and e.bound().split(":")[0] in stages
    # A wider value block computes the output kernel's scores P = QKᵀ fewer times.
    wide = cm.estimate(op, "triton", call, dataclasses.replace(config, block_v=64))
    assert dict(wide.stages)["output"].flops < stages["output"].flops


def test_ssd_pipeline_has_no_wy_stage_and_the_heuristic_is_not_flagged():
    op, call = _gdn_call(name="ssd", k=128, v=64, heads=8)
    assert [name for name, _ in cm.estimate(op, "triton", call, op.implementations["triton"].default_config(call)
                                            ).stages] == ["state", "output"]
    gdn, gdn_call = _gdn_call(t=32768, heads=64)
    check = cm.heuristic_check(gdn, "triton", gdn_call)
    assert not check.flagged and cm.has_model("chunk_gated_delta_rule", "triton")
