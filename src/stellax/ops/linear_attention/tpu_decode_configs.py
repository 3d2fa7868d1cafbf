"""Configs of the Mosaic TPU decode kernels (`mosaic_tpu_decode`): the value
tile of the state, and the tokens per grid step of the fused recurrence.

`fused_recurrent_gated_delta_rule` / `fused_recurrent_kda`
(`FusedRecurrentTpuConfig`): a grid step holds the float32 state tile
``S [K, BV]`` in a VMEM scratch, the initial- and final-state blocks
``[K, BV]`` (double-buffered) and ``block_t`` tokens of ``q, k`` (and KDA's
``g``) ``[block_t, K]``, ``v, o [block_t, BV]`` and the per-token scalars
``[block_t, 2]`` (double-buffered, float32). ``BV = min(block_v, V)``.

`ssd_step` (`SsdStepTpuConfig`): a grid step holds ``block_p`` rows of the
state ``[block_p, N]`` in and out (double-buffered), the rows' ``dt`` and
``x`` columns, ``B`` and ``C`` rows ``[1, N]`` and, for mamba_ssm's tied
shapes, ``A [block_p, N]``.

VMEM is estimated at TPU tiling (rows to 8, lanes to 128); configs over the
generation's scoped-VMEM default are not in its space (none come near it:
the largest, K = V = 256 with 128 tokens per step, takes about 2.4 MiB).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, product_space
from ...core.config import require_in
from ...core.tpu import target_generation

#: Value-tile widths (lanes) of the fused recurrence's state; ``V`` below a tile is taken whole.
BLOCK_V = (128, 256)
#: Tokens per grid step of the fused recurrence (a multiple of the 8-row sublane tile).
BLOCK_T = (8, 32, 128)
#: Row tiles of `ssd_step`'s state ``[P, N]``.
BLOCK_P = (64, 128, 256)
#: Largest ``K``/``V`` (GDN/KDA) and ``N`` (SSD) the decode kernels take.
MAX_HEAD_DIM = 256


def _tile_bytes(rows: int, cols: int, itemsize: int = 4) -> int:
    """VMEM bytes of a ``[rows, cols]`` buffer at TPU tiling (8·(4/itemsize) rows, 128 lanes)."""
    sub = 8 * max(1, 4 // itemsize)
    return (-(-rows // sub) * sub) * (-(-cols // 128) * 128) * itemsize


@dataclasses.dataclass(frozen=True)
class FusedRecurrentTpuConfig(KernelConfig):
    """``block_v`` value columns of the state per grid step; ``block_t`` tokens
    per grid step (the token axis is sequential)."""

    block_v: int = 128
    block_t: int = 8

    def validate(self) -> None:
        """``block_v`` one of 128, 256; ``block_t`` one of 8, 32, 128."""
        require_in("FusedRecurrentTpuConfig", "block_v", self.block_v, BLOCK_V)
        require_in("FusedRecurrentTpuConfig", "block_t", self.block_t, BLOCK_T)


def _recurrent_dims(call: Call) -> tuple[int, int, int, bool]:
    """``(K, V, tokens per sequence (mean, rounded up), per_channel)`` of a GDN/KDA call."""
    B, T, _, K = call.q.shape
    V = call.v.shape[-1]
    n = B if call.cu_seqlens is None else call.cu_seqlens.shape[0] - 1
    per_seq = T if call.cu_seqlens is None else -(-T // max(n, 1))
    return K, V, per_seq, call.g.ndim == 4


def fused_recurrent_tpu_vmem(call: Call, c: FusedRecurrentTpuConfig) -> int:
    """VMEM bytes of one grid step (see the module doc)."""
    K, V, _, per_channel = _recurrent_dims(call)
    bv = min(c.block_v, V)
    state_item = np.dtype(call.initial_state.dtype).itemsize if call.initial_state is not None else 4
    state = _tile_bytes(K, bv) + 2 * _tile_bytes(K, bv, state_item) + 2 * _tile_bytes(K, bv)
    tokens = 2 * ((3 if per_channel else 2) * _tile_bytes(c.block_t, K) + 2 * _tile_bytes(c.block_t, bv)
                  + _tile_bytes(c.block_t, 2))
    return state + tokens


def fused_recurrent_tpu_space(call: Call) -> list[FusedRecurrentTpuConfig]:
    """Value tiles 128/256 (one when ``V ≤ 128``: ``V`` is taken whole) × tokens
    per step 8/32/128 (those below the sequences' mean length and the smallest
    that holds it: the heuristic's), within the generation's scoped VMEM."""
    K, V, per_seq, _ = _recurrent_dims(call)
    budget = target_generation().scoped_vmem_bytes
    tiles = BLOCK_V if V > BLOCK_V[0] else BLOCK_V[:1]
    steps = [t for t in BLOCK_T if t < per_seq] + [t for t in BLOCK_T if t >= per_seq][:1]
    configs = product_space(FusedRecurrentTpuConfig, block_v=tuple(tiles), block_t=tuple(steps))
    kept = [c for c in configs if fused_recurrent_tpu_vmem(call, c) <= budget]
    return kept or [FusedRecurrentTpuConfig()]


def fused_recurrent_tpu_heuristic(call: Call) -> FusedRecurrentTpuConfig:
    """The whole value head up to 256 lanes (fewer grid steps per state), and
    the smallest token step that holds a sequence's mean length (8 for decode,
    where a step of a few tokens reads and writes the state once), 128 above."""
    K, V, per_seq, _ = _recurrent_dims(call)
    block_v = 256 if V > 128 else 128
    block_t = next((t for t in BLOCK_T if t >= per_seq), BLOCK_T[-1])
    return FusedRecurrentTpuConfig(block_v=block_v, block_t=block_t)


def fused_recurrent_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU fused recurrence cannot run ``call`` (None when it can)."""
    K, V, _, _ = _recurrent_dims(call)
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        return f"the Mosaic TPU fused recurrence takes K, V ≤ {MAX_HEAD_DIM}, got K={K}, V={V}"
    dtype = np.dtype(call.q.dtype)
    if dtype.name not in ("float32", "bfloat16"):
        return f"the Mosaic TPU fused recurrence needs float32/bfloat16 inputs, got {dtype.name}"
    return None


