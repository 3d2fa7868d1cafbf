"""Bad data under ``jit`` (issue 43): what the linear-attention ops do with
values that cannot be checked on the host, and their checked-mode checks.

Two data-dependent preconditions:

* ``g ≤ 0`` (GDN/KDA, a log-space decay; not with KDA's fused gate, whose
  decay is ≤ 0 by construction). Positive ``g`` grows the state by
  ``exp(Σ g)``: the exact recurrence overflows float32 once ``Σ g > 88``, and
  the chunked algorithm is not exact there (measured, T = 128, chunk 64, delta
  rule: ``g = 0.5`` agrees to 2e-5 relative, but ``g = 2`` gives NaN from the
  first token where the recurrence is finite for 45 tokens, ``g = 30`` NaN
  from the first token). The documented range is ``g ≤ 0`` (decay in
  ``(0, 1]``, what ``−softplus`` / ``−exp`` parameterisations produce). Out of
  range (positive or NaN), every output row and the final state of the
  affected (sequence, value head) are NaN — in every implementation and the
  golden, the recurrent forms included — and gradients through them NaN.
* ``cu_seqlens`` starts at 0, never decreases and ends at ``T``. Otherwise
  which token belongs to which sequence is undefined: the whole output and
  every final state are NaN (the kernels run on placeholder offsets
  ``[0, T, …, T]``, so nothing reads out of bounds).

Valid data is unchanged bit for bit: the values are multiplied by exactly 1.
The ops multiply the decays (`poison_decay`, chunked and token-by-token alike): a bad (sequence, head)'s ``g`` made
NaN makes the recurrence itself write its output rows, final state and gradients NaN, so the
outputs take no extra pass over HBM for the mask (on a v5e at T = 16384, HV = 32 that pass was a
256 MB read and write of ``o``, about 0.3 ms of a 7.2 ms GDN forward).
In checked mode (`stellax.checked`) both are ``checkify`` checks at the op's
entry naming the argument and the bad value (`require_decay`,
`require_cu_seqlens`).
"""

from __future__ import annotations

import jax.numpy as jnp

from ...core import Call
from ...core.pallas import F32
from ...core.runtime_checks import require
from .reference import sequence_tokens


# -- checked mode --------------------------------------------------------------------------------
def require_decay(g) -> None:
    """Checked mode: every ``g <= 0`` (log-space decay), reporting the largest value."""
    require(lambda: jnp.all(g <= 0),
            "g: expected a log-space decay <= 0 everywhere (decay exp(g) in (0, 1]), got a largest value of "
            "{largest}; unchecked, the affected (sequence, head) outputs and final states are NaN",
            largest=lambda: jnp.max(g))


def cu_seqlens_valid(cu_seqlens, length: int):
    """Whether packed offsets start at 0, never decrease and end at ``length`` (a traced bool)."""
    cu = cu_seqlens.astype(jnp.int32)
    return (cu[0] == 0) & (cu[-1] == length) & jnp.all(cu[1:] >= cu[:-1])


def require_cu_seqlens(cu_seqlens, length: int) -> None:
    """Checked mode: `cu_seqlens_valid`, reporting the first and last offsets and the smallest step."""
    if cu_seqlens is None:
        return
    require(lambda: cu_seqlens_valid(cu_seqlens, length),
            f"cu_seqlens: expected offsets starting at 0, non-decreasing, ending at T = {length}; got first "
            "{first}, last {last}, smallest step {step}; unchecked, every output and final state is NaN",
            first=lambda: cu_seqlens[0], last=lambda: cu_seqlens[-1],
            step=lambda: jnp.min(jnp.diff(cu_seqlens.astype(jnp.int32))))


# -- unchecked: placeholder offsets and NaN masks ----------------------------------------------------
def _safe_offsets(cu_seqlens, length: int):
    """``(offsets, ok)``: ``cu_seqlens`` when valid, else ``[0, T, …, T]``; ``ok`` the validity."""
    ok = cu_seqlens_valid(cu_seqlens, length)
    fallback = jnp.full(cu_seqlens.shape, length, cu_seqlens.dtype).at[0].set(0)
    return jnp.where(ok, cu_seqlens, fallback), ok


