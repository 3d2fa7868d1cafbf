"""Configs of the attention implementations.

* `ChunkedConfig` (``xla_chunked``): query/key block lengths of the online
  softmax loops.
* `FlashConfig` (``triton``): the forward kernel's ``block_q``/``block_k``
  and Triton ``num_warps``/``num_stages``. The backward op has its own
  `FlashBackwardConfig` (blocks of the dq and the dk/dv kernels).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from ...core import Call, KernelConfig, TritonConfig, current_platform, next_power_of_two, product_space
from ...core.config import require_positive, require_power_of_two
from .masks import MaskSpec, mask_spec_of

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


def _flash_ladder(call: Call, config_type, *, float32, sm80_small, small, medium, large):
    """The Triton config by padded head dim ``d``, each a ``(block_q, block_k, num_warps, num_stages)``:
    ``float32`` for float32 operands at ``d > 64``, else ``sm80_small`` (``d <= 64`` below sm_90),
    ``small`` (``d <= 64``), ``medium`` (``d <= 128``) or ``large``."""
    h, hv = head_dims(call)
    d = max(_padded(h), _padded(hv))
    if _itemsize(call) == 4 and d > 64:
        blocks = float32
    elif d <= 64 and current_platform().nvidia_below((9, 0)):
        blocks = sm80_small
    elif d <= 64:
        blocks = small
    elif d <= 128:
        blocks = medium
    else:
        blocks = large
    block_q, block_k, num_warps, num_stages = blocks
    return config_type(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages)


def flash_heuristic(call: Call) -> FlashConfig:
    # sm80_small: static GPU tier, sm_80, bf16 H=64: 128x64 on 4 warps takes 255 registers and spills 40 B
    # (24 B with 2 stages, 8 B on 8 warps); 64x64 takes 168, no spills, 12 warps per SM.
    return _flash_ladder(call, FlashConfig, float32=(64, 32, 4, 2), sm80_small=(64, 64, 4, 3), small=(128, 64, 4, 3),
                         medium=(128, 64, 8, 2), large=(64, 32, 8, 2))


def flash_space(call: Call) -> list[FlashConfig]:
    h, hv = head_dims(call)
    space = product_space(FlashConfig, block_q=(64, 128), block_k=(32, 64, 128), num_warps=(4, 8),
                          num_stages=(2, 3))
    # The static GPU tier (ptxas, sm_90, bf16 H=128): 128-row query tiles on 4 warps hit 255
    # registers and spill (24-696 B); 8 warps hold them in 134 registers. Below sm_90 they spill at
    # H=64 too (24-40 B).
    spills_on_4_warps = current_platform().nvidia_below((9, 0)) or max(_padded(h), _padded(hv)) >= 128
    return [c for c in space if _fits(c.block_q, c.block_k, h, hv, c.num_stages, _itemsize(call))
            and not (spills_on_4_warps and c.num_warps == 4 and c.block_q == 128)]


def flash_backward_heuristic(call: Call) -> FlashBackwardConfig:
    # sm80_small: static GPU tier, sm_80, bf16 H=64: the dk/dv kernel at 64x64 takes 255 registers and spills
    # 36 B (48 B on 8 warps, 20 B at block_k 32, 16 B with one stage); block_q 32 takes 252, none.
    return _flash_ladder(call, FlashBackwardConfig, float32=(32, 32, 4, 1), sm80_small=(32, 64, 4, 2),
                         small=(64, 64, 4, 2), medium=(64, 64, 8, 2), large=(32, 32, 8, 1))


def flash_backward_space(call: Call) -> list[FlashBackwardConfig]:
    h, hv = head_dims(call)
    space = product_space(FlashBackwardConfig, block_q=(32, 64), block_k=(32, 64), num_warps=(4, 8),
                          num_stages=(1, 2))
    size = _itemsize(call)
    return [c for c in space if _fits(c.block_q, c.block_k, h, hv, c.num_stages, size)
            and _fits(c.block_k, c.block_q, h, hv, c.num_stages, size)]


# -- Mosaic TPU (splash-class flash attention) -----------------------------------------------
#: Block lengths the TPU kernels take: multiples of 128 (the lane width) from 128 to 2048.
TPU_BLOCKS = (128, 256, 512, 1024, 2048)
#: Head dims the TPU kernels hold in one VMEM tile row (query/key and value).
TPU_MAX_HEAD_DIM = 256


def _require_tpu_block(config: str, name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value % 128 or not 128 <= value <= 2048:
        raise ValueError(f"{config}: {name} must be a multiple of 128 in [128, 2048] (TPU lane tiling), "
                         f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class SplashConfig(KernelConfig):
    """Mosaic TPU forward kernel: one step computes a ``(G·block_q) × block_kv``
    logits tile (the ``G`` query heads of a kv head share its K/V block)."""

    block_q: int = 512
    block_kv: int = 512

    def validate(self) -> None:
        _require_tpu_block("SplashConfig", "block_q", self.block_q)
        _require_tpu_block("SplashConfig", "block_kv", self.block_kv)


@dataclasses.dataclass(frozen=True)
class SplashBackwardConfig(KernelConfig):
    """Mosaic TPU backward kernels: dq (``block_q_dq × block_kv_dq`` tiles, q-block
    major) and dk/dv (``block_q_dkv × block_kv_dkv`` tiles, kv-block major); with
    ``fused`` one kernel computes dq, dk and dv on the dk/dv blocks (the dq blocks
    are unused), the head group's dq resident in VMEM (`mosaic_tpu_backward`)."""

    block_q_dq: int = 512
    block_kv_dq: int = 512
    block_q_dkv: int = 512
    block_kv_dkv: int = 512
    fused: bool = False

    CHOICES = {"fused": (False, True)}

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.fused, bool):
            raise ValueError(f"SplashBackwardConfig: fused must be a bool, got {self.fused!r}")
        for name in ("block_q_dq", "block_kv_dq", "block_q_dkv", "block_kv_dkv"):
            _require_tpu_block("SplashBackwardConfig", name, getattr(self, name))


