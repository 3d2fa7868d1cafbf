"""Configs of every linear-attention backend: config dataclasses, heuristics,
autotuning spaces and what each backend's kernels can run (``requirements``).

* Triton (`pipeline` and its stage kernels): `LinearAttentionConfig`, forward
  and backward ops alike;
* Mosaic TPU, chunked (`mosaic_tpu`, `mosaic_tpu_backward`):
  `TpuLinearAttentionConfig`, the forward and the backward ops' spaces;
* Mosaic TPU, decode (`mosaic_tpu_decode`): `FusedRecurrentTpuConfig` and
  `SsdStepTpuConfig`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, TritonConfig, current_platform, product_space
from ...core.config import require_in
from ...core.pallas import padded_dim
from ...core.platform import target_generation
from ...core.precision import HIGHEST
from .mxu import Products, chunk_products, operand_dtype
from .tpu_costs import kernel_seconds

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


def triton_requirements(call: Call) -> str | None:
    """The ``requirements`` of the Triton implementations, forward and backward:
    `linear_attention_requirements` with the call's decays (per channel when ``g``
    has the rank of ``k``: KDA's ``[B, T, HV, K]`` and ``[Bs, HV, Tp, K]``; SSD never)."""
    per_channel = "x" not in call.arrays and call.g.ndim == call.k.ndim
    return linear_attention_requirements(call, per_channel=per_channel)


# == Mosaic TPU, chunked ===========================================================
# Configs of the Mosaic TPU chunked linear-attention kernels (`mosaic_tpu`,
# `mosaic_tpu_backward`): chunk length and value columns per program, sized
# per TPU generation.
#
# A grid step holds, double-buffered, the chunk's ``q, k [C, Kp]`` (and
# per-channel ``g [C, Kp]``), ``v`` and ``o [C, BV]``, the decay and ``β``
# columns (``[C, 1]``, padded to 128 lanes in VMEM), the ``h0`` and ``final``
# blocks ``[Kp, BV]``, the float32 state scratch ``[Kp, BV]``, and the chunk's
# temporaries (scores, the solve's ``[C, C]`` products, ``[C, Kp]`` factors).
# `tpu_vmem_bytes` estimates that at TPU tiling; configs over the generation's
# scoped-VMEM default raise ``vmem_limit_bytes`` (never above half the
# physical VMEM) and those over it are not in the space.

#: Chunk lengths the kernels take (64 is the backward layout's, `TRITON_CHUNK`).
TPU_CHUNKS = (64, 128)
#: Value columns of the state per program.
TPU_BLOCK_V = (128, 256)
#: (batch·)heads per grid step: their independent chains of products overlap on the MXU
#: (`tpu_costs`); the space keeps those that divide the call's heads.
TPU_HEADS_PER_STEP = (1, 2, 4)
#: Largest key / value head size (the ``[K, V]`` state and ``[C, K]`` tiles in VMEM).
TPU_MAX_HEAD_DIM = 256
#: Temporaries of one chunk step, in ``[C, max(C, Kp, BV)]`` float32 tiles (scores,
#: decays, the solve's products, the factors): an upper estimate.
_TEMPORARIES = 16


@dataclasses.dataclass(frozen=True)
class TpuLinearAttentionConfig(KernelConfig):
    """``chunk`` tokens per grid step, ``block_v`` value columns of the state per program and
    ``heads_per_step`` heads per grid step (a divisor of the call's heads ``HV``)."""

    chunk: int = 64
    block_v: int = 128
    heads_per_step: int = 1

    def validate(self) -> None:
        require_in("TpuLinearAttentionConfig", "chunk", self.chunk, TPU_CHUNKS)
        require_in("TpuLinearAttentionConfig", "block_v", self.block_v, TPU_BLOCK_V)
        require_in("TpuLinearAttentionConfig", "heads_per_step", self.heads_per_step, TPU_HEADS_PER_STEP)


