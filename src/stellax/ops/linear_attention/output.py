"""Stage 6 of the chunked pipeline: the output.

For one chunk with initial state ``S`` and residuals ``Δ`` (stage 5):

    O = (Γ ⊙ Q) S + P Δ

the inter-chunk part (the state, decayed to each row) plus the intra-chunk
part (the chunk's own residuals through the causal decayed scores ``P`` of
stage 2). `chunk_step` fuses stages 5 and 6 for the XLA scan (``W S`` and
``(Γ⊙Q) S`` in one matmul). The Triton kernels of this stage are in
`triton_output`.
"""

from __future__ import annotations

import jax.numpy as jnp

from ...core.pallas import F32, HIGHEST
from .scan import state_step


def _einsum(spec, *operands, precision=HIGHEST):
    return jnp.einsum(spec, *operands, precision=precision, preferred_element_type=F32)


def chunk_output(parts, S, delta, precision=HIGHEST):
    """``O [..., C, V] = (Γ⊙Q) S + P Δ`` for the chunk's initial state ``S [..., K, V]``."""
    return (_einsum("...ck,...kv->...cv", parts["qg"], S, precision=precision)
            + _einsum("...ij,...jv->...iv", parts["P"], delta, precision=precision))


def chunk_step(S, parts, precision=HIGHEST):
    """`scan.state_step` and `chunk_output` together: ``(S', O)``. ``W S`` and
    ``(Γ⊙Q) S`` share one matmul (one launch of ``[2C, K] × [K, V]``)."""
    if "W" not in parts:
        new, delta = state_step(S, parts, precision)
        return new, chunk_output(parts, S, delta, precision)
    c = parts["W"].shape[-2]
    both = _einsum("...ck,...kv->...cv", jnp.concatenate([parts["W"], parts["qg"]], axis=-2), S, precision=precision)
    delta = parts["U"] - both[..., :c, :]
    out = both[..., c:, :] + _einsum("...ij,...jv->...iv", parts["P"], delta, precision=precision)
    new = parts["gamma"] * S + _einsum("...ck,...cv->...kv", parts["kg"], delta, precision=precision)
    return new, out
