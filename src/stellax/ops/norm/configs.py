"""Configs of the normalization kernels: rows per program, warps, stages (Triton); rows per
block and the VMEM they need (Mosaic TPU)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, TritonConfig, next_power_of_two, product_space
from ...core.config import require_positive, require_power_of_two
from ...core.platform import target_generation

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
    """``block_rows`` 1 … 16 × 2/4/8 warps, at most `MAX_ROW_BLOCK` elements per program and
    `MAX_ELEMENTS_PER_THREAD` per thread."""
    block_d = row_block(_features(call))
    configs = product_space(NormConfig, block_rows=(1, 2, 4, 8, 16), num_warps=(2, 4, 8), num_stages=(1,))
    return [c for c in configs if c.block_rows * block_d <= MAX_ROW_BLOCK
            and c.block_rows * block_d <= MAX_ELEMENTS_PER_THREAD * 32 * c.num_warps]


#: The static GPU tier (ptxas, sm_90, bf16 rows of 4096): 256 elements per thread spill 7-38 KB
#: (2 warps × 4 rows, 4 × 8, 4 × 16, 8 × 16); 128 per thread fit in 255 registers (4 warps × 4 rows).
MAX_ELEMENTS_PER_THREAD = 128


def _features(call: Call) -> int:
    """Length of the normalized axis (the backward op's calls carry ``axis=-1``)."""
    return call.x.shape[call.axis]


def norm_requirements(call: Call) -> str | None:
    """Why the Triton norm kernels cannot run ``call`` (a row longer than `MAX_ROW_BLOCK`), or None."""
    features = _features(call)
    if row_block(features) > MAX_ROW_BLOCK:
        return f"the Triton norm kernel holds a row in registers: row length {features} > {MAX_ROW_BLOCK}"
    return None


# -- Mosaic TPU ----------------------------------------------------------------------
#: Lane width of a TPU vector register: the feature axis is padded to a multiple of it.
TPU_LANES = 128
#: Rows per block the TPU space offers (multiples of 16: bfloat16 packs 16 rows per vreg tile).
TPU_BLOCK_ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
#: Most elements one block holds: the kernels walk a block in chunks, so neither the code nor
#: the float32 temporaries grow with it; past 4M elements (8 MiB of bfloat16 per stream) longer
#: DMAs buy nothing and the pipeline's first and last steps (not overlapped) grow.
TPU_MAX_BLOCK_ELEMENTS = 1 << 22
#: Bytes of one row-blocked operand's block the heuristic aims for: with ~0.35 µs per grid step
#: and 819 GB/s (v5e), a forward step moving 2 × 4 MiB takes ~10 µs, so the step cost is ~3 %.
TPU_TARGET_BLOCK_BYTES = 4 * 1024 * 1024
#: Grid steps the heuristic keeps at least (when the rows allow): the pipeline overlaps a
#: step's DMAs with its neighbours' compute, the first read and the last write are exposed.
TPU_MIN_STEPS = 8
#: Rows the kernels process at a time inside a block (one bfloat16 sublane tile).
CHUNK_ROWS = 16
#: Widest lane slab of a chunk the kernels hold at once: 16 × 512 float32 = 8 vector registers.
TPU_MAX_SLAB = 512
#: Dtypes the Mosaic TPU norm kernels load and store.
TPU_DTYPES = ("float32", "bfloat16")
#: ``[chunk, Dp]`` float32 scratch buffers per kernel (forward: h; backward: x̂ and dy).
_TPU_SCRATCH = {"forward": 1, "backward": 2}
#: Headroom for the compiler's own temporaries (spilled vector registers, ...).
_TPU_SLACK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class NormTpuConfig(KernelConfig):
    """``block_rows`` rows (of the feature axis padded to 128 lanes) per grid step of the
    Mosaic TPU norm kernels; a multiple of 16 (the bfloat16 sublane tile)."""

    block_rows: int = 256

    def validate(self) -> None:
        """``block_rows`` must be a positive multiple of 16."""
        require_positive("NormTpuConfig", "block_rows", self.block_rows)
        if self.block_rows % 16:
            raise ValueError(f"NormTpuConfig.block_rows: expected a multiple of 16, got {self.block_rows}")


def tpu_padded_features(features: int) -> int:
    """The feature axis padded to a multiple of `TPU_LANES`."""
    return -(-int(features) // TPU_LANES) * TPU_LANES


def tpu_block_rows(rows: int, block_rows: int) -> int:
    """The rows one block really holds: ``block_rows``; with fewer rows than that, the most
    whole `CHUNK_ROWS` tiles they fill (the last block partial), or all of them when fewer
    than `CHUNK_ROWS` (a block equal to the full array dimension is legal at any size)."""
    rows = int(rows)
    if rows >= block_rows:
        return int(block_rows)
    return rows // CHUNK_ROWS * CHUNK_ROWS if rows >= CHUNK_ROWS else rows


def tpu_chunk_rows(block_rows: int) -> int:
    """Rows per inner step of a block: `CHUNK_ROWS`, or the whole block when it is smaller."""
    return CHUNK_ROWS if block_rows % CHUNK_ROWS == 0 else int(block_rows)


def tpu_slab(padded: int) -> int:
    """Lanes per slab of a chunk: the widest of 512/256/128 that divides ``padded``."""
    for width in (TPU_MAX_SLAB, 256, TPU_LANES):
        if padded % width == 0:
            return width
    raise ValueError(f"padded features {padded}: expected a multiple of {TPU_LANES}")


def _tpu_streams(call: Call) -> tuple[str, int, int]:
    """``(pass, row-blocked inputs, row-blocked outputs)`` of a forward or backward call."""
    if "dy" in call.arrays:
        return "backward", 2 + (call.dh is not None), 1
    with_residual = call.residual is not None
    return "forward", 1 + with_residual, 1 + with_residual


def tpu_block_vmem_bytes(kind: str, inputs: int, outputs: int, rows: int, features: int, itemsize: int,
                         block_rows: int) -> int:
    """VMEM one grid step of a norm kernel needs (``kind`` ``"forward"``/``"backward"``, ``inputs``
    / ``outputs`` row-blocked operands of ``itemsize`` bytes): double-buffered row blocks, the
    lane-padded ``[rows, 1]`` statistics, the ``[1, Dp]`` vectors, the ``[8, Dp]`` column-sum
    partials, the ``[chunk, Dp]`` float32 scratch and a fixed headroom."""
    block = tpu_block_rows(rows, block_rows)
    sublane_rows = -(-block // 8) * 8
    padded = tpu_padded_features(features)
    blocks = 2 * (inputs + outputs) * sublane_rows * padded * itemsize
    stats = 2 * 2 * sublane_rows * TPU_LANES * 4
    vectors = 2 * 2 * 8 * padded * 4
    partials = 2 * 2 * 8 * padded * 4 if kind == "backward" else 0
    scratch = _TPU_SCRATCH[kind] * -(-tpu_chunk_rows(block) // 8) * 8 * padded * 4
    return blocks + stats + vectors + partials + scratch + _TPU_SLACK_BYTES


def norm_tpu_vmem_bytes(call: Call, block_rows: int) -> int:
    """`tpu_block_vmem_bytes` of a `layer_norm` or `layer_norm_backward` call."""
    kind, ins, outs = _tpu_streams(call)
    return tpu_block_vmem_bytes(kind, ins, outs, _rows(call), _features(call), np.dtype(call.x.dtype).itemsize,
                                block_rows)


def tpu_vmem_limit(need: int) -> int | None:
    """The ``vmem_limit_bytes`` a block needing ``need`` bytes asks for: ``None`` while three
    quarters of the generation's scoped default hold it, else the need plus a quarter, capped
    at `tpu_vmem_cap`."""
    if need <= target_generation().scoped_vmem_bytes * 3 // 4:
        return None
    return min(need + need // 4, tpu_vmem_cap())


def tpu_vmem_cap() -> int:
    """The most VMEM a norm block may ask for: three quarters of the generation's physical VMEM."""
    return target_generation().vmem_bytes * 3 // 4


def _rows(call: Call) -> int:
    """Rows of the forward's 2-D view (every axis but the normalized one)."""
    return int(np.prod(call.x.shape)) // max(1, _features(call))


def norm_tpu_space(call: Call) -> list[NormTpuConfig]:
    """Every `TPU_BLOCK_ROWS` size whose VMEM estimate fits `tpu_vmem_cap` and whose block holds
    at most `TPU_MAX_BLOCK_ELEMENTS` (the smallest size is exempt from that cap), without
    sizes that exceed the rows (rounded up to 16) and so repeat the same block."""
    limit = max(16, -(-_rows(call) // 16) * 16)
    padded = tpu_padded_features(_features(call))
    return [NormTpuConfig(block_rows=b) for b in TPU_BLOCK_ROWS
            if b <= limit and norm_tpu_vmem_bytes(call, b) <= tpu_vmem_cap()
            and (b == TPU_BLOCK_ROWS[0] or b * padded <= TPU_MAX_BLOCK_ELEMENTS)]


def norm_tpu_heuristic(call: Call) -> NormTpuConfig:
    """The largest block of the space whose row-blocked operands are at most
    `TPU_TARGET_BLOCK_BYTES` each and that leaves at least `TPU_MIN_STEPS` grid steps (else the
    smallest in the space). Its VMEM may exceed the scoped default: the kernels raise
    ``vmem_limit_bytes`` (`tpu_vmem_limit`)."""
    space = norm_tpu_space(call) or [NormTpuConfig(block_rows=TPU_BLOCK_ROWS[0])]
    padded = tpu_padded_features(_features(call))
    itemsize = np.dtype(call.x.dtype).itemsize
    rows = _rows(call)
    fitting = [c for c in space if c.block_rows * padded * itemsize <= TPU_TARGET_BLOCK_BYTES
               and c.block_rows * TPU_MIN_STEPS <= max(rows, TPU_BLOCK_ROWS[0] * TPU_MIN_STEPS)]
    return fitting[-1] if fitting else space[0]


def norm_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU norm kernels cannot run ``call``: an operand in a dtype other than
    float32/bfloat16 (Mosaic cannot load float16 vectors: compiling fails with "Invalid vector
    type for load" on every generation), or even the smallest block of rows needs more VMEM
    than `tpu_vmem_cap` on the target generation."""
    for name in ("x", "dy", "scale", "offset"):
        value = call.arrays.get(name)
        if value is not None and np.dtype(value.dtype).name not in TPU_DTYPES:
            return (f"{name}: the Mosaic TPU norm kernels take {' or '.join(TPU_DTYPES)}, "
                    f"got {np.dtype(value.dtype).name}")
    if not norm_tpu_space(call):
        need = norm_tpu_vmem_bytes(call, TPU_BLOCK_ROWS[0])
        generation = target_generation()
        return (f"the Mosaic TPU norm kernel holds {TPU_BLOCK_ROWS[0]} rows of {_features(call)} features in VMEM: "
                f"needs {need} bytes > {tpu_vmem_cap()} usable on TPU {generation.name}")
    return None


#: TPU generations where the Mosaic TPU norm *backward* was measured slower than XLA's
#: (generation name → the measurement), so that ``implementation=None`` runs XLA's backward
#: there while the forward kernel stays the default (`norm_tpu_backward_defers_to_xla`).
#: Empty: the chunked backward (one pass over x and dy, column sums accumulated in VMEM)
#: replaced the kernel measured at 0.64x XLA on a v5e (rms_norm 16384x8192 bf16, forward +
#: backward 2.86 ms against 1.84) and has not been measured on a chip yet.
TPU_BACKWARD_SLOWER_THAN_XLA: dict[str, str] = {}


def norm_tpu_backward_defers_to_xla(platform) -> str | None:
    """Why the default chain passes the Mosaic TPU norm backward over on ``platform`` (its
    generation is in `TPU_BACKWARD_SLOWER_THAN_XLA`), or ``None``. The forward's default is
    not affected, and an explicit ``implementation="mosaic_tpu"`` still runs both kernels."""
    tpu = platform.tpu
    if tpu is not None and tpu.name in TPU_BACKWARD_SLOWER_THAN_XLA:
        return (f"measured slower than XLA on a {tpu.name} ({TPU_BACKWARD_SLOWER_THAN_XLA[tpu.name]}); "
                f"the forward kernel stays the default, its gradient runs XLA's backward")
    return None
