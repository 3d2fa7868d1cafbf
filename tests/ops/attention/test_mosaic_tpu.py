"""Mosaic TPU (splash-class) attention: what the registry tiers do not cover.

* an independent oracle: jax's bundled splash attention (`make_splash_mha`,
  interpreted) on identical inputs, forward and gradients;
* the options the examples do not reach (head dim 192 with Hv != H, bf16,
  fully masked rows, determinism);
* block sparsity: the kernel's own visit counter equals the block table,
  which equals the mask's non-empty blocks;
* configs (validation, the per-generation heuristic, requirements), dispatch
  on a TPU target, context parallelism lowering for a TPU;
* ``tpu`` marker: the real Mosaic compiler (libtpu) on the four generations.

Interpreted TPU kernels cost ~12 s of CPU to compile each (the persistent
compilation cache makes reruns cheap), so the default tier runs few, dense
cases; ``-m slow`` runs more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import Mesh

import stellax
from stellax.core import UnsupportedError, use_configs
from stellax.ops.attention import attention_op, base, mosaic_tpu
from stellax.ops.attention.configs import FUSED_BACKWARD_BY_DEFAULT, SplashBackwardConfig, SplashConfig
from stellax.ops.attention.masks import (
    EMPTY, FULL, LOWER_EDGE, PARTIAL, UPPER_EDGE, MaskSpec, classify_blocks, default_positions, dense_mask,
    edge_parts, mask_fn,
)
from stellax.testing import assert_close

from .attention_cases import check_against_golden, make_inputs

#: The backward kernels the heuristic runs where the fused one fits (`configs.fused_backward_default`).
BACKWARD_KERNELS = (("stellax_splash_attention_backward_fused",) if FUSED_BACKWARD_BY_DEFAULT else
                    ("stellax_splash_attention_backward_dq", "stellax_splash_attention_backward_dkdv"))
BLOCKS = {("attention", "mosaic_tpu"): SplashConfig(block_q=128, block_kv=128),
          ("attention_backward", "mosaic_tpu"): SplashBackwardConfig(128, 128, 128, 128)}


# -- the oracle: jax's splash attention ----------------------------------------------------------
def _splash(mask, q, k, v, seg, sinks, cap):
    """jax's splash attention, interpreted: ``q [N, T, H]`` (already scaled), one batch element."""
    sizes = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                              block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    kernel = splash.make_splash_mha(splash.MultiHeadMask([mask] * q.shape[0]), block_sizes=sizes, head_shards=1,
                                    q_seq_shards=1, attn_logits_soft_cap=cap, interpret=True)
    ids = None if seg is None else splash.SegmentIds(q=seg, kv=seg)
    return kernel(q, k, v, ids, sinks)


def _oracle_inputs(seed, t, n, h):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    q, k, v, w = (jax.random.normal(kk, (1, t, n, h), jnp.float32) for kk in keys[:4])
    sinks = jax.random.normal(keys[4], (n,), jnp.float32)
    return q, k, v, w, sinks


def _compare_with_splash(mask, ours_kwargs, seg=None, *, cap=None, t=256, n=2, h=128):
    q, k, v, w, sinks = _oracle_inputs(t + n, t, n, h)
    to_heads = lambda x: jnp.swapaxes(x[0], 0, 1)  # [1, T, N, H] -> [N, T, H]

    def ours(q, k, v, sinks):
        extra = {} if seg is None else dict(q_segment_ids=seg[None], kv_segment_ids=seg[None])
        out = stellax.dot_product_attention(q, k, v, scale=1.0, sinks=sinks, logits_soft_cap=cap,
                                            implementation="mosaic_tpu", **extra, **ours_kwargs)
        return jnp.sum(out * w), out

    def theirs(q, k, v, sinks):
        out = _splash(mask, to_heads(q), to_heads(k), to_heads(v), seg, sinks, cap)
        out = jnp.swapaxes(out, 0, 1)[None]
        return jnp.sum(out * w), out

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
    with stellax.interpret_mode(), use_configs(BLOCKS):
        fn = grad(ours)
        (_, out), grads = fn(q, k, v, sinks)
        again = fn(q, k, v, sinks)  # deterministic: a second run is bitwise equal
    for a, b in zip(jax.tree_util.tree_leaves(((out,), grads)), jax.tree_util.tree_leaves((again[0][1:], again[1]))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), "two runs differ"
    (_, ref), ref_grads = grad(theirs)(q, k, v, sinks)
    assert_close(out, ref, dtype=jnp.float32, name="out vs splash")
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert_close(a, b, dtype=jnp.float32, gradient=True, name=f"{name} vs splash")
    golden = stellax.dot_product_attention(q, k, v, scale=1.0, sinks=sinks, logits_soft_cap=cap,
                                           implementation="xla", **ours_kwargs,
                                           **({} if seg is None else dict(q_segment_ids=seg[None],
                                                                           kv_segment_ids=seg[None])))
    assert_close(out, golden, dtype=jnp.float32, name="out vs golden")
    return out, ref


