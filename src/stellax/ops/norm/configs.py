"""Configs of the normalization kernels: rows per program, warps, stages."""

from __future__ import annotations

import dataclasses

from ...core import Call, TritonConfig, next_power_of_two, product_space
from ...core.config import require_power_of_two

#: Longest row (elements) a Triton program holds in registers at once.
MAX_ROW_BLOCK = 65536


@dataclasses.dataclass(frozen=True)
class NormConfig(TritonConfig):
    """``block_rows`` rows of the (padded) row length per Triton program."""

    block_rows: int = 4

    def validate(self) -> None:
        """``block_rows`` must be a power of two."""
        super().validate()
        require_power_of_two("NormConfig", "block_rows", self.block_rows)


def row_block(features: int) -> int:
    """The padded row length a Triton program holds: the next power of two ≥ ``features``."""
    return next_power_of_two(features)


def norm_heuristic(call: Call) -> NormConfig:
    """About 4096 elements per program (1 … 16 rows), warps by the row length, one stage."""
    block_d = row_block(_features(call))
    rows = max(1, min(16, 4096 // block_d))
    warps = 4 if block_d <= 4096 else 8 if block_d <= 16384 else 16
    return NormConfig(block_rows=rows, num_warps=warps, num_stages=1)


def norm_space(call: Call) -> list[NormConfig]:
    """``block_rows`` 1 … 16 × 2/4/8 warps, at most `MAX_ROW_BLOCK` elements per program."""
    block_d = row_block(_features(call))
    configs = product_space(NormConfig, block_rows=(1, 2, 4, 8, 16), num_warps=(2, 4, 8), num_stages=(1,))
    return [c for c in configs if c.block_rows * block_d <= MAX_ROW_BLOCK]


def _features(call: Call) -> int:
    """Length of the normalized axis (the backward op's calls carry ``axis=-1``)."""
    return call.x.shape[call.axis]


def norm_requirements(call: Call) -> str | None:
    """Why the Triton norm kernels cannot run ``call`` (a row longer than `MAX_ROW_BLOCK`), or None."""
    features = _features(call)
    if row_block(features) > MAX_ROW_BLOCK:
        return f"the Triton norm kernel holds a row in registers: row length {features} > {MAX_ROW_BLOCK}"
    return None
