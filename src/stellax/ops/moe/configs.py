"""Configs of the grouped-matmul implementations: tiles, warps, stages.

* `GroupedMatmulConfig` (Triton): the forward/dlhs kernel tiles the output in
  ``[block_m, block_n]`` (``block_m`` rows of one group) and steps ``block_k``
  along the contraction; the ``tgmm`` kernel tiles the ``[K, N]`` output of a
  group in ``[block_k, block_n]`` and steps ``block_m`` rows of the group.
* `XlaGroupedMatmulConfig`: the row tile of the XLA loop (`xla.py`).

Heuristics and spaces for `ragged_dot`, `ragged_dot_tgmm` and the quantized
`ragged_dot` (whose ``block_k`` is capped at the scales' K block).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, next_power_of_two, product_space
from ...core.config import MatmulTileConfig, require_in

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