def _scale(bad):
    """1 where fine, NaN where ``bad`` (float32)."""
    return jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(1.0))


def guard(call: Call, *, decay: str | None = "g"):
    """Sanitize ``call``'s ``cu_seqlens`` and compute the NaN masks of its bad data.

    ``decay``: the name of the log-decay array to range-check (``[B, T, HV]`` or
    ``[B, T, HV, K]``), ``None`` for none. Returns ``(call, scales)``: ``scales``
    ``None`` when there is nothing to check, else ``(rows [B, T, HV], states [N, HV])``
    of 1 / NaN, for `poison`.
    """
    g = None if decay is None else call.arrays[decay]
    cu = call.arrays.get("cu_seqlens")
    if g is None and cu is None:
        return call, None
    lead = next(a for a in (call.arrays.get("v"), call.arrays.get("x")) if a is not None)
    B, T, HV = lead.shape[:3]
    ok = None
    if cu is not None:
        cu, ok = _safe_offsets(cu, T)
        call = call.replace_arrays(cu_seqlens=cu)
    if g is not None:
        bad = ~(g <= 0)
        if bad.ndim == 4:
            bad = jnp.any(bad, axis=-1)  # [B, T, HV]
        if cu is None:
            per_seq = jnp.any(bad, axis=1)  # [B, HV]
            rows = jnp.broadcast_to(per_seq[:, None], (B, T, HV))
        else:  # batch 1: a sequence is bad where any of its tokens is (a prefix count of bad tokens)
            counts = jnp.concatenate([jnp.zeros((1, HV), jnp.int32), jnp.cumsum(bad[0].astype(jnp.int32), 0)])
            c = cu.astype(jnp.int32)
            per_seq = (counts[c[1:]] - counts[c[:-1]]) > 0  # [N, HV]
            rows = per_seq[sequence_tokens(cu, T)[0]][None]
    else:
        n = cu.shape[0] - 1
        per_seq = jnp.zeros((n, HV), bool)
        rows = jnp.zeros((B, T, HV), bool)
    if ok is not None:
        per_seq, rows = per_seq | ~ok, rows | ~ok
    return call, (_scale(rows), _scale(per_seq))


def poison_decay(scales, call: Call, decay: str) -> Call:
    """``call`` with its log decays ``decay`` (``[B, T, HV]`` or ``[B, T, HV, K]``) times `guard`'s row
    scales: exactly ``g`` where valid, NaN on every token of a bad (sequence, head). Every output row of
    that (sequence, head) is then NaN through its decays (``Γ_i = exp(Σ_{t≤i} g_t)`` scales the state's
    contribution to row ``i``), its final state too, and the gradients through them; a sequence's state
    is reset, not multiplied, at its start, so no NaN crosses into the next one. The final states still
    need `poison` (an empty sequence passes its initial state through)."""
    if scales is None:
        return call
    rows, _ = scales
    g = call.arrays[decay]
    scale = rows.reshape(rows.shape + (1,) * (g.ndim - 3))
    return call.replace_arrays(**{decay: (g.astype(F32) * scale).astype(g.dtype)})


def poison(scales, out, state=None):
    """``out [B, T, HV, ...]`` and ``state [N, HV, ...]`` times the 1 / NaN `guard` scales
    (exactly themselves where valid; NaN, and NaN gradients, where not; ``None`` stays ``None``)."""
    if scales is None:
        return out, state
    rows, per_seq = scales
    if out is not None:
        out = out * rows.reshape(rows.shape + (1,) * (out.ndim - 3)).astype(out.dtype)
    if state is not None:
        state = state * per_seq.reshape(per_seq.shape + (1,) * (state.ndim - 2)).astype(state.dtype)
    return out, state
