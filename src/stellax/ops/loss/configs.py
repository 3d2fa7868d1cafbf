"""Configs of the linear cross-entropy implementations: chunk sizes of the XLA
path, tiles of the Triton and Mosaic TPU kernels."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, TritonConfig, product_space
from ...core.config import require_in, require_positive, require_power_of_two
from ...core.platform import target_generation
from .reduction import dims


@dataclasses.dataclass(frozen=True)
class ChunkedConfig(KernelConfig):
    """``xla_chunked``: ``block_tokens`` tokens per chunk, ``block_vocab`` vocabulary
    columns per inner chunk. The largest temporaries are a ``[block_tokens, V]``
    float32 stack of logits tiles (a scalar loss under ``jax.grad``) and
    ``[block_tokens, block_vocab]`` tiles."""

    block_tokens: int = 256
    block_vocab: int = 2048

    def validate(self) -> None:
        require_positive("ChunkedConfig", "block_tokens", self.block_tokens)
        require_positive("ChunkedConfig", "block_vocab", self.block_vocab)


def chunked_heuristic(call: Call) -> ChunkedConfig:
    """256 tokens × 2048 vocabulary columns (measured on the 2-core CPU at T=4096, D=1024,
    V=32768; see docs/loss.md), smaller for smaller calls."""
    tokens, _, vocab = dims(call)
    return ChunkedConfig(block_tokens=min(256, max(1, tokens)), block_vocab=min(2048, max(1, vocab)))


def chunked_space(call: Call) -> list[ChunkedConfig]:
    """Token chunks 128 … 1024 × vocabulary chunks 1024 … 8192."""
    return product_space(ChunkedConfig, block_tokens=(128, 256, 512, 1024), block_vocab=(1024, 2048, 4096, 8192))


#: Tile sizes a Triton dot takes (every dimension ≥ 16).
_TILES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyConfig(TritonConfig):
    """Triton tiles: ``block_t`` tokens × ``block_v`` vocabulary columns per logits tile,
    stepping ``block_d`` along the hidden size. The forward and the ``dx`` kernel run one
    program per token block, the ``dw`` kernel one per vocabulary block; the gradient
    kernels hold a ``[block_t or block_v, block_d]`` float32 accumulator per program and
    a second grid axis over the hidden size in steps of ``block_d``."""

    block_t: int = 64
    block_v: int = 64
    block_d: int = 64

    def validate(self) -> None:
        super().validate()
        for field in ("block_t", "block_v", "block_d"):
            require_power_of_two("LinearCrossEntropyConfig", field, getattr(self, field))
            require_in("LinearCrossEntropyConfig", field, getattr(self, field), _TILES)


#: The space's tiles: (block_t, block_v, block_d, num_warps, num_stages).
_SPACE = tuple(LinearCrossEntropyConfig(block_t=t, block_v=v, block_d=d, num_warps=w, num_stages=s)
               for t, v, d, w, s in ((16, 32, 32, 4, 2), (32, 64, 64, 4, 2), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3),
                                     (128, 64, 32, 8, 2), (128, 128, 64, 8, 2)))


def triton_space(call: Call) -> list[LinearCrossEntropyConfig]:
    """The Triton autotuning space (six tile shapes)."""
    return list(_SPACE)


def triton_heuristic(call: Call) -> LinearCrossEntropyConfig:
    """16-token tiles for decode-sized calls, 64 × 64 × 64 otherwise."""
    tokens, _, _ = dims(call)
    if tokens <= 16:
        return LinearCrossEntropyConfig(block_t=16, block_v=64, block_d=64, num_warps=4, num_stages=2)
    return LinearCrossEntropyConfig(block_t=64, block_v=64, block_d=64, num_warps=4, num_stages=3)


# -- Mosaic TPU --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LossTpuConfig(KernelConfig):
    """Tiles of the Mosaic TPU kernels: ``block_t`` token rows × ``block_v`` vocabulary
    columns per logits tile, the whole hidden size ``D`` in one contraction. The forward
    and the ``dx`` kernels keep a ``[block_t, D]`` token block resident and stream the
    ``[D, block_v]`` weight tiles; the ``dw`` kernel of the backward op keeps a weight tile
    resident and streams the token blocks. ``block_t`` is a multiple of 16 (bfloat16
    sublanes), ``block_v`` of 128 (lanes); a dimension smaller than its tile is one whole
    block. ``chunk_t``: tokens per chunk of the fused training sweep (a scalar loss under
    differentiation, `mosaic_tpu.fused_forward_backward`), which keeps a ``[chunk, V]``
    logits array in HBM; rounded to whole token blocks."""

    block_t: int = 512
    block_v: int = 512
    chunk_t: int = 2048

    def validate(self) -> None:
        super().validate()
        for field, multiple in (("block_t", 16), ("block_v", 128), ("chunk_t", 16)):
            value = getattr(self, field)
            require_positive("LossTpuConfig", field, value)
            if value % multiple:
                raise ValueError(f"LossTpuConfig.{field}: expected a multiple of {multiple}, got {value}")


def tpu_tile(size: int, block: int) -> int:
    """The tile a dimension of ``size`` really uses: ``block``, or the whole dimension when smaller."""
    return int(size) if size <= block else int(block)


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def tpu_chunk(tokens: int, block_t: int, chunk_t: int) -> tuple[int, int]:
    """``(chunks, chunk)`` of the fused sweep: ``tokens`` padded to ``chunks`` chunks of
    ``chunk`` tokens, a whole number of ``bt``-token blocks (the whole call when it is one
    block) between half of ``max(chunk_t, bt)`` and all of it — the one that pads least, the
    largest of those (3000 tokens, 512-token blocks, ``chunk_t`` 2048: two chunks of 1536,
    not 2048 + a padded 2048). Chunks much smaller than ``chunk_t`` would make the running
    ``dw``'s traffic per chunk the ``dw`` kernel's bound."""
    bt = tpu_tile(tokens, block_t)
    largest = min(max(int(chunk_t), bt) // bt, -(-int(tokens) // bt))
    best = None
    for blocks in range(max(1, (largest + 1) // 2), largest + 1):
        chunk = blocks * bt
        padded = -(-int(tokens) // chunk) * chunk
        if best is None or padded <= best[0]:
            best = (padded, chunk)
    return best[0] // best[1], best[1]


#: Hidden-size slices the fused ``dw`` kernel tries, widest first (it re-reads the chunk's
#: ``dz`` once per slice, and holds ``[chunk, slice]`` of ``x`` in VMEM).
DW_SLICES = (2048, 1024, 512, 256, 128)


def dw_accumulate_vmem_bytes(chunk: int, slice_d: int, bv: int, itemsize: int) -> int:
    """VMEM of the fused ``dw`` kernel's grid step: double-buffered ``x [chunk, slice_d]`` and
    ``dz [chunk, bv]`` blocks, the running ``dw`` tile ``[bv, slice_d]`` in and out (two
    bfloat16 parts, or one float32), double-buffered, four float32 temporaries of the tile, a
    transposed copy of ``dz``, and for float32 operands Mosaic's bfloat16 splits of both blocks
    (fitted to the real compiler: chunk 2048, slice 1024, float32 takes 64 MiB on a v5p)."""
    chunk, bv, slice_d = _round_up(chunk, 16), _round_up(bv, 128), _round_up(slice_d, 128)
    blocks = chunk * (slice_d + bv) * itemsize
    running = 2 * 2 * bv * slice_d * 4
    splits = 2 * blocks if itemsize >= 4 else chunk * bv * itemsize
    return 2 * blocks + running + 4 * bv * slice_d * 4 + splits


def dw_slice(chunk: int, features: int, bv: int, itemsize: int) -> int:
    """The widest hidden-size slice (``D`` itself when ``D`` ≤ 2048, else one of `DW_SLICES`)
    whose fused ``dw`` step fits half the generation's VMEM (wider slices only save re-reads
    of ``dz``, a fifth of that kernel's traffic at D=4096 and 2048)."""
    candidates = ([features] if features <= DW_SLICES[0] else []) + [s for s in DW_SLICES if s < features]
    for slice_d in candidates:
        if dw_accumulate_vmem_bytes(chunk, slice_d, bv, itemsize) <= target_generation().vmem_bytes // 2:
            return slice_d
    return candidates[-1]


