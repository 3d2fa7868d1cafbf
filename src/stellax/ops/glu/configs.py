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


#: Wide (block_n, block_k) tiles beside the MXU-width ones: the K step is where a tile pays for its
#: float32 accumulator's read-modify-write. Static schedules of the forward kernel on v5e (libtpu's
#: bundles, SwiGLU bf16 M=8192 K=4096 N=14336; cycles per step over the step's MXU time) at
#: (block_m, block_n, block_k): (512, 256, 256) 2.10, (512, 512, 512) 1.42, (512, 1024, 1024) 1.22,
#: (512, 512, 2048) 1.01, (512, 1024, 2048) 1.06, (256, 1024, 2048) 1.01. A K that 2048 does not
#: divide also gets, for each wide ``block_n`` with a 2048 K step, its `exact_k_tile`: at M=8192
#: K=7168 N=18432 (static, `tpu_cases`) a (512, 512, 2048) step is 1.01x its MXU time but the fourth
#: K step is half padding, so the whole forward takes 38.1M cycles (1.16x the useful MXU time);
#: (512, 512, 1792) divides K: 1.01x per step and 33.4M cycles for the kernel (1.01x).
WIDE_TILES = ((512, 1024), (512, 2048), (1024, 1024), (1024, 2048), (256, 2048))

#: The longest K step of the space (`WIDE_TILES`, `exact_k_tile`).
LONGEST_K_STEP = 2048


