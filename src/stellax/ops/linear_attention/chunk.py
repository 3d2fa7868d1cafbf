"""The chunked algorithm, one chunk at a time (shared by every implementation).

Notation for one chunk of ``C`` tokens and one (batch, value-head) pair, all
float32; ``g_t`` is the log decay of step ``t`` (a scalar per token for
GDN/SSD, a ``K``-vector for KDA), ``G_i = Σ_{t≤i} g_t`` its chunk-local sum
and ``Γ_i = exp(G_i)``:

* decayed scores (`decayed_scores`)
      P_ij = Σ_c q_ic k_jc exp(G_ic − G_jc)   for j ≤ i, else 0
  and the same with ``k`` for ``q``: the strictly lower ``A_ij = β_i (k_i·k_j)_decayed``;
* the UT/WY representation of the delta rule inside the chunk
      T = (I + A)⁻¹,   U = T (β ⊙ V),   W = T (β ⊙ Γ ⊙ K)
  so that the pre-update residuals are ``Δ = U − W S`` for the chunk's
  initial state ``S [K, V]`` (`solve_unit_lower`);
* the state transition (`state_step`)
      S' = Γ_C ⊙ S + K̃ᵀ Δ,   K̃_j = k_j ⊙ exp(G_C − G_j)
  which is affine in ``S``:  ``S' = 𝒜 S + ℬ`` with ``𝒜 = diag(Γ_C) − K̃ᵀ W``
  and ``ℬ = K̃ᵀ U`` (`state_transition` returns them — the summary a context-
  parallel shard passes on);
* the output (`chunk_output`)
      O = (Γ ⊙ Q) S + P Δ.

Without the delta rule (SSD: ``β`` absent) ``Δ = V`` (``U = V``, ``W = 0``).

Every exponent is a sum of decays over a span of steps, ``Σ_{j<t≤i} g_t ≤ 0``
(masked to ``−inf`` before the ``exp`` outside the span), so decays of −20
per step underflow to zero instead of overflowing; and it is summed directly
over the span (`pair_sums`, `tail_sums`), never as a difference of prefix
sums ``G_i − G_j``, which would lose the digits of short spans next to long
ones. KDA's per-channel scores use sub-blocks (`DECAY_BLOCK`): across blocks the decay
splits at a reference row ``r`` between ``j`` and ``i`` as
``exp(Σ_{r<t≤i} g) · exp(Σ_{j<t≤r} g)`` (both ≤ 1, two matmuls); within a
diagonal block it is formed elementwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST
#: Sub-block size of the triangular solve.
SUB_BLOCK = 16
#: Sub-block size of KDA's per-channel decays: the diagonal blocks cost
#: ``C·s·K`` exps and the off-diagonal factors ``(C/s)·C·K`` (measured fastest
#: at the XLA path's KDA chunk of 16 on a CPU).
DECAY_BLOCK = 4


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_HIGHEST, preferred_element_type=F32)


def _sub_block(c: int, size: int = SUB_BLOCK) -> int:
    return size if c % size == 0 else c


def _masked_exp(diff, mask):
    """``exp(diff)`` where ``mask``, exactly 0 elsewhere. Every ``diff`` here is a
    span sum, ≤ 0 inside the mask and exactly 0 outside it (an empty span), so
    ``exp`` never overflows and no ``−inf`` (nor inf·0 in a gradient) appears."""
    return jnp.where(mask, jnp.exp(diff), 0.0)


def pair_sums(g):
    """``D[..., i, j] = Σ_{j < t ≤ i} g_t`` over the last axis of ``g`` (0 for ``i ≤ j``).

    Summed directly rather than as ``G_i − G_j``: the g are all ≤ 0, so the
    sum is exact to a few ulps of itself, where the difference of two prefix
    sums (each up to −20·64) would lose every digit of a small ``D``.
    """
    c = g.shape[-1]
    later = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]  # [t, j]: t > j
    return jnp.cumsum(jnp.where(later, g[..., :, None], 0.0), axis=-2)


def tail_sums(g, axis: int = -1):
    """``Σ_{t > j} g_t`` along ``axis`` (an exclusive reverse cumsum)."""
    rev = jnp.flip(jnp.cumsum(jnp.flip(g, axis), axis=axis), axis)
    zero = jnp.zeros_like(jax.lax.slice_in_dim(g, 0, 1, axis=axis))
    return jnp.concatenate([jax.lax.slice_in_dim(rev, 1, g.shape[axis], axis=axis), zero], axis=axis)


def decayed_scores(x, y, g):
    """``[..., R, C, C]`` decayed inner products of rows of ``x`` with rows of ``y``.

    Args:
      x: ``[..., R, C, K]`` (``R`` stacked row sets at the same positions, e.g. q and k).
      y: ``[..., C, K]``.
      g: per-step log decays of the chunk, ``[..., C]`` (scalar) or ``[..., C, K]``.
    Returns ``S[r, i, j] = Σ_c x_ric y_jc exp(Σ_{j<t≤i} g_tc)`` for ``j ≤ i``, 0 above.
    """
    c = y.shape[-2]
    causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
    if g.ndim == y.ndim - 1:  # scalar decay per token
        decay = _masked_exp(pair_sums(g), causal)
        return _einsum("...rik,...jk->...rij", x, y) * decay[..., None, :, :]
    s = _sub_block(c, DECAY_BLOCK)
    nb = c // s
    kdim = y.shape[-1]
    lead = y.shape[:-2]
    r = x.shape[-3]
    gb = g.reshape(*lead, nb, s, kdim)
    xb = x.reshape(*lead, r, nb, s, kdim)
    yb = y.reshape(*lead, nb, s, kdim)
    # Diagonal blocks: elementwise decays [.., nb, s, s, K].
    inner = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    spans = jnp.moveaxis(pair_sums(jnp.swapaxes(gb, -1, -2)), -3, -1)  # [.., nb, s, s, K]
    e = _masked_exp(spans, inner[..., None])
    # Explicit products and sums, one row set at a time: a 3-operand einsum here
    # becomes a dot_general batched over every channel (1×1 matrices, 10× slower
    # on XLA:CPU), and broadcasting the row-set axis into the product made the
    # gradient crash XLA:CPU (jax 0.10.2).
    ye = yb[..., :, None, :, :] * e  # [.., nb, i, t, K]
    diag = jnp.stack([jnp.sum(xb[..., j, :, :, None, :] * ye, axis=-1) for j in range(r)], axis=-4)
    out = _einsum("...rast,ab->...rasbt", diag, jnp.eye(nb, dtype=F32))
    if nb > 1:
        # Off-diagonal blocks split at the last row r_a = a·s − 1 before block a:
        # exp(Σ_{r_a<t≤i} g) for rows of block a, exp(Σ_{j<t≤r_a} g) for earlier columns j.
        x_exp = xb * jnp.exp(jnp.cumsum(gb, axis=-2))[..., None, :, :, :]
        before = jnp.arange(c)[None, :] < (jnp.arange(nb) * s)[:, None]  # [nb, C]: j < a·s
        upto = jnp.where(before[..., None], g[..., None, :, :], 0.0)  # [.., nb, C, K]
        y_exp = y[..., None, :, :] * _masked_exp(tail_sums(upto, axis=-2), before[..., None])
        off = _einsum("...rask,...ajk->...rasj", x_exp, y_exp)
        out = out + off.reshape(off.shape[:-1] + (nb, s))
    return out.reshape(*lead, r, c, c)


def solve_unit_lower(A, R):
    """``X = (I + A)⁻¹ R`` for strictly lower ``A [..., C, C]`` and ``R [..., C, N]``.

    Blocked forward substitution over sub-blocks of 16 rows; each diagonal
    block is inverted exactly by the nilpotent product
    ``(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)`` (A is 16×16 strictly lower).
    """
    c = A.shape[-1]
    s = _sub_block(c)
    nb = c // s
    eye = jnp.eye(s, dtype=F32)
    blocks = jnp.stack([A[..., a * s:(a + 1) * s, a * s:(a + 1) * s] for a in range(nb)], axis=-3)
    inv = eye - blocks
    power = blocks
    span = 2
    while span < s:
        power = _einsum("...ij,...jk->...ik", power, power)
        inv = inv + _einsum("...ij,...jk->...ik", inv, power)
        span *= 2
    xs = []
    for a in range(nb):
        rows = R[..., a * s:(a + 1) * s, :]
        if a:
            done = jnp.concatenate(xs, axis=-2)
            rows = rows - _einsum("...ij,...jn->...in", A[..., a * s:(a + 1) * s, :a * s], done)
        xs.append(_einsum("...ij,...jn->...in", inv[..., a, :, :], rows))
    return jnp.concatenate(xs, axis=-2)


def _expand_gate(g, like):
    """A per-row gate ``[..., C]`` or ``[..., C, K]`` broadcastable against ``like [..., C, K]``."""
    return g[..., None] if g.ndim == like.ndim - 1 else g


def chunk_intra(q, k, v, g, beta):
    """The parallel, per-chunk part.

    Args: ``q, k [..., C, K]`` (q already scaled), ``v [..., C, V]``,
      ``g`` per-step log decays ``[..., C]`` or ``[..., C, K]``, ``beta [..., C]``
      or ``None`` (no delta rule).
    Returns a dict with ``U [.., C, V]``, ``W [.., C, K]`` (absent without
    delta), ``P [.., C, C]``, ``qg = Γ⊙Q``, ``kg = K̃ [.., C, K]`` and
    ``gamma = Γ_C`` (``[..., 1, 1]`` or ``[..., K, 1]``).
    """
    step = _expand_gate(g, k)
    gate = jnp.exp(jnp.cumsum(step, axis=-2))  # Γ_i = exp(Σ_{t≤i} g_t)
    out = {
        "qg": q * gate,
        "kg": k * jnp.exp(tail_sums(step, axis=-2)),  # exp(Σ_{t>j} g_t)
        "gamma": jnp.swapaxes(gate[..., -1:, :], -1, -2),
    }
    if beta is None:
        out["P"] = decayed_scores(q[..., None, :, :], k, g)[..., 0, :, :]
        out["U"] = v
        return out
    scores = decayed_scores(jnp.stack([q, k], axis=-3), k, g)
    c = k.shape[-2]
    strictly_lower = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]
    A = jnp.where(strictly_lower, scores[..., 1, :, :], 0.0) * beta[..., :, None]
    b = beta[..., None]
    rhs = jnp.concatenate([b * v, b * gate * k], axis=-1)
    x = solve_unit_lower(A, rhs)
    out["P"] = scores[..., 0, :, :]
    out["U"], out["W"] = x[..., :v.shape[-1]], x[..., v.shape[-1]:]
    return out


def state_step(S, parts):
    """One chunk of the state recurrence: ``(S', Δ)`` with ``Δ = U − W S`` and
    ``S' = Γ_C ⊙ S + K̃ᵀ Δ`` (``S [..., K, V]``)."""
    delta = parts["U"]
    if "W" in parts:
        delta = delta - _einsum("...ck,...kv->...cv", parts["W"], S)
    new = parts["gamma"] * S + _einsum("...ck,...cv->...kv", parts["kg"], delta)
    return new, delta


def state_transition(parts):
    """The chunk's affine state map ``S' = 𝒜 S + ℬ`` as ``(𝒜 [..., K, K], ℬ [..., K, V])``.

    Composing the maps of consecutive chunks (``𝒜₂𝒜₁``, ``𝒜₂ℬ₁ + ℬ₂``) summarizes
    a whole shard run from a zero state, which is what context parallelism
    exchanges; `state_step` applies the same map without forming ``𝒜``.
    """
    kg = parts["kg"]
    kdim = kg.shape[-1]
    a = parts["gamma"] * jnp.eye(kdim, dtype=F32)
    if "W" in parts:
        a = a - _einsum("...ck,...cj->...kj", kg, parts["W"])
    return a, _einsum("...ck,...cv->...kv", kg, parts["U"])


def chunk_step(S, parts):
    """`state_step` and `chunk_output` together: ``(S', O)``. ``W S`` and
    ``(Γ⊙Q) S`` share one matmul (one launch of ``[2C, K] × [K, V]``)."""
    if "W" not in parts:
        new, delta = state_step(S, parts)
        return new, chunk_output(parts, S, delta)
    c = parts["W"].shape[-2]
    both = _einsum("...ck,...kv->...cv", jnp.concatenate([parts["W"], parts["qg"]], axis=-2), S)
    delta = parts["U"] - both[..., :c, :]
    out = both[..., c:, :] + _einsum("...ij,...jv->...iv", parts["P"], delta)
    new = parts["gamma"] * S + _einsum("...ck,...cv->...kv", parts["kg"], delta)
    return new, out


def chunk_output(parts, S, delta):
    """``O = (Γ⊙Q) S + P Δ`` for the chunk's initial state ``S``."""
    return _einsum("...ck,...kv->...cv", parts["qg"], S) + _einsum("...ij,...jv->...iv", parts["P"], delta)

