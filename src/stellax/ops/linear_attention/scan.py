"""Stage 5 of the chunked pipeline: the state scan over chunks.

With the chunk's factors from stage 4 (``U``, ``W``, ``K̃``, ``Γ_C``), one
chunk moves the state ``S [K, V]`` (per batch and value head) by

    Δ  = U − W S                    the pre-update residuals (Δ = U = V without the delta rule)
    S' = Γ_C ⊙ S + K̃ᵀ Δ             (diag(Γ_C) S for per-channel decays)

which is affine in ``S``: ``S' = 𝒜 S + ℬ`` with ``𝒜 = diag(Γ_C) − K̃ᵀ W``
and ``ℬ = K̃ᵀ U`` (`state_transition`: the summary a context-parallel shard
passes on). The scan is sequential over chunks and parallel over everything
else; packed batches reset ``S`` to the sequence's initial state at its
first chunk and read its final state after its last.

This module is the math of one step (XLA); the loops over chunks are
`xla.scan_chunks` (XLA) and `triton_scan` (the Triton kernels, forward and
reverse).
"""

from __future__ import annotations

import jax.numpy as jnp

from ...core.pallas import F32, HIGHEST


def _einsum(spec, *operands, precision=HIGHEST):
    return jnp.einsum(spec, *operands, precision=precision, preferred_element_type=F32)


def state_step(S, parts, precision=HIGHEST):
    """One chunk of the state recurrence: ``(S', Δ)`` with ``Δ = U − W S`` and
    ``S' = Γ_C ⊙ S + K̃ᵀ Δ`` (``S [..., K, V]``, ``parts`` from `wy.chunk_intra`;
    ``precision`` of its contractions)."""
    delta = parts["U"]
    if "W" in parts:
        delta = delta - _einsum("...ck,...kv->...cv", parts["W"], S, precision=precision)
    new = parts["gamma"] * S + _einsum("...ck,...cv->...kv", parts["kg"], delta, precision=precision)
    return new, delta


def state_transition(parts, precision=HIGHEST):
    """The chunk's affine state map ``S' = 𝒜 S + ℬ`` as ``(𝒜 [..., K, K], ℬ [..., K, V])``.

    Composing the maps of consecutive chunks (``𝒜₂𝒜₁``, ``𝒜₂ℬ₁ + ℬ₂``) summarizes
    a whole shard run from a zero state, which is what context parallelism
    exchanges; `state_step` applies the same map without forming ``𝒜``.
    """
    kg = parts["kg"]
    kdim = kg.shape[-1]
    a = parts["gamma"] * jnp.eye(kdim, dtype=F32)
    if "W" in parts:
        a = a - _einsum("...ck,...cj->...kj", kg, parts["W"], precision=precision)
    return a, _einsum("...ck,...cv->...kv", kg, parts["U"], precision=precision)
