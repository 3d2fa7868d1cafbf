"""Configs of the quantization kernels, every backend's: frozen config dataclasses,
heuristics and autotuning spaces (the requirements are with the kernels).

Pallas Triton (GPU): `HadamardConfig`, `QMatmulConfig`, `DequantConfig`, `QuantizeConfig`.

Pallas Mosaic TPU (`QuantTpuConfig`, `HadamardTpuConfig`, `QMatmulTpuConfig`), sized per TPU
generation:

* `quantize` / `dequantize` view the array as rows of one quantization block
  (``[R·nb, g]``, see `mosaic_tpu`); a grid step holds ``block_rows`` such rows.
* `hadamard_transform` views it as rows of ``W`` lanes (``W`` a multiple of the
  Hadamard block, ≥ 128 when the size allows) and multiplies ``block_rows``
  rows by the block-diagonal ``W × W`` Hadamard matrix on the MXU.
* `quantized_matmul`: output tile ``block_m × block_n``, ``block_k`` logical
  K per step (packed 4-bit weights step ``block_k / 2`` bytes).

A Mosaic TPU config's VMEM estimate counts the double-buffered blocks at TPU tiling (8
sublanes × 128 lanes) plus the float32 temporaries of one step; configs whose
estimate exceeds half the generation's scoped VMEM default are not in its
space (the other half is left to the compiler's own temporaries).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, TritonConfig, product_space
from ...core.config import MatmulTileConfig, require_power_of_two
from ...core.pallas import cdiv
from ...core.platform import target_generation
from . import formats as F


# == Pallas Triton ==========================================================================
@dataclasses.dataclass(frozen=True)
class HadamardConfig(TritonConfig):
    """``block_rows`` rows of Hadamard blocks per Triton program."""

    block_rows: int = 64

    CHOICES = {"block_rows": (16, 32, 64, 128, 256)}


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

    CHOICES = {"block_m": (16, 32, 64, 128), "block_n": (16, 32, 64, 128, 256), "block_k": (16, 32, 64, 128)}


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

    CHOICES = {"block_k": (32, 64, 128, 256, 512, 1024)}

    def validate(self) -> None:
        super().validate()
        require_power_of_two("DequantConfig", "block_rows", self.block_rows)


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

    CHOICES = {"block_k": (64, 128, 256, 512)}

    def validate(self) -> None:
        super().validate()
        require_power_of_two("QuantizeConfig", "block_rows", self.block_rows)


def quantize_heuristic(call: Call) -> QuantizeConfig:
    return QuantizeConfig(block_rows=16, block_k=256, num_warps=4, num_stages=1)


def quantize_space(call: Call) -> list[QuantizeConfig]:
    return product_space(QuantizeConfig, block_rows=(8, 32), block_k=(128, 512), num_warps=(4,), num_stages=(1,))


# == Pallas Mosaic TPU =====================================================================
ROW_BLOCKS = (32, 64, 128, 256, 512, 1024)
#: float32 temporaries per element a quantize / dequantize step holds at once.
_QUANT_TEMPS = 8
_HADAMARD_TEMPS = 3


def _round_up(x: int, to: int) -> int:
    return max(to, -(-x // to) * to)


def _budget() -> int:
    return target_generation().scoped_vmem_bytes // 2


@dataclasses.dataclass(frozen=True)
class _RowBlocksTpuConfig(KernelConfig):
    """``block_rows`` rows (one of `ROW_BLOCKS`) per grid step: what the two element-wise
    kernels' configs share (each keeps its own type, so neither accepts the other's)."""

    block_rows: int = 256

    CHOICES = {"block_rows": ROW_BLOCKS}


@dataclasses.dataclass(frozen=True)
class QuantTpuConfig(_RowBlocksTpuConfig):
    """``block_rows`` quantization blocks (rows of the block view) per grid step."""


@dataclasses.dataclass(frozen=True)
class HadamardTpuConfig(_RowBlocksTpuConfig):
    """``block_rows`` rows of ``W`` lanes per grid step."""


@dataclasses.dataclass(frozen=True)
class QMatmulTpuConfig(KernelConfig):
    """Output tile ``block_m × block_n``; ``block_k`` logical K per grid step."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 512

    CHOICES = {"block_m": (32, 64, 128, 256, 512), "block_n": (128, 256, 512), "block_k": (256, 512, 1024, 2048)}


