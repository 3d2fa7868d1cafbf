"""Stage 4 of the chunked pipeline: the chunk's W/U (the UT/WY form of the delta rule).

Notation for one chunk of ``C`` tokens and one (batch, value-head) pair, all
float32: ``g_t`` the per-step log decay (a scalar for GDN/SSD, a ``K``-vector
for KDA), ``Γ_i = exp(Σ_{t≤i} g_t)`` (stage 1), ``P`` and ``A`` the decayed
scores (stage 2), ``T = (I + A)⁻¹`` (stage 3). The delta rule's writes inside
the chunk then collapse to

    U = T (β ⊙ V),   W = T (β ⊙ Γ ⊙ K)

so that the pre-update residuals for the chunk's initial state ``S [K, V]``
are ``Δ = U − W S`` (stage 5). Without the delta rule (SSD: ``β`` absent)
``Δ = V`` (``U = V``, ``W = 0``). `chunk_intra` also forms the factors the
scan and the output need: ``Γ⊙Q``, ``K̃_j = k_j ⊙ exp(Σ_{t>j} g_t)`` and
``Γ_C``.

This is the XLA form (batched over leading axes); the Triton kernels of the
same stage are `triton_intra.gdn_wy_forward` and `triton_intra.kda_intra_forward`.
"""

from __future__ import annotations

import jax.numpy as jnp

from ...core.pallas import HIGHEST
from .decay import expand_gate, tail_sums
from .scores import decayed_scores
from .solve import solve_unit_lower


def chunk_intra(q, k, v, g, beta, precision=HIGHEST):
    """The parallel, per-chunk part (stages 1–4), float32.

    Args: ``q, k [..., C, K]`` (q already scaled), ``v [..., C, V]``,
      ``g`` per-step log decays ``[..., C]`` or ``[..., C, K]``, ``beta [..., C]``
      or ``None`` (no delta rule); ``precision`` of the matmuls.
    Returns a dict with ``U [.., C, V]``, ``W [.., C, K]`` (absent without
    delta), ``P [.., C, C]``, ``qg = Γ⊙Q``, ``kg = K̃ [.., C, K]`` and
    ``gamma = Γ_C`` (``[..., 1, 1]`` or ``[..., K, 1]``).
    """
    step = expand_gate(g, k)
    gate = jnp.exp(jnp.cumsum(step, axis=-2))  # Γ_i = exp(Σ_{t≤i} g_t)
    out = {
        "qg": q * gate,
        "kg": k * jnp.exp(tail_sums(step, axis=-2)),  # exp(Σ_{t>j} g_t)
        "gamma": jnp.swapaxes(gate[..., -1:, :], -1, -2),
    }
    if beta is None:
        out["P"] = decayed_scores(q[..., None, :, :], k, g, precision)[..., 0, :, :]
        out["U"] = v
        return out
    scores = decayed_scores(jnp.stack([q, k], axis=-3), k, g, precision)
    c = k.shape[-2]
    strictly_lower = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]
    A = jnp.where(strictly_lower, scores[..., 1, :, :], 0.0) * beta[..., :, None]
    b = beta[..., None]
    rhs = jnp.concatenate([b * v, b * gate * k], axis=-1)
    x = solve_unit_lower(A, rhs, precision)
    out["P"] = scores[..., 0, :, :]
    out["U"], out["W"] = x[..., :v.shape[-1]], x[..., v.shape[-1]:]
    return out
