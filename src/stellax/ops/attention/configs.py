"""Configs of the attention implementations.

* `ChunkedConfig` (``xla_chunked``): query/key block lengths of the online
  softmax loops.
* `FlashConfig` (``triton``): the forward kernel's ``block_q``/``block_k``
  and Triton ``num_warps``/``num_stages``. The backward op has its own
  `FlashBackwardConfig` (blocks of the dq and the dk/dv kernels).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ...core import Call, KernelConfig, TritonConfig, next_power_of_two, product_space
from ...core.config import require_positive, require_power_of_two

#: Head dims the Triton kernels hold in registers (padded to a power of two).
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class ChunkedConfig(KernelConfig):
    block_q: int = 256
    block_k: int = 256

    def validate(self) -> None:
        require_positive("ChunkedConfig", "block_q", self.block_q)
        require_positive("ChunkedConfig", "block_k", self.block_k)


def _lengths(call: Call):
    q, k = call.query, call.key
    return q.shape[-3], k.shape[-3]


def chunked_heuristic(call: Call) -> ChunkedConfig:
    t, s = _lengths(call)
    # 256 x 256 logits tiles measured best on a 2-core CPU (T = S = 2048, H = 64).
    return ChunkedConfig(block_q=max(1, min(256, t)), block_k=max(1, min(256, s)))


def chunked_space(call: Call) -> list[ChunkedConfig]:
    return product_space(ChunkedConfig, block_q=(128, 256, 512, 1024), block_k=(128, 256, 512, 1024))


@dataclasses.dataclass(frozen=True)
class FlashConfig(TritonConfig):
    """Forward kernel: a ``block_q × block_k`` logits tile per step."""

    block_q: int = 64
    block_k: int = 64

    def validate(self) -> None:
        super().validate()
        require_power_of_two("FlashConfig", "block_q", self.block_q)
        require_power_of_two("FlashConfig", "block_k", self.block_k)
        if self.block_q < 16 or self.block_k < 16:
            raise ValueError(f"FlashConfig: block_q/block_k must be >= 16 (tl.dot), got "
                             f"{self.block_q}/{self.block_k}")


@dataclasses.dataclass(frozen=True)
class FlashBackwardConfig(TritonConfig):
    """Backward kernels: dq (q-block major, loops over k) and dk/dv (k-block
    major, loops over q and the query heads of the kv head's group)."""

    block_q: int = 64
    block_k: int = 64

    def validate(self) -> None:
        super().validate()
        require_power_of_two("FlashBackwardConfig", "block_q", self.block_q)
        require_power_of_two("FlashBackwardConfig", "block_k", self.block_k)
        if self.block_q < 16 or self.block_k < 16:
            raise ValueError(f"FlashBackwardConfig: block_q/block_k must be >= 16 (tl.dot), got "
                             f"{self.block_q}/{self.block_k}")


def head_dims(call: Call):
    return call.query.shape[-1], call.value.shape[-1]


def _padded(d: int) -> int:
    return max(16, next_power_of_two(d))


def flash_requirements(call: Call) -> str | None:
    h, hv = head_dims(call)
    if max(h, hv) > MAX_HEAD_DIM:
        return f"the Triton attention kernels support head dims up to {MAX_HEAD_DIM}, got H={h}, Hv={hv}"
    return None


def _fits(block_q: int, block_k: int, h: int, hv: int, num_stages: int, itemsize: int = 2) -> bool:
    """Rough shared-memory bound: staged K/V tiles plus the resident Q tile."""
    hp, hvp = _padded(h), _padded(hv)
    smem = (block_q * hp + num_stages * block_k * (hp + hvp)) * itemsize
    return smem <= 160 * 1024 and block_q * max(hp, hvp) <= 128 * 256


def _itemsize(call: Call) -> int:
    return 4 if call.query.dtype == jnp.float32 else 2


def flash_heuristic(call: Call) -> FlashConfig:
    h, hv = head_dims(call)
    d = max(_padded(h), _padded(hv))
    if _itemsize(call) == 4 and d > 64:
        return FlashConfig(block_q=64, block_k=32, num_warps=4, num_stages=2)
    if d <= 64:
        return FlashConfig(block_q=128, block_k=64, num_warps=4, num_stages=3)
    if d <= 128:
        return FlashConfig(block_q=128, block_k=64, num_warps=8, num_stages=2)
    return FlashConfig(block_q=64, block_k=32, num_warps=8, num_stages=2)


def flash_space(call: Call) -> list[FlashConfig]:
    h, hv = head_dims(call)
    space = product_space(FlashConfig, block_q=(64, 128), block_k=(32, 64, 128), num_warps=(4, 8),
                          num_stages=(2, 3))
    return [c for c in space if _fits(c.block_q, c.block_k, h, hv, c.num_stages, _itemsize(call))]


def flash_backward_heuristic(call: Call) -> FlashBackwardConfig:
    h, hv = head_dims(call)
    d = max(_padded(h), _padded(hv))
    if _itemsize(call) == 4 and d > 64:
        return FlashBackwardConfig(block_q=32, block_k=32, num_warps=4, num_stages=1)
    if d <= 64:
        return FlashBackwardConfig(block_q=64, block_k=64, num_warps=4, num_stages=2)
    if d <= 128:
        return FlashBackwardConfig(block_q=64, block_k=64, num_warps=8, num_stages=2)
    return FlashBackwardConfig(block_q=32, block_k=32, num_warps=8, num_stages=1)


def flash_backward_space(call: Call) -> list[FlashBackwardConfig]:
    h, hv = head_dims(call)
    space = product_space(FlashBackwardConfig, block_q=(32, 64), block_k=(32, 64), num_warps=(4, 8),
                          num_stages=(1, 2))
    size = _itemsize(call)
    return [c for c in space if _fits(c.block_q, c.block_k, h, hv, c.num_stages, size)
            and _fits(c.block_k, c.block_q, h, hv, c.num_stages, size)]
