"""Tile configs of the fused GLU matmul kernels (Triton and Mosaic TPU)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig
from ...core.config import MatmulTileConfig, require_positive
from ...core.platform import target_generation


@dataclasses.dataclass(frozen=True)
class GluConfig(MatmulTileConfig):
    """Tiles: the forward and ``dgate/dup`` kernels tile ``[block_m, block_n]``
    of the output and step ``block_k`` along K; the ``dx`` kernel tiles
    ``[block_m, block_k]`` stepping ``block_n``; the weight-gradient kernel
    tiles ``[block_k, block_n]`` stepping ``block_m``. Every tile dimension
    is one of 16 … 256."""


#: The space's tiles: (block_m, block_n, block_k, num_warps, num_stages).
_SPACE = tuple(GluConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s) for m, n, k, w, s in (
    (16, 32, 32, 4, 2), (32, 64, 32, 4, 2), (64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 8, 3),
    (128, 128, 32, 8, 2), (64, 64, 64, 4, 2)))


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


# -- Mosaic TPU ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GluTpuConfig(KernelConfig):
    """Tiles of the Mosaic TPU GLU kernels (each a multiple of 128, the TPU lane width):
    the forward and ``dgate/dup`` kernels tile ``[block_m, block_n]`` of the output and
    step ``block_k`` along K (a sequential grid axis, float32 accumulators in VMEM); the
    ``dx`` kernel tiles ``[block_m, block_k]`` stepping ``block_n``; the weight-gradient
    kernel tiles ``[block_k, block_n]`` stepping ``block_m``. A dimension smaller than its
    tile is one full block."""

    block_m: int = 256
    block_n: int = 256
    block_k: int = 256

    def validate(self) -> None:
        """Every tile size a positive multiple of 128."""
        for field in ("block_m", "block_n", "block_k"):
            value = getattr(self, field)
            require_positive("GluTpuConfig", field, value)
            if value % 128:
                raise ValueError(f"GluTpuConfig.{field}: expected a multiple of 128, got {value}")


def tpu_tile(size: int, block: int) -> int:
    """The tile a dimension of ``size`` really uses: ``block``, or the whole dimension when it
    is smaller (a block equal to the full array dimension is legal at any size)."""
    return int(size) if size <= block else int(block)


def glu_tpu_vmem_bytes(m: int, k: int, n: int, itemsize: int, config: GluTpuConfig) -> int:
    """VMEM the largest of the four GLU kernels needs for one grid step: double-buffered
    operand and output tiles of ``itemsize`` bytes, float32 accumulators, and float32
    temporaries (the activation epilogue, masked tail tiles)."""
    bm, bn, bk = (tpu_tile(m, config.block_m), tpu_tile(n, config.block_n), tpu_tile(k, config.block_k))
    bm, bn, bk = (-(-bm // 16) * 16, -(-bn // 128) * 128, -(-bk // 128) * 128)
    forward = 2 * (bm * bk + 2 * bk * bn) * itemsize + 2 * bm * bn * itemsize + 2 * bm * bn * 4 + 4 * bm * bn * 4
    act_grad = forward + 2 * 3 * bm * bn * itemsize + 2 * bm * bn * 4
    dx = 2 * (2 * bm * bn + 2 * bk * bn + bm * bk) * itemsize + 2 * bm * bk * 4
    dw = 2 * (bm * bk + 2 * bm * bn + 2 * bk * bn) * itemsize + 4 * bk * bn * 4
    return max(forward, act_grad, dx, dw)


def glu_tpu_vmem_limit(need: int) -> int | None:
    """``vmem_limit_bytes`` for ``need`` bytes: ``None`` while three quarters of the target
    generation's scoped default hold it, else the need plus a quarter (at most three
    quarters of the physical VMEM)."""
    generation = target_generation()
    if need <= generation.scoped_vmem_bytes * 3 // 4:
        return None
    return min(need + need // 4, generation.vmem_bytes * 3 // 4)


def _tpu_dims(call: Call) -> tuple[int, int, int, int]:
    """``(M, K, N, itemsize)`` of a forward or backward GLU call."""
    m = 1
    for d in call.x.shape[:-1]:
        m *= d
    return m, call.x.shape[-1], call.w_gate.shape[-1], np.dtype(call.x.dtype).itemsize


def _tpu_candidates(mxu: int) -> list[GluTpuConfig]:
    """``block_m`` 128/256/512 (and 1024 with a 256-wide MXU) × (``block_n``, ``block_k``) one
    or two MXU widths each."""
    rows = (128, 256, 512) + ((1024,) if mxu >= 256 else ())
    return [GluTpuConfig(block_m=bm, block_n=bn, block_k=bk) for bm in rows
            for bn, bk in ((mxu, mxu), (2 * mxu, mxu), (mxu, 2 * mxu), (2 * mxu, 2 * mxu))]


def glu_tpu_space(call: Call) -> list[GluTpuConfig]:
    """`_tpu_candidates` for the target generation's MXU that fit three quarters of its VMEM,
    one per distinct effective tiling (tiles larger than the dimensions collapse)."""
    m, k, n, itemsize = _tpu_dims(call)
    generation = target_generation()
    seen, out = set(), []
    for config in _tpu_candidates(generation.mxu):
        tiles = (tpu_tile(m, config.block_m), tpu_tile(n, config.block_n), tpu_tile(k, config.block_k))
        if tiles in seen or glu_tpu_vmem_bytes(m, k, n, itemsize, config) > generation.vmem_bytes * 3 // 4:
            continue
        seen.add(tiles)
        out.append(config)
    return out


def glu_tpu_heuristic(call: Call) -> GluTpuConfig:
    """Tiles of two MXU widths (256 on v5e/v5p, 512 on v6e/TPU7x), ``block_m`` 512 for at least
    512 rows (else 256), shrunk (``block_k``, then ``block_n``, then ``block_m``) until the
    kernels fit three quarters of the generation's scoped VMEM. Per K step a tile does
    ``4·bm·bn·bk`` flops on ``2·(bm + 2·bn)·bk`` bytes (bf16): 512 × 512 tiles give 341
    flop/byte (a v5e needs ~240 to keep its MXUs fed from HBM, a v6e ~560: the 1024-row
    tiles of the space are there for autotuning, but need more than the scoped VMEM by
    `glu_tpu_vmem_bytes`)."""
    m, k, n, itemsize = _tpu_dims(call)
    generation = target_generation()
    mxu = generation.mxu
    block_m = 512 if m >= 512 else 256
    config = GluTpuConfig(block_m=block_m, block_n=2 * mxu, block_k=2 * mxu)
    budget = generation.scoped_vmem_bytes * 3 // 4
    for field in ("block_k", "block_n", "block_m") * 3:
        if glu_tpu_vmem_bytes(m, k, n, itemsize, config) <= budget:
            break
        if getattr(config, field) > 128:
            config = config.replace(**{field: getattr(config, field) // 2})
    return config


def glu_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU GLU kernels cannot run ``call``: operand dtypes the MXU does not
    multiply natively on the target generation (float16)."""
    generation = target_generation()
    for name in ("x", "w_gate"):
        dtype = np.dtype(getattr(call, name).dtype)
        if not generation.has_dtype(dtype):
            return (f"{name}: the Mosaic TPU GLU kernels multiply {', '.join(generation.matmul_dtypes)} "
                    f"on TPU {generation.name}, got {dtype.name}")
    return None


def glu_tpu_defers_to_xla(platform) -> str | None:
    """Why the default chain passes the Mosaic TPU GLU kernels over on ``platform``: on a v5e
    they were measured slower than XLA's two matmuls, activation and product (`stellax bench`
    side by side, M=8192 K=4096 N=14336 SwiGLU bf16, 2026-12-05: forward 17.4 ms against 10.9,
    forward+backward 59.7 against 33.1). Other generations are not measured: the kernels stay
    their default there."""
    tpu = platform.tpu
    if tpu is not None and tpu.name == "v5e":
        return ("measured slower than XLA on a v5e (0.63x forward, 0.55x forward+backward at "
                "M=8192 K=4096 N=14336 bf16)")
    return None

