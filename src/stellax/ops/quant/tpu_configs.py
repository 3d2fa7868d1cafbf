"""Configs of the Mosaic TPU quantization kernels, sized per TPU generation.

* `quantize` / `dequantize` view the array as rows of one quantization block
  (``[R·nb, g]``, see `mosaic_tpu`); a grid step holds ``block_rows`` such rows.
* `hadamard_transform` views it as rows of ``W`` lanes (``W`` a multiple of the
  Hadamard block, ≥ 128 when the size allows) and multiplies ``block_rows``
  rows by the block-diagonal ``W × W`` Hadamard matrix on the MXU.
* `quantized_matmul`: output tile ``block_m × block_n``, ``block_k`` logical
  K per step (packed 4-bit weights step ``block_k / 2`` bytes).

A config's VMEM estimate counts the double-buffered blocks at TPU tiling (8
sublanes × 128 lanes) plus the float32 temporaries of one step; configs whose
estimate exceeds half the generation's scoped VMEM default are not in its
space (the other half is left to the compiler's own temporaries).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, product_space
from ...core.config import require_in
from ...core.pallas import cdiv
from ...core.tpu import target_generation
from . import formats as F

ROW_BLOCKS = (32, 64, 128, 256, 512, 1024)
#: float32 temporaries per element a quantize / dequantize step holds at once.
_QUANT_TEMPS = 8
_HADAMARD_TEMPS = 3


def _round_up(x: int, to: int) -> int:
    return max(to, -(-x // to) * to)


def _budget() -> int:
    return target_generation().scoped_vmem_bytes // 2


@dataclasses.dataclass(frozen=True)
class QuantTpuConfig(KernelConfig):
    """``block_rows`` quantization blocks (rows of the block view) per grid step."""

    block_rows: int = 256

    def validate(self) -> None:
        require_in("QuantTpuConfig", "block_rows", self.block_rows, ROW_BLOCKS)


@dataclasses.dataclass(frozen=True)
class HadamardTpuConfig(KernelConfig):
    """``block_rows`` rows of ``W`` lanes per grid step."""

    block_rows: int = 256

    def validate(self) -> None:
        require_in("HadamardTpuConfig", "block_rows", self.block_rows, ROW_BLOCKS)


@dataclasses.dataclass(frozen=True)
class QMatmulTpuConfig(KernelConfig):
    """Output tile ``block_m × block_n``; ``block_k`` logical K per grid step."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 512

    def validate(self) -> None:
        require_in("QMatmulTpuConfig", "block_m", self.block_m, (32, 64, 128, 256, 512))
        require_in("QMatmulTpuConfig", "block_n", self.block_n, (128, 256, 512))
        require_in("QMatmulTpuConfig", "block_k", self.block_k, (256, 512, 1024, 2048))


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