def _tpu_shape(call: Call):
    """``(T, S, G, H, Hv, itemsize)`` of a forward or backward call."""
    q, k, v = call.query, call.key, call.value
    return (q.shape[-3], k.shape[-3], q.shape[-2] // k.shape[-2], q.shape[-1], v.shape[-1],
            jnp.dtype(q.dtype).itemsize)


def _lane_pad(d: int) -> int:
    return -(-d // 128) * 128


def splash_vmem_bytes(rows: int, block_kv: int, h: int, hv: int, itemsize: int, *, backward: bool = False) -> int:
    """Estimated VMEM of one kernel step (bytes): double-buffered q/k/v/out
    blocks, the row statistics (one 128-lane tile row each), the float32
    scratch and about four float32 ``rows × block_kv`` temporaries (logits,
    probabilities, their gradients). ``rows = G·block_q``."""
    hp, hvp = _lane_pad(h), _lane_pad(hv)
    blocks = 2 * itemsize * (rows * hp + block_kv * (hp + hvp) + rows * hvp)
    stats = 2 * 4 * 128 * rows * (4 if backward else 3)
    if backward:  # dO rides with q; dq or dk/dv accumulators
        blocks += 2 * itemsize * (rows * hvp + block_kv * (hp + hvp))
        scratch = 4 * max(rows * hp, block_kv * (hp + hvp))
    else:
        scratch = 4 * rows * (hvp + 2 * 128)
    return blocks + stats + scratch + 4 * 4 * rows * block_kv


def fused_dq_bytes(t: int, g: int, h: int, itemsize: int, block_q: int, *, output_buffers: int = 2) -> int:
    """VMEM the fused backward keeps for one head group's whole dq (bytes): the float32
    accumulator ``[T·G, H]`` (``T`` padded to ``block_q``) and ``output_buffers`` buffers of its
    output block in the operands' dtype (`fused_output_buffers`: two, one when the grid has a
    single (batch, kv head) and the block never changes). libtpu's v5e compile agrees: MQA (16
    heads) at T=16384, B=1, 128 × 1024, uses 204.8 MiB of VMEM: 128 + 64 of dq and 12.8 of the
    step; MHA at T=131072 (16 heads), 1024 × 1024, 138.3 MiB: 64 + 2 × 32 and 10.3. MHA, T=8192,
    H=128, bf16: 8 MiB; GQA G=4: 32 MiB; MQA G=16, B=1: 96 MiB."""
    rows = -(-t // block_q) * block_q * g
    return rows * _lane_pad(h) * (4 + output_buffers * itemsize)


def fused_output_buffers(batch: int, kv_heads: int) -> int:
    """Buffers Mosaic gives the fused backward's resident dq output block: one when the grid
    has a single (batch, kv head), so the block's index never changes; two otherwise."""
    return 1 if batch * kv_heads == 1 else 2


def fused_step_bytes(rows: int, block_kv: int, h: int, hv: int, itemsize: int) -> int:
    """The fused backward step's VMEM beside its resident dq (bytes): the backward estimate
    (`splash_vmem_bytes`) less its float32 ``rows × block_kv`` temporaries, which the fused
    kernel (keys first, in pieces) keeps in the compiler's internal scratch, not in the
    kernel's scoped VMEM: MQA T=16384 at 128 × 1024 (2048 rows) uses 12.8 MiB beside dq on
    libtpu's v5e compile, this estimate 14."""
    return splash_vmem_bytes(rows, block_kv, h, hv, itemsize, backward=True) - 4 * 4 * rows * block_kv


def fused_backward_fits(call: Call, block_q: int, block_kv: int, generation) -> bool:
    """Whether the fused backward's step (`fused_step_bytes`) plus its resident dq
    (`fused_dq_bytes`) fit seven eighths of the generation's VMEM, the most its launch asks
    for (`mosaic_tpu.vmem_limit`). On a v5e (128 MiB), bf16, H=128: MHA up to T=65536, GQA 4
    up to 16384, MQA (16 heads) of one sequence up to 8192 (110 MiB; compiled and measured
    there), of several up to 4096."""
    t, s, g, h, hv, size = _tpu_shape(call)
    buffers = fused_output_buffers(math.prod(call.query.shape[:-3]), call.key.shape[-2])
    need = fused_step_bytes(g * block_q, block_kv, h, hv, size)
    return need + fused_dq_bytes(t, g, h, size, block_q, output_buffers=buffers) <= generation.vmem_bytes * 7 // 8


def _tpu_budget(generation) -> int:
    # Leave a quarter of VMEM to the compiler's own temporaries.
    return generation.vmem_bytes * 3 // 4


def _clamp(block: int, length: int) -> int:
    """The smallest TPU block covering ``length`` when ``block`` exceeds it."""
    return min(block, max(128, _lane_pad(length)))


def _fits_tpu(block_q: int, block_kv: int, call: Call, generation, *, backward: bool, budget: int) -> bool:
    t, s, g, h, hv, size = _tpu_shape(call)
    return splash_vmem_bytes(g * block_q, block_kv, h, hv, size, backward=backward) <= budget


def _preferred_blocks(generation) -> list[tuple[int, int]]:
    """(block_q, block_kv) in order of preference: MXU-sized (256 on v6e/TPU7x,
    128 before) and large enough to amortize the ~0.35 µs per grid step."""
    if generation.mxu >= 256:
        return [(1024, 512), (512, 512), (512, 256), (256, 256), (256, 128), (128, 128)]
    return [(512, 512), (512, 256), (256, 256), (256, 128), (128, 128)]


#: The forward's first choice on 128-wide-MXU chips (v5e, v5p) when its VMEM estimate fits twice the
#: scoped default (the launch raises the limit): measured on a v5e (bf16, B=1, N=16, D=128, T=8192),
#: forward 2.87 ms causal / 4.42 ms full at 1024×1024 against 4.78 / 7.75 ms at 512×512, and on-chip
#: autotuning of T=S=16384 full picked 2048×2048 (17.6 ms vs 30.3 at 512×512). The backward keeps
#: 512×512, its best there.
_LARGE_FORWARD_BLOCKS = (1024, 1024)


def _large_forward_blocks(g: int) -> list[tuple[int, int]]:
    """The forward's large candidates for ``g`` query heads per kv head: a step's logits tile is
    ``(g·block_q) × block_kv``, so GQA/MQA keep the MHA tile's 1024 rows with ``block_q = 1024 / g``
    (at least 128) rather than falling back to the small preference list; then half the kv block.
    (Modelled from the MHA measurement, same tile shape; not yet measured for g > 1.)"""
    rows, kv = _LARGE_FORWARD_BLOCKS
    bq = max(128, rows // g)
    return [(bq, kv), (bq, kv // 2)]


#: The forward's first choice on 128-wide-MXU chips for a long dense call (no mask of any kind, one
#: query head per kv head, ``T, S >= DENSE_LONG``): measured by on-chip autotuning on a v5e (bf16,
#: B=1, N=16, D=128, T=S=16384 full; `benchmarks/results/stellax-tpu-suite-2026-12-07-v5e.json`):
#: 2048 × 2048 13.69 ms against 14.58 at the 1024 × 1024 default and 17.90 at 512 × 512 (on
#: 2026-12-05, before the per-side mask work: 17.6 against 30.3 at 512 × 512). Its step estimate
#: (77 MiB, mostly the float32 2048 × 2048 temporaries) fits three quarters of a v5e's 128 MiB, not
#: of a v5p's 64 (which keeps 1024 tiles); masked calls keep 1024 tiles (their diagonal or band
#: blocks would waste more of a 2048 tile).
DENSE_LONG = 16384
DENSE_LONG_BLOCKS = (2048, 2048)

def _dense(call: Call) -> bool:
    """Whether a forward ``call`` attends every query to every key: no mask, bias, segments, lengths,
    positions, window, chunks or causality."""
    return call.bias is None and call.mask is None and mask_spec_of(call) == MaskSpec(default_positions=True)


def _heuristic_blocks(call: Call, *, backward: bool) -> tuple[int, int]:
    from ...core.platform import target_generation

    generation = target_generation()
    t, s, g = _tpu_shape(call)[:3]
    if (not backward and generation.mxu < 256 and g == 1 and min(t, s) >= DENSE_LONG and _dense(call)
            and _fits_tpu(*DENSE_LONG_BLOCKS, call, generation, backward=False, budget=_tpu_budget(generation))):
        return DENSE_LONG_BLOCKS
    # v5e/v5p: 1024-row tiles (1024/G query rows per kv head) within twice the scoped VMEM
    # default, forward and backward. Measured on a v5e (benchmarks/results/attention_tpu-v5e-2026-12-06.json,
    # forward + backward, bf16): MHA causal T=8192 11.57 ms against 13.45 at 512/512, GQA N=32 K=8
    # 21.38 against 26.97; a 1024-token sliding window 11.73 against 11.41.
    if generation.mxu < 256:
        for bq, bk in _large_forward_blocks(g):
            if _fits_tpu(bq, bk, call, generation, backward=backward, budget=2 * generation.scoped_vmem_bytes):
                return _clamp(bq, t), _clamp(bk, s)
    for bq, bk in _preferred_blocks(generation):
        if _fits_tpu(bq, bk, call, generation, backward=backward, budget=generation.scoped_vmem_bytes):
            return _clamp(bq, t), _clamp(bk, s)
    return _clamp(128, t), _clamp(128, s)


def splash_heuristic(call: Call) -> SplashConfig:
    """The largest preferred blocks whose estimated VMEM fits the generation's
    scoped-VMEM default (`stellax.core.platform.target_generation`), clamped to the
    sequence lengths."""
    bq, bk = _heuristic_blocks(call, backward=False)
    return SplashConfig(block_q=bq, block_kv=bk)


#: A sliding window at most ``NARROW_WINDOW`` keys wide (left + right, the causal side counting 0)
#: takes the fused backward at ``NARROW_WINDOW_BLOCK`` tiles first: at 1024 tiles its band is all
#: masked blocks, at 512 a third of them are unmasked. Measured on a v5e (window 1024 causal,
#: T=16384, bf16, forward + backward, `benchmarks/results/attention_tpu-v5e-2026-12-07.json`):
#: 8.19 ms with the backward fused at 512 × 512 against 8.83 ms at 1024 × 1024. Static (libtpu's v5e
#: schedule, with the per-side mask classes; docs/attention.md "Per-side mask classes"): the fused
#: backward's visited steps 3.31 M bundles at 512 tiles against 4.50 M at 1024; the forward's 2.03 M
#: against 2.46 M, but over three times the grid steps (1536 against 512, ~0.35 µs each on the chip):
#: a tie, so the forward keeps the large tiles (the measured 1024 × 1024).
NARROW_WINDOW = 1024
NARROW_WINDOW_BLOCK = 512


def _narrow_window(call: Call) -> bool:
    """Whether ``call``'s sliding window is at most `NARROW_WINDOW` keys wide."""
    window = getattr(call, "local_window_size", None)
    if window is None:
        return False
    left, right = window
    right = 0 if getattr(call, "is_causal", False) else right
    return left is not None and right is not None and left + right <= NARROW_WINDOW


def splash_backward_heuristic(call: Call) -> SplashBackwardConfig:
    """The heuristic blocks for both kernels, fused (`fused_backward_default`) where its
    resident dq fits. On 128-wide-MXU chips (v5e, v5p) the fused kernel is tried first at
    512-row tiles for a window of at most `NARROW_WINDOW` keys, then at the forward's large
    tiles (`_large_forward_blocks`), and taken at the first that fits."""
    from ...core.platform import target_generation

    generation = target_generation()
    bq, bk = _heuristic_blocks(call, backward=True)
    if FUSED_BACKWARD_BY_DEFAULT and generation.mxu < 256:
        # The fused kernel at the forward's large tiles wherever it fits, though the unfused
        # pair's estimate would not: measured on a v5e (MQA N=16 K=1 causal T=8192, bf16, forward
        # + backward) 8.10 ms fused at 128 × 1024 against 10.33 ms unfused at 128 × 512.
        t, s, g = _tpu_shape(call)[:3]
        narrow = [(max(128, NARROW_WINDOW_BLOCK // g), NARROW_WINDOW_BLOCK)] if _narrow_window(call) else []
        for cq, ck in narrow + _large_forward_blocks(g):
            if fused_backward_fits(call, _clamp(cq, t), _clamp(ck, s), generation):
                bq, bk = _clamp(cq, t), _clamp(ck, s)
                break
    fused = fused_backward_default(call, bq, bk, generation)
    return SplashBackwardConfig(block_q_dq=bq, block_kv_dq=bk, block_q_dkv=bq, block_kv_dkv=bk, fused=fused)


#: The fused backward's default (`fused_backward_default`); flip to False to make the unfused
#: pair the default everywhere.
FUSED_BACKWARD_BY_DEFAULT = True


def fused_backward_default(call: Call, block_q: int, block_kv: int, generation) -> bool:
    """The one rule choosing the fused backward: wherever its resident dq fits
    (`fused_backward_fits`). Measured on a v5e (forward + backward, bf16): MHA causal T=8192
    9.44 ms fused against 11.48 unfused, GQA 32/8 16.85 against 21.34, a 1024 window at
    T=16384 9.72 against 11.74. Per visited block pair it runs 5 matmuls and one ``exp`` pass against the unfused pair's 7 and two (T=8192, N=16,
    H=128 causal, 1024 blocks: 36 pairs per head, 2 matmuls of 0.27 GFLOP each saved, 0.31
    TFLOP in all, ~1.6-1.9 ms of the unfused backward's ~8.7 ms on a v5e at 167-197 TFLOP/s),
    and reads q/dO/lse/delta once per pair instead of twice and k/v once per kv block; it
    writes dq once (2 MiB per head in bf16) where splash's fused kernel writes and re-reads a
    dq partial per kv block (8 × 2 MiB per head, ~0.5 GB in all at N=16, ~0.65 ms at 819 GB/s).
    Its cost: the j axis is sequential, so megacore chips split only batch and kv heads."""
    return FUSED_BACKWARD_BY_DEFAULT and fused_backward_fits(call, block_q, block_kv, generation)


def _tpu_block_pairs(call: Call, *, backward: bool) -> list[tuple[int, int]]:
    """Distinct (block_q, block_kv) pairs (clamped to the lengths) whose
    estimated VMEM fits three quarters of the generation's VMEM."""
    from ...core.platform import target_generation

    generation = target_generation()
    t, s = _tpu_shape(call)[:2]
    pairs = []
    for bq in TPU_BLOCKS:
        for bk in TPU_BLOCKS:
            pair = (_clamp(bq, t), _clamp(bk, s))
            if pair not in pairs and _fits_tpu(*pair, call, generation, backward=backward,
                                               budget=_tpu_budget(generation)):
                pairs.append(pair)
    return pairs


def splash_space(call: Call) -> list[SplashConfig]:
    return [SplashConfig(block_q=bq, block_kv=bk) for bq, bk in _tpu_block_pairs(call, backward=False)]


def splash_backward_space(call: Call) -> list[SplashBackwardConfig]:
    """The dq and dk/dv kernels tuned with the same pair (they launch one
    after the other; their blocks are independent fields for explicit use),
    each pair also fused where its resident dq fits (`fused_backward_fits`)."""
    from ...core.platform import target_generation

    generation = target_generation()
    space = []
    for bq, bk in _tpu_block_pairs(call, backward=True):
        for fused in (False, True):
            if not fused or fused_backward_fits(call, bq, bk, generation):
                space.append(SplashBackwardConfig(block_q_dq=bq, block_kv_dq=bk, block_q_dkv=bq, block_kv_dkv=bk,
                                                  fused=fused))
    return space


def splash_requirements(call: Call) -> str | None:
    """Why the Mosaic TPU kernels cannot take ``call`` (None when they can)."""
    dtype = jnp.dtype(call.query.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"the Mosaic TPU attention kernels take float32 or bfloat16, got {dtype.name}"
    if call.arrays.get("bias") is not None or call.arrays.get("mask") is not None:
        return ("the Mosaic TPU attention kernels take the mask as positions/segments/causal/window/chunk "
                "(block-sparse), not a dense bias or boolean mask")
    h, hv = head_dims(call)
    if max(h, hv) > TPU_MAX_HEAD_DIM:
        return f"the Mosaic TPU attention kernels support head dims up to {TPU_MAX_HEAD_DIM}, got H={h}, Hv={hv}"
    return None