def test_matches_jax_splash_causal_segments_softcap_sinks():
    """CausalMask + segment ids (three documents, boundaries inside blocks) +
    soft cap + sinks, forward and gradients; ours is deterministic."""
    t = 256
    seg = jnp.asarray(np.repeat([0, 1, 2], [100, 60, 96]), jnp.int32)
    _compare_with_splash(splash.CausalMask((t, t)), {"is_causal": True}, seg, cap=20.0)


@pytest.mark.slow
def test_matches_jax_splash_local_window():
    """LocalMask (left 64, right 16): our ``local_window_size=(64, 16)``."""
    t = 256
    _compare_with_splash(splash.LocalMask((t, t), window_size=(64, 16), offset=0), {"local_window_size": (64, 16)})


# -- the golden: options the examples do not reach ---------------------------------------------------
@pytest.mark.slow
def test_head_dim_192_value_128_bf16_fully_masked_rows_deterministic():
    """bf16, T != S (causal bottom-right, lengths not block multiples), GQA 2,
    H = 192 with Hv = 128, soft cap; query rows past their length are fully
    masked (zeros out, zero gradients, never NaN); two runs are bitwise equal."""
    args, kwargs = make_inputs(3, 1, 200, 300, 4, 2, 192, 128, jnp.bfloat16)
    kwargs.update(is_causal=True, logits_soft_cap=10.0, query_seq_lengths=jnp.array([150], jnp.int32))
    out, grads = check_against_golden("mosaic_tpu", args, kwargs, configs=BLOCKS, repeat=True)
    np.testing.assert_array_equal(np.asarray(out[:, 150:], np.float32), 0)
    np.testing.assert_array_equal(np.asarray(grads[0][:, 150:], np.float32), 0)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


@pytest.mark.slow
@pytest.mark.parametrize("opt,t,s,kh", [
    ({"is_causal": True}, 130, 256, 1),                 # MQA, T < S
    ({"is_causal": True}, 300, 140, 2),                 # T > S: leading rows see nothing
    ({"local_window_size": (40, 8)}, 256, 256, 2),
    ({"chunk_size": 96}, 256, 256, 1),
])
def test_sweep_against_golden(opt, t, s, kh):
    args, kwargs = make_inputs(t + s, 2, t, s, 4, kh, 64, 64, jnp.float32, sinks=True)
    check_against_golden("mosaic_tpu", args, {**kwargs, **opt}, configs=BLOCKS)


# -- block sparsity ----------------------------------------------------------------------------
def _canonical(t, s, **kwargs):
    q = jnp.zeros((1, t, 2, 64), jnp.float32)
    k = jnp.zeros((1, s, 1, 64), jnp.float32)
    return base.canonicalize(attention_op.check(q, k, k, **kwargs))