# -- quantize / dequantize ----------------------------------------------------------------
def quant_block_geometry(shape, block_shape) -> tuple[int, int, int]:
    """``(rows, nb, width)`` of the block view of an array quantized along its
    last axis in 1-D blocks: ``rows · nb`` block rows of ``width`` elements
    (the block, rounded up to even so 4-bit codes pack within it)."""
    k = shape[-1]
    g = block_shape[-1]
    rows = int(np.prod(shape[:-1]))
    nb = cdiv(k, g)
    width = g + (g % 2 if nb == 1 else 0)
    return rows, nb, width


def quant_tpu_vmem(width: int, in_item: int, out_item: int, block_rows: int) -> int:
    """VMEM bytes of one quantize / dequantize step on ``[block_rows, width]``."""
    lanes = _round_up(width, 128)
    rows = _round_up(block_rows, 32)
    return rows * lanes * (2 * in_item + 2 * out_item + 4 * _QUANT_TEMPS) + 4 * rows * 128 * 4


def _quant_space(block_rows_total: int, width: int, in_item: int, out_item: int) -> list[QuantTpuConfig]:
    limit = _round_up(block_rows_total, 32)
    kept = [QuantTpuConfig(b) for b in ROW_BLOCKS
            if b <= max(limit, 32) and quant_tpu_vmem(width, in_item, out_item, b) <= _budget()]
    return kept or [QuantTpuConfig(ROW_BLOCKS[0])]


def _quant_heuristic(space: list[QuantTpuConfig], width: int) -> QuantTpuConfig:
    """The largest block holding at most 2^18 (lane-padded) elements: a step
    of ~1 MiB per float32 temporary, large enough to hide the per-step cost."""
    lanes = _round_up(width, 128)
    fitting = [c for c in space if c.block_rows * lanes <= 1 << 18]
    return max(fitting or space[:1], key=lambda c: c.block_rows)


def _quantize_dims(call: Call):
    rows, nb, width = quant_block_geometry(call.x.shape, call.block_shape)
    return rows * nb, width, np.dtype(call.x.dtype).itemsize


def quantize_tpu_space(call: Call) -> list[QuantTpuConfig]:
    """Row blocks that the call can use and that fit the generation's VMEM budget."""
    total, width, item = _quantize_dims(call)
    return _quant_space(total, width, item, 1)


def quantize_tpu_heuristic(call: Call) -> QuantTpuConfig:
    total, width, _ = _quantize_dims(call)
    return _quant_heuristic(quantize_tpu_space(call), width)


def _dequantize_dims(call: Call):
    rows, nb, width = quant_block_geometry(call.shape, call.block_shape)
    return rows * nb, width, np.dtype(call.dtype).itemsize


def dequantize_tpu_space(call: Call) -> list[QuantTpuConfig]:
    """Row blocks that the call can use and that fit the generation's VMEM budget."""
    total, width, item = _dequantize_dims(call)
    return _quant_space(total, width, 1, item)


def dequantize_tpu_heuristic(call: Call) -> QuantTpuConfig:
    total, width, _ = _dequantize_dims(call)
    return _quant_heuristic(dequantize_tpu_space(call), width)


# -- hadamard ------------------------------------------------------------------------------
def hadamard_lanes(total: int, block: int) -> int:
    """Row width ``W`` of the Hadamard view: the largest of 256 (v6e/TPU7x MXU)
    or 128 lanes that is a multiple of ``block`` and divides ``total``
    elements, else ``block`` itself."""
    mxu = target_generation().mxu
    for w in sorted({mxu, 128}, reverse=True):
        if w >= block and w % block == 0 and total % w == 0:
            return w
    return block


def hadamard_tpu_vmem(width: int, item: int, block_rows: int) -> int:
    """VMEM bytes of one Hadamard step: double-buffered in/out rows, the matrix, temporaries."""
    lanes = _round_up(width, 128)
    rows = _round_up(block_rows, 16)
    return rows * lanes * (4 * item + 4 * _HADAMARD_TEMPS) + 2 * _round_up(width, 8) * lanes * 4