def loss_tpu_vmem_bytes(tokens: int, features: int, vocab: int, itemsize: int, config: LossTpuConfig) -> int:
    """VMEM the largest of the kernels (forward, ``dx``, ``dw``; the fused sweep's logits
    forward, ``dz``/``dx`` and ``dw`` kernels) needs for one grid step: double-buffered
    ``[bt, D]`` and ``[bv, D]`` operand blocks of ``itemsize`` bytes, the ``dx``/``dw``
    output block (double-buffered) and its float32 accumulator, five ``[bt, 1]`` per-token
    vectors (padded to 128 lanes), about six float32 ``[bt, bv]`` temporaries (logits, soft
    cap, exponentials, masks, ``dz``) and, in the fused sweep, the ``[bt, bv]`` logits blocks
    in and out (`dw_accumulate_vmem_bytes` for its ``dw`` kernel)."""
    bt = _round_up(tpu_tile(tokens, config.block_t), 16)
    bv = _round_up(tpu_tile(vocab, config.block_v), 128)
    d = _round_up(features, 128)
    operands = 2 * (bt + bv) * d * itemsize
    vectors = 2 * 5 * bt * 128 * 4
    temps = 6 * bt * bv * 4
    dx = bt * d * 4 + 2 * bt * d * itemsize
    dw = bv * d * 4 + 2 * bv * d * itemsize
    logits = 2 * 2 * bt * bv * itemsize + 2 * bt * 128 * 4
    fused_forward = operands + vectors + temps + logits
    fused_dx = 2 * bv * d * itemsize + logits + vectors + temps + 2 * bt * d * 4
    _, chunk = tpu_chunk(tokens, config.block_t, config.chunk_t)
    fused_dw = dw_accumulate_vmem_bytes(chunk, dw_slice(chunk, features, bv, itemsize), bv, itemsize)
    return max(operands + vectors + temps + max(dx, dw), fused_forward, fused_dx, fused_dw)


