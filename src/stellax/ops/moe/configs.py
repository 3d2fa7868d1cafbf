"""Configs of the grouped-matmul implementations: tiles, warps, stages.

* `GroupedMatmulConfig` (Triton): the forward/dlhs kernel tiles the output in
  ``[block_m, block_n]`` (``block_m`` rows of one group) and steps ``block_k``
  along the contraction; the ``tgmm`` kernel tiles the ``[K, N]`` output of a
  group in ``[block_k, block_n]`` and steps ``block_m`` rows of the group.
* `XlaGroupedMatmulConfig`: the row tile of the XLA loop (`xla.py`).
* `TpuGroupedMatmulConfig` (Mosaic TPU): ``block_m`` rows (128 … 1024) ×
  ``block_k`` × ``block_n`` (128 … 2048). A grid step holds, double-buffered,
  an ``lhs`` tile ``[bm, bk]``, one (two for gated weights) ``rhs`` tiles
  ``[bk, bn]`` and the output (and pre-activation) tiles ``[bm, bn]``, plus
  float32 accumulators ``[bm, bn]`` and the step's float32 product
  (`gmm_tpu_vmem_need`). Blocks past three quarters of the generation's
  scoped-VMEM default make the kernel raise ``vmem_limit_bytes``
  (`tpu_vmem_limit`); the spaces hold every config within half the physical
  VMEM (`tpu_space_budget`: 64 MiB on v5e and v6e, 32 MiB on v5p and TPU7x).
  `ragged_dot_tgmm` (the weight gradient) uses the config with other roles:
  its output block is ``[bk, bn]`` (of ``out[g]``, double-buffered in the
  output dtype, plus its float32 accumulator) and each step streams
  ``[bm, bk]`` rows of ``lhs`` and ``[bm, bn]`` rows of ``rhs``
  (`tgmm_tpu_vmem_need`). The heuristics minimise a cost model
  (`gmm_tpu_cost`, `tgmm_tpu_cost`: MXU time, HBM traffic and grid steps with
  v5e's rates) over the configs within `tpu_heuristic_budget`; the forward,
  its dlhs (a transposed-rhs call: K and N swapped) and the tgmm are separate
  calls, each resolved (tuned cache, then heuristic) by its own shapes.

Heuristics and spaces for `ragged_dot`, `ragged_dot_tgmm` and the quantized
`ragged_dot` (whose ``block_k`` is capped at the scales' K block).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, next_power_of_two, product_space
from ...core.config import MatmulTileConfig, require_in
from ...core.platform import target_generation
from ...core.tpu import TPU_GENERATIONS

#: Shared memory a Triton program may use on sm_90 / sm_80 (bytes), minus slack.
SMEM_BUDGET = 200 * 1024


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig(MatmulTileConfig):
    """Tiles of the Triton grouped-matmul kernels (every dimension one of 16 … 256)."""


@dataclasses.dataclass(frozen=True)
class XlaGroupedMatmulConfig(KernelConfig):
    """``block_m`` rows of one group per step of the XLA loop."""

    block_m: int = 128

    def validate(self) -> None:
        """``block_m`` must be one of 8 … 512 (a power of two)."""
        require_in("XlaGroupedMatmulConfig", "block_m", self.block_m, (8, 16, 32, 64, 128, 256, 512))


# -- shapes of a call -------------------------------------------------------------
def gmm_dims(call: Call) -> tuple[int, int, int, int, bool]:
    """``(M, K, N_total, G_local, gated)`` of a `ragged_dot` call (``N_total``
    counts both halves of a gated rhs)."""
    m, k = call.lhs.shape
    rhs = call.rhs
    if call.transpose_rhs:
        g, n, _ = rhs.shape
        return m, k, n, g, False
    gated = rhs.ndim == 4
    n = rhs.shape[-1] * (2 if gated else 1)
    return m, k, n, rhs.shape[0], gated


def tgmm_dims(call: Call) -> tuple[int, int, int, int]:
    """``(M, K, N, G_local)`` of a `ragged_dot_tgmm` call."""
    if call.transpose_lhs:
        m, k = call.lhs.shape
    else:
        k, m = call.lhs.shape
    return m, k, call.rhs.shape[1], call.num_local_groups


def _itemsize(call: Call) -> int:
    return np.dtype(call.lhs.dtype).itemsize


def cap_block(block: int, dim: int) -> int:
    """The largest useful block for a dimension of size ``dim`` (≥ 16)."""
    return max(16, min(block, next_power_of_two(dim)))


def _smem(bm: int, bn: int, bk: int, stages: int, itemsize: int, b_tiles: int = 1) -> int:
    return stages * (bm * bk + b_tiles * bk * bn) * itemsize


# -- forward / dlhs kernel -----------------------------------------------------------
def gmm_heuristic(call: Call) -> GroupedMatmulConfig:
    """The `ragged_dot` Triton tiles: ``block_m`` ≈ rows per group, the widest ``block_n`` of the
    output (halved for a gated rhs), stages cut to the shared-memory budget."""
    m, k, n, g, gated = gmm_dims(call)
    rows_per_group = max(1, m // max(g, 1))
    bm = cap_block(16 if rows_per_group <= 16 else 32 if rows_per_group <= 32 else 64 if rows_per_group <= 96
                   else 128, m)
    half_n = n // 2 if gated else n
    bn = cap_block(64 if gated else 128, half_n)
    bk = cap_block(32 if _itemsize(call) >= 4 else 64, k)
    warps = 8 if bm * bn * (2 if gated else 1) >= 128 * 128 else 4
    stages = 3
    while stages > 1 and _smem(bm, bn, bk, stages, _itemsize(call), 2 if gated else 1) > SMEM_BUDGET:
        stages -= 1
    return GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def gmm_space(call: Call) -> list[GroupedMatmulConfig]:
    """The `ragged_dot` Triton autotuning space, capped at the call's dimensions and the shared memory."""
    m, k, n, _, gated = gmm_dims(call)
    half_n = n // 2 if gated else n
    configs = product_space(GroupedMatmulConfig, block_m=(16, 32, 64, 128), block_n=(64, 128, 256),
                            block_k=(32, 64), num_warps=(4, 8), num_stages=(3, 4))
    out = []
    for c in configs:
        if c.block_m > cap_block(128, m) or c.block_n > cap_block(256, half_n) or c.block_k > cap_block(64, k):
            continue
        if _smem(c.block_m, c.block_n, c.block_k, c.num_stages, _itemsize(call), 2 if gated else 1) > SMEM_BUDGET:
            continue
        if c.num_warps == 8 and c.block_m * c.block_n < 64 * 128:
            continue
        out.append(c)
    return out or [gmm_heuristic(call)]