def _hadamard_dims(call: Call):
    total = int(np.prod(call.x.shape))
    width = hadamard_lanes(total, call.block)
    return total // width, width, np.dtype(call.x.dtype).itemsize


def hadamard_tpu_space(call: Call) -> list[HadamardTpuConfig]:
    """Row blocks that the call can use and that fit the generation's VMEM budget."""
    rows, width, item = _hadamard_dims(call)
    limit = max(_round_up(rows, 32), 32)
    kept = [HadamardTpuConfig(b) for b in ROW_BLOCKS if b <= limit and hadamard_tpu_vmem(width, item, b) <= _budget()]
    return kept or [HadamardTpuConfig(ROW_BLOCKS[0])]


def hadamard_tpu_heuristic(call: Call) -> HadamardTpuConfig:
    """The largest row block of at most 2^18 lane-padded elements (see `_quant_heuristic`)."""
    _, width, _ = _hadamard_dims(call)
    space = hadamard_tpu_space(call)
    lanes = _round_up(width, 128)
    fitting = [c for c in space if c.block_rows * lanes <= 1 << 18]
    return max(fitting or space[:1], key=lambda c: c.block_rows)


# -- quantized matmul ----------------------------------------------------------------------
def qmm_packed(call: Call) -> bool:
    return F.get_format(call.w_format).packed


def qmm_tpu_vmem(call: Call, c: QMatmulTpuConfig) -> int:
    """VMEM bytes of one quantized-matmul step: double-buffered x tile(s) ``[bm, bk]``,
    weight codes ``[bk, bn]`` (bytes, halved when packed), scale / zero-point rows,
    the output tile, the float32 accumulator and the decoded weights (float32)."""
    return qmm_vmem_bytes(np.dtype(call.x_values.dtype).itemsize, np.dtype(call.preferred_element_type).itemsize,
                          qmm_packed(call), c.block_m, c.block_n, c.block_k)


def qmm_vmem_bytes(x_item: int, out_item: int, packed: bool, block_m: int, block_n: int, block_k: int) -> int:
    """`qmm_tpu_vmem` from the operand item sizes and the tile."""
    bm, bn, bk = _round_up(block_m, 32), block_n, block_k
    w_rows = bk // 2 if packed else bk
    x_tiles = 2 * bm * bk * x_item
    w_tiles = 2 * w_rows * bn
    side = 2 * 2 * _round_up(max(bk // 8, 8), 8) * bn * 4
    decoded = 3 * w_rows * bn * 4
    return x_tiles + w_tiles + side + decoded + 2 * bm * bn * out_item + bm * bn * 4


def _qmm_useful(call: Call, c: QMatmulTpuConfig) -> bool:
    return (c.block_m <= _round_up(call.m, 32) and c.block_n <= _round_up(call.n, 128)
            and c.block_k <= _round_up(call.k, 256))


def qmatmul_tpu_space(call: Call) -> list[QMatmulTpuConfig]:
    """Tiles the call's dimensions can use that fit the generation's VMEM budget."""
    configs = product_space(QMatmulTpuConfig, block_m=(32, 128, 256), block_n=(128, 256, 512),
                            block_k=(256, 512, 1024))
    kept = [c for c in configs if _qmm_useful(call, c) and qmm_tpu_vmem(call, c) <= _budget()]
    return kept or [QMatmulTpuConfig(32, 128, 256)]


def qmatmul_tpu_heuristic(call: Call) -> QMatmulTpuConfig:
    """``block_m`` up to 256 (decode work is shared by every row of the tile),
    ``block_n`` the MXU width or wider, ``block_k`` as deep as fits: decoding is
    per weight element, so the tile that reads each weight the fewest times
    (largest ``block_m``) and the fewest grid steps wins."""
    mxu = target_generation().mxu
    space = qmatmul_tpu_space(call)
    preferred = [c for c in space if c.block_n >= min(mxu, _round_up(call.n, 128))]
    pool = preferred or space
    return max(pool, key=lambda c: (c.block_m, c.block_n * c.block_k, c.block_n))