def _nonempty_blocks(c, bq, bk):
    """Blocks holding at least one visible (query, key) pair, from the dense mask."""
    t, s = c.q.shape[1], c.k.shape[1]
    dense = np.asarray(dense_mask(c.spec, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg))[0]
    nq, nk = -(-t // bq), -(-s // bk)
    visible = np.zeros((nq * bq, nk * bk), bool)
    visible[:t, :s] = dense
    return visible.reshape(nq, bq, nk, bk).any(axis=(1, 3))


SEGMENTS = jnp.asarray(np.repeat(np.arange(4), 256)[None], jnp.int32)
SPARSITY_CASES = {
    "causal": (1024, 1024, {"is_causal": True}),
    "causal T<S": (512, 1024, {"is_causal": True}),
    "window(128,0)": (1024, 1024, {"local_window_size": (128, 0)}),
    "segments": (1024, 1024, {"q_segment_ids": SEGMENTS, "kv_segment_ids": SEGMENTS}),
    "chunk 256": (1024, 1024, {"chunk_size": 256}),
}


@pytest.mark.parametrize("case", list(SPARSITY_CASES))
def test_visited_blocks_equal_the_masks_nonempty_blocks(case):
    t, s, kwargs = SPARSITY_CASES[case]
    c = _canonical(t, s, **kwargs)
    tiling = mosaic_tpu.Tiling.of(c, 128, 128)
    (visited, unmasked), table = jax.jit(lambda c: (mosaic_tpu.visited_blocks(c, 128, 128),
                                                    mosaic_tpu.schedule(c, tiling)[0]))(c)
    visited, unmasked = np.asarray(visited)[0], np.asarray(unmasked)[0]
    nonempty = _nonempty_blocks(c, 128, 128)
    np.testing.assert_array_equal(visited, nonempty.sum(axis=1))
    assert visited.sum() < nonempty.size  # real skipping in every case here
    # The table the kernels read lists exactly the non-empty blocks, ascending, FULL ones flagged.
    table = np.asarray(table).reshape(tiling.nq, tiling.nk)
    kinds = mosaic_tpu.KINDS
    for i in range(tiling.nq):
        live = table[i, :visited[i]]
        np.testing.assert_array_equal(live // kinds, np.flatnonzero(nonempty[i]))
        assert (live % kinds != EMPTY).all() and (table[i, visited[i]:] % kinds == EMPTY).all()
        assert int((live % kinds == FULL).sum()) == unmasked[i]
        assert set((live % kinds).tolist()) <= {FULL, *edge_parts(c.spec)}


def _expected_sides(spec, t, s, bq, bk, seg=None):
    """Per-side classes from the dense masks of each side (numpy oracle of `classify_blocks`
    with ``sides``): a non-empty, non-full block is `UPPER_EDGE` when every pair passes all
    but the causal/right-window terms, `LOWER_EDGE` when every pair passes all but the
    left-window term (each only where `edge_parts` has it), else `PARTIAL`."""
    q_pos, kv_pos = default_positions(t, s)
    segs = (None, None) if seg is None else (seg[:, :, None], seg[:, None, :])
    dense = lambda sp: np.asarray(mask_fn(sp, q_pos[:, :, None], kv_pos[:, None, :], *segs)
                                  if not sp.is_trivial else jnp.ones((1, t, s), bool))[0]
    import dataclasses
    whole = dense(spec)
    no_upper = dense(dataclasses.replace(spec, causal=False, window_right=None))
    no_lower = dense(dataclasses.replace(spec, window_left=None))
    parts = edge_parts(spec)
    nq, nk = t // bq, s // bk
    out = np.zeros((nq, nk), np.int32)
    for i in range(nq):
        for j in range(nk):
            blk = (slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk))
            if not whole[blk].any():
                out[i, j] = EMPTY
            elif whole[blk].all():
                out[i, j] = FULL
            elif UPPER_EDGE in parts and no_upper[blk].all():
                out[i, j] = UPPER_EDGE
            elif LOWER_EDGE in parts and no_lower[blk].all():
                out[i, j] = LOWER_EDGE
            else:
                out[i, j] = PARTIAL
    return out


def test_block_classes_per_side_of_a_sliding_window():
    """A causal window of 150 keys at 128-row, 256-key blocks (T = S = 1024): the diagonal key
    block of an even query block is cut by the causal edge only, of an odd one by both edges, the
    key block before it by the window's left edge only; without ``sides`` all three are PARTIAL."""
    spec = MaskSpec(causal=True, window_left=150, default_positions=True)
    q_pos, kv_pos = default_positions(1024, 1024)
    classes = np.asarray(classify_blocks(spec, q_pos, kv_pos, block_q=128, block_k=256, sides=True))[0]
    U, L, P, F, E = UPPER_EDGE, LOWER_EDGE, PARTIAL, FULL, EMPTY
    assert classes.tolist() == [
        [U, E, E, E], [P, E, E, E],
        [L, U, E, E], [L, P, E, E],
        [E, L, U, E], [E, L, P, E],
        [E, E, L, U], [E, E, L, P],
    ]
    np.testing.assert_array_equal(classes, _expected_sides(spec, 1024, 1024, 128, 256))
    plain = np.asarray(classify_blocks(spec, q_pos, kv_pos, block_q=128, block_k=256))[0]
    np.testing.assert_array_equal(plain, np.where(classes >= PARTIAL, np.where(classes == FULL, FULL, PARTIAL),
                                                  classes))
    # A block-sized window at block-sized tiles (issue 37's 1024 window at 1024 tiles, scaled):
    # every visited block is one-sided, none evaluates both edges.
    spec = MaskSpec(causal=True, window_left=128, default_positions=True)
    classes = np.asarray(classify_blocks(spec, q_pos, kv_pos, block_q=128, block_k=128, sides=True))[0]
    assert (np.diag(classes) == U).all() and (np.diag(classes, -1) == L).all()
    assert ((classes == EMPTY) | (classes == U) | (classes == L)).all()


@pytest.mark.parametrize("spec, seg", [
    (MaskSpec(causal=True, window_left=300, default_positions=True), None),
    (MaskSpec(window_left=200, window_right=70, default_positions=True), None),     # two-sided, no causal
    (MaskSpec(causal=True, chunk_size=384, default_positions=True), None),          # chunks: causal edge only
    (MaskSpec(causal=True, segments=True, default_positions=True),
     jnp.asarray(np.repeat([0, 1, 2], [300, 500, 224])[None], jnp.int32)),
    (MaskSpec(causal=True, default_positions=True), None),                          # one side: PARTIAL only
    (MaskSpec(window_left=256, default_positions=True), None),
])
def test_block_classes_per_side_match_the_dense_masks(spec, seg):
    q_pos, kv_pos = default_positions(1024, 1024)
    for bq, bk in ((128, 128), (256, 128), (128, 256)):
        classes = np.asarray(classify_blocks(spec, q_pos, kv_pos, seg, seg, block_q=bq, block_k=bk,
                                             sides=True))[0]
        np.testing.assert_array_equal(classes, _expected_sides(spec, 1024, 1024, bq, bk, seg), err_msg=str((bq, bk)))
    one_sided = not (spec.window_left is not None and (spec.causal or spec.window_right is not None)
                     or spec.chunk_size or spec.segments)
    assert (set(edge_parts(spec)) == {PARTIAL}) == one_sided
    if one_sided:
        assert not ({UPPER_EDGE, LOWER_EDGE} & set(classes.ravel().tolist()))


def test_edge_parts_evaluate_one_side_only():
    """The part of the mask a one-sided block evaluates: the causal comparison alone (upper),
    the window's left comparison alone (lower); the whole mask on a PARTIAL block."""
    spec = MaskSpec(causal=True, window_left=3, segments=True)
    parts = edge_parts(spec)
    assert parts[PARTIAL] == spec
    assert parts[UPPER_EDGE] == MaskSpec(causal=True)
    assert parts[LOWER_EDGE] == MaskSpec(window_left=3)
    assert set(edge_parts(MaskSpec(causal=True, chunk_size=8))) == {PARTIAL, UPPER_EDGE}
    assert set(edge_parts(MaskSpec(window_left=8, window_right=2))) == {PARTIAL, UPPER_EDGE, LOWER_EDGE}


@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_each_block_class_matches_golden(fused):
    """Interpreted, forward and gradients (sinks, soft cap) against the golden where the tables
    hold blocks of every masked class (UPPER_EDGE, LOWER_EDGE and PARTIAL): a causal window of 150
    keys over T = S = 512, the forward at 128 × 256 tiles
    (`test_block_classes_per_side_of_a_sliding_window`'s layout), the backward at 256 × 128; the
    fused backward and (slow tier) the dq + dk/dv pair."""
    opt = {"local_window_size": (150, 0), "is_causal": True, "logits_soft_cap": 20.0}
    args, kwargs = make_inputs(37, 1, 512, 512, 2, 2, 64, 64, jnp.float32, sinks=True)
    c = _canonical(512, 512, local_window_size=(150, 0), is_causal=True)
    classes = np.asarray(mosaic_tpu.mask_classes(c, mosaic_tpu.Tiling.of(c, 128, 256)))
    assert {UPPER_EDGE, LOWER_EDGE, PARTIAL} <= set(classes.ravel().tolist())
    classes = np.asarray(mosaic_tpu.mask_classes(c, mosaic_tpu.Tiling.of(c, 256, 128), kv_major=True))
    assert {UPPER_EDGE, LOWER_EDGE, PARTIAL} <= set(classes.ravel().tolist())
    configs = {("attention", "mosaic_tpu"): SplashConfig(block_q=128, block_kv=256),
               ("attention_backward", "mosaic_tpu"): SplashBackwardConfig(256, 128, 256, 128, fused=fused)}
    check_against_golden("mosaic_tpu", args, {**kwargs, **opt}, configs=configs)


@pytest.mark.parametrize("case", list(SPARSITY_CASES))
def test_grid_width_bounds_the_nonempty_blocks_of_every_row_and_column(case):
    """With the default positions the kernels' grid walks `grid_width` steps per table row:
    never fewer than a row's (column's, for dk/dv) non-empty blocks, exactly the most of them
    without segments (which only remove blocks), and fewer than the whole row for a window
    or chunks (what made a sliding window cost the whole row)."""
    t, s, kwargs = SPARSITY_CASES[case]
    c = _canonical(t, s, **kwargs)
    assert c.spec.default_positions
    for bq, bk in ((128, 128), (128, 256), (256, 128)):
        tiling = mosaic_tpu.Tiling.of(c, bq, bk)
        nonempty = _nonempty_blocks(c, bq, bk)
        rows, cols = mosaic_tpu.grid_width(c, tiling), mosaic_tpu.grid_width(c, tiling, kv_major=True)
        assert rows >= nonempty.sum(axis=1).max() and cols >= nonempty.sum(axis=0).max(), (bq, bk)
        if not c.spec.segments:
            assert (rows, cols) == (nonempty.sum(axis=1).max(), nonempty.sum(axis=0).max()), (bq, bk)
        if "window" in case or "chunk" in case:
            assert rows < tiling.nk and cols < tiling.nq, (bq, bk, rows, cols)


def test_grid_width_is_the_whole_row_with_explicit_positions():
    """Explicit positions (varlen, context parallelism) can put any key in any block: no static bound."""
    pos = jnp.arange(1024, dtype=jnp.int32)[None]
    c = _canonical(1024, 1024, local_window_size=(128, 0), q_positions=pos, kv_positions=pos)
    assert not c.spec.default_positions
    tiling = mosaic_tpu.Tiling.of(c, 128, 128)
    assert mosaic_tpu.grid_width(c, tiling) == tiling.nk and mosaic_tpu.grid_width(c, tiling, kv_major=True) == 8


@pytest.mark.parametrize("opt,t,s,kh", [
    ({"local_window_size": (150, 0), "is_causal": True}, 1000, 1000, 2),  # odd length, GQA: 2-3 of 8 blocks a row
    ({"chunk_size": 256}, 700, 900, 1),                                      # chunks, T < S, MQA
])
def test_narrow_grid_matches_golden(opt, t, s, kh):
    """Windows and chunks on a grid narrower than the row (`grid_width`), interpreted, forward
    and gradients (with sinks) against the golden."""
    args, kwargs = make_inputs(t + s, 1, t, s, 4, kh, 64, 64, jnp.float32, sinks=True)
    c = _canonical(t, s, **opt)
    tiling = mosaic_tpu.Tiling.of(c, 128, 128)
    assert mosaic_tpu.grid_width(c, tiling) < tiling.nk and mosaic_tpu.grid_width(c, tiling, kv_major=True) < tiling.nq
    check_against_golden("mosaic_tpu", args, {**kwargs, **opt}, configs=BLOCKS)


@pytest.mark.parametrize("opt", [{"local_window_size": (200, 0), "is_causal": True}, {}])
def test_forward_computes_a_wide_kv_block_in_sub_blocks(monkeypatch, opt):
    """A forward kv block wider than `mosaic_tpu.KV_CHUNK` is computed one sub-block at a time
    (the online softmax steps per sub-block; masks and padded keys offset by the sub-block's first
    key): with the sub-block shrunk to 128, 256-key blocks over 600 keys (the last block part
    padding), a window's partial blocks and sinks, interpreted, against the golden."""
    assert (mosaic_tpu.kv_chunk(2048), mosaic_tpu.kv_chunk(1024), mosaic_tpu.kv_chunk(512)) == (1024, 1024, 512)
    monkeypatch.setattr(mosaic_tpu, "KV_CHUNK", 128)
    assert mosaic_tpu.kv_chunk(256) == 128
    args, kwargs = make_inputs(7, 1, 400, 600, 2, 1, 64, 64, jnp.float32, sinks=True)
    configs = {("attention", "mosaic_tpu"): SplashConfig(block_q=128, block_kv=256),
               ("attention_backward", "mosaic_tpu"): SplashBackwardConfig(128, 128, 128, 128)}
    check_against_golden("mosaic_tpu", args, {**kwargs, **opt}, configs=configs)


@pytest.mark.parametrize("opt,t,s,h,hv,kh", [
    ({"is_causal": True, "local_window_size": (200, 0)}, 512, 384, 256, 128, 4),  # direct: T != S, Hv != H
    ({"is_causal": True}, 384, 384, 128, 128, 2),                                 # grouped (G = 2): the copies
])
def test_direct_layout_matches_golden(opt, t, s, h, hv, kh):
    """MHA with lane-aligned head dims and block-multiple lengths reads q/k/v/dO and writes
    out/dq/dk/dv in place (`mosaic_tpu.Layout.direct`); GQA keeps the grouped copies. Both
    interpreted, forward and gradients (sinks included), against the golden."""
    args, kwargs = make_inputs(t + s + h, 1, t, s, 4, kh, h, hv, jnp.float32, sinks=True)
    q = jnp.zeros((1, t, 4, h))
    k = jnp.zeros((1, s, kh, h))
    c = base.canonicalize(attention_op.check(q, k, jnp.zeros((1, s, kh, hv)), **opt))
    layout = mosaic_tpu.Layout(mosaic_tpu.Tiling.of(c, 128, 128), None, None)
    assert layout.direct == (kh == 4)
    check_against_golden("mosaic_tpu", args, {**kwargs, **opt}, configs=BLOCKS)


@pytest.mark.parametrize("dtype, chunk", [(jnp.float32, 64), (jnp.bfloat16, 256)])
def test_forward_reads_a_head_group_in_place(dtype, chunk):
    """GQA 4 with lane-aligned heads and block-multiple lengths: the forward's blocks are
    ``[block_q, G·D]`` windows of ``[B, T, N·D]`` (`Layout.lane_heads` = G, no group copy),
    each head computed from its lanes in pieces of `mosaic_tpu.ROW_CHUNK` rows (patched: 64,
    a head's 128 rows in two pieces; 256, two heads' rows stacked in one piece); causal +
    segments + soft cap + sinks, forward and gradients against the golden, interpreted."""
    args, kwargs = make_inputs(11, 1, 256, 256, 8, 2, 128, 128, dtype, sinks=True, segments=True)
    kwargs.update(is_causal=True, logits_soft_cap=15.0)
    c = base.canonicalize(attention_op.check(*args[:3], is_causal=True))
    layout = mosaic_tpu.Layout(mosaic_tpu.Tiling.of(c, 128, 128), None, None, heads_in_lanes=True)
    assert layout.direct and layout.lane_heads == 4
    assert not mosaic_tpu.Layout(mosaic_tpu.Tiling.of(c, 128, 128), None, None).direct  # the backward's
    saved = mosaic_tpu.ROW_CHUNK
    mosaic_tpu.ROW_CHUNK = chunk
    try:
        assert mosaic_tpu.row_chunk(128) == min(chunk, 128)
        check_against_golden("mosaic_tpu", args, kwargs, configs=BLOCKS)
    finally:
        mosaic_tpu.ROW_CHUNK = saved


def test_kernel_visits_what_the_table_lists():
    """The forward kernel's own step counter (debug output) equals the table:
    causal (bottom-right, T = 256, S = 384) within packed documents; the last
    40 queries are a document with no keys: fully masked rows give zeros and
    ``lse = -inf``, never NaN. The output matches the golden."""
    q_seg = jnp.asarray(np.repeat([0, 1, 9], [128, 88, 40])[None], jnp.int32)
    kv_seg = jnp.asarray(np.repeat([0, 0, 1], 128)[None], jnp.int32)
    key = jax.random.split(jax.random.PRNGKey(4), 3)
    q = jax.random.normal(key[0], (1, 256, 2, 64))
    k, v = (jax.random.normal(kk, (1, 384, 1, 64)) for kk in key[1:])
    c = base.canonicalize(attention_op.check(q, k, v, is_causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg))
    with stellax.interpret_mode():
        out, lse, counts = jax.jit(lambda c: mosaic_tpu.forward(c, SplashConfig(128, 128), debug=True))(c)
    ref, ref_lse = stellax.dot_product_attention(q, k, v, is_causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                                                 return_residuals=True, implementation="xla")
    assert_close(out, ref, dtype=jnp.float32, name="out")
    np.testing.assert_array_equal(np.asarray(out[:, 216:]), 0)
    assert np.isneginf(np.asarray(lse[:, :, 216:])).all() and np.isfinite(np.asarray(lse[:, :, :216])).all()
    np.testing.assert_allclose(np.asarray(lse[:, :, :216]), np.asarray(ref_lse[:, :, :216]), rtol=1e-5, atol=1e-5)
    counts = np.asarray(counts[0, 0])[::128]  # one entry per query block
    visited, unmasked = (np.asarray(x)[0] for x in mosaic_tpu.visited_blocks(c, 128, 128))
    np.testing.assert_array_equal(counts // 65536, visited)
    np.testing.assert_array_equal(counts % 65536, unmasked)
    # Query block 0 (document 0) sees key blocks 0 (FULL) and 1 (the causal
    # diagonal); query block 1 (document 1) only key block 2, of 3 each.
    assert visited.tolist() == [2, 1] and unmasked.tolist() == [1, 0]


# -- configs and dispatch -------------------------------------------------------------------------
def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="block_kv must be a multiple of 128"):
        SplashConfig(block_q=128, block_kv=200)
    with pytest.raises(ValueError, match="block_q_dkv must be a multiple of 128 in \\[128, 2048\\]"):
        SplashBackwardConfig(block_q_dkv=4096)


def test_heuristic_follows_the_generation():
    q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    call = attention_op.check(q, q, q, is_causal=True)
    impl = attention_op.implementations["mosaic_tpu"]
    chosen = {}
    for generation in ("v5e", "v5p", "v6e", "tpu7x"):
        with stellax.lowering_target(generation):
            chosen[generation] = impl.default_config(call)
            assert chosen[generation] in impl.config_space(call)
    # v5e: the forward's large MHA blocks (`configs._LARGE_FORWARD_BLOCKS`); v6e: its own preference list
    assert chosen["v5e"] == SplashConfig(1024, 1024) and chosen["v6e"] == SplashConfig(1024, 512)
    short = attention_op.check(jnp.zeros((1, 100, 2, 64)), jnp.zeros((1, 300, 2, 64)), jnp.zeros((1, 300, 2, 64)))
    assert impl.default_config(short) == SplashConfig(block_q=128, block_kv=384 // 128 * 128)
    assert impl.config_space(short) == [SplashConfig(128, 128), SplashConfig(128, 256), SplashConfig(128, 384)]


def test_requirements_explain_and_dispatch_falls_back():
    q = jnp.zeros((1, 128, 2, 64), jnp.float16)
    impl = attention_op.implementations["mosaic_tpu"]
    assert "float32 or bfloat16" in impl.requirements(attention_op.check(q, q, q))
    x = jnp.zeros((1, 128, 2, 64))
    bias_call = attention_op.check(x, x, x, jnp.zeros((1, 2, 128, 128)))
    assert "dense bias" in impl.requirements(bias_call)
    big = jnp.zeros((1, 128, 2, 320))
    assert "up to 256" in impl.requirements(attention_op.check(big, big, big))
    with stellax.lowering_target("v6e"):
        assert attention_op.select(attention_op.check(x, x, x)).name == "mosaic_tpu"
        assert attention_op.select(bias_call).name == "xla_chunked"
        with pytest.raises(UnsupportedError, match="dense bias"):
            attention_op.select(bias_call, "mosaic_tpu")


def test_default_implementation_on_a_tpu_lowers_to_mosaic_kernels():
    """On a TPU ``implementation=None`` runs the Mosaic kernels: the forward and the backward's
    (`BACKWARD_KERNELS`: fused where its resident dq fits)."""
    x = jax.ShapeDtypeStruct((1, 512, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(stellax.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))
    with stellax.lowering_target("v6e"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, kv, kv).lower(
            lowering_platforms=("tpu",)).as_text()
    for name in ("stellax_splash_attention_forward",) + BACKWARD_KERNELS:
        assert name in text, name
    assert text.count("tpu_custom_call") >= 1 + len(BACKWARD_KERNELS)


# -- context parallelism on a TPU ---------------------------------------------------------------------
def test_ring_attention_runs_mosaic_tpu_locally_on_a_tpu():
    """``context_parallel_attention`` (ring, 8 devices) on a TPU: its local
    attention and the flash backward (fused by default) are the Mosaic TPU kernels."""
    from stellax.parallel import context_parallel_attention
    from stellax.parallel.ring import FLASH_BACKWARDS

    assert FLASH_BACKWARDS[0] == "mosaic_tpu"
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets --xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:8]), ("cp",))
    q = jax.ShapeDtypeStruct((1, 8 * 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8 * 256, 2, 128), jnp.bfloat16)

    def loss(q, k, v):
        out = context_parallel_attention(q, k, v, mesh=mesh, axis_name="cp", strategy="ring", is_causal=True)
        return jnp.sum(out.astype(jnp.float32))

    with stellax.lowering_target("v6e"):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    for name in ("stellax_splash_attention_forward",) + BACKWARD_KERNELS:
        assert name in text, name


