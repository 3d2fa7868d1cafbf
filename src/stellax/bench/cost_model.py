"""An analytic cost model of one kernel config on one GPU (the H200 by default).

For a call and a config, `estimate` counts what the kernel does, not what the
op needs: the programs of its grid (``tiles``), how many fit on an SM at once
(``resident``: the static tier's occupancy when known, else a shared-memory and
warp bound), the waves that makes and their quantization (``wave_efficiency``:
tiles / (waves × SMs × resident)), the FLOPs it executes (masked diagonal
blocks and padded rows included), the bytes it moves (K/V re-read per query
block, weights per row block, ...), the arithmetic intensity, and the roofline
time on the machine:

    time = max(flops / (peak · mma_efficiency) / wave_efficiency,
               hbm_bytes / (bandwidth · min(1, tiles / SMs)),
               bytes / L2 bandwidth)

HBM moves each operand once (``hbm_bytes``: the op's own byte count; the tiles
that re-read a K/V block or a weight block run at the same time and find it in
L2), the L2 serves every tile's reads (``bytes``). The compute side pays for
wave quantization, the memory side only for too few programs to keep every SM
streaming. ``mma_efficiency`` is the fraction of a wgmma the tile fills (M below 64 rows
per warpgroup runs the instruction padded). ``fraction`` is the op's ideal
roofline time (its useful FLOPs and minimum bytes at the peaks) over that
time: the share of the roofline the config can reach at best.

Models exist for the headline kernels (`MODELS`: attention forward/backward,
ragged_dot, paged decode, and the chunked GDN / SSD forward as a
`PipelineEstimate` of its three kernels); other kernels get the op's own
FLOP/byte counts with one wave (`generic`), which ranks every config alike.

`rank_space` orders an autotuning space by predicted time (stable: ties keep
the space's order) and puts configs the static tier flagged (spills, FMA
dots: `flagged_configs`, read from ``static_gpu_sm90.json`` beside this module)
last, for kernels without a model too; the autotuner uses it to pick which configs to try when ``max_configs``
cuts the space. `heuristic_check` says how far the heuristic's config is from
the model's best.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Machine:
    """Ceilings of one GPU: datasheet (dense) and measured on the lent machine."""

    name: str
    sms: int
    peak_flops: float  # dense bf16, FLOP/s (datasheet)
    peak_bytes: float  # HBM, bytes/s (datasheet)
    measured_flops: float
    measured_bytes: float
    l2_bytes: float = 7e12  # L2 read bandwidth, bytes/s: an assumption (not measured here)
    smem_per_sm: int = 228 * 1024
    warps_per_sm: int = 64


#: The lent H200 (datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s; measured here: ~790 TFLOP/s on an
#: 8192³ bf16 matmul of random data and ~4.3 TB/s device-to-device copy, see the device notes).
H200 = Machine("NVIDIA H200", 132, 989e12, 4.8e12, 790e12, 4.3e12)


class _Roofline:
    """What an estimate reports against the op's own roofline (``useful_flops``, ``min_bytes``
    and ``machine`` fields, a ``time_s`` method)."""

    def ideal_time_s(self, measured: bool = True) -> float:
        m = self.machine
        return max(self.useful_flops / (m.measured_flops if measured else m.peak_flops),
                   self.min_bytes / (m.measured_bytes if measured else m.peak_bytes))

    @property
    def fraction(self) -> float:
        """The op's roofline time over this config's predicted time (datasheet peaks)."""
        return self.ideal_time_s(False) / self.time_s(False)

    @property
    def tflops(self) -> float:
        """Predicted useful TFLOP/s at the measured ceilings."""
        return self.useful_flops / self.time_s() / 1e12


@dataclasses.dataclass(frozen=True)
class Estimate(_Roofline):
    """The model's counts for one (call, config)."""

    tiles: int
    resident: int
    flops: float  # executed
    bytes: float  # read and written by the tiles (through L2)
    useful_flops: float  # the op's count
    min_bytes: float  # the op's count
    mma_efficiency: float = 1.0
    machine: Machine = H200
    extra_hbm_bytes: float = 0.0  # HBM traffic beyond the op's (split-K partials, ...)

    @property
    def waves(self) -> int:
        return max(1, math.ceil(self.tiles / (self.machine.sms * self.resident)))

    @property
    def wave_efficiency(self) -> float:
        return self.tiles / (self.waves * self.machine.sms * self.resident)

    @property
    def intensity(self) -> float:
        """Executed FLOPs per byte the tiles move."""
        return self.flops / self.bytes if self.bytes else math.inf

    def _times(self, measured: bool) -> dict:
        m = self.machine
        flops_rate = (m.measured_flops if measured else m.peak_flops) * self.mma_efficiency
        bytes_rate = m.measured_bytes if measured else m.peak_bytes
        return {"compute": self.flops / flops_rate / self.wave_efficiency,
                "memory": (self.min_bytes + self.extra_hbm_bytes) / (bytes_rate * min(1.0, self.tiles / m.sms)),
                "l2": self.bytes / m.l2_bytes}

    def time_s(self, measured: bool = True) -> float:
        """Predicted seconds at the measured (default) or datasheet ceilings."""
        return max(self._times(measured).values())

    def bound(self, measured: bool = True) -> str:
        """What limits the config: ``compute``, ``memory`` (HBM) or ``l2``."""
        times = self._times(measured)
        return max(times, key=lambda k: times[k])

    def to_json(self) -> dict:
        return {"tiles": self.tiles, "resident": self.resident, "waves": self.waves,
                "wave_efficiency": round(self.wave_efficiency, 4), "flops": self.flops, "bytes": self.bytes,
                "intensity": round(self.intensity, 2), "mma_efficiency": round(self.mma_efficiency, 4),
                "bound": self.bound(), "time_ms": self.time_s() * 1e3, "fraction_of_roofline": round(self.fraction, 4),
                "predicted_tflops": round(self.tflops, 1)}