# -- ssd_step ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SsdStepTpuConfig(KernelConfig):
    """``block_p`` rows (head-dim entries) of the ``[P, N]`` state per grid step."""

    block_p: int = 64

    def validate(self) -> None:
        """``block_p`` one of 64, 128, 256."""
        require_in("SsdStepTpuConfig", "block_p", self.block_p, BLOCK_P)


def _tied_a(call: Call) -> bool:
    return call.A.ndim == 3


def ssd_step_tpu_vmem(call: Call, c: SsdStepTpuConfig) -> int:
    """VMEM bytes of one `ssd_step` grid step (see the module doc)."""
    P, N = call.x.shape[-1], call.B.shape[-1]
    bp = min(c.block_p, P)
    item = np.dtype(call.state.dtype).itemsize
    state = 2 * 2 * _tile_bytes(bp, N, item)
    columns = 2 * 3 * _tile_bytes(bp, 1)  # dt, x, y
    rows = 2 * 2 * _tile_bytes(1, N)
    a = 2 * _tile_bytes(bp, N) if _tied_a(call) else 2 * _tile_bytes(1, 1)
    return state + columns + rows + a


def ssd_step_tpu_space(call: Call) -> list[SsdStepTpuConfig]:
    """Row tiles 64/128/256 (those not above ``P`` rounded up to 64, at least 64),
    within the generation's scoped VMEM."""
    P = call.x.shape[-1]
    budget = target_generation().scoped_vmem_bytes
    configs = [SsdStepTpuConfig(b) for b in BLOCK_P if b == BLOCK_P[0] or b <= -(-P // 64) * 64]
    kept = [c for c in configs if ssd_step_tpu_vmem(call, c) <= budget]
    return kept or [SsdStepTpuConfig()]


def ssd_step_tpu_heuristic(call: Call) -> SsdStepTpuConfig:
    """The whole head (``P`` rows) up to 256: one grid step per (batch, head)."""
    P = call.x.shape[-1]
    return SsdStepTpuConfig(next((b for b in BLOCK_P if b >= P), BLOCK_P[-1]))


def ssd_step_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU `ssd_step` kernel cannot run ``call`` (None when it can)."""
    N = call.B.shape[-1]
    if N > MAX_HEAD_DIM:
        return f"the Mosaic TPU ssd_step kernel takes a state size N ≤ {MAX_HEAD_DIM}, got N={N}"
    for name in ("x", "state"):
        dtype = np.dtype(call.arrays[name].dtype)
        if dtype.name not in ("float32", "bfloat16"):
            return f"the Mosaic TPU ssd_step kernel needs float32/bfloat16 {name}, got {dtype.name}"
    return None