# -- tier 3: the real Mosaic compiler ---------------------------------------------------------------
@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("h", [128, 256])
def test_heuristic_compiles_forward_and_gradients(generation, h):
    """B=1, N=8, T=S=4096, bf16, causal: the heuristic configs (forward, dq,
    dk/dv) compile for each generation."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    q = jax.ShapeDtypeStruct((1, 4096, 8, h), jnp.bfloat16)
    result = compile_config(attention_op, "mosaic_tpu", (q, q, q), {"is_causal": True}, generation=generation,
                            grad=True)
    assert result.ok, result.describe()


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("mask, kv_heads", [({"local_window_size": (1024, 0), "is_causal": True}, 8),
                                            ({"chunk_size": 1024}, 2)])
def test_narrow_grid_compiles_forward_and_gradients(generation, mask, kv_heads):
    """B=1, N=8, T=S=8192, bf16, a sliding window (MHA: the direct layout) or chunks (GQA, K=2: the
    grouped one): the kernels on their narrow grids (`mosaic_tpu.grid_width`) with the heuristic
    configs compile for each generation."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    q = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8192, kv_heads, 128), jnp.bfloat16)
    result = compile_config(attention_op, "mosaic_tpu", (q, kv, kv), mask, generation=generation, grad=True)
    assert result.ok, result.describe()