# -- occupancy ---------------------------------------------------------------------------------
STATIC_FILE = Path(__file__).with_name("static_gpu_sm90.json")


@functools.lru_cache(maxsize=1)
def _static_table() -> dict:
    """(op, implementation, config id) → {"blocks_per_sm": int | None, "failures": [...]} from the
    static tier's stored summary (empty when the file is absent)."""
    if not STATIC_FILE.is_file():
        return {}
    data = json.loads(STATIC_FILE.read_text())
    return {(r["op"], r["implementation"], r["config"]): r for r in data.get("configs", [])}


def _config_id(config) -> str:
    from ..testing.registry import config_id

    return config_id(config)


def resident_blocks(op: str, implementation: str, config, smem_bytes: int, machine: Machine = H200) -> int:
    """Programs per SM: the static tier's occupancy (ptxas registers and the compiled shared memory)
    when stored, else bounded by ``smem_bytes``, the warps, and ~128 registers per thread."""
    known = _static_table().get((op, implementation, _config_id(config)))
    if known and known.get("blocks_per_sm"):
        return int(known["blocks_per_sm"])
    warps = getattr(config, "num_warps", 4)
    by_smem = machine.smem_per_sm // (smem_bytes + 1024)
    by_regs = 65536 // (128 * 32 * warps)
    return max(1, min(by_smem, machine.warps_per_sm // warps, by_regs, 32))


def flagged_configs(op: str, implementation: str) -> dict:
    """config id → the static tier's failures for configs of the space it flagged."""
    return {cid: r["failures"] for (o, i, cid), r in _static_table().items()
            if o == op and i == implementation and r.get("failures")}


def _mma_efficiency(rows: int, num_warps: int) -> float:
    """The fraction of wgmma M (64 rows per warpgroup) that ``rows`` rows per program fill."""
    groups = max(1, num_warps // 4)
    per_group = rows / groups
    return min(1.0, per_group / (math.ceil(per_group / 64) * 64)) if per_group > 0 else 1.0


# -- models -------------------------------------------------------------------------------------
def _itemsize(x) -> int:
    return np.dtype(x.dtype).itemsize


def _visited_blocks(t: int, s: int, bq: int, bk: int, causal: bool) -> int:
    """(query block, key block) pairs a flash kernel computes (bottom-right aligned causal mask)."""
    nq, nk = math.ceil(t / bq), math.ceil(s / bk)
    if not causal:
        return nq * nk
    offset = s - t
    return sum(min(nk, max(0, math.ceil(min(s, (i + 1) * bq + offset) / bk))) for i in range(nq))


def _attention_dims(call):
    q, k, v = call.query, call.key, call.value
    b = int(np.prod(q.shape[:-3])) if q.ndim > 3 else 1
    t, n, h = q.shape[-3:]
    s, kv = k.shape[-3], k.shape[-2]
    return b, t, s, n, kv, h, v.shape[-1]


def _causal(call) -> bool:
    spec = call.options.get("spec")
    if spec is not None:
        return bool(spec.causal)
    return bool(call.options.get("is_causal")) or call.options.get("chunk_size") is not None


def attention_forward(op, call, config, machine: Machine = H200) -> Estimate:
    """Flash forward: one program per (batch, head, query block) loops over the visible key blocks,
    reading a K and a V block per step; writes O and the LSE once."""
    b, t, s, n, _, h, hv = _attention_dims(call)
    bq, bk = config.block_q, config.block_k
    size = _itemsize(call.query)
    pairs = _visited_blocks(t, s, bq, bk, _causal(call))
    flops = b * n * pairs * bq * bk * 2.0 * (h + hv)
    moved = b * n * (t * h * size + t * hv * size + t * 4 + pairs * bk * (h + hv) * size)
    smem = (bq * h + config.num_stages * bk * (h + hv)) * size
    return Estimate(b * n * math.ceil(t / bq), resident_blocks(op.name, "triton", config, smem, machine), flops,
                    moved, op.flops(call), op.bytes_accessed(call), _mma_efficiency(bq, config.num_warps), machine)


def attention_backward(op, call, config, machine: Machine = H200) -> Estimate:
    """Flash backward, two kernels over the same visible block pairs: dq (query-block major, reads K/V
    per step; recomputes q·kᵀ, dO·vᵀ, ds·k) and dk/dv (key-block major, reads q, dO, LSE, Δ per step;
    recomputes q·kᵀ, dO·vᵀ, then pᵀ·dO and dsᵀ·q)."""
    b, t, s, n, _, h, hv = _attention_dims(call)
    bq, bk = config.block_q, config.block_k
    size = _itemsize(call.query)
    pairs = _visited_blocks(t, s, bq, bk, _causal(call))
    flops = b * n * pairs * bq * bk * 2.0 * ((2 * h + hv) + (2 * h + 2 * hv))
    dq_bytes = t * (h + hv) * size * 2 + t * 8 + pairs * bk * (h + hv) * size
    dkv_bytes = s * (h + hv) * size * 2 + pairs * bq * (h + hv) * size + pairs * bq * 8
    tiles = b * n * (math.ceil(t / bq) + math.ceil(s / bk))
    smem = (max(bq, bk) * (h + hv) + config.num_stages * max(bq, bk) * (h + hv)) * size
    return Estimate(tiles, resident_blocks(op.name, "triton", config, smem, machine), flops,
                    b * n * (dq_bytes + dkv_bytes), op.flops(call), op.bytes_accessed(call),
                    _mma_efficiency(min(bq, bk), config.num_warps), machine)


def _group_sizes(call, m: int, g: int) -> np.ndarray:
    """The call's group sizes when concrete, else balanced."""
    sizes = call.arrays.get("group_sizes")
    try:
        values = np.asarray(sizes).astype(np.int64).reshape(-1)
        if values.size:
            return values
    except Exception:  # noqa: BLE001 - abstract group sizes
        pass
    return np.full(g, m // max(g, 1))


def ragged_dot(op, call, config, machine: Machine = H200) -> Estimate:
    """Grouped matmul: one program per (row block of a group, column block); each reads its rows
    of the lhs and the group's [K, block_n] weights once and writes its output block. A group's
    last row block is padded to ``block_m`` rows."""
    from ..ops.moe.configs import gmm_dims

    m, k, n, g, _ = gmm_dims(call)
    sizes = _group_sizes(call, m, g)
    bm, bn = config.block_m, config.block_n
    row_blocks = int(sum(math.ceil(int(x) / bm) for x in sizes))
    col_blocks = math.ceil(n / bn)
    size = _itemsize(call.lhs)
    tiles = row_blocks * col_blocks
    flops = 2.0 * row_blocks * bm * k * col_blocks * bn
    moved = tiles * (bm * k + k * bn) * size + m * n * size
    smem = config.num_stages * (bm * config.block_k + config.block_k * bn) * size
    return Estimate(tiles, resident_blocks(op.name, "triton", config, smem, machine), flops, moved,
                    op.flops(call), op.bytes_accessed(call), _mma_efficiency(bm, config.num_warps), machine)


def paged_decode(op, call, config, machine: Machine = H200) -> Estimate:
    """Paged decode: one program per (sequence, kv head, split) streams its share of the pages
    (``pages_per_block`` per step); splits write float32 partial outputs that a second pass
    combines. Memory-bound: the bytes are the op's plus the partials."""
    from ..ops.paged_attention.configs import geometry

    geo = geometry(call, "paged")
    splits = config.num_splits
    hv = geo.dims[1]
    partials = (2 * geo.programs * geo.kv_heads * geo.rows * (hv + 2) * 4 * splits) if splits > 1 else 0
    tiles = geo.programs * geo.kv_heads * splits
    page_bytes = geo.page_size * sum(geo.dims) * 2
    smem = config.num_stages * config.pages_per_block * page_bytes
    return Estimate(tiles, resident_blocks(op.name, "triton", config, smem, machine), op.flops(call),
                    op.bytes_accessed(call) + partials, op.flops(call), op.bytes_accessed(call), 1.0, machine,
                    extra_hbm_bytes=partials)


#: TF32X3 float32 matmuls (the linear-attention kernels') run three TF32 passes at half the bf16 rate.
TF32X3_RATE = 1 / 6


@dataclasses.dataclass(frozen=True)
class PipelineEstimate(_Roofline):
    """Kernels that run one after another (``stages``: name → `Estimate`): the times add up;
    ``useful_flops`` / ``min_bytes`` are the op's counts."""

    stages: tuple
    useful_flops: float
    min_bytes: float
    machine: Machine = H200

    def time_s(self, measured: bool = True) -> float:
        return sum(e.time_s(measured) for _, e in self.stages)

    def bound(self, measured: bool = True) -> str:
        """The longest stage and what limits it, e.g. ``"state: compute"``."""
        name, e = max(self.stages, key=lambda s: s[1].time_s(measured))
        return f"{name}: {e.bound(measured)}"

    def to_json(self) -> dict:
        return {"stages": {name: e.to_json() for name, e in self.stages}, "bound": self.bound(),
                "time_ms": self.time_s() * 1e3, "fraction_of_roofline": round(self.fraction, 4),
                "predicted_tflops": round(self.tflops, 1)}


def _scalar_decay_dims(call) -> tuple[int, int, int, int, bool]:
    """``(batch × value heads, tokens, K, V)`` of a GDN (``k, v``) or SSD (``x``, state size
    ``B``) call, head sizes padded as the kernels pad them, and whether it has the delta rule."""
    from ..core.pallas import padded_dim

    if "x" in call.arrays:  # SSD: K = state size N, V = head dim P, no WY stage
        b, t, heads, v = call.x.shape
        return b * heads, t, padded_dim(call.B.shape[-1]), padded_dim(v), False
    b, t, heads, v = call.v.shape
    return b * heads, t, padded_dim(call.k.shape[-1]), padded_dim(v), True


def scalar_decay_forward(op, call, config, machine: Machine = H200) -> PipelineEstimate:
    """The chunked GDN / SSD forward (`linear_attention.pipeline.gdn_forward`), three kernels on
    float32 operands (TF32X3 matmuls, `TF32X3_RATE` of the bf16 peak), chunks of C = 64:

    * ``wy`` (GDN only; a program per chunk and head): ``A = β K Kᵀ``, ``T = (I + A)⁻¹`` (ten
      ``C³`` products), ``U = T β V``, ``W = T β Γ K``; reads k, v, writes U, W;
    * ``state`` (a program per head and ``block_v`` value columns, the chunks in sequence):
      ``Δ = U − W S`` and ``S ← γ S + K̃ᵀ Δ``; writes each chunk's state and Δ;
    * ``output`` (a program per chunk, head and value block): ``P = (Q Kᵀ) ⊙ decays`` (again
      per value block), ``O = Q S_c + P Δ``.

    The scan's steps depend on each other, so its programs run latency-bound; the model
    gives them the SM's full matmul rate, which makes the state stage a lower bound."""
    bh, t, k, v = _scalar_decay_dims(call)[:4]
    delta_rule = _scalar_decay_dims(call)[4]
    c = 64
    nt = math.ceil(t / c)
    tp = nt * c
    bv = min(config.block_v, v)
    vb = math.ceil(v / bv)
    f32 = 4
    resident = resident_blocks(op.name, "triton", config, 0, machine)
    rate = _mma_efficiency(c, config.num_warps) * TF32X3_RATE

    def stage(tiles, flops, hbm, l2):
        return Estimate(tiles, resident, flops, l2, flops, hbm, rate, machine)

    stages = []
    if delta_rule:
        flops = nt * bh * (2.0 * c * c * (2 * k + v) + 20.0 * c ** 3)
        hbm = f32 * bh * tp * (2 * k + 2 * v + 2)
        stages.append(("wy", stage(nt * bh, flops, hbm, hbm)))
    flops = bh * nt * 4.0 * c * k * v
    hbm = f32 * bh * (tp * (2 * k + 2 * v + 1) + nt * k * v)
    stages.append(("state", stage(bh * vb, flops, hbm, hbm + f32 * bh * (vb - 1) * tp * 2 * k)))
    flops = bh * nt * (vb * 2.0 * c * c * k + 2.0 * c * k * v + 2.0 * c * c * v)
    hbm = f32 * bh * (tp * (2 * k + 2 * v + 1) + nt * k * v)
    stages.append(("output", stage(nt * bh * vb, flops, hbm, hbm + f32 * bh * (vb - 1) * tp * (2 * k + 1))))
    return PipelineEstimate(tuple(stages), op.flops(call), op.bytes_accessed(call), machine)


def generic(op, call, config, machine: Machine = H200) -> Estimate:
    """No kernel model: the op's FLOPs and bytes, one full wave."""
    return Estimate(machine.sms, 1, op.flops(call), op.bytes_accessed(call), op.flops(call),
                    op.bytes_accessed(call), 1.0, machine)


MODELS: dict[tuple[str, str], Callable[..., Estimate]] = {
    ("attention", "triton"): attention_forward,
    ("attention_backward", "triton"): attention_backward,
    ("ragged_dot", "triton"): ragged_dot,
    ("paged_attention", "triton"): paged_decode,
    ("chunk_gated_delta_rule", "triton"): scalar_decay_forward,
    ("ssd", "triton"): scalar_decay_forward,
}


def has_model(op_name: str, implementation: str) -> bool:
    return (op_name, implementation) in MODELS


def estimate(op, implementation: str, call, config, machine: Machine = H200) -> Estimate | PipelineEstimate:
    """The model's `Estimate` of ``op``'s ``implementation`` with ``config`` on ``call``."""
    return MODELS.get((op.name, implementation), generic)(op, call, config, machine)


def rank_space(op, implementation: str, call, space: list, machine: Machine = H200) -> list:
    """``space`` fastest first by the model (ties keep their order), configs the static tier flagged
    last; in the space's order (flagged configs still last) when no model covers the kernel or a
    config cannot be estimated."""
    flagged = flagged_configs(op.name, implementation)
    in_order = ([c for c in space if _config_id(c) not in flagged]
                + [c for c in space if _config_id(c) in flagged])
    if not has_model(op.name, implementation) or not space:
        return in_order
    try:
        keyed = [(_config_id(c) in flagged, estimate(op, implementation, call, c, machine).time_s(), i, c)
                 for i, c in enumerate(space)]
    except Exception:  # noqa: BLE001 - a call the model cannot read: the space's order
        return in_order
    return [c for *_, c in sorted(keyed, key=lambda x: x[:3])]


@dataclasses.dataclass(frozen=True)
class HeuristicCheck:
    """The heuristic's config against the model's best config of the space."""

    heuristic: Any
    best: Any
    heuristic_estimate: Estimate
    best_estimate: Estimate
    threshold: float

    @property
    def slowdown(self) -> float:
        """Predicted heuristic time over the best config's."""
        return self.heuristic_estimate.time_s() / self.best_estimate.time_s()

    @property
    def flagged(self) -> bool:
        return self.slowdown > self.threshold


def heuristic_check(op, implementation: str, call, *, threshold: float = 1.5,
                    machine: Machine = H200) -> HeuristicCheck:
    """Compare the heuristic's config with the best of the space (plus the heuristic) by the model;
    ``flagged`` when the heuristic is predicted more than ``threshold`` times slower."""
    impl = op.implementations[implementation]
    chosen = impl.default_config(call)
    space = [chosen] + [c for c in impl.config_space(call) if c != chosen]
    ranked = rank_space(op, implementation, call, space, machine)
    best = ranked[0]
    return HeuristicCheck(chosen, best, estimate(op, implementation, call, chosen, machine),
                          estimate(op, implementation, call, best, machine), threshold)
