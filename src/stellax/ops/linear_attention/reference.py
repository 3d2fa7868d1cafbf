"""Golden references for linear attention: naive recurrences in float32, one
token at a time.

Gated delta rule (GDN; per head, state ``S [K, V]``, fla layout):

    S  = exp(g_t) · S                       (KDA: diag(exp(g_t)) · S, g_t ∈ R^K)
    S  = S + k_t ⊗ β_t (v_t − Sᵀ k_t)       (the delta rule: write v_t at key k_t)
    o_t = Sᵀ (scale · q_t)

with ``g_t ≤ 0`` the log-space decay. Grouped value heads: value head ``hv``
reads query/key head ``hv // (HV // H)``.

Mamba2 SSD (per head, state ``h [P, N]``, mamba_ssm layout; group ``h // (H // G)``):

    dt_t = softplus(dt_t + dt_bias) (if dt_softplus), clipped to dt_limit
    h    = exp(dt_t · A) · h + dt_t · x_t ⊗ B_t
    y_t  = h C_t + D · x_t,   then y_t · silu(z_t) when z is given

Packed batches (``cu_seqlens [N+1]``, batch 1): the state is reset to the
sequence's initial state at each sequence start, and each sequence's final
state is the state after its last token (its initial state when it is empty).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call
from ...core.precision import float32_exp, float32_softplus

_HIGHEST = jax.lax.Precision.HIGHEST
F32 = jnp.float32


# -- small shared pieces (used by every implementation) -------------------------
def l2norm(x, eps: float = 1e-6):
    """``x / sqrt(Σx² + eps)`` over the last axis, in float32 (fla's l2norm)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def kda_gate(g, A_log=None, dt_bias=None, lower_bound=None):
    """Kimi Linear's fused KDA gate on raw ``g [..., HV, K]`` (float32 result).

    ``dt_bias [HV*K]`` is added per channel, then either
    ``g = −exp(A_log) · softplus(g + dt_bias)`` (default) or, with ``lower_bound``,
    ``g = lower_bound · sigmoid(exp(A_log) · (g + dt_bias))`` (the "safe gate":
    every step decays by at most ``exp(lower_bound)``). ``A_log [HV]`` absent means
    ``exp(A_log) = 1``.
    """
    hv, kdim = g.shape[-2:]
    g = g.astype(F32)
    if dt_bias is not None:
        g = g + dt_bias.astype(F32).reshape(hv, kdim)
    # float32-accurate exp and softplus: a TPU's own are off by up to 5e-6 (`core.precision`)
    a = jnp.ones((hv, 1), F32) if A_log is None else float32_exp(A_log.astype(F32)).reshape(hv, 1)
    if lower_bound is None:
        return -a * float32_softplus(g)
    return lower_bound * jax.nn.sigmoid(a * g)


def ssd_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """Mamba2's step sizes: bias, optional softplus, then clipping to ``dt_limit``."""
    dt = dt.astype(F32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(F32)
    if dt_softplus:
        dt = float32_softplus(dt)  # float32-accurate on a TPU too (`core.precision`)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = jnp.clip(dt, lo, hi)
    return dt


def sequence_tokens(cu_seqlens, total: int):
    """Per token of a packed row of length ``total``: ``(seq [T], first [T],
    last [T])`` — its sequence index and whether it starts / ends its sequence."""
    t = jnp.arange(total, dtype=jnp.int32)
    cu = cu_seqlens.astype(jnp.int32)
    seq = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, cu.shape[0] - 2)
    return seq, t == cu[seq], t == cu[seq + 1] - 1


def _scan_tokens(step, state0, xs, cu_seqlens, total, tokens=None):
    """Run ``state, y = step(state, x)`` over time (axis 0 of ``xs``).

    Without ``cu_seqlens``: ``state0 [B, ...]`` and returns ``(ys, final)``.
    With it (batch 1): ``state0 [N, ...]`` holds each sequence's initial state,
    the state is reset at every sequence start and ``final [N, ...]`` collects
    each sequence's last state. ``tokens = (seq, first, last)`` per token may
    be given instead of ``cu_seqlens``.
    """
    if cu_seqlens is None and tokens is None:
        final, ys = jax.lax.scan(step, state0, xs)
        return ys, final
    seq, first, last = tokens if tokens is not None else sequence_tokens(cu_seqlens, total)

    def varlen_step(carry, inputs):
        state, finals = carry
        x, s, f, l = inputs
        state = jnp.where(f, state0[s][None], state)
        state, y = step(state, x)
        finals = finals.at[s].set(jnp.where(l, state[0], finals[s]))
        return (state, finals), y

    (_, finals), ys = jax.lax.scan(varlen_step, (state0[:1], state0), (xs, seq, first, last))
    return ys, finals


# -- gated delta rule (GDN and KDA) ---------------------------------------------
def delta_rule_recurrence(q, k, v, g, beta, *, scale, initial_state=None, cu_seqlens=None, tokens=None,
                          precision=_HIGHEST):
    """The gated delta rule, token by token, in float32.

    Args (already prepared: l2-normalized if requested, gates in log space):
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; beta: ``[B, T, HV]``;
      g: ``[B, T, HV]`` (GDN) or ``[B, T, HV, K]`` (KDA); beta ``None``: no
      delta rule (plain gated linear attention, ``S = decay·S + k ⊗ v``).
      initial_state: ``[N, HV, K, V]`` or ``None`` (zeros).
      tokens: per-token ``(seq, first, last)`` instead of ``cu_seqlens``.
      precision: of the contractions (`HIGHEST` for the golden; the XLA
        implementations pass their call's).
    Returns ``(o [B, T, HV, V] float32, final_state [N, HV, K, V] float32)``.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    delta = beta is not None
    q, k, v, g = (x.astype(F32) for x in (q, k, v, g))
    beta = beta.astype(F32) if delta else jnp.ones(g.shape[:3], F32)
    q = jnp.repeat(q, group, axis=2) * scale
    k = jnp.repeat(k, group, axis=2)
    per_channel = g.ndim == 4
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state0 = jnp.zeros((n, HV, K, V), F32) if initial_state is None else initial_state.astype(F32)

    def step(S, x):  # S [B, HV, K, V]
        q_t, k_t, v_t, g_t, b_t = x
        decay = jnp.exp(g_t)[..., None] if per_channel else jnp.exp(g_t)[..., None, None]
        S = S * decay
        if delta:
            v_t = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=precision)
        update = b_t[..., None] * v_t
        S = S + k_t[..., :, None] * update[..., None, :]
        return S, jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=precision)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    ys, final = _scan_tokens(step, state0, xs, cu_seqlens, T, tokens)
    return jnp.moveaxis(ys, 0, 1), final


def prepare_delta_inputs(call: Call):
    """float32 ``(q, k, g)`` as the recurrence sees them: l2-normalized q/k
    when ``use_qk_l2norm``, KDA's fused gate applied when requested."""
    q, k, g = call.q.astype(F32), call.k.astype(F32), call.g.astype(F32)
    if call.use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if call.options.get("use_gate_in_kernel"):
        g = kda_gate(g, call.A_log, call.dt_bias, call.lower_bound)
    # g is a log decay (<= 0). A positive traced g (eagerly an error, see `api`) is clamped to 0
    # here so that no kernel overflows (exp(g) > 1 compounds over the chunk); the ops then make its
    # (sequence, head) NaN (`bad_data`), never this finite clamped result.
    g = jnp.where(g > 0, 0.0, g)  # (not jnp.minimum: its gradient at g == 0 is halved)
    beta = call.beta.astype(F32)
    if call.options.get("use_beta_sigmoid_in_kernel"):
        beta = jax.nn.sigmoid(beta)
    return q, k, g, beta


def delta_rule_reference(call: Call):
    """Golden for the GDN/KDA ops: ``(o in v.dtype, final_state float32 or None)``."""
    q, k, g, beta = prepare_delta_inputs(call)
    o, final = delta_rule_recurrence(q, k, call.v, g, beta, scale=call.scale,
                                     initial_state=call.initial_state, cu_seqlens=call.cu_seqlens)
    return o.astype(call.v.dtype), (final if call.output_final_state else None)


# -- Mamba2 SSD -------------------------------------------------------------------
def ssd_recurrence(x, dt, A, B, C, *, initial_states=None, cu_seqlens=None, precision=_HIGHEST):
    """SSD token by token in float32 with prepared step sizes ``dt [B, T, H]``.

    ``x [B, T, H, P]``, ``A [H]``, ``B, C [B, T, G, N]``, ``initial_states
    [N_seq, H, P, N]``. Returns ``(y [B, T, H, P] without D/z, final [N_seq, H, P, N])``.
    """
    batch, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    group = H // G
    x, dt, A = x.astype(F32), dt.astype(F32), A.astype(F32)
    Bh = jnp.repeat(B.astype(F32), group, axis=2)
    Ch = jnp.repeat(C.astype(F32), group, axis=2)
    n = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state0 = jnp.zeros((n, H, P, N), F32) if initial_states is None else initial_states.astype(F32)

    def step(h, inputs):  # h [batch, H, P, N]
        x_t, dt_t, B_t, C_t = inputs
        h = h * jnp.exp(dt_t * A)[..., None, None]
        h = h + (dt_t[..., None] * x_t)[..., :, None] * B_t[..., None, :]
        return h, jnp.einsum("bhpn,bhn->bhp", h, C_t, precision=precision)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (x, dt, Bh, Ch))
    ys, final = _scan_tokens(step, state0, xs, cu_seqlens, T)
    return jnp.moveaxis(ys, 0, 1), final


