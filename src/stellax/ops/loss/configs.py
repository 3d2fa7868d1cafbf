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
    and the ``dx`` kernel keep a ``[block_t, D]`` token block resident and stream the
    ``[D, block_v]`` weight tiles; the ``dw`` kernel keeps a weight tile resident and
    streams the token blocks. ``block_t`` is a multiple of 16 (bfloat16 sublanes),
    ``block_v`` of 128 (lanes); a dimension smaller than its tile is one whole block."""

    block_t: int = 512
    block_v: int = 512

    def validate(self) -> None:
        super().validate()
        for field, multiple in (("block_t", 16), ("block_v", 128)):
            value = getattr(self, field)
            require_positive("LossTpuConfig", field, value)
            if value % multiple:
                raise ValueError(f"LossTpuConfig.{field}: expected a multiple of {multiple}, got {value}")


def tpu_tile(size: int, block: int) -> int:
    """The tile a dimension of ``size`` really uses: ``block``, or the whole dimension when smaller."""
    return int(size) if size <= block else int(block)


def _round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def loss_tpu_vmem_bytes(tokens: int, features: int, vocab: int, itemsize: int, config: LossTpuConfig) -> int:
    """VMEM the largest of the three kernels (forward, ``dx``, ``dw``) needs for one grid step:
    double-buffered ``[bt, D]`` and ``[bv, D]`` operand blocks of ``itemsize`` bytes, the
    ``dx``/``dw`` output block (double-buffered) and its float32 accumulator, five ``[bt, 1]``
    per-token vectors (padded to 128 lanes) and about six float32 ``[bt, bv]`` temporaries
    (logits, soft cap, exponentials, masks, ``dz``)."""
    bt = _round_up(tpu_tile(tokens, config.block_t), 16)
    bv = _round_up(tpu_tile(vocab, config.block_v), 128)
    d = _round_up(features, 128)
    operands = 2 * (bt + bv) * d * itemsize
    vectors = 2 * 5 * bt * 128 * 4
    temps = 6 * bt * bv * 4
    dx = bt * d * 4 + 2 * bt * d * itemsize
    dw = bv * d * 4 + 2 * bv * d * itemsize
    return operands + vectors + temps + max(dx, dw)


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
    ~45 ms of MXU work per matmul)."""
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