# -- the float32 precision contract (docs/precision.md) --------------------------------------------
def test_float32_precision_default_is_one_bf16_pass_high_is_float32_accurate():
    """Interpreted, the kernel writes ``'default'`` as one bfloat16 pass (bf16-like
    error against the golden) and ``'high'`` as three (float32-accurate)."""
    from stellax.testing.numerics import compare, golden

    keys = jax.random.split(jax.random.PRNGKey(35), 3)
    q, k, v = (jax.random.normal(kk, (1, 128, 2, 64), jnp.float32) for kk in keys)
    ref = golden(lambda q, k, v: stellax.dot_product_attention(q, k, v, is_causal=True, implementation="xla",
                                                              precision="highest"), q, k, v)
    errors = {}
    with stellax.interpret_mode(), use_configs(BLOCKS):
        for precision in ("default", "high"):
            out = stellax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic_tpu",
                                                precision=precision)
            errors[precision] = compare(out, ref).rel_l2
    assert 1e-4 < errors["default"] < 3e-2, errors
    assert errors["high"] < 1e-4, errors


@pytest.mark.parametrize("generation, heads, kv_heads, forward, backward", [
    ("v5e", 16, 16, (1024, 1024), (1024, 1024)),  # MHA: the large blocks measured faster on a v5e, both ways
    ("v5p", 16, 16, (1024, 1024), (1024, 1024)),
    ("v5e", 32, 8, (256, 1024), (256, 1024)),     # GQA: the MHA tile's 1024 rows (G·block_q), measured backward too
    ("v5e", 16, 1, (128, 512), (128, 1024)),      # MQA: 2048 rows, so half the kv block forward; the fused
                                                  # backward at the full one (measured 8.10 ms vs 10.33)
    ("v6e", 16, 16, (1024, 512), (1024, 512)),   # 256-wide MXU: its own list
])
def test_heuristic_blocks_per_generation(generation, heads, kv_heads, forward, backward):
    from stellax.core import lowering_target
    from stellax.ops.attention.configs import splash_backward_heuristic, splash_heuristic

    q = jax.ShapeDtypeStruct((1, 8192, heads, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8192, kv_heads, 128), jnp.bfloat16)
    with lowering_target(generation):
        call = stellax.registered_ops()["attention"].check(q, kv, kv, is_causal=True)
        fwd, bwd = splash_heuristic(call), splash_backward_heuristic(call)
    assert (fwd.block_q, fwd.block_kv) == forward
    assert (bwd.block_q_dq, bwd.block_kv_dq, bwd.block_q_dkv, bwd.block_kv_dkv) == backward * 2