def ssd_epilogue(y, x, D=None, z=None):
    """``y + D·x`` (``D [H]`` or ``[H, P]``), then ``· silu(z)``; float32."""
    y = y.astype(F32)
    if D is not None:
        d = D.astype(F32)
        y = y + x.astype(F32) * (d[:, None] if d.ndim == 1 else d)
    if z is not None:
        y = y * jax.nn.silu(z.astype(F32))
    return y


def ssd_reference(call: Call):
    """Golden `ssd`: ``y`` in x.dtype, or ``(y, final_states float32)``."""
    dt = ssd_dt(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit)
    y, final = ssd_recurrence(call.x, dt, call.A, call.B, call.C, initial_states=call.initial_states,
                              cu_seqlens=call.cu_seqlens)
    y = ssd_epilogue(y, call.x, call.D, call.z).astype(call.x.dtype)
    return (y, final) if call.return_final_states else y


def _is_tied(call: Call) -> bool:
    """Whether an `ssd_step` call uses mamba_ssm's per-(head, head_dim) shapes."""
    return call.dt.ndim == 3 or call.A.ndim == 3 or (call.dt_bias is not None and call.dt_bias.ndim == 2)


def _tied_step_reference(call: Call, precision=_HIGHEST):
    """One decode token with ``dt [B, H, P]``, ``A [H, P, N]``, ``dt_bias [H, P]``
    (mamba_ssm's ``selective_state_update`` with tied head dims; ``[B, H]`` /
    ``[H]`` operands broadcast over P and N), float32:

        dt ← clip(softplus(dt + dt_bias)),   state ← exp(dt·A)·state + (dt·x) ⊗ B_h
        y = state · C_h + D·x,  times silu(z)
    """
    batch, H, P = call.x.shape
    group = H // call.B.shape[1]
    dt = call.dt.astype(F32)
    dt = jnp.broadcast_to(dt if dt.ndim == 3 else dt[..., None], (batch, H, P))
    bias = call.dt_bias
    if bias is not None and bias.ndim == 1:
        bias = bias[:, None]
    dt = ssd_dt(dt, bias, call.dt_softplus, call.dt_limit)
    A = call.A.astype(F32)
    A = A if A.ndim == 3 else A[:, None, None]
    Bh = jnp.repeat(call.B.astype(F32), group, axis=1)
    Ch = jnp.repeat(call.C.astype(F32), group, axis=1)
    x = call.x.astype(F32)
    state = call.state.astype(F32) * jnp.exp(dt[..., None] * A) + (dt * x)[..., None] * Bh[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", state, Ch, precision=precision)
    y = ssd_epilogue(y, x, call.D, call.z)
    return y.astype(call.x.dtype), state.astype(call.state.dtype)


def ssd_step_reference(call: Call, precision=_HIGHEST):
    """Golden `ssd_step`, both shape conventions: one decode token. Returns ``(y [B, H, P],
    new_state [B, H, P, N])`` (``precision``: `HIGHEST` for the golden, the call's for the
    XLA implementation)."""
    if _is_tied(call):
        return _tied_step_reference(call, precision)
    dt = ssd_dt(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit)
    y, final = ssd_recurrence(call.x[:, None], dt[:, None], call.A, call.B[:, None], call.C[:, None],
                              initial_states=call.state, precision=precision)
    y = ssd_epilogue(y[:, 0], call.x, call.D, None if call.z is None else call.z)
    return y.astype(call.x.dtype), final.astype(call.state.dtype)
