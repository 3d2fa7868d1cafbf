"""Configs of the Mosaic TPU chunked linear-attention kernels (`mosaic_tpu`,
`mosaic_tpu_backward`): chunk length and value columns per program, sized
per TPU generation.

A grid step holds, double-buffered, the chunk's ``q, k [C, Kp]`` (and
per-channel ``g [C, Kp]``), ``v`` and ``o [C, BV]``, the decay and ``β``
columns (``[C, 1]``, padded to 128 lanes in VMEM), the ``h0`` and ``final``
blocks ``[Kp, BV]``, the float32 state scratch ``[Kp, BV]``, and the chunk's
temporaries (scores, the solve's ``[C, C]`` products, ``[C, Kp]`` factors).
`tpu_vmem_bytes` estimates that at TPU tiling; configs over the generation's
scoped-VMEM default raise ``vmem_limit_bytes`` (never above half the
physical VMEM) and those over it are not in the space.
"""

from __future__ import annotations

import dataclasses

from ...core import Call, KernelConfig, product_space
from ...core.config import require_in
from ...core.tpu import target_generation

#: Chunk lengths the kernels take (64 is the backward layout's, `configs.TRITON_CHUNK`).
TPU_CHUNKS = (64, 128)
#: Value columns of the state per program.
TPU_BLOCK_V = (128, 256)
#: Largest key / value head size (the ``[K, V]`` state and ``[C, K]`` tiles in VMEM).
TPU_MAX_HEAD_DIM = 256
#: Temporaries of one chunk step, in ``[C, max(C, Kp, BV)]`` float32 tiles (scores,
#: decays, the solve's products, the factors): an upper estimate.
_TEMPORARIES = 16


@dataclasses.dataclass(frozen=True)
class TpuLinearAttentionConfig(KernelConfig):
    """``chunk`` tokens per grid step and ``block_v`` value columns of the state per program."""

    chunk: int = 64
    block_v: int = 128

    def validate(self) -> None:
        require_in("TpuLinearAttentionConfig", "chunk", self.chunk, TPU_CHUNKS)
        require_in("TpuLinearAttentionConfig", "block_v", self.block_v, TPU_BLOCK_V)


