"""Pallas Mosaic TPU flash attention (splash class), forward kernel.

Layout. A grid step owns one (batch ``b``, kv head ``kk``, query block ``i``)
and reads the ``G = N / K`` query heads of kv head ``kk`` at once: the wrapper
lays the queries out as ``[B, K, nq, R, H]`` with ``R = G·block_q`` rows
(head-major inside a block), so K/V blocks are fetched once for the whole
group (GQA/MQA without repeating K/V) and every matmul has ``R`` rows.
Per-row vectors (positions, segments, lse, sinks) are ``[R, 1]`` columns and
per-key vectors ``[1, block_kv]`` rows, so a mask tile is a plain broadcast.

Block sparsity. `classify_blocks` (the shared `MaskSpec` description) gives
every (query block, kv block) pair a class; `block_table` compacts each row
of classes into the list of its non-empty kv blocks. Grid step ``j`` of row
``i`` visits entry ``j`` of that list; steps past its end repeat the last
visited block index (already resident in VMEM: no new DMA) and compute
nothing. The table (block index · `KINDS` + class) is a scalar-prefetch operand
the K/V index maps read, so empty blocks are neither fetched nor computed,
FULL blocks skip mask evaluation and masked blocks evaluate only the part of
the mask that can cut them: the classes are per side (`masks.edge_parts`), so
a block that only the causal edge cuts compares ``kp <= qp`` alone, one that
only a window's left edge cuts ``kp >= qp - left`` alone, and a PARTIAL block
the whole mask; each class is its own statically specialised body. (A
query block that sees no key at all still has block 0 fetched once, and
computes nothing.)

Online softmax over the sequential ("arbitrary") kv axis, in base 2: the
kernel's logits are ``t = log2(e)·s`` (the scale and ``log2 e`` are one
constant, so ``exp`` is the hardware's ``pow2`` with no multiply of its own);
float32 ``m``, ``l`` (``[R, 128]``, lanes equal) and ``acc`` (``[R, Hv]``) in
VMEM scratch; per visited block with logits tile ``t`` (float32):

    t    = (scale·log2 e)·q·kᵀ   (soft cap: t = (cap·log2 e)·tanh((scale/cap)·q·kᵀ));
    t    = -inf where masked
    m'   = max(m, rowmax(t));  α = 2^(m - m');  p = 2^(t - m')
    l    = α·l + rowsum(p);  acc = α·acc + p·v;  m = m'
    last step: sinks join l (m'' = max(m, σ·log2 e), rescale), out = acc · (1/l),
               lse = ln2·m + ln l   (l = 0: out = 0, lse = -inf)

``m`` starts at `NEG_START` (finite), so a row with no visible key so far
computes ``p = 2^(-inf) = 0`` and ``α = 1`` with no special case. ``m'`` and
``α`` stay lanes-equal ``[R, 128]`` and are tiled along the lanes to the
tile's width (no lane broadcast of a column).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import (
    cdiv, mxu_dot, mxu_dot_nt, mxu_dot_tn, operand, output, pad_axis, tpu_kernel_call,
)
from ...core.platform import target_generation
from ...core.precision import accurate_functions, float32_log, soft_cap_tanh
from .configs import splash_vmem_bytes
from .masks import EMPTY, FULL, MaskSpec, classify_blocks, edge_parts, mask_fn, static_block_counts

F32 = jnp.float32
LANES = 128
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: The running max's start: finite, far below any logit (splash's mask value), so that
#: ``2^(-inf - m) = 0`` and ``2^(m - m) = 1`` on a row that has seen no visible key.
NEG_START = -0.7 * float(jnp.finfo(jnp.float32).max)


# -- sizes -------------------------------------------------------------------------------
class Tiling(NamedTuple):
    """Sizes of one launch: ``q [b, t, n, h]``, ``k [b, s, kh, h]``, ``v [.., hv]``,
    ``g = n / kh`` query heads per kv head; ``bq × bk`` blocks, ``nq × nk`` of
    them over the padded lengths ``tp × sp``; ``rows = g·bq`` per step."""

    b: int
    t: int
    s: int
    n: int
    kh: int
    g: int
    h: int
    hv: int
    bq: int
    bk: int
    nq: int
    nk: int

    @classmethod
    def of(cls, c, block_q: int, block_kv: int) -> "Tiling":
        b, t, n, h = c.q.shape
        s, kh = c.k.shape[1:3]
        return cls(b, t, s, n, kh, n // kh, h, c.v.shape[-1], block_q, block_kv, cdiv(t, block_q),
                   cdiv(s, block_kv))

    @property
    def tp(self) -> int:
        return self.nq * self.bq

    @property
    def sp(self) -> int:
        return self.nk * self.bk

    @property
    def rows(self) -> int:
        return self.g * self.bq


# -- the block table -------------------------------------------------------------------------
#: Table entries are ``KINDS·col + class`` (classes 0..4: `masks.EMPTY` .. `masks.LOWER_EDGE`).
KIND_BITS = 3
KINDS = 1 << KIND_BITS


def block_table(classes):
    """Compact each row of block classes into the blocks a kernel visits.

    ``classes [Bc, n_rows, n_cols]`` int32 (`masks.EMPTY`, `masks.FULL` or a masked class of
    `masks.edge_parts`) → ``(table [Bc·n_rows·n_cols] int32, count [Bc, n_rows] int32)``: entry
    ``(c, r, j)`` is ``KINDS·col + class`` of the ``j``-th non-empty block of row
    ``r`` (columns ascending); past the row's ``count`` it repeats the last
    non-empty column (block 0 for an empty row) with class `EMPTY`.
    """
    n = classes.shape[-1]
    nonempty = classes != EMPTY
    order = jnp.argsort(jnp.where(nonempty, 0, 1), axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(nonempty, axis=-1, dtype=jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(count - 1, 0)[..., None], axis=-1)
    steps = jnp.arange(n, dtype=jnp.int32)
    live = steps < count[..., None]
    col = jnp.where(live, order, last)
    kind = jnp.where(live, jnp.take_along_axis(classes, order, axis=-1), EMPTY)
    return (col * KINDS + kind).reshape(-1).astype(jnp.int32), count


def mask_classes(c, tiling: Tiling, *, kv_major: bool = False):
    """``[Bc, nq, nk]`` block classes of the mask, per side (`masks.classify_blocks` with
    ``sides``; ``[Bc, nk, nq]`` with ``kv_major``)."""
    classes = classify_blocks(c.spec, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg, block_q=tiling.bq,
                              block_k=tiling.bk, sides=True)
    return jnp.swapaxes(classes, 1, 2) if kv_major else classes


def schedule(c, tiling: Tiling, *, kv_major: bool = False):
    """``(table, step, width)``: the flat block table of the mask (`block_table`;
    per query block, or per key block with ``kv_major``), the `Step` that
    reads it and the grid steps per table row: the most non-empty blocks a
    row can have (`masks.static_block_counts`) with the default positions,
    else the whole row."""
    classes = mask_classes(c, tiling, kv_major=kv_major)
    table, _ = block_table(classes)
    step = Step(classes.shape[0] > 1, classes.shape[1], classes.shape[2], c.spec)
    return table, step, grid_width(c, tiling, kv_major=kv_major)


def grid_width(c, tiling: Tiling, *, kv_major: bool = False) -> int:
    """Grid steps per table row (module docstring): with the default positions, the
    static bound of `masks.static_block_counts` (a sliding window of ``w`` visits about
    ``w / block + 2`` blocks, not all of them); otherwise ``nk`` (``nq`` with ``kv_major``)."""
    whole = tiling.nq if kv_major else tiling.nk
    if not c.spec.default_positions:
        return whole
    per_row, per_col = static_block_counts(c.spec, tiling.t, tiling.s, block_q=tiling.bq, block_k=tiling.bk)
    return min(whole, per_col if kv_major else per_row)


def visited_blocks(c, block_q: int, block_kv: int):
    """``(visited, unmasked)`` ``[Bc, nq]`` int32: kv blocks the forward kernel
    visits per query block (its table's non-empty entries) and how many of
    them are FULL (no mask evaluation)."""
    classes = mask_classes(c, Tiling.of(c, block_q, block_kv))
    return (jnp.sum(classes != EMPTY, axis=-1, dtype=jnp.int32),
            jnp.sum(classes == FULL, axis=-1, dtype=jnp.int32))


class Step:
    """Grid-step helpers for a table over ``(b, ·, row, j)`` grids: the flat
    entry of step ``j`` of table row ``r``, its block index / class, and the
    dispatch of a step to the body of its class (`visit`) for the mask ``spec``."""

    def __init__(self, batched: bool, n_rows: int, n_cols: int, spec: MaskSpec | None = None):
        self.batched, self.n_rows, self.n_cols = batched, n_rows, n_cols
        self.parts = edge_parts(spec if spec is not None else MaskSpec())

    def entry(self, table, b, r, j):
        bc = b if self.batched else 0
        return table[(bc * self.n_rows + r) * self.n_cols + j]

    def block(self, table, b, r, j):
        return jax.lax.shift_right_logical(self.entry(table, b, r, j), KIND_BITS)

    def kind(self, table, b, r, j):
        return jax.lax.bitwise_and(self.entry(table, b, r, j), KINDS - 1)

    def visit(self, table, b, r, j, update):
        """Run ``update(mask)`` on step ``j``'s block, one statically specialised body per
        class: ``mask = None`` (no mask evaluation) on a FULL block, on a masked one the
        `masks.MaskSpec` of the terms that can cut it (`masks.edge_parts`: the whole mask on a
        PARTIAL block, only the causal side on an `masks.UPPER_EDGE` one, only the window's
        left side on a `masks.LOWER_EDGE` one). An EMPTY entry is never visited."""
        kind = self.kind(table, b, r, j)
        pl.when(kind == FULL)(lambda: update(None))
        for cls, part in self.parts.items():
            pl.when(kind == cls)(functools.partial(update, part))


# -- the tile math -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TileMath:
    """Static description of the logits tile, shared by the three kernels."""

    spec: MaskSpec
    scale: float
    cap: float | None
    s_len: int            # true key length (key index >= s_len: padding)
    padded_keys: bool     # the key length is not a block multiple
    block_kv: int
    precision: Any
    tanh: Callable        # the soft cap's tanh (`core.precision.soft_cap_tanh`)
    accurate: bool = False  # float32 at HIGHEST: per-row logs by `core.precision.float32_log`

    @classmethod
    def of(cls, c, tiling: Tiling) -> "TileMath":
        # the call's resolved precision (`core.precision`); non-float32 operands stay native
        return cls(c.spec, c.scale, c.logits_soft_cap, tiling.s, tiling.sp != tiling.s, tiling.bk, c.precision,
                   soft_cap_tanh(c.q.dtype, c.precision), accurate_functions(c.q.dtype, c.precision))

    def logits2(self, q, k):
        """``(t, tanh)``: the base-2 logits ``t = log2(e)·s`` ``[R, bk]`` float32 of
        ``q [R, H]``, ``k [bk, H]`` (the scale, the soft cap's ``cap`` and ``log2 e`` folded
        into one multiply) and the soft cap's ``tanh`` (None without a cap)."""
        raw = mxu_dot_nt(q, k, self.precision)
        if self.cap is None:
            return raw * F32(self.scale * LOG2E), None
        tanh = self.tanh(raw * F32(self.scale / self.cap))
        return F32(self.cap * LOG2E) * tanh, tanh

    def log(self, x):
        """Natural log of per-row float32 ``x``: `float32_log` when accurate, else the hardware's."""
        return float32_log(x) if self.accurate else jnp.log(x)

    def visible(self, col, q_pos, kv_pos, q_seg, kv_seg, *, keys_first: bool = False, offset: int = 0,
                spec: MaskSpec | None = None):
        """``[R, bk]`` bool of a masked block ``col``: the mask ``spec`` (default the call's;
        a part of it from `Step.visit` on a one-sided block) of the
        positions ``q_pos [R, 1]`` / ``kv_pos [1, bk]`` (and segments), padded
        keys hidden. None when nothing is hidden. With ``keys_first`` the
        transposed tile ``[bk, R]`` from ``q_pos [1, R]`` / ``kv_pos [bk, 1]``.
        ``offset``: the tile's first key within the block (a sub-block of ``bk`` keys)."""
        ok = mask_fn(self.spec if spec is None else spec, q_pos, kv_pos, q_seg, kv_seg)
        if self.padded_keys:
            width = kv_pos.shape[0] if keys_first else kv_pos.shape[1]
            shape, axis = ((width, 1), 0) if keys_first else ((1, width), 1)
            key = col * self.block_kv + offset + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
            in_range = key < self.s_len
            ok = in_range if ok is None else jnp.logical_and(ok, in_range)
        return ok

    def dot(self, a, b):
        """``a [M, K] · b [K, N]``, float32."""
        return mxu_dot(a, b, self.precision)

    def dot_nt(self, a, b):
        """``a [M, K] · b [N, K]ᵀ``, float32."""
        return mxu_dot_nt(a, b, self.precision)

    def dot_tn(self, a, b):
        """``a [K, M]ᵀ · b [K, N]``, float32."""
        return mxu_dot_tn(a, b, self.precision)


# -- layouts -----------------------------------------------------------------------------------
def group_rows(x, tiling: Tiling, fill=0):
    """``[B, T, N, D]`` → ``[B, K, nq, R, D]`` (T padded to ``tp``; rows of a
    block head-major: row ``g·bq + t`` is head ``g``, token ``t``)."""
    b, t, n, d = x.shape
    t_ = tiling
    x = pad_axis(x, 1, t_.tp, fill).reshape(b, t_.nq, t_.bq, t_.kh, t_.g, d)
    return x.transpose(0, 3, 1, 4, 2, 5).reshape(b, t_.kh, t_.nq, t_.rows, d)


def ungroup_rows(x, tiling: Tiling):
    """`group_rows`'s inverse: ``[B, K, nq, R, D]`` → ``[B, T, N, D]``."""
    t_ = tiling
    b, d = x.shape[0], x.shape[-1]
    x = x.reshape(b, t_.kh, t_.nq, t_.g, t_.bq, d).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(b, t_.tp, t_.n, d)[:, :t_.t]


def group_stats(x, tiling: Tiling, fill=0.0):
    """Per-row statistics ``[B, N, T]`` → ``[B, K, nq, R, 1]``."""
    return group_rows(jnp.swapaxes(x, 1, 2)[..., None], tiling, fill)


def ungroup_stats(x, tiling: Tiling):
    """`group_stats`'s inverse: ``[B, K, nq, R, 1]`` → ``[B, N, T]``."""
    return jnp.swapaxes(ungroup_rows(x, tiling)[..., 0], 1, 2)


def head_major(x, length: int):
    """``[B, S, K, D]`` → ``[B, K, Sp, D]`` (keys padded with zeros)."""
    return pad_axis(jnp.swapaxes(x, 1, 2), 2, length)


def row_tokens(x, tiling: Tiling):
    """Per-query ints ``[Bx, T]`` → ``[Bx, nq, R, 1]`` (repeated over the group's heads)."""
    bx = x.shape[0]
    x = pad_axis(x, 1, tiling.tp).reshape(bx, tiling.nq, 1, tiling.bq)
    x = jnp.broadcast_to(x, (bx, tiling.nq, tiling.g, tiling.bq))
    return x.reshape(bx, tiling.nq, tiling.rows, 1)


def col_tokens(x, length: int):
    """Per-key ints ``[Bx, S]`` → ``[Bx, 1, Sp]``."""
    return pad_axis(x, 1, length)[:, None, :]


def sink_rows(sinks, tiling: Tiling):
    """``[N]`` → ``[K, R, 1]`` float32: each row's head's sink logit."""
    s = sinks.astype(F32).reshape(tiling.kh, tiling.g, 1)
    return jnp.broadcast_to(s, (tiling.kh, tiling.g, tiling.bq)).reshape(tiling.kh, tiling.rows, 1)


class Layout:
    """Where a launch over ``(b, kk, r, j)`` grids reads and writes its token-major operands
    (q, dO, out, dq: ``[B, T, N, D]``; k, v, dk, dv: ``[B, S, K, D]``).

    Direct (MHA, ``G = 1``, or any ``G`` with ``heads_in_lanes``; head dims multiples of 128,
    lengths multiples of the blocks): a block is a ``[block, G·D]`` window of the operand
    viewed as ``[B, T, N·D]`` (a free reshape), lane block = kv head, so no transpose or pad
    copies before or after the kernel; the kernel reads head ``g`` of a query block from lanes
    ``g·D ..`` (`lane_heads`). Otherwise the grouped layouts (`group_rows`, `head_major`): one
    XLA copy each way.
    ``q_block(b, r, j, tab)`` / ``kv_block(b, r, j, tab)`` give the block a step reads.
    """

    def __init__(self, tiling: Tiling, q_block, kv_block, *, heads_in_lanes: bool = False):
        t_ = tiling
        self.t_, self.q_block, self.kv_block = tiling, q_block, kv_block
        aligned = t_.h % LANES == 0 and t_.hv % LANES == 0 and t_.tp == t_.t and t_.sp == t_.s
        self.direct = aligned and (t_.g == 1 or heads_in_lanes)
        #: Query heads of a block side by side in its lanes (``[block_q, G·D]``, head ``g`` in
        #: lanes ``g·D ..``): the direct layout of a head group (``heads_in_lanes``, the forward).
        self.lane_heads = t_.g if self.direct else 1

    def _rows_spec(self, d: int):
        t_, qb = self.t_, self.q_block
        if self.direct:
            return pl.BlockSpec((None, t_.bq, t_.g * d), lambda b, kk, r, j, tab: (b, qb(b, r, j, tab), kk))
        return pl.BlockSpec((None, None, None, t_.rows, d), lambda b, kk, r, j, tab: (b, kk, qb(b, r, j, tab), 0, 0))

    def _keys_spec(self, d: int):
        t_, kb = self.t_, self.kv_block
        if self.direct:
            return pl.BlockSpec((None, t_.bk, d), lambda b, kk, r, j, tab: (b, kb(b, r, j, tab), kk))
        return pl.BlockSpec((None, None, t_.bk, d), lambda b, kk, r, j, tab: (b, kk, kb(b, r, j, tab), 0))

    def rows_in(self, x):
        """A query-side input ``[B, T, N, D]``."""
        b, t, n, d = x.shape
        return operand(x.reshape(b, t, n * d) if self.direct else group_rows(x, self.t_), self._rows_spec(d))

    def rows_out(self, d: int, dtype):
        t_ = self.t_
        shape = (t_.b, t_.t, t_.n * d) if self.direct else (t_.b, t_.kh, t_.nq, t_.rows, d)
        return output(shape, dtype, self._rows_spec(d))

    def rows_result(self, y):
        """A `rows_out` result as ``[B, T, N, D]``."""
        t_ = self.t_
        return y.reshape(t_.b, t_.t, t_.n, -1) if self.direct else ungroup_rows(y, t_)

    def keys_in(self, x):
        """A key-side input ``[B, S, K, D]``."""
        b, s, kh, d = x.shape
        return operand(x.reshape(b, s, kh * d) if self.direct else head_major(x, self.t_.sp), self._keys_spec(d))

    def keys_out(self, d: int, dtype):
        t_ = self.t_
        shape = (t_.b, t_.s, t_.kh * d) if self.direct else (t_.b, t_.kh, t_.sp, d)
        return output(shape, dtype, self._keys_spec(d))

    def keys_result(self, y):
        """A `keys_out` result as ``[B, S, K, D]``."""
        t_ = self.t_
        return y.reshape(t_.b, t_.s, t_.kh, -1) if self.direct else jnp.swapaxes(y, 1, 2)[:, :t_.s]


def batch_index(size: int):
    """Index-map helper: the batch index, or 0 for a broadcast (size-1) batch."""
    return (lambda b: b) if size > 1 else (lambda b: 0)


class Tokens(NamedTuple):
    """The mask's token operands in kernel layout: ``q_pos``/``q_seg``
    ``[Bx, nq, R, 1]``, ``kv_pos``/``kv_seg`` ``[Bx, 1, Sp]`` (segments None
    without)."""

    q_pos: Any
    kv_pos: Any
    q_seg: Any
    kv_seg: Any

    @classmethod
    def of(cls, c, tiling: Tiling) -> "Tokens":
        q_seg = kv_seg = None
        if c.spec.segments:
            segb = max(c.q_seg.shape[0], c.kv_seg.shape[0])
            q_seg = row_tokens(jnp.broadcast_to(c.q_seg, (segb, tiling.t)), tiling)
            kv_seg = col_tokens(jnp.broadcast_to(c.kv_seg, (segb, tiling.s)), tiling.sp)
        return cls(row_tokens(c.q_pos, tiling), col_tokens(c.kv_pos, tiling.sp), q_seg, kv_seg)


def token_inputs(toks: Tokens, tiling: Tiling, q_block, kv_block) -> dict:
    """The named token operands of a launch over ``(b, kk, r, j)``:
    ``q_block(b, r, j, table)`` / ``kv_block(b, r, j, table)`` give the query /
    key block a step reads."""
    def rows(x):
        if x is None:
            return None
        fb = batch_index(x.shape[0])
        return operand(x, pl.BlockSpec((None, None, tiling.rows, 1),
                                       lambda b, kk, r, j, t: (fb(b), q_block(b, r, j, t), 0, 0)))

    def cols(x):
        if x is None:
            return None
        fb = batch_index(x.shape[0])
        return operand(x, pl.BlockSpec((None, 1, tiling.bk),
                                       lambda b, kk, r, j, t: (fb(b), 0, kv_block(b, r, j, t))))

    return dict(q_pos=rows(toks.q_pos), q_seg=rows(toks.q_seg), kv_pos=cols(toks.kv_pos),
                kv_seg=cols(toks.kv_seg))


def vmem_limit(tiling: Tiling, itemsize: int, *, backward: bool = False, resident: int = 0) -> int | None:
    """The scoped-VMEM limit a launch asks for: twice the estimate
    (`configs.splash_vmem_bytes`) plus ``resident`` bytes (the fused backward's
    whole-sequence dq, `configs.fused_dq_bytes`) when that exceeds the
    generation's default, capped at seven eighths of its VMEM; None when the
    default suffices."""
    generation = target_generation()
    need = 2 * splash_vmem_bytes(tiling.rows, tiling.bk, tiling.h, tiling.hv, itemsize, backward=backward)
    need += resident
    if need <= generation.scoped_vmem_bytes:
        return None
    return min(need, generation.vmem_bytes * 7 // 8)


# -- the forward kernel ----------------------------------------------------------------------
def lane_tile(x, width: int):
    """A lanes-equal ``[R, 128]`` float32 column as ``[R, width]``: whole-vreg copies along the
    lanes when ``width`` is a multiple of 128, its first ``width`` lanes when narrower (no lane
    broadcast: D=64), else a broadcast of its first lane."""
    if width % LANES == 0:
        return x if width == LANES else jnp.tile(x, (1, width // LANES))
    if width < LANES:
        return x[:, :width]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


#: Rows of a forward step computed as one piece: a step's rows are independent softmaxes, and
#: written as pieces the compiler overlaps one piece's exp pass with the next piece's matmuls.
ROW_CHUNK = 256


def row_chunk(rows: int) -> int:
    """The piece of a step's ``rows`` the forward kernel computes at once (`ROW_CHUNK`)."""
    return ROW_CHUNK if rows > ROW_CHUNK and rows % ROW_CHUNK == 0 else rows


#: Keys of a forward step computed as one sub-block: a larger kv block (2048) is computed 1024
#: keys at a time (the online softmax steps once per sub-block), so its logits pieces stay
#: ``256 × 1024`` while the step's fixed cost is paid once per 2048 keys.
KV_CHUNK = 1024


def kv_chunk(block_kv: int) -> int:
    """The sub-block of a step's ``block_kv`` keys the forward kernel computes at once (`KV_CHUNK`)."""
    return KV_CHUNK if block_kv > KV_CHUNK and block_kv % KV_CHUNK == 0 else block_kv


def softmax_step2(t, m_scr, l_scr):
    """One base-2 online-softmax step over ``t [R, C]`` (float32, ``-inf`` where masked) with the
    running max ``m_scr`` and sum ``l_scr`` (``[R, 128]`` refs, lanes equal; ``m`` finite, from
    `NEG_START`): updates both and returns ``(p [R, C], alpha [R, 128])`` with ``p = 2^(t - m')``
    and ``alpha = 2^(m - m')`` (module docstring)."""
    m_prev = m_scr[...]
    m_new = jnp.maximum(m_prev, jnp.max(t, axis=1, keepdims=True))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(t - lane_tile(m_new, t.shape[1]))
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p, axis=1, keepdims=True)
    m_scr[...] = m_new
    return p, alpha


def _forward_kernel(*, table, q, k, v, sinks, q_pos, kv_pos, q_seg, kv_seg, out, lse, visits, m_scr, l_scr,
                    acc_scr, count_scr, math_: TileMath, step: Step, lane_heads: int = 1):
    """One grid step ``(b, kk, i, j)``: block ``j`` of query block ``i``'s
    table row (module docstring). ``q [R, H]``, ``k [bk, H]``, ``v [bk, Hv]``,
    ``out [R, Hv]``, ``lse [R, 1]``; with ``lane_heads = G`` (`Layout.lane_heads`)
    ``q [bq, G·H]`` and ``out [bq, G·Hv]``, the ``G`` heads side by side in the lanes."""
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, NEG_START, F32)
        l_scr[...] = jnp.zeros(l_scr.shape, F32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, F32)
        if count_scr is not None:
            count_scr[0] = 0
            count_scr[1] = 0

    h, n_rows = q.shape[1] // lane_heads, acc_scr.shape[0]
    per_head = n_rows // lane_heads

    def pieces():
        """``(q rows, [q lanes, ...], scratch rows)`` of each piece of the step (`row_chunk`):
        head ``g`` of a direct head group is lanes ``g·H ..`` of the block, rows ``g·bq ..``
        of the scratch (the grouped row order); heads shorter than a piece join it whole,
        their rows stacked (``k`` heads per piece, consecutive scratch rows)."""
        chunk = row_chunk(per_head)
        together = 1
        if chunk == per_head and lane_heads > 1:
            together = max(1, min(lane_heads, ROW_CHUNK // per_head))
            while lane_heads % together:
                together -= 1
        for g0 in range(0, lane_heads, together):
            for r0 in range(0, per_head, chunk):
                lanes = [slice(g * h, (g + 1) * h) for g in range(g0, g0 + together)]
                start = g0 * per_head + r0
                yield slice(r0, r0 + chunk), lanes, slice(start, start + together * chunk)

    def update_rows(mask, keys: slice, rows: slice, lanes: list, scr: slice):
        q_piece = q[rows, lanes[0]] if len(lanes) == 1 else jnp.concatenate([q[rows, x] for x in lanes], axis=0)
        t, _ = math_.logits2(q_piece, k[keys, :])
        if mask is not None:
            qs = None if q_seg is None or not mask.segments else q_seg[scr, :]
            ks = None if kv_seg is None or not mask.segments else kv_seg[:, keys]
            ok = math_.visible(step.block(table, b, i, j), q_pos[scr, :], kv_pos[:, keys], qs, ks,
                               offset=keys.start, spec=mask)
            if ok is not None:
                t = jnp.where(ok, t, -jnp.inf)
        p, alpha = softmax_step2(t, m_scr.at[scr, :], l_scr.at[scr, :])
        acc_scr[scr, :] = (acc_scr[scr, :] * lane_tile(alpha, acc_scr.shape[1])
                           + math_.dot(p.astype(v.dtype), v[keys, :]))

    def update(mask):
        """The step's body; ``mask``: None (FULL) or the part of the mask to evaluate (`Step.visit`)."""
        bk = k.shape[0]
        sub = kv_chunk(bk)
        for c0 in range(0, bk, sub):
            for piece in pieces():
                update_rows(mask, slice(c0, c0 + sub), *piece)
        if count_scr is not None:
            count_scr[0] += 1
            count_scr[1] += 1 if mask is None else 0

    step.visit(table, b, i, j, update)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        m, l, acc = m_scr[...], l_scr[...], acc_scr[...]
        if sinks is not None:
            sink = sinks[...] * F32(LOG2E)
            m_new = jnp.maximum(m, sink)
            alpha = jnp.exp2(m - m_new)
            l = l * alpha + jnp.exp2(sink - m_new)
            acc = acc * lane_tile(alpha, acc.shape[1])
            m = m_new
        positive = l > 0
        l_safe = jnp.where(positive, l, 1.0)
        inv = jnp.where(positive, 1.0 / l_safe, 0.0)
        normalized = (acc * lane_tile(inv, acc.shape[1])).astype(out.dtype)
        if lane_heads == 1:
            out[...] = normalized
        else:
            hv = acc.shape[1]
            for g in range(lane_heads):
                out[:, g * hv:(g + 1) * hv] = normalized[g * per_head:(g + 1) * per_head]
        m1, l1, positive1 = m[:, :1], l_safe[:, :1], positive[:, :1]
        lse[...] = jnp.where(positive1, m1 * F32(LN2) + math_.log(l1), -jnp.inf)
        if visits is not None:
            visits[...] = jnp.full(visits.shape, count_scr[0] * 65536 + count_scr[1], jnp.int32)


def forward(c, config, *, debug: bool = False):
    """``(out [B, T, N, Hv], lse [B, N, T] float32)`` of canonical operands ``c``
    (`base.Canonical`, no dense bias/mask); with ``debug`` also the kv blocks
    each query row's kernel step computed, ``[B, N, T]`` int32
    ``visited·65536 + unmasked``."""
    tiling = Tiling.of(c, config.block_q, config.block_kv)
    t_ = tiling
    math_ = TileMath.of(c, tiling)
    table, step, width = schedule(c, tiling)
    toks = Tokens.of(c, tiling)
    col = lambda b, i, j, tab: step.block(tab, b, i, j)
    rows = lambda d: pl.BlockSpec((None, None, None, t_.rows, d), lambda b, kk, i, j, tab: (b, kk, i, 0, 0))
    layout = Layout(tiling, lambda b, i, j, tab: i, col, heads_in_lanes=True)
    stat = lambda dtype: output((t_.b, t_.kh, t_.nq, t_.rows, 1), dtype, rows(1))
    sinks = None
    if c.sinks is not None:
        sinks = operand(sink_rows(c.sinks, tiling),
                        pl.BlockSpec((None, t_.rows, 1), lambda b, kk, i, j, tab: (kk, 0, 0)))
    itemsize = jnp.dtype(c.q.dtype).itemsize
    outs = tpu_kernel_call(
        functools.partial(_forward_kernel, math_=math_, step=step, lane_heads=layout.lane_heads),
        grid=(t_.b, t_.kh, t_.nq, width),
        scalar_prefetch=dict(table=table),
        inputs=dict(q=layout.rows_in(c.q), k=layout.keys_in(c.k), v=layout.keys_in(c.v),
                    sinks=sinks,
                    **token_inputs(toks, tiling, lambda b, i, j, tab: i, col)),
        outputs=dict(out=layout.rows_out(t_.hv, c.q.dtype),
                     lse=stat(F32), visits=stat(jnp.int32) if debug else None),
        scratch=dict(m_scr=pltpu.VMEM((t_.rows, LANES), F32), l_scr=pltpu.VMEM((t_.rows, LANES), F32),
                     acc_scr=pltpu.VMEM((t_.rows, t_.hv), F32),
                     count_scr=pltpu.SMEM((2,), jnp.int32) if debug else None),
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(tiling, itemsize),
        name="stellax_splash_attention_forward",
    )
    out, lse = layout.rows_result(outs.out), ungroup_stats(outs.lse, tiling)
    if debug:
        return out, lse, ungroup_stats(outs.visits, tiling)
    return out, lse