def lanes(d: int) -> int:
    """A head size padded to whole 128-lane vregs (the kernels' ``Kp``, ``Vp``)."""
    return max(128, -(-d // 128) * 128)


def _tpu_dims(call: Call) -> tuple[int, int, bool]:
    """``(K, V, per_channel)`` of a GDN/KDA, SSD or backward call."""
    if "x" in call.arrays:  # ssd: K = state size N, V = head dim P
        return call.B.shape[-1], call.x.shape[-1], False
    per_channel = call.g.ndim == call.k.ndim
    return call.k.shape[-1], call.v.shape[-1], per_channel


def tpu_vmem_bytes(kp: int, bv: int, chunk: int, per_channel: bool, backward: bool = False, heads: int = 1) -> int:
    """VMEM bytes of one grid step of ``heads`` heads (module docstring; each head's blocks and
    temporaries, all live at once in the unrolled step), float32. The backward
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
    return 4 * heads * (tokens + states + temporaries)


def tpu_vmem_limit(kp: int, bv: int, chunk: int, per_channel: bool, backward: bool = False,
                   heads: int = 1) -> int | None:
    """``vmem_limit_bytes`` for a config: ``None`` within the generation's scoped
    default, else twice the estimate (at most half the physical VMEM)."""
    generation = target_generation()
    need = tpu_vmem_bytes(kp, bv, chunk, per_channel, backward, heads)
    if need <= generation.scoped_vmem_bytes:
        return None
    return min(2 * need, generation.vmem_bytes // 2)


def tpu_heads(call: Call) -> int:
    """The heads ``HV`` of a GDN/KDA, SSD or backward call (the grid's rows are batch × ``HV``)."""
    if "x" in call.arrays:  # ssd [B, T, H, P]
        return call.x.shape[2]
    return call.v.shape[1] if "do" in call.arrays else call.v.shape[2]


def linear_attention_tpu_space(call: Call) -> list[TpuLinearAttentionConfig]:
    """Chunks of 64 or 128, ``block_v`` 128 or 256 (≤ the padded V) and 1, 2 or 4 heads
    per step (divisors of ``HV``) whose VMEM estimate fits half the generation's physical VMEM."""
    kdim, vdim, per_channel = _tpu_dims(call)
    kp, vp = lanes(kdim), lanes(vdim)
    heads = tpu_heads(call)
    budget = target_generation().vmem_bytes // 2
    configs = product_space(TpuLinearAttentionConfig, chunk=TPU_CHUNKS, block_v=TPU_BLOCK_V,
                            heads_per_step=TPU_HEADS_PER_STEP)
    return [c for c in configs
            if c.block_v <= vp and vp % c.block_v == 0 and heads % c.heads_per_step == 0
            and tpu_vmem_bytes(kp, c.block_v, c.chunk, per_channel, heads=c.heads_per_step) <= budget]


def _backward_chunks(call: Call) -> tuple[int, ...]:
    """Chunks a backward-op call can take: 64 (its layout's, `TRITON_CHUNK`),
    and 128 for a dense batch whose padded length is a multiple of 128."""
    dense = call.arrays.get("first") is None
    return (64, 128) if dense and call.v.shape[2] % 128 == 0 else (64,)


def linear_attention_tpu_backward_space(call: Call) -> list[TpuLinearAttentionConfig]:
    """The backward ops' space: the chunks the call can take (`_backward_chunks`), ``block_v``
    128 or 256 and 1, 2 or 4 heads per step (divisors of ``HV``) whose backward VMEM estimate
    (`tpu_vmem_bytes`, ``backward``) fits half the physical VMEM."""
    kdim, vdim, per_channel = _tpu_dims(call)
    kp, vp = lanes(kdim), lanes(vdim)
    heads = tpu_heads(call)
    budget = target_generation().vmem_bytes // 2
    configs = product_space(TpuLinearAttentionConfig, chunk=_backward_chunks(call), block_v=TPU_BLOCK_V,
                            heads_per_step=TPU_HEADS_PER_STEP)
    return [c for c in configs if c.block_v <= vp and vp % c.block_v == 0 and heads % c.heads_per_step == 0
            and tpu_vmem_bytes(kp, c.block_v, c.chunk, per_channel, backward=True, heads=c.heads_per_step) <= budget]


def linear_attention_tpu_backward_heuristic(call: Call) -> TpuLinearAttentionConfig:
    """The backward ops' default: the whole padded V per program (≤ 256), the largest chunk of
    the space (chunks of 128 halve the stored chunk states, ``NT·K·V`` per head in HBM), and at
    that chunk the most heads per step of the space (the backward kernel and its states pass
    batch the step's heads as the forward does). The static schedule of the backward kernel
    (v5e, libtpu 0.0.42, bfloat16, K = V = 128; `tpu_cases`, docs/linear_attention.md) says
    more heads per step win for every family: cycles per head and chunk step (the larger of
    bundles and critical path) at 1 / 2 / 4 heads, GDN at chunk 128 9199 / 6394 / 5089, SSD at
    128 1170 / 920 / 780, KDA at 64 10103 / 7210 / 5842 and at 128 18928 / 14714 / — (four heads
    at 128 are over the VMEM budget; two fit v5e's and v6e's, not v5p's or TPU7x's). The chunk
    comes first (HBM): KDA at 64 × 4 heads would take 1.26× fewer cycles per token than at
    128 × 2, for twice the stored states."""
    _, vdim, _ = _tpu_dims(call)
    space = linear_attention_tpu_backward_space(call)
    whole = [c for c in space if c.block_v == min(lanes(vdim), 256)] or space
    if not whole:
        return TpuLinearAttentionConfig(64, min(lanes(vdim), 256))
    return max(whole, key=lambda c: (c.chunk, c.heads_per_step))


def tpu_products(call: Call) -> Products:
    """The `mxu.Products` the Mosaic TPU chunked kernels run ``call`` with: bfloat16
    ``q, k, v`` inputs (GDN/KDA; SSD's ``x, B, C``) take `mxu.BF16_PRODUCTS`, others
    every product at the call's precision (``HIGHEST`` when it has none)."""
    names = ("x", "B", "C") if "x" in call.arrays else tuple(n for n in ("q", "k", "v") if n in call.arrays)
    dtype = np.result_type(*(call.arrays[n].dtype for n in names))
    precision = call.options.get("precision")
    return chunk_products(operand_dtype(dtype), HIGHEST if precision is None else precision)


def tpu_forward_seconds(call: Call, config: TpuLinearAttentionConfig) -> float:
    """The forward kernel's modelled time on ``call`` with ``config`` (`tpu_costs.kernel_seconds`:
    grid steps and bfloat16-pass MXU FLOPs at the call's `tpu_products`)."""
    kdim, vdim, per_channel = _tpu_dims(call)
    lead = call.x if "x" in call.arrays else call.v
    if "do" in call.arrays:  # a backward op's call, heads-major [Bs, HV, Tp, V]
        rows, tokens = lead.shape[0] * lead.shape[1], lead.shape[2]
    else:  # [B, T, HV, V]
        rows, tokens = lead.shape[0] * lead.shape[2], lead.shape[1]
    delta = "x" not in call.arrays and call.arrays.get("beta", True) is not None  # SSD: no delta rule
    return kernel_seconds(rows, tokens, lanes(kdim), lanes(vdim), config.chunk, config.block_v,
                          per_channel=per_channel, delta=delta, products=tpu_products(call),
                          mxu=target_generation().mxu, heads_per_step=config.heads_per_step)


def linear_attention_tpu_heuristic(call: Call) -> TpuLinearAttentionConfig:
    """The config of the space with the least modelled time (`tpu_forward_seconds`: the
    solve's MXU work per token grows with the chunk, the grid steps shrink; splitting V
    repeats the chunk's solve; more heads per step overlap their chains of dependent
    products), the earlier one of the space on a tie; chunks of 64
    and the whole padded V (≤ 256) when the space is empty."""
    _, vdim, _ = _tpu_dims(call)
    space = linear_attention_tpu_space(call)
    if not space:
        return TpuLinearAttentionConfig(chunk=64, block_v=min(lanes(vdim), 256))
    return min(space, key=lambda c: tpu_forward_seconds(call, c))


def linear_attention_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU kernels cannot run ``call`` (``None`` when they can)."""
    kdim, vdim, _ = _tpu_dims(call)
    if kdim > TPU_MAX_HEAD_DIM or vdim > TPU_MAX_HEAD_DIM:
        return (f"the Mosaic TPU kernels hold [K, V] states and [C, K] tiles in VMEM: K={kdim}, V={vdim}, "
                f"the limit is {TPU_MAX_HEAD_DIM}")
    return None


# == Mosaic TPU, decode ============================================================
# Configs of the Mosaic TPU decode kernels (`mosaic_tpu_decode`): the value
# tile of the state, and the tokens per grid step of the fused recurrence.
#
# `fused_recurrent_gated_delta_rule` / `fused_recurrent_kda`
# (`FusedRecurrentTpuConfig`): a grid step holds the float32 state tile
# ``S [K, BV]`` in a VMEM scratch, the initial- and final-state blocks
# ``[K, BV]`` (double-buffered) and ``block_t`` tokens of ``q, k`` (and KDA's
# ``g``) ``[block_t, K]``, ``v, o [block_t, BV]`` and the per-token scalars
# ``[block_t, 2]`` (double-buffered, float32). ``BV = min(block_v, V)``.
#
# `ssd_step` (`SsdStepTpuConfig`): a grid step holds ``block_p`` rows of the
# state ``[block_p, N]`` in and out (double-buffered), the rows' ``dt`` and
# ``x`` columns, ``B`` and ``C`` rows ``[1, N]`` and, for mamba_ssm's tied
# shapes, ``A [block_p, N]``.
#
# VMEM is estimated at TPU tiling (rows to 8, lanes to 128); configs over the
# generation's scoped-VMEM default are not in its space (none come near it:
# the largest, K = V = 256 with 128 tokens per step, takes about 2.4 MiB).

#: Value-tile widths (lanes) of the fused recurrence's state; ``V`` below a tile is taken whole.
BLOCK_V = (128, 256)
#: Tokens per grid step of the fused recurrence (a multiple of the 8-row sublane tile).
BLOCK_T = (8, 32, 128)
#: Row tiles of `ssd_step`'s state ``[P, N]``.
BLOCK_P = (64, 128, 256)
#: `ssd_step`'s heads per grid step.
BLOCK_H = (1, 2, 4, 8, 16, 32)
#: `ssd_step`'s heuristic stacks heads up to this many bytes of state tile per grid step.
SSD_STEP_STATE_TILE_BYTES = 512 * 1024
#: Largest ``K``/``V`` (GDN/KDA) and ``N`` (SSD) the decode kernels take.
DECODE_MAX_HEAD_DIM = 256


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
    if K > DECODE_MAX_HEAD_DIM or V > DECODE_MAX_HEAD_DIM:
        return f"the Mosaic TPU fused recurrence takes K, V ≤ {DECODE_MAX_HEAD_DIM}, got K={K}, V={V}"
    dtype = np.dtype(call.q.dtype)
    if dtype.name not in ("float32", "bfloat16"):
        return f"the Mosaic TPU fused recurrence needs float32/bfloat16 inputs, got {dtype.name}"
    return None


# -- decode kernels measured slower than XLA -----------------------------------------------
#: TPU generations where the Mosaic TPU decode kernels were measured slower than XLA's
#: token step (generation name → the measurement), so that ``implementation=None`` runs XLA
#: there; an explicit ``implementation="mosaic_tpu"`` still runs the kernel. Measured in the TPU
#: suite's bench stage on a v5e (2026-12-07, `benchmarks/results/stellax-tpu-suite-2026-12-07-v5e.json`,
#: XLA in the same process): the kernels take one (sequence, head) state per grid step, and 2048
#: to 5120 steps of 32-256 KB each cost more than XLA's single fused pass over the states.
DECODE_SLOWER_THAN_XLA: dict[str, dict[str, str]] = {
    "fused_recurrent": {
        "v5e": "GDN B=64 HV=32 K=V=128: 2.28 ms against 0.88 forward (0.38x), 3.66 against 1.34 forward+backward; "
               "K=V=256 B=16 HV=16: 0.68 against 0.55 (0.81x); KDA alike (0.30-0.67x)"},
    "ssd_step": {  # measured with one head a step; the heuristic's 16 heads a step are not yet measured
        "v5e": "B=64 H=80 P=64 N=128, one head a step: 3.79 ms against 0.80 forward (0.21x), 4.52 against 1.07 "
               "forward+backward"},
}


def _decode_defers_to_xla(kernel: str):
    def defers_to_xla(platform) -> str | None:
        tpu = platform.tpu
        measured = DECODE_SLOWER_THAN_XLA[kernel].get(tpu.name) if tpu is not None else None
        return None if measured is None else f"measured slower than XLA on a {tpu.name} ({measured})"

    defers_to_xla.__doc__ = (f"Why the default chain passes the Mosaic TPU {kernel} kernel over on ``platform`` "
                             f"(`DECODE_SLOWER_THAN_XLA`), or ``None``.")
    return defers_to_xla


fused_recurrent_tpu_defers_to_xla = _decode_defers_to_xla("fused_recurrent")
ssd_step_tpu_defers_to_xla = _decode_defers_to_xla("ssd_step")


# -- ssd_step ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SsdStepTpuConfig(KernelConfig):
    """``block_p`` rows (head-dim entries) of the ``[P, N]`` state and ``block_h`` heads per
    grid step (a divisor of ``H``; more heads per step spread the step's fixed cost: one head's
    32 KB state a step ran at 0.21x XLA on a v5e)."""

    block_p: int = 64
    block_h: int = 1

    def validate(self) -> None:
        """``block_p`` one of 64, 128, 256; ``block_h`` one of 1, 2, 4, 8, 16, 32."""
        require_in("SsdStepTpuConfig", "block_p", self.block_p, BLOCK_P)
        require_in("SsdStepTpuConfig", "block_h", self.block_h, BLOCK_H)


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
    return c.block_h * (state + columns + rows + a)


def _ssd_step_head_blocks(call: Call) -> tuple[int, ...]:
    """The `BLOCK_H` entries that divide ``H``."""
    H = call.x.shape[1]
    return tuple(b for b in BLOCK_H if H % b == 0)


def ssd_step_tpu_space(call: Call) -> list[SsdStepTpuConfig]:
    """Row tiles 64/128/256 (those not above ``P`` rounded up to 64, at least 64) × heads per
    step (the `BLOCK_H` dividing ``H``), within the generation's scoped VMEM."""
    P = call.x.shape[-1]
    budget = target_generation().scoped_vmem_bytes
    rows = [b for b in BLOCK_P if b == BLOCK_P[0] or b <= -(-P // 64) * 64]
    configs = [SsdStepTpuConfig(b, h) for b in rows for h in _ssd_step_head_blocks(call)]
    kept = [c for c in configs if ssd_step_tpu_vmem(call, c) <= budget]
    return kept or [SsdStepTpuConfig()]


def ssd_step_tpu_heuristic(call: Call) -> SsdStepTpuConfig:
    """The whole head (``P`` rows) up to 256, and as many heads per step (dividing ``H``) as
    keep the state tile within `SSD_STEP_STATE_TILE_BYTES`: Mamba2's 64x128 float32 head state
    is 32 KB, so 16 heads a step (512 KB)."""
    P, N = call.x.shape[-1], call.B.shape[-1]
    block_p = next((b for b in BLOCK_P if b >= P), BLOCK_P[-1])
    tile = _tile_bytes(min(block_p, P), N, np.dtype(call.state.dtype).itemsize)
    fitting = [h for h in _ssd_step_head_blocks(call) if h * tile <= SSD_STEP_STATE_TILE_BYTES]
    return SsdStepTpuConfig(block_p, max(fitting, default=1))


def ssd_step_tpu_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU `ssd_step` kernel cannot run ``call`` (None when it can)."""
    N = call.B.shape[-1]
    if N > DECODE_MAX_HEAD_DIM:
        return f"the Mosaic TPU ssd_step kernel takes a state size N ≤ {DECODE_MAX_HEAD_DIM}, got N={N}"
    for name in ("x", "state"):
        dtype = np.dtype(call.arrays[name].dtype)
        if dtype.name not in ("float32", "bfloat16"):
            return f"the Mosaic TPU ssd_step kernel needs float32/bfloat16 {name}, got {dtype.name}"
    return None