def exact_k_tile(k: int, unit: int, longest: int = LONGEST_K_STEP) -> int | None:
    """The longest K step that divides ``k`` exactly: the largest multiple of ``unit`` (the MXU
    width) at most ``longest`` dividing ``k``, e.g. 1792 for K=7168 (= 4 x 1792; a 2048 step
    leaves 7168 = 3.5 x 2048). None when ``k`` fits one step, when ``longest`` divides it (the
    wide tiles already do), or when no such tile reaches ``longest / 4`` (a K that is not a
    multiple of ``unit``, or one whose divisors are short steps: its tail is masked)."""
    if k <= longest or k % longest == 0 or k % unit:
        return None
    for tile in range(longest - longest % unit, longest // 4 - 1, -unit):
        if k % tile == 0:
            return tile
    return None


def _tpu_candidates(mxu: int, k: int | None = None) -> list[GluTpuConfig]:
    """``block_m`` 128/256/512/1024 × (``block_n``, ``block_k``) one or two MXU widths each, or
    one of `WIDE_TILES`, or (with the contraction length ``k``) a wide ``block_n`` whose
    `WIDE_TILES` K step is `LONGEST_K_STEP` with ``k``'s `exact_k_tile`."""
    pairs = [(mxu, mxu), (2 * mxu, mxu), (mxu, 2 * mxu), (2 * mxu, 2 * mxu)]
    pairs += [p for p in WIDE_TILES if p not in pairs]
    exact = exact_k_tile(k, mxu) if k is not None else None
    if exact is not None:
        pairs += [(bn, exact) for bn, bk in WIDE_TILES if bk == LONGEST_K_STEP and (bn, exact) not in pairs]
    return [GluTpuConfig(block_m=bm, block_n=bn, block_k=bk) for bm in (128, 256, 512, 1024) for bn, bk in pairs]


def glu_tpu_space(call: Call) -> list[GluTpuConfig]:
    """`_tpu_candidates` for the target generation's MXU and the call's K that fit its
    `tuning_vmem_bytes` (half the VMEM), one per distinct effective tiling (tiles larger than the
    dimensions collapse)."""
    m, k, n, itemsize = _tpu_dims(call)
    generation = target_generation()
    seen, out = set(), []
    for config in _tpu_candidates(generation.mxu, k):
        tiles = (tpu_tile(m, config.block_m), tpu_tile(n, config.block_n), tpu_tile(k, config.block_k))
        if tiles in seen or glu_tpu_vmem_bytes(m, k, n, itemsize, config) > generation.tuning_vmem_bytes:
            continue
        seen.add(tiles)
        out.append(config)
    return out


#: The flops per byte a K step should move: 1.4x v5e's bf16 peak over its HBM bandwidth (197 TFLOP/s
#: / 819 GB/s = 240; the margin because streaming kernels reach 70-85 % of that bandwidth). v5e's
#: rates on every generation (the only one measured), as the grouped matmul's cost model does.
TARGET_FLOP_PER_BYTE = 1.4 * 197e12 / 819e9


#: The per-step cost of a K step beyond its MXU time, in K rows (a step of ``block_k`` costs about
#: ``block_k + STEP_OVERHEAD_ROWS`` rows of MXU time): the float32 accumulators' read-modify-write
#: and the step's prologue. Fitted to the static v5e schedules of `WIDE_TILES` (1.42x the MXU time
#: at a 512 step, 1.22x at 1024: 215 and 225 rows) and rounded up: it only ranks K steps.
STEP_OVERHEAD_ROWS = 256


def _k_step_efficiency(k: int, bk: int) -> float:
    """The useful fraction of the modelled contraction time: ``k`` rows of work over
    ``ceil(k / bk)`` steps of ``bk + STEP_OVERHEAD_ROWS`` rows each. A longer step amortises the
    overhead; a step that leaves a partial last tile pays the padding (computed, then masked): at
    K=7168, 1792 gives 0.875, 2048 0.78 (four steps either way), 1024 0.80."""
    steps = -(-k // bk)
    return k / (steps * (bk + STEP_OVERHEAD_ROWS))


def _tile_rank(m: int, k: int, n: int, itemsize: int, config: GluTpuConfig):
    """How good a tiling looks (larger is better): the contraction's modelled efficiency
    (`_k_step_efficiency`: a longer K step amortises the float32 accumulator's read-modify-write,
    `WIDE_TILES`, and a padded last step wastes its masked part), then the flops per byte a K step
    moves, counted up to `TARGET_FLOP_PER_BYTE`, then the smaller VMEM need."""
    bm, bn, bk = tpu_tile(m, config.block_m), tpu_tile(n, config.block_n), tpu_tile(k, config.block_k)
    intensity = 4 * bm * bn * bk / ((bm * bk + 2 * bk * bn) * itemsize)
    return (_k_step_efficiency(k, bk), min(intensity, TARGET_FLOP_PER_BYTE),
            -glu_tpu_vmem_bytes(m, k, n, itemsize, config))


def glu_tpu_heuristic(call: Call) -> GluTpuConfig:
    """The best-ranked config of `glu_tpu_space` within the generation's `heuristic_vmem_bytes`
    (`_tile_rank`: the most efficient contraction, i.e. the longest K step that leaves no padded
    last step, then enough flops per byte, then the least VMEM). On a v5e at SwiGLU bf16 shapes
    with K=4096 that is (512, 512, 2048): 341 flop/byte, and statically a forward step within 1 %
    of its MXU time, where the MXU-width tiles (512, 256, 256) take 2.1x it (`WIDE_TILES`); at
    K=7168 it is (512, 512, 1792), K's `exact_k_tile`, where 2048 would compute four steps for
    3.5 of work.
    """
    m, k, n, itemsize = _tpu_dims(call)
    space = glu_tpu_space(call)
    budget = target_generation().heuristic_vmem_bytes
    fits = [c for c in space if glu_tpu_vmem_bytes(m, k, n, itemsize, c) <= budget] or space
    return max(fits, key=lambda c: _tile_rank(m, k, n, itemsize, c))


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
    they were measured slower than XLA's two matmuls, activation and product on two of issue
    40's three shapes (`benchmarks/glu_tpu.py`, SwiGLU bf16, XLA in the same process,
    2026-12-07, the wide-tile heuristic 512x512x2048): M=8192 K=4096 N=14336 forward 12.65 ms
    against 11.43 (0.90x), forward+backward 38.77 against 36.67 (0.95x); M=8192 K=7168
    N=18432 forward 29.88 against 25.00 (0.84x), and at K's exact step (512x512x1792, the
    heuristic since) 26.53 against 25.03 (0.94x), forward+backward 82.57 against 82.07 (0.99x);
    faster only at M=32768 K=4096 N=14336 (forward 44.84 against 46.54, 1.04x;
    forward+backward 141.9 against 152.8, 1.08x). Other generations are not measured: the
    kernels stay their default there."""
    tpu = platform.tpu
    if tpu is not None and tpu.name == "v5e":
        return ("measured slower than XLA on a v5e at M=8192 (0.90x forward, 0.95x forward+backward "
                "at K=4096 N=14336, 512x512x2048 tiles; 0.94x / 0.99x at K=7168 N=18432, 512x512x1792; "
                "bf16); faster only at M=32768 (1.04x / 1.08x)")
    return None

