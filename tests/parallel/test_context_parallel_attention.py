"""Context-parallel attention on the 8 simulated CPU devices equals single-device
`stellax.dot_product_attention` (float32 golden) forward and in every gradient.

The default tier covers each strategy once with a causal load-balanced layout,
plus masks across shard boundaries, sinks/soft cap and errors; the full matrix
(strategy × causal × layout × 2/4/8-way) is behind ``-m slow``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec as P

from stellax.parallel import (LocalAttention, context_parallel_attention, context_parallel_attention_shard,
                              reorder_for_load_balance, restore_from_load_balance, shard_positions)

from .cp_cases import attention_inputs, check_against_single, mesh_1d, mesh_2d, need_devices, run_cp


@pytest.mark.parametrize("strategy,size,load_balance,causal", [
    ("all_gather", 4, "zigzag", True),
    ("ulysses", 4, "striped", True),  # 2 kv heads repeated for 4 devices
    ("ring", 4, None, True),  # causal steps skipped
    ("ring", 8, "zigzag", True),
])
def test_strategy_matches_single_device(strategy, size, load_balance, causal):
    check_against_single(strategy, mesh_1d(size), size, load_balance=load_balance, is_causal=causal)


def test_explicit_axis_mesh_non_causal():
    """A `jax.make_mesh` mesh (explicit axes, used under `jax.set_mesh`)."""
    need_devices(2)
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        check_against_single("ring", mesh, 2, is_causal=False)


def test_usp_2x4_matches_single_device():
    inputs = attention_inputs(1, n=8, kh=4)
    check_against_single("usp", mesh_2d(2, 4), 8, load_balance="zigzag", inputs=inputs, is_causal=True)


def test_ring_default_local_implementation_is_deterministic():
    """``implementation=None`` (the dispatch default: a flash-style kernel, whose
    backward takes the merged statistics); two runs are bitwise equal."""
    check_against_single("ring", mesh_1d(4), 4, load_balance="striped", implementation=None, is_causal=True)
    q, k, v, do = attention_inputs(4)
    first = run_cp(q, k, v, do, strategy="ring", mesh=mesh_1d(4), axis_size=4, implementation=None, is_causal=True)
    second = run_cp(q, k, v, do, strategy="ring", mesh=mesh_1d(4), axis_size=4, implementation=None, is_causal=True)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_segments_and_window_across_shard_boundaries():
    # Documents end at tokens 11 and 24, not at the 8-token shard boundaries; the
    # window (5 back) reaches into the previous shard.
    seg = jnp.asarray([[0] * 11 + [1] * 13 + [2] * 8], jnp.int32)
    check_against_single("ring", mesh_1d(4), 4, segment_ids=seg, is_causal=True, local_window_size=(5, 0),
                         implementation="xla_chunked")


def test_sinks_and_soft_cap_ring():
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    check_against_single("ring", mesh_1d(2), 2, load_balance="zigzag", sinks=sinks, logits_soft_cap=3.0,
                         is_causal=True, implementation="xla_chunked")


def test_lse_is_returned_in_layout():
    q, k, v, _ = attention_inputs(2)
    import stellax
    mesh = mesh_1d(2)
    out, lse = jax.jit(lambda q, k, v: context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="cp", strategy="ulysses", is_causal=True, return_residuals=True,
        implementation="xla"))(q, k, v)
    ref, ref_lse = stellax.dot_product_attention(q, k, v, is_causal=True, implementation="xla", return_residuals=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_shard_level_api_inside_user_shard_map(strategy):
    q, k, v, _ = attention_inputs(3)
    mesh = mesh_1d(2)
    local = LocalAttention(is_causal=True, implementation="xla")
    pos = jnp.asarray(shard_positions(q.shape[1], 2, "striped").reshape(1, -1))
    lay = lambda x: reorder_for_load_balance(x, 2, "striped")

    def body(q, k, v, pos):
        return context_parallel_attention_shard(q, k, v, pos, local=local, strategy=strategy, axis_name="cp")[0]

    spec = P(None, "cp")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec, check_vma=False))
    out = restore_from_load_balance(f(lay(q), lay(k), lay(v), pos), 2, "striped")
    import stellax
    ref = stellax.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


# -- errors ---------------------------------------------------------------------------
def test_bad_meshes_and_sizes_raise_clear_errors():
    q, k, v, _ = attention_inputs(0, t=24, n=6, kh=2)
    mesh = mesh_1d(4)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        context_parallel_attention(q, k, v, mesh=mesh, axis_name="sp", strategy="ring")
    with pytest.raises(ValueError, match="strategy"):
        context_parallel_attention(q, k, v, mesh=mesh, axis_name="cp", strategy="tree")
    with pytest.raises(ValueError, match=r"query heads \(6\) must be divisible by the axis size \(4\)"):
        context_parallel_attention(q, k, v, mesh=mesh, axis_name="cp", strategy="ulysses")
    with pytest.raises(ValueError, match="divisible by 8"):
        context_parallel_attention(*attention_inputs(0, t=12)[:3], mesh=mesh, axis_name="cp", strategy="ring",
                                   load_balance="zigzag")
    with pytest.raises(ValueError, match="divisible by 4"):
        context_parallel_attention(*attention_inputs(0, t=10)[:3], mesh=mesh, axis_name="cp", strategy="ring")
    with pytest.raises(ValueError, match="divisible by 16"):
        context_parallel_attention(*attention_inputs(0, t=40)[:3], mesh=mesh_1d(8), axis_name="cp",
                                   strategy="ring", load_balance="zigzag")
    with pytest.raises(TypeError, match="Mesh"):
        context_parallel_attention(q, k, v, mesh=None, axis_name="cp")
    mesh2 = mesh_2d(2, 4)
    with pytest.raises(ValueError, match="ulysses_axis"):
        context_parallel_attention(q, k, v, mesh=mesh2, strategy="usp", ring_axis="ring")
    with pytest.raises(ValueError, match="must be different"):
        context_parallel_attention(q, k, v, mesh=mesh2, strategy="usp", ring_axis="uly", ulysses_axis="uly")
    with pytest.raises(ValueError, match="strategy='usp'"):
        context_parallel_attention(q, k, v, mesh=mesh2, axis_name=("ring", "uly"), strategy="ring")
    with pytest.raises(ValueError, match="self-attention"):
        context_parallel_attention(q, k[:, :8], v[:, :8], mesh=mesh, axis_name="cp")
    with pytest.raises(ValueError, match="q_segment_ids/kv_segment_ids"):
        context_parallel_attention(q, k, v, mesh=mesh, axis_name="cp", q_segment_ids=jnp.zeros((1, 24), jnp.int32))


# -- the full matrix ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("load_balance", [None, "zigzag", "striped"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("strategy", ["all_gather", "ulysses", "ring"])
def test_full_matrix(strategy, size, causal, load_balance):
    inputs = attention_inputs(size, n=8, kh=2)
    check_against_single(strategy, mesh_1d(size), size, load_balance=load_balance, inputs=inputs, is_causal=causal)


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", [None, "zigzag", "striped"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_usp_matrix(shape, causal, load_balance):
    inputs = attention_inputs(7, n=8, kh=2)
    check_against_single("usp", mesh_2d(*shape), shape[0] * shape[1], load_balance=load_balance, inputs=inputs,
                         is_causal=causal)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all_gather", "ulysses", "usp"])
def test_masks_across_boundaries_all_strategies(strategy):
    seg = jnp.asarray([[0] * 11 + [1] * 13 + [2] * 8], jnp.int32)
    mesh = mesh_2d(2, 2) if strategy == "usp" else mesh_1d(4)
    check_against_single(strategy, mesh, 4, load_balance="zigzag", segment_ids=seg, is_causal=True,
                         local_window_size=(5, 0))
    check_against_single(strategy, mesh, 4, local_window_size=(3, 6))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all_gather", "ulysses", "usp"])
def test_sinks_all_strategies(strategy):
    sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32)
    mesh = mesh_2d(2, 2) if strategy == "usp" else mesh_1d(2)
    check_against_single(strategy, mesh, mesh.size, sinks=sinks, is_causal=True, logits_soft_cap=3.0)


@pytest.mark.slow
def test_bfloat16_ring():
    inputs = attention_inputs(5, dtype=jnp.bfloat16)
    check_against_single("ring", mesh_1d(4), 4, load_balance="zigzag", inputs=inputs, is_causal=True,
                         implementation="xla_chunked")