def loss_tpu_vmem_limit(need: int) -> int | None:
    """``vmem_limit_bytes`` for ``need`` bytes: ``None`` while three quarters of the target
    generation's scoped default hold it, else the need plus a quarter (at most the physical
    VMEM less 8 MiB)."""
    generation = target_generation()
    if need <= generation.scoped_vmem_bytes * 3 // 4:
        return None
    return min(need + need // 4, generation.vmem_bytes - 8 * 2**20)


def _tpu_dims(call: Call) -> tuple[int, int, int, int]:
    tokens, features, vocab = dims(call)
    return tokens, features, vocab, np.dtype(call.x.dtype).itemsize


def _tpu_budget() -> int:
    """VMEM a config may take: three quarters of the generation's physical VMEM."""
    return target_generation().vmem_bytes * 3 // 4


def loss_tpu_space(call: Call) -> list[LossTpuConfig]:
    """``block_t`` 256/512/1024 × ``block_v`` 256/512/1024 that fit three quarters of the
    generation's VMEM (`loss_tpu_vmem_bytes`), one per distinct effective tiling; the
    smallest tiles (128 × 128) when nothing else fits."""
    tokens, features, vocab, itemsize = _tpu_dims(call)
    seen, out = set(), []
    for bt in (256, 512, 1024):
        for bv in (256, 512, 1024):
            config = LossTpuConfig(block_t=bt, block_v=bv)
            tiles = (tpu_tile(tokens, bt), tpu_tile(vocab, bv))
            if tiles in seen or loss_tpu_vmem_bytes(tokens, features, vocab, itemsize, config) > _tpu_budget():
                continue
            seen.add(tiles)
            out.append(config)
    return out or [LossTpuConfig(block_t=128, block_v=128)]


def loss_tpu_heuristic(call: Call) -> LossTpuConfig:
    """512 × 512 tiles, shrunk (``block_v``, then ``block_t``, down to 128) until the kernels
    fit three quarters of the generation's VMEM. Why 512 tokens: the forward and the ``dx``
    kernel stream the whole weight matrix once per token block, so a step does
    ``2·bt·bv·D`` flops (``4·bt·bv·D`` in ``dx``) per ``bv·D`` weight bytes: ``bt`` flop/byte
    in bfloat16 — a v5e needs ~240 (197 TFLOP/s over 819 GB/s) to keep its MXU busy. The
    ``dw`` kernel streams the tokens once per weight tile, ``2·bv`` flop/byte. The grid then
    has ``T/512 · V/512`` steps (4096 at T=8192, V=131072: ~1.4 ms of step overhead against
    ~45 ms of MXU work per matmul).

    Chunks of 2048 tokens for the fused sweep: its ``dw`` kernel reads and writes the running
    ``dw`` (8 bytes per weight, two bfloat16 parts or float32) once per chunk against
    ``2·chunk`` flops per weight, ``chunk/4`` flop/byte — 512 at 2048, twice what a v5e needs —
    while the kept logits take ``chunk·V`` elements of HBM (512 MiB at V=131072 in bfloat16)."""
    tokens, features, vocab, itemsize = _tpu_dims(call)
    config = LossTpuConfig(block_t=512, block_v=512)
    for field in ("block_v", "block_t") * 3:
        if loss_tpu_vmem_bytes(tokens, features, vocab, itemsize, config) <= _tpu_budget():
            break
        if getattr(config, field) > 128:
            config = config.replace(**{field: getattr(config, field) // 2})
    return config


def loss_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU kernels cannot run ``call``: operands the MXU does not multiply
    natively on the target generation (float16), or a hidden size so large that even
    128 × 128 tiles with the whole ``D`` resident do not fit the VMEM (the kernels do not
    tile ``D``)."""
    generation = target_generation()
    dtype = np.dtype(call.x.dtype)
    if not generation.has_dtype(dtype):
        return (f"x: the Mosaic TPU loss kernels multiply {', '.join(generation.matmul_dtypes)} on TPU "
                f"{generation.name}, got {dtype.name}")
    tokens, features, vocab, itemsize = _tpu_dims(call)
    smallest = LossTpuConfig(block_t=128, block_v=128)
    need = loss_tpu_vmem_bytes(tokens, features, vocab, itemsize, smallest)
    if need > _tpu_budget():
        return (f"x: hidden size D={features} needs {need / 2**20:.0f} MiB of VMEM with the smallest tiles "
                f"(the kernels hold whole rows of D), over {_tpu_budget() / 2**20:.0f} MiB on TPU {generation.name}")
    return None
