"""Configs of the linear cross-entropy implementations: chunk sizes of the XLA
path, tiles of the Triton kernels."""

from __future__ import annotations

import dataclasses

from ...core import Call, KernelConfig, TritonConfig, product_space
from ...core.config import require_in, require_positive, require_power_of_two
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
