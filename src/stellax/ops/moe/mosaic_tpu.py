"""Pallas Mosaic TPU grouped matmul (megablox class): ``ragged_dot`` forward and ``ragged_dot_tgmm``.

Rows of ``lhs [M, K]`` are sorted by group. On a TPU a block is addressed by
block index, so row tiles are *aligned* (tile ``i`` is rows
``[i·bm, (i+1)·bm)``) and a tile that straddles a group boundary is visited
once per group it holds rows of. The visit list is computed on device
(`tile_visits`) and passed by scalar prefetch:

    for every group g (with two pseudo-groups covering the rows before the
    local groups and after them, whose output rows are zeros):
        for every aligned tile i holding rows of g, in row order:
            visit (g, i): rows [max(start_g, i·bm), min(end_g, (i+1)·bm))

An empty group has no visit (it costs nothing). The grid's visit axis is
*dynamic*: its extent is the real visit count (computed on device, at most
``M/bm + G + 1``), so no grid step is spent, and no operand block copied, for
visits that do not exist (a static bound padded with idle visits re-read
the last visit's ``lhs``/``rhs`` blocks at every K step of every idle visit).

Grid ``(N/bn, visits, K/bk)``, K innermost (``arbitrary``): the K axis
accumulates ``lhs[i, k] @ rhs[g][k, j]`` (operands in their own dtype, bf16
straight into the MXU, float32 accumulation) in a float32 VMEM scratch; at
the last K step the visit writes *its rows* of the output tile ``(i, j)``:
a visit that covers the whole tile (every interior tile of a group) stores
``epilogue(acc)`` as is, a partial one selects its rows
(``where(row in visit, epilogue(acc), out)``). The visits of one tile are
consecutive, so the output block stays in VMEM across them and every row is
written by exactly one visit before it is copied out. Pseudo-group visits copy
no operands (their K index is pinned) and write zeros.

The epilogue is the fused activation, or ``act(gate) · up`` for gated weights
``rhs [G, K, 2, N]`` (two accumulators; the gate and up halves are two block
views of the same array). Dimensions that are not block multiples are *not*
padded (a pad is an HBM copy of the whole operand: about 1 ms for the 369 MB
weights of issue 38's skewed case on a v5e): the last block along M, K or N is
a partial edge block, whose part past the array holds whatever the DMA left
there. Rows past M are outside every group (a zero-fill visit, never stored);
columns past N are never stored; the K remainder is zeroed in *both* operands
of the last K step (`_keep_k`: a select, since the leftover may be NaN). Only a
dimension shorter than its block is padded up to the block (a small copy). Blocks larger
than the generation's scoped-VMEM default raise ``vmem_limit_bytes``
(`configs.tpu_vmem_limit`).

`tgmm` (``ragged_dot_tgmm``, the weight gradient ``out[g] = lhs[rows of g]ᵀ @
rhs[rows of g]``) walks a second visit list, `group_visits`: the local groups
only (rows outside them are never read), *one visit for every empty group* (its
output block must still be written, as zeros). Grid ``(K/bk, N/bn, visits)``
(the visit axis dynamic again): the visit axis is sequential and accumulates in
a float32 VMEM scratch ``[bk, bn]``; the visits of a group are consecutive, so
the output block ``(g, k, j)`` stays in VMEM and is written once, by the
group's last visit. Only a visit that covers part of its tile masks the other
rows (of both operands); a whole-tile visit multiplies the blocks as loaded.
The transposed-rhs `gmm` is the dlhs of ``ragged_dot_backward``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import cdiv, mxu_dot, mxu_dot_nt, mxu_dot_tn, operand, output, pad_axis, tpu_kernel_call
from .activations import activation_fn, fusable_in_kernel, kernel_activation_fn
from .configs import gmm_tpu_vmem_need, tgmm_tpu_vmem_need, tpu_vmem_limit
from .schedule import group_bounds


@dataclasses.dataclass(frozen=True)
class TileVisits:
    """The visit list (int32 ``[V_max]`` each; see the module doc) and its real length."""

    group: jax.Array  # local group of the visit; -1 for the zero-fill pseudo-groups
    tile: jax.Array   # aligned row tile
    lo: jax.Array     # first row of the visit
    hi: jax.Array     # one past its last row
    live: jax.Array   # 1 for real visits, 0 for the padding past the count
    count: jax.Array  # [] the number of real visits: the kernels' (dynamic) grid extent


def max_visits(m_tiles: int, num_groups: int) -> int:
    """``m_tiles + num_groups + 1``: each of the ``num_groups`` boundaries (and the
    two pseudo-groups') adds at most one visit to the aligned tiles."""
    return m_tiles + num_groups + 1


def tile_visits(bounds, m_padded: int, block_m: int) -> TileVisits:
    """Visits of the aligned ``block_m`` tiles of ``[0, m_padded)`` by the local
    groups and the two zero-fill pseudo-groups, in row order."""
    zero = jnp.zeros((1,), jnp.int32)
    starts = jnp.concatenate([zero, bounds.starts, bounds.end[None]])
    ends = jnp.concatenate([bounds.begin[None], bounds.starts + bounds.sizes, jnp.full((1,), m_padded, jnp.int32)])
    groups = jnp.concatenate([zero - 1, jnp.arange(bounds.sizes.shape[0], dtype=jnp.int32), zero - 1])
    first = starts // block_m
    count = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    last = jnp.cumsum(count)
    total = last[-1]
    v_max = max_visits(m_padded // block_m, int(bounds.sizes.shape[0]))
    v = jnp.minimum(jnp.arange(v_max, dtype=jnp.int32), total - 1)  # padding repeats the last visit
    owner = jnp.minimum(jnp.sum(last[None, :] <= v[:, None], axis=1), groups.shape[0] - 1).astype(jnp.int32)
    tile = first[owner] + v - (last[owner] - count[owner])
    lo = jnp.maximum(starts[owner], tile * block_m)
    hi = jnp.minimum(ends[owner], (tile + 1) * block_m)
    live = (jnp.arange(v_max) < total).astype(jnp.int32)
    return TileVisits(groups[owner], tile, lo, hi, live, total.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class Blocks:
    bm: int
    bk: int
    bn: int


def _keep_k(x, axis: int, k_rem: int):
    """``x`` with its entries at ``axis`` index ``>= k_rem`` zeroed (a select: garbage there may be NaN)."""
    shape = [1, 1]
    shape[axis] = x.shape[axis]
    idx = jax.lax.broadcasted_iota(jnp.int32, tuple(shape), axis)
    return jnp.where(idx < k_rem, x, jnp.zeros_like(x))


def _epilogue(accs, activation, gated: bool):
    act = kernel_activation_fn(activation)
    return act(accs[0]) * accs[1] if gated else act(accs[0])


def _gmm_kernel(visit_group, visit_tile, visit_lo, visit_hi, *, lhs, rhs, rhs_up, out, pre, acc, acc_up,
                bm, transpose_rhs, activation, precision, halves, k_rem):
    """Grid step ``(j, v, k)``: accumulate ``lhs[tile, k] @ rhs[g][k, j]`` of visit
    ``v``; at the last K step write the visit's rows of ``out`` / ``pre`` (the whole
    block when the visit covers the tile, no select)."""
    v, k = pl.program_id(1), pl.program_id(2)
    group = visit_group[v]
    valued = group >= 0
    last_k = k == pl.num_programs(2) - 1
    accs = (acc, acc_up)[:halves]

    @pl.when(k == 0)
    def _init():
        for a in accs:
            a[...] = jnp.zeros(a.shape, a.dtype)

    def accumulate(masked: bool):
        a, w = lhs[...], rhs[0]
        w_up = None if rhs_up is None else rhs_up[0]
        if masked:  # the partial last K block: columns past K hold whatever the edge DMA left
            a = _keep_k(a, 1, k_rem)
            w = _keep_k(w, 1 if transpose_rhs else 0, k_rem)
            w_up = None if w_up is None else _keep_k(w_up, 0, k_rem)
        product = mxu_dot_nt if transpose_rhs else mxu_dot
        acc[...] += product(a, w, precision)
        if w_up is not None:
            acc_up[...] += mxu_dot(a, w_up, precision)

    if k_rem:
        pl.when(valued & jnp.logical_not(last_k))(lambda: accumulate(False))
        pl.when(valued & last_k)(lambda: accumulate(True))
    else:
        pl.when(valued)(lambda: accumulate(False))

    base = visit_tile[v] * bm
    lo, hi = visit_lo[v], visit_hi[v]
    whole = (lo == base) & (hi == base + bm)

    def store(ref, value, mine):
        value = value.astype(ref.dtype)
        ref[...] = value if mine is None else jnp.where(mine, value, ref[...])

    def write(values, mine):
        """``values``: the accumulators, or None for zeros; ``mine``: the row mask or None (every row)."""
        if out is not None:
            y = (jnp.zeros(out.shape, jnp.float32) if values is None
                 else _epilogue(values, activation, halves == 2))
            store(out, y, mine)
        if pre is not None:
            for half in range(halves):
                view = pre.at[half] if halves == 2 else pre
                store(view, jnp.zeros(view.shape, jnp.float32) if values is None else values[half], mine)

    def rows_of_visit():
        rows = base + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        return (rows >= lo) & (rows < hi)

    @pl.when(last_k & valued & whole)
    def _write_tile():
        write([a[...] for a in accs], None)

    @pl.when(last_k & valued & jnp.logical_not(whole))
    def _write_rows():
        write([a[...] for a in accs], rows_of_visit())

    @pl.when(last_k & jnp.logical_not(valued))
    def _write_zeros():
        write(None, rows_of_visit())


def gmm(lhs, rhs, group_sizes, group_offset, *, transpose_rhs: bool, activation, precision, out_dtype,
        save_preactivation: bool, config):
    """Same contract as `xla.gmm`: ``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]``
    transposed, ``[G, K, 2, N]`` gated) → ``(out [M, N], preactivation or None)``;
    rows outside the local groups are zeros. A callable activation is applied
    by XLA to the kernel's pre-activation (it is not traced into the kernel)."""
    m = lhs.shape[0]
    gated = rhs.ndim == 4
    num_local = rhs.shape[0]
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[-1]
    fused = fusable_in_kernel(activation)
    write_pre = save_preactivation or not fused
    b = Blocks(config.block_m, config.block_k, config.block_n)
    # No padding copies of dimensions longer than their block: the last block of M, K or N is a
    # partial (edge) block; only a dimension shorter than its block is padded to it.
    lhs_p = pad_axis(pad_axis(lhs, 0, b.bm), 1, b.bk)
    if transpose_rhs:
        rhs_p = pad_axis(pad_axis(rhs, 1, b.bn), 2, b.bk)
    elif gated:  # [G, K, 2, N] -> [G, 2, K, N]: gate and up as two block views
        rhs_p = pad_axis(pad_axis(jnp.moveaxis(rhs, 2, 1), 2, b.bk), 3, b.bn)
    else:
        rhs_p = pad_axis(pad_axis(rhs, 1, b.bk), 2, b.bn)
    m_a, k_a = lhs_p.shape
    n_a = max(n_dim, b.bn)
    m_p, k_p, n_p = cdiv(m_a, b.bm) * b.bm, cdiv(k_a, b.bk) * b.bk, cdiv(n_a, b.bn) * b.bn
    visits = tile_visits(group_bounds(group_sizes, group_offset, num_local, m), m_p, b.bm)
    k_steps = k_p // b.bk

    def k_of(v, kk, group):  # pseudo-group visits pin K: no operand copies
        return jnp.where(group[v] >= 0, kk, 0)

    lhs_spec = pl.BlockSpec((b.bm, b.bk), lambda j, v, kk, g, t, *_: (t[v], k_of(v, kk, g)))
    if transpose_rhs:
        rhs_spec = pl.BlockSpec((1, b.bn, b.bk), lambda j, v, kk, g, *_: (jnp.maximum(g[v], 0), j, k_of(v, kk, g)))
        rhs_operands = dict(rhs=operand(rhs_p, rhs_spec), rhs_up=None)
    elif gated:
        def half_spec(half):
            return pl.BlockSpec((1, None, b.bk, b.bn),
                                lambda j, v, kk, g, *_: (jnp.maximum(g[v], 0), half, k_of(v, kk, g), j))
        rhs_operands = dict(rhs=operand(rhs_p, half_spec(0)), rhs_up=operand(rhs_p, half_spec(1)))
    else:
        rhs_spec = pl.BlockSpec((1, b.bk, b.bn), lambda j, v, kk, g, *_: (jnp.maximum(g[v], 0), k_of(v, kk, g), j))
        rhs_operands = dict(rhs=operand(rhs_p, rhs_spec), rhs_up=None)
    out_spec = pl.BlockSpec((b.bm, b.bn), lambda j, v, kk, g, t, *_: (t[v], j))
    pre_spec = (pl.BlockSpec((2, b.bm, b.bn), lambda j, v, kk, g, t, *_: (0, t[v], j)) if gated else out_spec)
    halves = 2 if gated else 1
    kernel = functools.partial(_gmm_kernel, bm=b.bm, transpose_rhs=transpose_rhs,
                               activation=activation if fused else None, precision=precision, halves=halves,
                               k_rem=k_a % b.bk)
    need = gmm_tpu_vmem_need(b.bm, b.bk, b.bn, halves=halves, itemsize=jnp.dtype(lhs.dtype).itemsize,
                             out_itemsize=jnp.dtype(out_dtype).itemsize, outputs=int(fused) + int(write_pre))
    outs = tpu_kernel_call(
        kernel, grid=(n_p // b.bn, visits.count, k_steps),
        scalar_prefetch=dict(visit_group=visits.group, visit_tile=visits.tile, visit_lo=visits.lo,
                             visit_hi=visits.hi),
        inputs=dict(lhs=operand(lhs_p, lhs_spec), **rhs_operands),
        outputs=dict(out=output((m_a, n_a), out_dtype, out_spec) if fused else None,
                     pre=output(((2, m_a, n_a) if gated else (m_a, n_a)), out_dtype, pre_spec) if write_pre
                     else None),
        scratch=dict(acc=pltpu.VMEM((b.bm, b.bn), jnp.float32),
                     acc_up=pltpu.VMEM((b.bm, b.bn), jnp.float32) if gated else None),
        dimension_semantics=("parallel", "arbitrary", "arbitrary"), name="stellax_ragged_dot_tpu",
        vmem_limit_bytes=tpu_vmem_limit(need),
    )
    pre = None
    if write_pre:
        pre = outs.pre[:, :m, :n_dim] if gated else outs.pre[:m, :n_dim]
        pre = jnp.moveaxis(pre, 0, 1) if gated else pre
    if fused:
        out = outs.out[:m, :n_dim]
    else:
        z = pre.astype(jnp.float32)
        act = activation_fn(activation)
        y = act(z[:, 0]) * z[:, 1] if gated else act(z)
        bounds = group_bounds(group_sizes, group_offset, num_local, m)
        rows = jnp.arange(m)[:, None]
        out = jnp.where((rows >= bounds.begin) & (rows < bounds.end), y, 0.0).astype(out_dtype)
    return out, (pre if save_preactivation else None)


# -- tgmm: the weight gradient ----------------------------------------------------------------------
def group_visits(bounds, m_padded: int, block_m: int) -> TileVisits:
    """Visits of the aligned ``block_m`` tiles by the local groups only, in row
    order, with *one visit for every empty group* (rows ``[lo, lo)``: nothing
    to add, but its output block must be written, as zeros). No pseudo-groups:
    rows outside the local groups are never visited. At most
    ``m_padded/block_m + G - 1`` visits (adjacent groups share at most one tile)."""
    m_tiles = m_padded // block_m
    num_local = int(bounds.sizes.shape[0])
    starts, sizes = bounds.starts, bounds.sizes
    ends = starts + sizes
    first = jnp.minimum(starts // block_m, m_tiles - 1)
    count = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 1)
    last = jnp.cumsum(count)
    total = last[-1]
    v_max = m_tiles + num_local - 1
    v = jnp.minimum(jnp.arange(v_max, dtype=jnp.int32), total - 1)  # padding repeats the last visit
    owner = jnp.minimum(jnp.sum(last[None, :] <= v[:, None], axis=1), num_local - 1).astype(jnp.int32)
    tile = first[owner] + v - (last[owner] - count[owner])
    lo = jnp.maximum(starts[owner], tile * block_m)
    hi = jnp.maximum(lo, jnp.minimum(ends[owner], (tile + 1) * block_m))
    live = (jnp.arange(v_max) < total).astype(jnp.int32)
    return TileVisits(owner, tile, lo, hi, live, total.astype(jnp.int32))


def _tgmm_kernel(visit_group, visit_tile, visit_lo, visit_hi, *, lhs, rhs, out, acc, bm, transpose_lhs,
                 precision):
    """Grid step ``(kk, j, v)``: add the visit's rows of ``lhs[tile]ᵀ @ rhs[tile]``
    to the accumulator of its group (masking the other rows only when the visit
    covers part of its tile); the group's last visit writes ``out[g]``."""
    v, visits = pl.program_id(2), pl.num_programs(2)
    group = visit_group[v]
    lo, hi = visit_lo[v], visit_hi[v]
    base = visit_tile[v] * bm
    whole = (lo == base) & (hi == base + bm)

    @pl.when((v == 0) | (visit_group[jnp.maximum(v - 1, 0)] != group))
    def _init():
        acc[...] = jnp.zeros(acc.shape, acc.dtype)

    def accumulate(masked: bool):
        a, b = lhs[...], rhs[...]
        if masked:
            rows_b = base + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
            b = jnp.where((rows_b >= lo) & (rows_b < hi), b, jnp.zeros_like(b))
            if transpose_lhs:  # a [bm, bk]
                a = jnp.where((rows_b >= lo) & (rows_b < hi), a, jnp.zeros_like(a))
            else:  # a [bk, bm]
                cols = base + jax.lax.broadcasted_iota(jnp.int32, (1, bm), 1)
                a = jnp.where((cols >= lo) & (cols < hi), a, jnp.zeros_like(a))
        acc[...] += mxu_dot_tn(a, b, precision) if transpose_lhs else mxu_dot(a, b, precision)

    @pl.when(whole)
    def _accumulate_tile():
        accumulate(False)

    @pl.when((hi > lo) & jnp.logical_not(whole))
    def _accumulate_rows():
        accumulate(True)

    after = jnp.minimum(v + 1, visits - 1)
    group_ends = (v == visits - 1) | (visit_group[after] != group)

    @pl.when(group_ends)
    def _write():
        out[0] = acc[...].astype(out.dtype)


def tgmm(lhs, rhs, group_sizes, group_offset, *, num_local: int, transpose_lhs: bool, precision, out_dtype,
         config):
    """Same contract as `xla.tgmm`: ``lhs [K, M]`` (``[M, K]`` with ``transpose_lhs``),
    ``rhs [M, N]`` → ``out [G_local, K, N]``, ``out[g] = lhs[rows of g]ᵀ @ rhs[rows of g]``.

    Grid ``(K/bk, N/bn, visits)`` (`group_visits`, the visit extent the real
    count): the visit axis is sequential and accumulates in a float32 VMEM
    scratch ``[bk, bn]``; the visits of one group are consecutive, so the output
    block ``(g, kk, j)`` stays in VMEM across them and is written once, by the
    group's last visit (deterministic: no atomics, a fixed order). Rows of a
    straddling tile that are not the visit's are masked to zero in both
    operands; an empty group's one visit adds nothing and writes zeros; rows
    outside the local groups are never visited. M, K and N that are not block
    multiples end in partial edge blocks (no padding copy): rows past M are only in
    partial visits (masked), and output rows and columns past K and N are never stored."""
    if transpose_lhs:
        m, k = lhs.shape
    else:
        k, m = lhs.shape
    n = rhs.shape[1]
    b = Blocks(config.block_m, config.block_k, config.block_n)
    # As in `gmm`: edge blocks instead of padding copies, except for a dimension shorter than its
    # block. Rows past M are only in partial visits (masked); K and N past the array are
    # output rows and columns that are never stored.
    if transpose_lhs:
        lhs_p = pad_axis(pad_axis(lhs, 0, b.bm), 1, b.bk)
        lhs_spec = pl.BlockSpec((b.bm, b.bk), lambda kk, j, v, g, t, *_: (t[v], kk))
        m_a, k_a = lhs_p.shape
    else:
        lhs_p = pad_axis(pad_axis(lhs, 0, b.bk), 1, b.bm)
        lhs_spec = pl.BlockSpec((b.bk, b.bm), lambda kk, j, v, g, t, *_: (kk, t[v]))
        k_a, m_a = lhs_p.shape
    rhs_p = pad_axis(pad_axis(rhs, 0, b.bm), 1, b.bn)
    n_a = rhs_p.shape[1]
    m_p, k_p, n_p = cdiv(m_a, b.bm) * b.bm, cdiv(k_a, b.bk) * b.bk, cdiv(n_a, b.bn) * b.bn
    rhs_spec = pl.BlockSpec((b.bm, b.bn), lambda kk, j, v, g, t, *_: (t[v], j))
    out_spec = pl.BlockSpec((1, b.bk, b.bn), lambda kk, j, v, g, *_: (g[v], kk, j))
    visits = group_visits(group_bounds(group_sizes, group_offset, num_local, m), m_p, b.bm)
    kernel = functools.partial(_tgmm_kernel, bm=b.bm, transpose_lhs=transpose_lhs, precision=precision)
    need = tgmm_tpu_vmem_need(b.bm, b.bk, b.bn, itemsize=jnp.dtype(lhs.dtype).itemsize,
                              out_itemsize=jnp.dtype(out_dtype).itemsize)
    outs = tpu_kernel_call(
        kernel, grid=(k_p // b.bk, n_p // b.bn, visits.count),
        scalar_prefetch=dict(visit_group=visits.group, visit_tile=visits.tile, visit_lo=visits.lo,
                             visit_hi=visits.hi),
        inputs=dict(lhs=operand(lhs_p, lhs_spec), rhs=operand(rhs_p, rhs_spec)),
        outputs=dict(out=output((num_local, k_a, n_a), out_dtype, out_spec)),
        scratch=dict(acc=pltpu.VMEM((b.bk, b.bn), jnp.float32)),
        dimension_semantics=("parallel", "parallel", "arbitrary"), name="stellax_ragged_dot_tgmm_tpu",
        vmem_limit_bytes=tpu_vmem_limit(need),
    )
    return outs.out[:, :k, :n]