# -- tgmm kernel ------------------------------------------------------------------------
def tgmm_heuristic(call: Call) -> GroupedMatmulConfig:
    """The `ragged_dot_tgmm` Triton tiles: ``[block_k, block_n]`` outputs, ``block_m`` rows per step."""
    m, k, n, g = tgmm_dims(call)
    rows_per_group = max(1, m // max(g, 1))
    bm = cap_block(32 if rows_per_group <= 32 else 64, m)
    bk = cap_block(64 if _itemsize(call) >= 4 else 128, k)
    bn = cap_block(64 if _itemsize(call) >= 4 else 128, n)
    warps = 8 if bk * bn >= 128 * 128 else 4
    stages = 3
    while stages > 1 and _smem(bk, bn, bm, stages, _itemsize(call)) > SMEM_BUDGET:
        stages -= 1
    return GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def tgmm_space(call: Call) -> list[GroupedMatmulConfig]:
    """The `ragged_dot_tgmm` Triton autotuning space, capped at the call's dimensions and the shared memory."""
    m, k, n, _ = tgmm_dims(call)
    configs = product_space(GroupedMatmulConfig, block_m=(32, 64), block_n=(64, 128), block_k=(64, 128),
                            num_warps=(4, 8), num_stages=(2, 3))
    out = [c for c in configs
           if c.block_m <= cap_block(64, m) and c.block_n <= cap_block(128, n) and c.block_k <= cap_block(128, k)
           and _smem(c.block_k, c.block_n, c.block_m, c.num_stages, _itemsize(call)) <= SMEM_BUDGET]
    return out or [tgmm_heuristic(call)]


# -- XLA loop -----------------------------------------------------------------------------
def xla_block(m: int, g: int) -> XlaGroupedMatmulConfig:
    """Row tile ≈ rows per group (capped at 128, measured best on CPU): the
    last tile of a group is padding, so small groups want small tiles."""
    rows_per_group = max(1, m // max(g, 1))
    return XlaGroupedMatmulConfig(block_m=int(min(128, max(16, next_power_of_two(rows_per_group)))))


def gmm_xla_heuristic(call: Call) -> XlaGroupedMatmulConfig:
    """The XLA row tile of a `ragged_dot` call (`xla_block`)."""
    m, _, _, g, _ = gmm_dims(call)
    return xla_block(m, g)


def tgmm_xla_heuristic(call: Call) -> XlaGroupedMatmulConfig:
    """The XLA row tile of a `ragged_dot_tgmm` call (`xla_block`)."""
    m, _, _, g = tgmm_dims(call)
    return xla_block(m, g)


def xla_space(call: Call) -> list[XlaGroupedMatmulConfig]:
    """Row tiles 32 … 256 of the XLA loop."""
    return [XlaGroupedMatmulConfig(block_m=b) for b in (32, 64, 128, 256)]


# -- quantized ragged_dot ----------------------------------------------------------------
def quantized_dims(call: Call) -> tuple[int, int, int, int]:
    """``(M, K, N, G_local)`` of a quantized `ragged_dot` call."""
    g, k, n = call.rhs_shape
    return call.lhs.shape[0], k, n, g


def quantized_k_block(call: Call) -> int | None:
    """The K block of the quantized weights' scales, or None when per channel (one scale row)."""
    return None if call.rhs_scales.shape[1] == 1 else call.rhs_block_shape[1]


def effective_block_k(config: GroupedMatmulConfig, k_block: int | None) -> int:
    """``block_k`` capped at the scales' K block, so a step reads one scale row."""
    return config.block_k if k_block is None else min(config.block_k, k_block)


def quantized_heuristic(call: Call) -> GroupedMatmulConfig:
    """The quantized `ragged_dot` Triton tiles (``block_k`` is capped at the scales' K block at launch)."""
    m, k, n, g = quantized_dims(call)
    rows_per_group = max(1, m // max(g, 1))
    bm = cap_block(16 if rows_per_group <= 16 else 32 if rows_per_group <= 32 else 64, m)
    bn = cap_block(128, n)
    bk = cap_block(64, k)
    return GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4 if bm * bn < 64 * 128 else 8,
                               num_stages=3)


def quantized_space(call: Call) -> list[GroupedMatmulConfig]:
    """A modest space: the effective block_k is capped at the K block, so
    configs that collapse to the same kernel are dropped."""
    m, k, n, _ = quantized_dims(call)
    kb = quantized_k_block(call)
    out, seen = [], set()
    for c in product_space(GroupedMatmulConfig, block_m=(16, 64), block_n=(64, 128), block_k=(32, 64),
                           num_warps=(4,), num_stages=(3,)):
        if c.block_m > cap_block(64, m) or c.block_n > cap_block(128, n) or c.block_k > cap_block(64, k):
            continue
        key = (c.block_m, c.block_n, effective_block_k(c, kb))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out or [quantized_heuristic(call)]


def quantized_xla_heuristic(call: Call) -> XlaGroupedMatmulConfig:
    """The XLA row tile of a quantized `ragged_dot` call (`xla_block`)."""
    m, _, _, g = quantized_dims(call)
    return xla_block(m, g)


# -- Mosaic TPU ------------------------------------------------------------------------------
#: Row tiles of the Mosaic TPU grouped matmuls.
M_TILES = (128, 256, 512, 1024)
#: Contraction and column tiles (2048 where the VMEM allows: the kernels raise ``vmem_limit_bytes``).
KN_TILES = (128, 256, 512, 1024, 2048)
#: The quantized kernel's tiles (every dimension; its space stays within the scoped VMEM default).
TILES = (128, 256, 512, 1024)
#: The quantized heuristic chooses among tiles up to 512.
HEURISTIC_TILE_MAX = 512

#: The heuristics' cost model (`gmm_tpu_cost`, `tgmm_tpu_cost`): a v5e's bfloat16 MXU peak and HBM
#: bandwidth, and the fixed cost of one grid step (only their ratios steer the choice).
PEAK_FLOPS = 197e12
HBM_BYTES_PER_S = 819e9
STEP_SECONDS = 0.35e-6
#: Rows-equivalent cost of a step's float32 accumulator read-modify-write (``[rows, bn]`` per
#: ``contraction`` of a step): `mxu_seconds` charges ``ACCUMULATOR_ROWS / contraction``
#: extra. Fitted on the v5e's balanced DeepSeek-like tgmm (M=16384, K=7168, N=2048, G=64):
#: (128, 1024, 2048) 5.92 ms against (256, 1024, 2048) 4.74 ms (2026-12-06); the skewed
#: case's tgmm then comes out within 10 % of the chip at 128, 256 and 512 rows.
ACCUMULATOR_ROWS = 96


@dataclasses.dataclass(frozen=True)
class TpuGroupedMatmulConfig(KernelConfig):
    """``block_m`` rows × ``block_k`` × ``block_n`` columns per grid step."""

    block_m: int = 128
    block_k: int = 256
    block_n: int = 256

    def validate(self) -> None:
        """``block_m`` one of `M_TILES` (128 … 1024); ``block_k`` and ``block_n`` multiples of 128
        from 128 to 2048 (the spaces hold `KN_TILES` and a dimension's own length, `whole_tile`)."""
        require_in("TpuGroupedMatmulConfig", "block_m", self.block_m, M_TILES)
        for name in ("block_k", "block_n"):
            value = getattr(self, name)
            if not isinstance(value, int) or value % 128 or not KN_TILES[0] <= value <= KN_TILES[-1]:
                raise ValueError(f"TpuGroupedMatmulConfig.{name}: expected a multiple of 128 from {KN_TILES[0]} "
                                 f"to {KN_TILES[-1]}, got {value!r}")


def _round_up(x: int, to: int) -> int:
    return max(to, -(-x // to) * to)


def gmm_tpu_vmem_need(bm: int, bk: int, bn: int, *, halves: int, itemsize: int, out_itemsize: int,
                      outputs: int) -> int:
    """VMEM bytes of one `ragged_dot` grid step: double-buffered ``lhs [bm, bk]`` and ``halves``
    ``rhs [bk, bn]`` tiles, ``outputs`` double-buffered ``[bm, bn]`` output blocks (the output and
    the pre-activation's halves), the float32 accumulators and the float32 product of a step."""
    operands = 2 * (bm * bk + halves * bk * bn) * itemsize
    return operands + 2 * bm * bn * out_itemsize * outputs + 2 * halves * bm * bn * 4


def tgmm_tpu_vmem_need(bm: int, bk: int, bn: int, *, itemsize: int, out_itemsize: int) -> int:
    """VMEM bytes of one `ragged_dot_tgmm` grid step: double-buffered ``lhs [bm, bk]`` and
    ``rhs [bm, bn]`` tiles (and their masked copies), the double-buffered ``out [bk, bn]``
    block, the float32 accumulator and the float32 product of a step."""
    return 3 * bm * (bk + bn) * itemsize + 2 * bk * bn * out_itemsize + 2 * bk * bn * 4


def tpu_vmem_limit(need: int) -> int | None:
    """The ``vmem_limit_bytes`` a kernel needing ``need`` bytes asks for: ``None`` (the
    compiler's scoped default) while three quarters of that default hold it, else half as
    much again as the need (the compiler's own temporaries), capped at three quarters of
    the generation's physical VMEM."""
    generation = target_generation()
    if need <= generation.scoped_vmem_bytes * 3 // 4:
        return None
    return int(min(need + need // 2, generation.vmem_bytes * 3 // 4))


def tpu_space_budget() -> int:
    """The VMEM a config of the float spaces may need (`TpuGeneration.tuning_vmem_bytes`), so that
    its `tpu_vmem_limit` fits."""
    return target_generation().tuning_vmem_bytes


def tpu_heuristic_budget() -> int:
    """The VMEM a heuristic config may need (`TpuGeneration.heuristic_vmem_bytes`)."""
    return target_generation().heuristic_vmem_bytes


def gmm_tpu_vmem(call: Call, c: TpuGroupedMatmulConfig) -> int:
    """VMEM bytes of one grid step's buffers for ``call`` (`gmm_tpu_vmem_need`, with both the
    output and the pre-activation)."""
    _, _, _, _, gated = gmm_dims(call)
    halves = 2 if gated else 1
    return gmm_tpu_vmem_need(c.block_m, c.block_k, c.block_n, halves=halves, itemsize=_itemsize(call),
                             out_itemsize=np.dtype(call.out_dtype).itemsize, outputs=1 + halves)


def _useful(call: Call, c: TpuGroupedMatmulConfig) -> bool:
    m, k, n, _, gated = gmm_dims(call)
    n_out = n // 2 if gated else n
    return (c.block_m <= _round_up(m, 128) and c.block_k <= _round_up(k, 128)
            and c.block_n <= _round_up(n_out, 128))


def whole_tile(dim: int) -> tuple[int, ...]:
    """``(dim,)`` when one block can hold the whole dimension and `KN_TILES` has no such block
    (a multiple of 128 up to 2048 that is no power of two, e.g. N = 1408 or 768), else ``()``.

    Such a block has no padded columns for the MXU to multiply (1408 in 2048-blocks wastes 31 %,
    in 512-blocks 8 %), and as ``block_k`` it makes the contraction one step, so consecutive
    visits of a group keep their ``rhs`` block (read once per group); as ``block_n`` one column
    block, so ``lhs`` is read once."""
    return (dim,) if dim % 128 == 0 and KN_TILES[0] < dim < KN_TILES[-1] and dim not in KN_TILES else ()


def _fitting_tiles(call: Call, useful, vmem, k: int, n: int) -> list[TpuGroupedMatmulConfig]:
    """The ``M_TILES × KN_TILES²`` configs (with the call's whole ``k`` and ``n`` as blocks too,
    `whole_tile`) that ``useful(call, c)`` keeps and whose ``vmem(call, c)`` fits
    `tpu_space_budget` (128³ when none does)."""
    budget = tpu_space_budget()
    configs = product_space(TpuGroupedMatmulConfig, block_m=M_TILES, block_k=KN_TILES + whole_tile(k),
                            block_n=KN_TILES + whole_tile(n))
    kept = [c for c in configs if useful(call, c) and vmem(call, c) <= budget]
    return kept or [TpuGroupedMatmulConfig(128, 128, 128)]


def _heuristic_pool(space: list[TpuGroupedMatmulConfig]) -> list[TpuGroupedMatmulConfig]:
    """The configs of ``space`` the quantized heuristic may pick: every tile at most `HEURISTIC_TILE_MAX`."""
    small = [c for c in space if max(c.block_m, c.block_k, c.block_n) <= HEURISTIC_TILE_MAX]
    return small or space


def visits_estimate(m: int, groups: int, block_m: int) -> int:
    """Visits of the ``block_m``-row tiles of ``m`` rows by ``groups`` groups of unknown sizes
    (`mosaic_tpu.tile_visits`): every tile once, plus one for every group boundary, each
    assumed inside a tile (the usual case for routed sizes; balanced sizes that are
    multiples of the tile do better)."""
    return -(-m // block_m) + max(groups - 1, 0)


def mxu_seconds(flops: float, streamed: int, contraction: int) -> float:
    """Modelled MXU seconds of ``flops`` done as ``[streamed, contraction] @ [contraction, n]``
    steps: the peak rate, slowed by the weight-stationary MXU's fill (each ``mxu × mxu`` weight
    tile is loaded, about ``mxu`` cycles, for ``streamed`` rows pushed through it: 128-row gmm
    tiles run at half the rate, 256 at two thirds — the v5e measured 67 % of peak for the
    forward at 256 rows, and 128-row dlhs tiles 1.30x slower than 256) and by the float32
    accumulator's update per step (`ACCUMULATOR_ROWS`)."""
    mxu = target_generation().mxu
    return flops / PEAK_FLOPS * (1 + mxu / streamed + ACCUMULATOR_ROWS / contraction)


def _seconds(mxu: float, nbytes: float, steps: float) -> float:
    return max(mxu, nbytes / HBM_BYTES_PER_S) + steps * STEP_SECONDS


def gmm_tpu_cost(call: Call, c: TpuGroupedMatmulConfig) -> float:
    """Modelled seconds of a `ragged_dot` call with ``c``: MXU work (every visit computes its
    whole tile, K and N rounded up to the blocks: edge blocks are computed whole; at the rate
    of `mxu_seconds`, ``block_m`` rows streamed), HBM traffic and grid steps, with the visits
    of `visits_estimate`.

    Traffic: the output once; with several K steps, for every column block each visit
    re-reads its ``lhs`` row tile and its group's ``rhs [K, bn]`` column block (K is the
    innermost grid axis, so block indices change at every step); with a single K step
    (``block_k >= K``) the blocks of consecutive visits of one group (``rhs``) or one tile
    (``lhs``) have the same index and are not copied again: each column block reads
    ``lhs`` once and every group's ``rhs`` once."""
    m, k, n_total, g, gated = gmm_dims(call)
    halves = 2 if gated else 1
    n = n_total // halves
    kp, np_ = _round_up(k, c.block_k), _round_up(n, c.block_n)
    visits = visits_estimate(m, g, c.block_m)
    columns = np_ // c.block_n
    item, out_item = _itemsize(call), np.dtype(call.out_dtype).itemsize
    flops = 2.0 * visits * c.block_m * kp * np_ * halves
    if kp == c.block_k:
        lhs_reads, rhs_reads = _round_up(m, c.block_m), min(visits, g)
    else:
        lhs_reads, rhs_reads = visits * c.block_m, visits
    nbytes = (columns * lhs_reads * kp * item + rhs_reads * kp * np_ * halves * item + m * np_ * out_item)
    return _seconds(mxu_seconds(flops, c.block_m, c.block_k), nbytes, columns * visits * (kp // c.block_k))


def _megacore_ok(parallel_blocks: int, extent: int) -> bool:
    """Two TensorCores per device (v5p) split the parallel grid axes: keep at least two blocks
    there when the dimension allows it (``extent`` above one 128-wide block)."""
    return target_generation().cores_per_chip < 2 or parallel_blocks >= 2 or extent <= 128


def _cheapest(space, cost, vmem, parallel, budget: int | None = None):
    """The config of ``space`` with the least modelled ``cost`` among those within ``budget``
    VMEM bytes (default `tpu_heuristic_budget`), at least the MXU width in K and N where the
    space has such, and splittable across megacore TensorCores (``parallel(c) -> (blocks,
    extent)``); near ties (within 2 %) go to the smaller VMEM need."""
    mxu = target_generation().mxu
    budget = tpu_heuristic_budget() if budget is None else budget
    pool = [c for c in space if vmem(c) <= budget] or space
    wide = [c for c in pool if c.block_k >= mxu and c.block_n >= mxu]
    pool = wide or pool
    pool = [c for c in pool if _megacore_ok(*parallel(c))] or pool
    return min(pool, key=lambda c: (round(float(np.log(cost(c))) / float(np.log(1.02))), vmem(c),
                                    -c.block_n, -c.block_k, -c.block_m))


def gmm_tpu_space(call: Call) -> list[TpuGroupedMatmulConfig]:
    """Row tiles of 128–1024 and K/N tiles of 128–2048 that the call's dimensions can use and
    whose VMEM fits `tpu_space_budget` (the kernel raises its VMEM limit to match)."""
    _, k, n_total, _, gated = gmm_dims(call)
    return _fitting_tiles(call, _useful, gmm_tpu_vmem, k, n_total // (2 if gated else 1))


def gmm_tpu_heuristic(call: Call) -> TpuGroupedMatmulConfig:
    """The config of the space `gmm_tpu_cost` rates fastest within `tpu_heuristic_budget`
    (`_cheapest`). This is the forward's and, on the dlhs call (``transpose_rhs``: K and N
    are the forward's N and K), the backward's own choice — each call is keyed and tuned
    by its own shapes. Big K and N go to big blocks (e.g. 256 × 1024 × 2048 at M = 16384,
    K = 7168, N = 2048, G = 64 on a v5e: few grid steps, ``lhs`` read once), the row tile
    follows the mean group size (rows past a group's end in its last tile are computed for
    nothing)."""
    m, k, n_total, _, gated = gmm_dims(call)
    n = n_total // (2 if gated else 1)
    return _cheapest(gmm_tpu_space(call), lambda c: gmm_tpu_cost(call, c), lambda c: gmm_tpu_vmem(call, c),
                     lambda c: (-(-n // c.block_n), n))


def gmm_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU grouped matmul cannot run ``call`` (None when it can)."""
    dtype = np.dtype(call.lhs.dtype)
    if dtype.name not in ("float32", "bfloat16"):
        return f"the Mosaic TPU grouped matmul needs float32/bfloat16 operands, got {dtype.name}"
    return None


# -- ragged_dot_tgmm -----------------------------------------------------------------------
def tgmm_tpu_vmem(call: Call, c: TpuGroupedMatmulConfig) -> int:
    """VMEM bytes of one `ragged_dot_tgmm` grid step (`tgmm_tpu_vmem_need`)."""
    return tgmm_tpu_vmem_need(c.block_m, c.block_k, c.block_n, itemsize=_itemsize(call),
                              out_itemsize=np.dtype(call.out_dtype).itemsize)


def _tgmm_useful(call: Call, c: TpuGroupedMatmulConfig) -> bool:
    m, k, n, _ = tgmm_dims(call)
    return c.block_m <= _round_up(m, 128) and c.block_k <= _round_up(k, 128) and c.block_n <= _round_up(n, 128)


def tgmm_tpu_space(call: Call) -> list[TpuGroupedMatmulConfig]:
    """Row tiles of 128–1024 and K/N tiles of 128–2048 that the `ragged_dot_tgmm` call can
    use and whose VMEM fits `tpu_space_budget`."""
    _, k, n, _ = tgmm_dims(call)
    return _fitting_tiles(call, _tgmm_useful, tgmm_tpu_vmem, k, n)


def tgmm_tpu_cost(call: Call, c: TpuGroupedMatmulConfig) -> float:
    """Modelled seconds of a `ragged_dot_tgmm` call with ``c``: MXU work (whole tiles per
    visit, at the rate of `mxu_seconds`: ``block_n`` rows streamed, ``block_m`` contracted),
    HBM traffic (for every ``[bk, bn]`` output block the visited rows of ``lhs`` and ``rhs``;
    the ``[G, K, N]`` output once) and grid steps (`visits_estimate` visits per output block).

    The streamed side is ``block_n``: on the v5e the tgmm's times followed it, not ``block_k``
    (skewed M=32768 K=2048 N=1408: (256, 2048, 1408) 2.44 ms, (256, 1024, 1408) 2.53 ms;
    Mixtral-like: (512, 1024, 2048) 11.58 ms, (256, 1024, 2048) 12.10 ms, (512, 2048, 512)
    12.42 ms), which libtpu's schedule of the step agrees with (docs/moe.md)."""
    m, k, n, g = tgmm_dims(call)
    kp, np_ = _round_up(k, c.block_k), _round_up(n, c.block_n)
    visits = visits_estimate(m, g, c.block_m)
    blocks = (kp // c.block_k) * (np_ // c.block_n)
    item, out_item = _itemsize(call), np.dtype(call.out_dtype).itemsize
    flops = 2.0 * visits * c.block_m * kp * np_
    nbytes = blocks * visits * c.block_m * (c.block_k + c.block_n) * item + g * kp * np_ * out_item
    # out[bk, bn] += lhs[g]ᵀ[bk, bm] @ rhs[bm, bn], bm contracted per step.
    return _seconds(mxu_seconds(flops, c.block_n, c.block_m), nbytes, blocks * visits)


def tgmm_tpu_heuristic_budget() -> int:
    """The VMEM a tgmm heuristic config may need: a quarter more than `tpu_heuristic_budget`,
    within `tpu_space_budget` (40 MiB on v5e and v6e, 20 on v5p, 32 on TPU7x). The v5e's
    fastest Mixtral-like tgmm, (512, 1024, 2048), is modelled at 33 MiB (`tgmm_tpu_vmem_need`):
    it compiled and ran with the raised VMEM limit its need asks for (`tpu_vmem_limit`)."""
    return min(tpu_heuristic_budget() * 5 // 4, tpu_space_budget())


#: The tgmm heuristic's least row tile (where the call has that many rows). On the v5e, 128- and
#: 256-row tiles ran the skewed (Dirichlet 0.3, routed-like) tgmm at the same speed (2.54 / 2.56 ms
#: at (·, 1024, 1408)) while the cost model, which puts every group boundary inside a tile, rated
#: 128 rows up to 4 % faster; on balanced sizes (boundaries on tile edges) 256 rows ran 1.25x
#: faster (DeepSeek-like, (·, 1024, 2048): 4.74 / 5.92 ms).
TGMM_MIN_ROWS = 256


def tgmm_tpu_heuristic(call: Call) -> TpuGroupedMatmulConfig:
    """The `ragged_dot_tgmm` config of its space that `tgmm_tpu_cost` rates fastest within
    `tgmm_tpu_heuristic_budget` (`_cheapest`), with row tiles of at least `TGMM_MIN_ROWS`: a large
    ``[bk, bn]`` output block (each row of ``lhs``/``rhs`` is read once per output block),
    the row tile following the mean group size (a tile straddling two groups is visited, and
    multiplied, twice)."""
    _, k, n, _ = tgmm_dims(call)
    space = tgmm_tpu_space(call)
    space = [c for c in space if c.block_m >= TGMM_MIN_ROWS] or space
    return _cheapest(space, lambda c: tgmm_tpu_cost(call, c), lambda c: tgmm_tpu_vmem(call, c),
                     lambda c: (-(-k // c.block_k) * -(-n // c.block_n), max(k, n)),
                     budget=tgmm_tpu_heuristic_budget())


# -- the quantized ragged_dot (`mosaic_tpu_quantized.py`) ------------------------------------
#: Element formats whose codes are float8: DMA'd as fp8, so they need a generation with float8.
FP8_ELEMENT_FORMATS = ("fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2")


def _quantized_fits(call: Call, c: TpuGroupedMatmulConfig) -> bool:
    """``block_k`` and the scales' K block divide one another; 4-bit codes need ``block_k`` ≥ 256."""
    kb = quantized_k_block(call)
    if call.rhs_values.dtype == np.uint8 and c.block_k < 256:
        return False
    return kb is None or c.block_k % kb == 0 or kb % c.block_k == 0


def quantized_tpu_vmem(call: Call, c: TpuGroupedMatmulConfig) -> int:
    """VMEM bytes of one quantized grid step: double-buffered ``lhs`` tile, code tile
    (``[bk/2, bn]`` bytes for 4-bit), scale (and zero-point) rows and output tile, the
    float32 accumulator, and the decoded weight (float32 and the compute dtype)."""
    item = np.dtype(call.lhs.dtype).itemsize
    kb = quantized_k_block(call)
    packed = call.rhs_values.dtype == np.uint8
    codes = c.block_k * c.block_n // (2 if packed else 1)
    rows = 1 if kb is None else max(1, c.block_k // kb)
    scales = rows * c.block_n * 4 * (2 if call.rhs_zero_points is not None else 1)
    out = c.block_m * c.block_n * np.dtype(call.out_dtype).itemsize
    decoded = c.block_k * c.block_n * (4 + item)
    return 2 * (c.block_m * c.block_k * item + codes + scales + out) + c.block_m * c.block_n * 4 + decoded


def quantized_tpu_space(call: Call) -> list[TpuGroupedMatmulConfig]:
    """Tiles of 128–1024 the call can use (`_quantized_fits`) within the generation's scoped VMEM."""
    m, k, n, _ = quantized_dims(call)
    budget = target_generation().scoped_vmem_bytes
    configs = product_space(TpuGroupedMatmulConfig, block_m=TILES, block_k=TILES, block_n=TILES)
    kept = [c for c in configs if _quantized_fits(call, c) and quantized_tpu_vmem(call, c) <= budget
            and c.block_m <= _round_up(m, 128) and c.block_k <= max(_round_up(k, 128), 256)
            and c.block_n <= _round_up(n, 128)]
    return kept or [c for c in configs if _quantized_fits(call, c)][:1]


def quantized_tpu_heuristic(call: Call) -> TpuGroupedMatmulConfig:
    """``block_m`` 128, ``block_k`` and ``block_n`` at least the MXU width, the largest tile that fits."""
    mxu = target_generation().mxu
    space = _heuristic_pool(quantized_tpu_space(call))
    preferred = [c for c in space if c.block_m == 128 and c.block_k >= mxu and c.block_n >= mxu]
    pool = preferred or [c for c in space if c.block_m == 128] or space
    return max(pool, key=lambda c: (c.block_k * c.block_n, c.block_n, -c.block_k))


def quantized_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU quantized grouped matmul cannot run ``call`` (None when it can):
    float32/bfloat16 activations; fp8 codes only where the generation has float8; scales
    whose K block is a power of two of at least 8 (16 for 4-bit codes) or per channel."""
    dtype = np.dtype(call.lhs.dtype)
    if dtype.name not in ("float32", "bfloat16"):
        return f"the Mosaic TPU quantized grouped matmul needs float32/bfloat16 lhs, got {dtype.name}"
    generation = target_generation()
    fmt = call.rhs_format
    if fmt in FP8_ELEMENT_FORMATS and not generation.has_dtype(call.rhs_values.dtype):
        with_fp8 = [g.name for g in TPU_GENERATIONS.values() if g.has_dtype(call.rhs_values.dtype)]
        return (f"rhs format {fmt} has float8 codes ({np.dtype(call.rhs_values.dtype).name}), which TPU "
                f"{generation.name} does not have (float8 on: {', '.join(with_fp8)}); use an int8/int4 format "
                f"or the xla implementation")
    kb = quantized_k_block(call)
    least = 16 if call.rhs_values.dtype == np.uint8 else 8
    if kb is not None and (kb < least or kb & (kb - 1)):
        return (f"the Mosaic TPU quantized grouped matmul needs per-channel scales or K blocks that are powers "
                f"of two >= {least}; rhs has K blocks of {kb}")
    return None
