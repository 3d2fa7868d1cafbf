"""FLOP and byte models of the linear attention ops (for the benchmark and
roofline code).

The chunked forward's matmul FLOPs per token and head (`recurrence_flops`):
the decayed scores ``2CK`` (twice with the delta rule), the triangular solve
``C(K+V)``, ``W S`` / ``Q S`` / ``K̃ᵀΔ`` (``2KV`` each) and ``PΔ`` (``2CV``);
the backward costs about 2.5 forwards; the token recurrence ``7KV``. These count
the algorithm's FLOPs, the same for every implementation; what the Mosaic TPU
kernels execute on the MXU — each product's bfloat16 passes at its precision,
the tile padding — is `tpu_costs` (the kernels' heuristic ranks configs by it).
"""

from __future__ import annotations

from ...core import Call
from ...core.pallas import nbytes
from .base import xla_chunk
from .configs import TRITON_CHUNK


def recurrence_flops(tokens: int, heads: int, kdim: int, vdim: int, chunk: int, delta: bool) -> float:
    """Matmul FLOPs of the chunked forward over ``tokens`` tokens and ``heads`` value heads."""
    per = 2 * chunk * kdim + 2 * kdim * vdim * 2 + 2 * chunk * vdim
    if delta:
        per += 2 * chunk * kdim + chunk * (kdim + vdim) + 2 * kdim * vdim
    return float(tokens) * heads * per


def delta_rule_flops(per_channel: bool):
    """FLOPs of a chunked GDN (``per_channel=False``) or KDA call."""
    def flops(call: Call) -> float:
        B, T, _, K = call.q.shape
        HV, V = call.v.shape[2:]
        return recurrence_flops(B * T, HV, K, V, xla_chunk(call.chunk_size, per_channel), True)
    return flops


def recurrent_flops(call: Call) -> float:
    """FLOPs of the token-by-token GDN/KDA recurrence: ``7·K·V`` per token and value head."""
    B, T, _, K = call.q.shape
    HV, V = call.v.shape[2:]
    return float(B * T * HV * 7 * K * V)


def delta_rule_bytes(call: Call) -> float:
    """Bytes a GDN/KDA call reads and writes (inputs, output, final state when returned)."""
    io = sum(nbytes(call.arrays[n]) for n in ("q", "k", "v", "g", "beta", "initial_state"))
    return float(io + nbytes(call.v) + (nbytes(call.initial_state) if call.output_final_state else 0))


def ssd_flops(call: Call) -> float:
    """FLOPs of a chunked SSD call (no delta rule; ``K`` = state size, ``V`` = head dim)."""
    batch, T, H, P = call.x.shape
    return recurrence_flops(batch * T, H, call.B.shape[-1], P, xla_chunk(call.chunk_size, False), False)


def ssd_bytes(call: Call) -> float:
    """Bytes an SSD call (or decode step) reads, plus its output."""
    return float(sum(nbytes(a) for a in call.arrays.values()) + nbytes(call.x))


def backward_flops(call: Call) -> float:
    """FLOPs of a recurrence backward call: about 2.5 forwards."""
    bs, hv, tp = call.v.shape[:3]
    kdim, vdim = call.k.shape[-1], call.v.shape[-1]
    return 2.5 * recurrence_flops(bs * tp, hv, kdim, vdim, TRITON_CHUNK, call.beta is not None)
