"""Tile configs of the fused GLU matmul kernels."""

from __future__ import annotations

import dataclasses

from ...core import Call
from ...core.config import MatmulTileConfig


@dataclasses.dataclass(frozen=True)
class GluConfig(MatmulTileConfig):
    """Tiles: the forward and ``dgate/dup`` kernels tile ``[block_m, block_n]``
    of the output and step ``block_k`` along K; the ``dx`` kernel tiles
    ``[block_m, block_k]`` stepping ``block_n``; the weight-gradient kernel
    tiles ``[block_k, block_n]`` stepping ``block_m``. Every tile dimension
    is one of 16 … 256."""


_SPACE = (
    GluConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2),
    GluConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2),
    GluConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3),
    GluConfig(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3),
    GluConfig(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=3),
    GluConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=2),
    GluConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2),
)


def glu_space(call: Call) -> list[GluConfig]:
    """The GLU Triton autotuning space (seven tile shapes)."""
    return list(_SPACE)


def glu_heuristic(call: Call) -> GluConfig:
    """GLU Triton tiles by the row count ``M`` (small ``block_m`` for decode-sized inputs)."""
    rows = 1
    for d in call.x.shape[:-1]:
        rows *= d
    if rows <= 16:
        return GluConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2)
    if rows <= 64:
        return GluConfig(block_m=32, block_n=64, block_k=32, num_warps=4, num_stages=2)
    return GluConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