def lanes(d: int) -> int:
    """A head size padded to whole 128-lane vregs (the kernels' ``Kp``, ``Vp``)."""
    return max(128, -(-d // 128) * 128)


def _dims(call: Call) -> tuple[int, int, bool]:
    """``(K, V, per_channel)`` of a GDN/KDA, SSD or backward call."""
    if "x" in call.arrays:  # ssd: K = state size N, V = head dim P
        return call.B.shape[-1], call.x.shape[-1], False
    per_channel = call.g.ndim == call.k.ndim
    return call.k.shape[-1], call.v.shape[-1], per_channel


def tpu_vmem_bytes(kp: int, bv: int, chunk: int, per_channel: bool, backward: bool = False) -> int:
    """VMEM bytes of one grid step (module docstring), float32. The backward
    kernel (``backward``) adds ``do``, the stored state, ``dfinal``/``dh0``, the
    gradient blocks, and keeps the chunk's forward temporaries for its
    transpose (counted three times; per channel ``3·C/16`` times)."""
    g_width = kp if per_channel else 128
    tokens = 2 * chunk * (2 * kp + g_width + 128 + 2 * bv)  # q k g β v o, double-buffered
    states = 2 * 2 * kp * bv + kp * bv                      # h0, final, scratch
    temporaries = _TEMPORARIES * chunk * max(chunk, kp, bv)
    if backward:
        tokens += 2 * chunk * (2 * kp + g_width + 128 + bv)  # dq dk dg dβ dv
        states += 2 * kp * bv
        # The transpose keeps the forward's temporaries; per channel, those of every
        # step of the unrolled diagonal loop of `scores.channel_scores` (16 steps of
        # [C, K] tiles, each step's count growing with the chunk's sub-blocks).
        temporaries *= 3 * chunk // 16 if per_channel else 3
    return 4 * (tokens + states + temporaries)


def tpu_vmem_limit(kp: int, bv: int, chunk: int, per_channel: bool, backward: bool = False) -> int | None:
    """``vmem_limit_bytes`` for a config: ``None`` within the generation's scoped
    default, else twice the estimate (at most half the physical VMEM)."""
    generation = target_generation()
    need = tpu_vmem_bytes(kp, bv, chunk, per_channel, backward)
    if need <= generation.scoped_vmem_bytes:
        return None
    return min(2 * need, generation.vmem_bytes // 2)


def linear_attention_tpu_space(call: Call) -> list[TpuLinearAttentionConfig]:
    """Chunks of 64 or 128 and ``block_v`` 128 or 256 (≤ the padded V) whose VMEM
    estimate fits half the generation's physical VMEM."""
    kdim, vdim, per_channel = _dims(call)
    kp, vp = lanes(kdim), lanes(vdim)
    budget = target_generation().vmem_bytes // 2
    configs = product_space(TpuLinearAttentionConfig, chunk=TPU_CHUNKS, block_v=TPU_BLOCK_V)
    return [c for c in configs
            if c.block_v <= vp and vp % c.block_v == 0 and tpu_vmem_bytes(kp, c.block_v, c.chunk, per_channel) <= budget]


def _backward_chunks(call: Call) -> tuple[int, ...]:
    """Chunks a backward-op call can take: 64 (its layout's, `configs.TRITON_CHUNK`),
    and 128 for a dense batch whose padded length is a multiple of 128."""
    dense = call.arrays.get("first") is None
    return (64, 128) if dense and call.v.shape[2] % 128 == 0 else (64,)


def linear_attention_tpu_backward_space(call: Call) -> list[TpuLinearAttentionConfig]:
    """The backward ops' space: the chunks the call can take (`_backward_chunks`)
    and ``block_v`` 128 or 256 whose backward VMEM estimate fits half the physical VMEM."""
    kdim, vdim, per_channel = _dims(call)
    kp, vp = lanes(kdim), lanes(vdim)
    budget = target_generation().vmem_bytes // 2
    configs = product_space(TpuLinearAttentionConfig, chunk=_backward_chunks(call), block_v=TPU_BLOCK_V)
    return [c for c in configs if c.block_v <= vp and vp % c.block_v == 0
            and tpu_vmem_bytes(kp, c.block_v, c.chunk, per_channel, backward=True) <= budget]


def linear_attention_tpu_backward_heuristic(call: Call) -> TpuLinearAttentionConfig:
    """The backward ops' default: the whole padded V per program (≤ 256) and the
    largest chunk of the space (chunks of 128 halve the stored chunk states,
    ``NT·K·V`` per head in HBM)."""
    _, vdim, _ = _dims(call)
    space = linear_attention_tpu_backward_space(call)
    whole = [c for c in space if c.block_v == min(lanes(vdim), 256)] or space
    return max(whole, key=lambda c: c.chunk) if whole else TpuLinearAttentionConfig(64, min(lanes(vdim), 256))


def linear_attention_tpu_heuristic(call: Call) -> TpuLinearAttentionConfig:
    """Chunks of 64 (the solve's MXU work per token grows with the chunk) and
    the whole padded V per program (splitting V repeats the chunk's solve)."""
    _, vdim, _ = _dims(call)
    return TpuLinearAttentionConfig(chunk=64, block_v=min(lanes(vdim), 256))


def linear_attention_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU kernels cannot run ``call`` (``None`` when they can)."""
    kdim, vdim, _ = _dims(call)
    if kdim > TPU_MAX_HEAD_DIM or vdim > TPU_MAX_HEAD_DIM:
        return (f"the Mosaic TPU kernels hold [K, V] states and [C, K] tiles in VMEM: K={kdim}, V={vdim}, "
                f"the limit is {TPU_MAX_HEAD_DIM}")
    return None