def test_heuristic_blocks_for_a_narrow_window():
    """A causal window of 1024 keys at T=16384 on a v5e (issue 37's case): the forward at 1024 ×
    1024 tiles (every visited block one-sided), the fused backward at 512 × 512 (`NARROW_WINDOW`:
    statically 3.31 M bundles against 4.50 M at 1024 tiles); a 4096 window keeps 1024 tiles."""
    from stellax.core import lowering_target
    from stellax.ops.attention.configs import splash_backward_heuristic, splash_heuristic

    q = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
    expected = {1024: ((1024, 1024), (512, 512, 512, 512)), 4096: ((1024, 1024), (1024, 1024, 1024, 1024))}
    with lowering_target("v5e"):
        for window, (forward, backward) in expected.items():
            call = stellax.registered_ops()["attention"].check(q, q, q, is_causal=True,
                                                              local_window_size=(window, 0))
            fwd, bwd = splash_heuristic(call), splash_backward_heuristic(call)
            assert (fwd.block_q, fwd.block_kv) == forward, window
            assert (bwd.block_q_dq, bwd.block_kv_dq, bwd.block_q_dkv, bwd.block_kv_dkv) == backward, window
            assert bwd.fused is FUSED_BACKWARD_BY_DEFAULT, window


def test_heuristic_blocks_for_long_dense_calls():
    """A long unmasked MHA forward on a v5e takes 2048 × 2048 tiles (`DENSE_LONG_BLOCKS`: tuned on
    the chip, 13.69 ms against 14.58 at 1024 × 1024, T=16384 full); a mask of any kind, GQA, a
    shorter sequence or a 256-wide MXU keeps the usual blocks, and the backward is unchanged."""
    from stellax.core import lowering_target
    from stellax.ops.attention.configs import splash_backward_heuristic, splash_heuristic

    op = stellax.registered_ops()["attention"]
    q = jax.ShapeDtypeStruct((1, 16384, 16, 128), jnp.bfloat16)
    gqa = jax.ShapeDtypeStruct((1, 16384, 4, 128), jnp.bfloat16)
    short = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((1, 16384), jnp.int32)

    def forward(generation, *args, **kwargs):
        with lowering_target(generation):
            c = splash_heuristic(op.check(*args, **kwargs))
        return c.block_q, c.block_kv

    assert forward("v5e", q, q, q) == (2048, 2048)
    assert forward("v5p", q, q, q) == (1024, 1024)  # its 64 MiB of VMEM do not hold the 77 MiB step
    assert forward("v5e", q, q, q, is_causal=True) == (1024, 1024)
    assert forward("v5e", q, q, q, local_window_size=(4096, 4096)) == (1024, 1024)
    assert forward("v5e", q, q, q, q_segment_ids=segments, kv_segment_ids=segments) == (1024, 1024)
    assert forward("v5e", q, gqa, gqa) != (2048, 2048)
    assert forward("v5e", short, short, short) == (1024, 1024)
    assert forward("v6e", q, q, q) == (1024, 512)
    with lowering_target("v5e"):
        bwd = splash_backward_heuristic(op.check(q, q, q))
    assert (bwd.block_q_dq, bwd.block_kv_dq) == (1024, 1024)
