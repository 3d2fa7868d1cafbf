"""Config of the linear attention Triton kernels, its heuristic, autotuning
space and what the kernels can run."""

from __future__ import annotations

import dataclasses
import functools

from ...core import Call, TritonConfig, current_platform, product_space
from ...core.config import require_in
from ...core.pallas import padded_dim

#: The Triton kernels work on chunks of this many tokens (fla's BT).
TRITON_CHUNK = 64
#: Largest key / value head size the kernels hold in registers.
MAX_HEAD_DIM = 256
#: KDA's WY solve kernel (stellax_kda_intra, the whole chunk's inverse) spills registers below sm_90
#: (static tier: 3.2-3.6 KB spill stores at sm_80; every KDA kernel fits 64 KiB of shared memory).
KDA_MIN_CAPABILITY = (9, 0)
#: Channels (and value columns) KDA's intra-chunk kernels handle at a time: their
#: ``[C, K]`` tiles at K = 256 took 320 KiB of shared memory (sm_90 has 227).
KDA_BLOCK_K = 64


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig(TritonConfig):
    """``block_v`` value columns of the ``[K, V]`` state per program (state
    scan, output and backward kernels); ``num_warps``/``num_stages`` for all."""

    block_v: int = 64

    def validate(self) -> None:
        super().validate()
        require_in("LinearAttentionConfig", "block_v", self.block_v, (16, 32, 64, 128))


def _dims(call: Call) -> tuple[int, int]:
    """``(K, V)`` of a GDN/KDA or SSD call (SSD: K = state size N, V = head dim P)."""
    if "x" in call.arrays:
        return call.B.shape[-1], call.x.shape[-1]
    return call.k.shape[-1], call.v.shape[-1]


def fits_shared_memory(kdim: int, config: LinearAttentionConfig) -> bool:
    """Keep the state kernels' ``[K, block_v]`` tiles (and their pipelined
    copies) within sm_80's 163 KiB of shared memory. Measured with the PTX
    tier: K=128, block_v=128, 2 stages takes 164 KiB; K=256, block_v=64,
    2 stages 229 KiB, block_v=32, 2 stages 208 KiB; block_v=64, 1 stage 80 KiB."""
    tile = kdim * config.block_v
    if config.num_stages > 1:
        return kdim <= 128 and tile <= 128 * 64
    return tile <= 256 * 64


#: Largest ``K × block_v`` state tile of the autotuning space: the scans carry
#: the ``[K, block_v]`` state in registers (as `triton_scan.BLOCK_K`-row
#: blocks), and the static tier measured register spills above ``128 × 64``.
MAX_STATE_TILE = 128 * 64


def linear_attention_heuristic(call: Call) -> LinearAttentionConfig:
    """The default config, from the static tier's ptxas readings (sm_90 and
    sm_80, TF32X3 dots): at ``K ≥ 128`` 32 value columns and one stage (64
    columns, or a second stage, spill the state scan's registers at K = V = 128),
    below sm_90 16 columns on 8 warps (at 32 columns on 4 warps sm_80's scans
    spilled 196 B (GDN) and 344 B (SSD state), the GDN output 8 B; 16 columns on
    4 warps still 32 B in the GDN scan; 16 on 8 warps none);
    below K = 128, ``block_v = min(64, V)`` and two stages (cp.async prefetch of the next
    chunk in the scans), four warps (head sizes padded as the kernels pad them)."""
    kdim, vdim = (padded_dim(d) for d in _dims(call))
    if kdim >= 128 and current_platform().nvidia_below((9, 0)):
        return LinearAttentionConfig(block_v=min(16, vdim), num_warps=8, num_stages=1)
    if kdim >= 128:
        return LinearAttentionConfig(block_v=min(32, vdim), num_warps=4, num_stages=1)
    return LinearAttentionConfig(block_v=min(64, vdim), num_warps=4, num_stages=2)


def linear_attention_space(call: Call) -> list[LinearAttentionConfig]:
    """The autotuning space: ``block_v ∈ {16, 32, 64}`` (≤ V, ``K × block_v`` at
    most `MAX_STATE_TILE`), 4 or 8 warps, 1 or 2 stages, keeping the configs that
    fit sm_80's shared memory (`fits_shared_memory`)."""
    kdim, vdim = (padded_dim(d) for d in _dims(call))
    configs = product_space(LinearAttentionConfig, block_v=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2))
    return [c for c in configs if c.block_v <= vdim and kdim * c.block_v <= MAX_STATE_TILE
            and fits_shared_memory(kdim, c)]


def linear_attention_requirements(call: Call, *, per_channel: bool = False) -> str | None:
    """Why the Triton kernels cannot run ``call`` (``None`` when they can): head
    sizes over `MAX_HEAD_DIM`, or, for per-channel decays (KDA), a GPU below sm_90."""
    kdim, vdim = _dims(call)
    if kdim > MAX_HEAD_DIM or vdim > MAX_HEAD_DIM:
        return f"the Triton kernels hold [K, V] states in registers: K={kdim}, V={vdim}, the limit is {MAX_HEAD_DIM}"
    if per_channel:  # KDA's kernels (triton_intra.kda_intra_forward, triton_kda_backward)
        platform = current_platform()
        if platform.nvidia_below(KDA_MIN_CAPABILITY):
            return (f"KDA's Triton kernels need sm_90: at sm_80 the WY solve kernel (stellax_kda_intra) spills "
                    f"3.2-3.6 KB of registers per thread (static tier), at sm_90 none; this GPU is "
                    f"{platform.describe()}")
    return None


def triton_requirements(per_channel: bool):
    """The ``requirements`` of a Triton implementation for scalar (GDN, SSD) or
    per-channel (KDA) decays."""
    return functools.partial(linear_attention_requirements, per_channel=per_channel)
