"""Configs of the quantization kernels."""

from __future__ import annotations

import dataclasses

from ...core import Call, TritonConfig, product_space
from ...core.config import MatmulTileConfig, require_in, require_power_of_two
from ...core.pallas import cdiv


@dataclasses.dataclass(frozen=True)
class HadamardConfig(TritonConfig):
    """``block_rows`` rows of Hadamard blocks per Triton program."""

    block_rows: int = 64

    def validate(self) -> None:
        super().validate()
        require_power_of_two("HadamardConfig", "block_rows", self.block_rows)
        require_in("HadamardConfig", "block_rows", self.block_rows, (16, 32, 64, 128, 256))


def hadamard_heuristic(call: Call) -> HadamardConfig:
    block = call.block
    rows = 128 if block <= 64 else 64
    return HadamardConfig(block_rows=rows, num_warps=4, num_stages=1)


def hadamard_space(call: Call) -> list[HadamardConfig]:
    return product_space(HadamardConfig, block_rows=(32, 64, 128), num_warps=(4, 8), num_stages=(1,))


@dataclasses.dataclass(frozen=True)
class QMatmulConfig(MatmulTileConfig):
    """Output tile ``block_m × block_n``; ``block_k`` logical K per step (it
    must divide every operand's K block so each step sees one scale row)."""

    TILE_SIZES = {"block_m": (16, 32, 64, 128), "block_n": (16, 32, 64, 128, 256), "block_k": (16, 32, 64, 128)}


def k_granularity(call: Call) -> int | None:
    """Largest block_k allowed: the gcd-like minimum of the K block sizes of
    operands scaled inside the K loop (``None``: no in-loop scales)."""
    groups = [g for g in (call.x_group_k, call.w_group_k) if g]
    return min(groups) if groups else None


def _allowed_k(call: Call, k: int) -> bool:
    for g in (call.x_group_k, call.w_group_k):
        if g and g % k:
            return False
    return True


def qmatmul_heuristic(call: Call) -> QMatmulConfig:
    m = call.m
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bk = 128
    while bk > 16 and not _allowed_k(call, bk):
        bk //= 2
    bn = 128 if call.n >= 128 else 64
    return QMatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=2)


def qmatmul_space(call: Call) -> list[QMatmulConfig]:
    out = product_space(QMatmulConfig, block_m=(32, 64), block_n=(64, 128), block_k=(32, 64, 128),
                        num_warps=(4,), num_stages=(2,))
    out = [c for c in out if _allowed_k(call, c.block_k)]
    return out or [qmatmul_heuristic(call)]


@dataclasses.dataclass(frozen=True)
class DequantConfig(TritonConfig):
    """``block_rows × block_k`` output elements per Triton program."""

    block_rows: int = 16
    block_k: int = 256

    def validate(self) -> None:
        super().validate()
        require_power_of_two("DequantConfig", "block_rows", self.block_rows)
        require_in("DequantConfig", "block_k", self.block_k, (32, 64, 128, 256, 512, 1024))


def _dequant_ok(call: Call, c: DequantConfig) -> bool:
    g = call.block_shape[call.axis]
    one_block = cdiv(call.shape[call.axis], g) == 1
    return one_block or g % c.block_k == 0 or c.block_k % g == 0


def dequant_heuristic(call: Call) -> DequantConfig:
    for bk in (256, 128, 512, 64, 1024, 32):
        c = DequantConfig(block_rows=16, block_k=bk, num_warps=4, num_stages=1)
        if _dequant_ok(call, c):
            return c
    return DequantConfig(num_stages=1)


def dequant_space(call: Call) -> list[DequantConfig]:
    out = product_space(DequantConfig, block_rows=(8, 32), block_k=(128, 512), num_warps=(4,), num_stages=(1,))
    return [c for c in out if _dequant_ok(call, c)] or [dequant_heuristic(call)]


@dataclasses.dataclass(frozen=True)
class QuantizeConfig(TritonConfig):
    """``block_rows × block_k`` input elements per Triton program (block_k a
    multiple of the format's block of 32)."""

    block_rows: int = 16
    block_k: int = 256

    def validate(self) -> None:
        super().validate()
        require_power_of_two("QuantizeConfig", "block_rows", self.block_rows)
        require_in("QuantizeConfig", "block_k", self.block_k, (64, 128, 256, 512))


def quantize_heuristic(call: Call) -> QuantizeConfig:
    return QuantizeConfig(block_rows=16, block_k=256, num_warps=4, num_stages=1)


def quantize_space(call: Call) -> list[QuantizeConfig]:
    return product_space(QuantizeConfig, block_rows=(8, 32), block_k=(128, 512), num_warps=(4,), num_stages=(1,))
