"""Pallas Mosaic TPU kernels of the serving-time (decode) linear-attention ops:
`fused_recurrent_gated_delta_rule` / `fused_recurrent_kda` (`fused_recurrent`)
and `ssd_step` (`ssd_step`).

Fused recurrence (GDN / KDA), the golden of `reference.delta_rule_recurrence`
token by token, per value head with the state tile ``S [K, BV]`` (float32, VMEM):

    S ← exp(g_t)·S   (KDA: diag(exp(g_t))·S),   u_t = β_t (v_t − Sᵀk_t)
    S ← S + k_t ⊗ u_t,                           o_t = Sᵀ(scale·q_t)

Grid ``(S, HV, V/BV, NC)``: sequences (dense batches: ``S = B``; packed ones,
``S = 1``), value heads and value tiles are ``"parallel"``; the ``NC`` token
chunks of ``block_t`` tokens are ``"arbitrary"`` and walked in order, the state
carried in the scratch. Inside a step the chunk's tokens run one at a time (a
loop of dynamic length: the chunk's token count by scalar prefetch). The state
is read from HBM once per (sequence, head, tile) — its block index does not
change over the sequence's chunks, so the pipeline fetches it once and
prefetches the next sequence's block while this one computes — and written
once, when the block index moves on. Value columns are independent (every op
is column-wise in ``S``), so tiling ``V`` recomputes nothing.

Token ``r`` of a chunk is handled on its aligned 8-row slab (rows ``8⌊r/8⌋ …``
of the chunk, a legal dynamic sublane slice) with the other rows masked to 0:
``Sᵀk`` is ``K8 S`` on the MXU, the outer product ``k ⊗ u`` is ``K8ᵀ U8``
(contraction over the slab's rows), ``o`` is ``Q8 S`` accumulated into the
chunk's output rows; KDA's per-channel decay column ``exp(g_t)`` over ``K`` is
broadcast over the tile as ``E8ᵀ 1`` (a row turned into a column by the MXU).
Every matmul at the call's resolved ``precision`` (`core.pallas.mxu_dot`:
``DEFAULT`` one bfloat16 pass, ``HIGH`` three, ``HIGHEST`` float32), in the
XLA backward too.

Layout (the wrapper): the per-token preparation of the XLA path
(`reference.prepare_delta_inputs`: l2-norm, KDA gate, β sigmoid, decay clamp;
``q`` scaled) runs outside the kernel, in float32; tokens are laid out
heads-major ``[S, H, NC·C, K]`` (value heads ``[S, HV, NC·C, V]``; grouped
heads read query/key head ``hv // (HV / H)`` through the index map), ``β`` and
GDN's ``g`` as the two lanes of ``[S, HV, NC·C, 2]``. A packed batch is laid
out with each sequence starting at a chunk boundary (``max(1, ⌈L/C⌉)`` chunks
per sequence, at most ``⌈T/C⌉ + N`` in all); int32 ``seq, first, count [S·NC]``
by scalar prefetch give each chunk its sequence (the state blocks' index),
whether it resets the state to the sequence's initial state, and its token
count. Padding rows are zeros, which is the identity step (``k = β = g = 0``).

Gradients: the kernels are forward only. `fused_recurrent` and `ssd_step`
run through `core.vjp` rules (`FusedRecurrent`, `SsdStep`) whose backward is
the VJP of the XLA path (`reference.delta_rule_recurrence` / the `ssd_step` golden) recomputed
from the inputs: exact gradients, at XLA speed (decode does not train).

SSD step (mamba_ssm ``selective_state_update``), per (batch, head) and tile of
``BP`` rows of the state ``h [P, N]``:

    h ← exp(dt·A)·h + (dt·x) ⊗ B_g,   y = h C_g     (float32; ``dt, x`` columns ``[BP, 1]``)

with ``dt`` prepared outside (bias, softplus, clip; `reference.ssd_dt`), ``A``
per head (``[1, 1]``) or mamba_ssm's tied ``A [P, N]`` block, and ``y + D·x``,
``· silu(z)`` applied after the kernel (`reference.ssd_epilogue`). Grid
``(B, H/BH, P/BP)``, all ``"parallel"``: a step updates ``BH`` heads' ``[BP, N]`` tiles at once
(``B_g``, ``C_g`` repeated per head beforehand, so a block of heads may span groups).

The new state is a separate output (no input/output aliasing):
`core.pallas.tpu_kernel_call` takes no ``input_output_aliases``, so a donated
state buffer is not reused in place; the ops' contract is functional (a new
``final_state`` / ``new_state`` array).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core import Call, UnsupportedError, vjp
from ...core.pallas import F32, mxu_dot, mxu_dot_tn, operand, output, tpu_kernel_call
from .reference import prepare_delta_inputs, sequence_tokens, ssd_dt, ssd_epilogue
from .configs import BLOCK_T, FusedRecurrentTpuConfig, SsdStepTpuConfig

_SLAB = 8  # rows of a float32 sublane tile


# -- fused recurrence (GDN / KDA) ------------------------------------------------------
def _recurrent_kernel(*, seq, first, count, q, k, v, g, coef, h0, o, final, states, state, chunks: int,
                      per_channel: bool, precision):
    """One (sequence, value head, value tile, chunk) step: reset the state at a
    sequence's first chunk, run the chunk's ``count`` tokens through the
    recurrence (module docstring), write the outputs and the state (and, for
    the backward, each token's incoming state to ``states [C, K, BV]``)."""
    del seq
    idx = pl.program_id(0) * chunks + pl.program_id(3)

    @pl.when(first[idx] != 0)
    def _():
        state[...] = h0[...].astype(F32)

    o[...] = jnp.zeros(o.shape, F32)
    width = o.shape[-1]
    rows = jax.lax.broadcasted_iota(jnp.int32, (_SLAB, 1), 0)

    def token(r, carry):
        base = pl.multiple_of(jax.lax.div(r, _SLAB) * _SLAB, _SLAB)
        mask = rows == r - base
        slab = pl.ds(base, _SLAB)
        k8 = jnp.where(mask, k[slab, :], 0.0)
        scalars = jnp.sum(jnp.where(mask, coef[slab, :], 0.0), axis=0, keepdims=True)  # [1, 2]
        s = state[...]
        if states is not None:
            states[r] = s
        if per_channel:
            decay = jnp.where(mask, jnp.exp(g[slab, :]), 0.0)
            s = s * mxu_dot_tn(decay, jnp.ones((_SLAB, width), F32), precision)
        else:
            s = s * jnp.exp(scalars[:, 1:2])
        u = jnp.where(mask, scalars[:, 0:1] * (v[slab, :] - mxu_dot(k8, s, precision)), 0.0)
        s = s + mxu_dot_tn(k8, u, precision)
        state[...] = s
        o[slab, :] += mxu_dot(jnp.where(mask, q[slab, :], 0.0), s, precision)
        return carry

    jax.lax.fori_loop(0, count[idx], token, 0)
    final[...] = state[...]


def _chunk_layout(cu_seqlens, batch: int, total: int, n: int, chunk: int):
    """``(S, NC, rows, seq, first, count)``: sequences on the grid's first axis,
    chunks per sequence, each token's row in the ``[S, NC·C]`` layout (``None``
    for a dense batch: rows are the tokens), and the int32 tables ``[S·NC]``."""
    if cu_seqlens is None:
        nc = -(-total // chunk)
        c = np.arange(nc)
        counts = np.clip(total - c * chunk, 0, chunk)
        tables = (np.tile(np.arange(batch)[:, None], (1, nc)), np.tile(c == 0, (batch, 1)),
                  np.tile(counts, (batch, 1)))
        return (batch, nc, None) + tuple(jnp.asarray(t.reshape(-1), jnp.int32) for t in tables)
    cu = cu_seqlens.astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    per_seq = jnp.maximum(1, (lengths + chunk - 1) // chunk)
    start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per_seq)[:-1]])  # first chunk of each
    nc = -(-total // chunk) + n
    c = jnp.arange(nc, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(start, c, side="right").astype(jnp.int32) - 1, 0, n - 1)
    used = start[-1] + per_seq[-1]
    first = (c == start[seq]) & (c < used)
    count = jnp.where(c < used, jnp.clip(lengths[seq] - (c - start[seq]) * chunk, 0, chunk), 0)
    t = jnp.arange(total, dtype=jnp.int32)
    tseq = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, n - 1)
    rows = start[tseq] * chunk + (t - cu[tseq])
    return 1, nc, rows, seq, first.astype(jnp.int32), count.astype(jnp.int32)


def _heads_major(x, rows, s: int, length: int):
    """``[B, T, heads, d]`` → ``[S, heads, length, d]`` float32: transposed, tokens
    placed at ``rows`` of the packed layout (or padded at the end), zeros elsewhere."""
    x = jnp.swapaxes(x.astype(F32), 1, 2)
    if rows is None:
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))
    return jnp.zeros((s, x.shape[1], length, x.shape[3]), F32).at[:, :, rows].set(x)


def _fused_recurrent_forward(call: Call, config: FusedRecurrentTpuConfig, save_states: bool = False):
    """``(o [B, T, HV, V] in v.dtype, final [N, HV, K, V] float32)`` from the kernel;
    with ``save_states`` also each token's incoming state ``[B, T, HV, K, V]``
    (float32, on chunks of 8 tokens so the states block stays small)."""
    q, k, g, beta = prepare_delta_inputs(call)
    B, T, H, K = q.shape
    HV, V = call.v.shape[2:]
    group = HV // H
    per_channel = g.ndim == 4
    n = B if call.cu_seqlens is None else call.cu_seqlens.shape[0] - 1
    chunk = BLOCK_T[0] if save_states else config.block_t
    bv = min(config.block_v, V)
    s, nc, rows, seq, first, count = _chunk_layout(call.cu_seqlens, B, T, n, chunk)
    length = nc * chunk
    gdn_g = jnp.zeros_like(beta) if per_channel else g
    tokens = {
        "q": _heads_major(q * call.scale, rows, s, length),
        "k": _heads_major(k, rows, s, length),
        "v": _heads_major(call.v, rows, s, length),
        "g": _heads_major(g, rows, s, length) if per_channel else None,
        "coef": _heads_major(jnp.stack([beta, gdn_g], axis=-1), rows, s, length),
    }
    h0 = call.initial_state if call.initial_state is not None else jnp.zeros((n, HV, K, V), F32)

    def qk_spec(width):
        return pl.BlockSpec((None, None, chunk, width), lambda b, h, j, c, *_: (b, jax.lax.div(h, group), c, 0))

    def token_spec(width, column):
        return pl.BlockSpec((None, None, chunk, width), lambda b, h, j, c, *_: (b, h, c, j if column else 0))

    def state_spec():
        return pl.BlockSpec((None, None, K, bv), lambda b, h, j, c, seq_, *_: (seq_[b * nc + c], h, 0, j))

    outs = tpu_kernel_call(
        lambda **refs: _recurrent_kernel(**refs, chunks=nc, per_channel=per_channel, precision=call.precision),
        grid=(s, HV, pl.cdiv(V, bv), nc),
        scalar_prefetch={"seq": seq, "first": first, "count": count},
        inputs={"q": operand(tokens["q"], qk_spec(K)), "k": operand(tokens["k"], qk_spec(K)),
                "v": operand(tokens["v"], token_spec(bv, True)),
                "g": operand(tokens["g"], token_spec(K, False)),
                "coef": operand(tokens["coef"], token_spec(2, False)),
                "h0": operand(h0, state_spec())},
        outputs={"o": output((s, HV, length, V), F32, token_spec(bv, True)),
                 "final": output((n, HV, K, V), F32, state_spec()),
                 "states": output((s, HV, length, K, V), F32,
                                  pl.BlockSpec((None, None, chunk, K, bv), lambda b, h, j, c, *_: (b, h, c, 0, j)))
                 if save_states else None},
        scratch={"state": pltpu.VMEM((K, bv), F32)},
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        name="fused_recurrent_kda" if per_channel else "fused_recurrent_gated_delta_rule",
    )
    def tokens_of(x):  # [S, HV, L, ...] -> [B, T, HV, ...]
        return jnp.swapaxes(x[:, :, :T] if rows is None else x[:, :, rows], 1, 2)

    o = tokens_of(outs.o).astype(call.v.dtype)
    return (o, outs.final) + ((tokens_of(outs.states),) if save_states else ())


def _per_value_head(call: Call, arrays):
    """The recurrence's float32 inputs per value head ``(q·scale, k, v, g, β)``
    (``[B, T, HV, ...]``) from ``call``'s arrays: `prepare_delta_inputs`, q/k
    heads repeated to the value heads."""
    c = call.replace_arrays(**arrays)
    q, k, g, beta = prepare_delta_inputs(c)
    group = c.v.shape[2] // c.q.shape[2]
    return (jnp.repeat(q, group, axis=2) * c.scale, jnp.repeat(k, group, axis=2), c.v.astype(F32), g, beta)


def _token_step(s_prev, x, precision):
    """One token of one batch row's heads from its incoming state ``s_prev
    [HV, K, V]``: ``(S_t, o_t)`` (the kernel's math, in XLA, at ``precision``)."""
    q, k, v, g, beta = x
    decay = jnp.exp(g)[..., None] if g.ndim == 2 else jnp.exp(g)[:, None, None]
    s = s_prev * decay
    u = beta[:, None] * (v - jnp.einsum("hk,hkv->hv", k, s, precision=precision))
    s = s + k[:, :, None] * u[:, None, :]
    return s, jnp.einsum("hk,hkv->hv", q, s, precision=precision)


def _recurrent_backward(call: Call, arrays, states, d_o, d_final):
    """Cotangents of ``call``'s arrays from those of ``(o, final)``: a reverse
    scan over tokens, each step the VJP of `_token_step` at the kernel's saved
    incoming state (so nothing is recomputed but the step), the state's
    cotangent handed back token by token, to ``d h0`` at a sequence's first
    token; then the VJP of the preparation (l2-norm, gate, β, head groups)."""
    prepared, prep_vjp = jax.vjp(lambda a: _per_value_head(call, a), arrays)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in prepared)  # [T, B, ...]
    s_prev = jnp.moveaxis(states, 1, 0)
    d_o = jnp.moveaxis(d_o.astype(F32), 1, 0)
    token_step = lambda s0, x: _token_step(s0, x, call.precision)
    step = jax.vmap(lambda s0, x, ds, do: jax.vjp(token_step, s0, x)[1]((ds, do)))
    T = xs[0].shape[0]
    if call.cu_seqlens is None:
        def back(carry, inp):
            s0, x, do = inp
            d_s0, dx = step(s0, x, carry, do)
            return d_s0, dx
        d_h0, dxs = jax.lax.scan(back, d_final, (s_prev, xs, d_o), reverse=True)
    else:
        seq, first, last = sequence_tokens(call.cu_seqlens, T)
        lengths = call.cu_seqlens[1:] - call.cu_seqlens[:-1]
        d_h0 = jnp.where((lengths == 0)[:, None, None, None], d_final, 0.0)  # empty: final = h0

        def back(carry, inp):
            d_s, d_h0 = carry
            s0, x, do, sq, f, l = inp
            d_in = jnp.where(l, d_final[sq][None], d_s)
            d_s0, dx = step(s0, x, d_in, do)
            d_h0 = d_h0.at[sq].add(jnp.where(f, d_s0[0], 0.0))
            return (jnp.where(f, 0.0, d_s0), d_h0), dx
        (_, d_h0), dxs = jax.lax.scan(back, (jnp.zeros_like(d_final[:1]), d_h0),
                                      (s_prev, xs, d_o, seq, first, last), reverse=True)
    (d_arrays,) = prep_vjp(tuple(jnp.moveaxis(dx, 0, 1) for dx in dxs))
    if arrays["initial_state"] is not None:
        d_arrays["initial_state"] = d_h0.astype(arrays["initial_state"].dtype)
    return d_arrays


@dataclasses.dataclass(frozen=True)
class FusedRecurrent:
    """The fused recurrence as a `core.vjp` rule: the operand is the dict of the call's
    arrays; ``options`` the call's options as ``(name, value)`` pairs. Not differentiated
    (`primal`), the kernel runs with ``config``; under ``jax.grad`` it also saves every
    token's incoming state ``[B, T, HV, K, V]`` (float32, on chunks of 8 tokens: what the
    XLA scan's VJP would store) and the backward is `_recurrent_backward` in XLA."""

    options: tuple
    config: Any

    def call(self, arrays) -> Call:
        return Call(arrays, dict(self.options))

    def primal(self, arrays):
        return _fused_recurrent_forward(self.call(arrays), self.config)

    def forward(self, arrays):
        o, final, states = _fused_recurrent_forward(self.call(arrays), self.config, save_states=True)
        return (o, final), (arrays, states)

    def backward(self, residuals, cotangents):
        arrays, states = residuals
        return (_recurrent_backward(self.call(arrays), arrays, states, *cotangents),)


def fused_recurrent(call: Call, config: FusedRecurrentTpuConfig):
    """`fused_recurrent_gated_delta_rule` / `fused_recurrent_kda` on the Mosaic
    TPU kernel (module docstring). ``call`` is the op's checked call (GDN
    ``g [B, T, HV]`` or KDA ``g [B, T, HV, K]``, options as the op's).

    Returns ``(o [B, T, HV, V] in v.dtype, final_state [N, HV, K, V] float32 or
    None)``, differentiable (`FusedRecurrent`)."""
    o, final = vjp.apply(FusedRecurrent(tuple(call.options.items()), config), dict(call.arrays))
    return o, (final if call.output_final_state else None)


# -- ssd_step ----------------------------------------------------------------------------
def _ssd_step_kernel(*, state, dt, x, A, B, C, new_state, y):
    """One (batch, head block, row tile) step, every head of the block at once:
    ``h ← exp(dt·A)·h + (dt·x) ⊗ B``, ``y = h C`` (state tiles ``[heads, rows, N]``)."""
    step = dt[...]
    h = state[...].astype(F32) * jnp.exp(step * A[...]) + (step * x[...]) * B[...]
    new_state[...] = h.astype(new_state.dtype)
    y[...] = jnp.sum(h * C[...], axis=-1, keepdims=True)


def _ssd_step_columns(call: Call):
    """``(dt, x)`` float32 ``[B, H, P, 1]``: prepared step sizes (both shape conventions) and inputs."""
    batch, H, P = call.x.shape
    dt = call.dt.astype(F32)
    dt = dt if dt.ndim == 3 else dt[..., None]
    bias = call.dt_bias
    bias = None if bias is None else (bias[:, None] if bias.ndim == 1 else bias)
    dt = jnp.broadcast_to(ssd_dt(dt, bias, call.dt_softplus, call.dt_limit), (batch, H, P))
    return dt[..., None], call.x.astype(F32)[..., None]


def _ssd_step_forward(call: Call, config: SsdStepTpuConfig):
    """``(y [B, H, P] in x.dtype, new_state [B, H, P, N] in state.dtype)`` from the kernel."""
    batch, H, P = call.x.shape
    G, N = call.B.shape[1:]
    bp, bh = min(config.block_p, P), config.block_h
    if H % bh:
        raise UnsupportedError(f"config.block_h: expected a divisor of the {H} heads, got {bh}")
    dt, x = _ssd_step_columns(call)
    tied = call.A.ndim == 3
    A = call.A.astype(F32) if tied else call.A.astype(F32).reshape(H, 1, 1)
    a_spec = (pl.BlockSpec((bh, bp, N), lambda b, h, j: (h, j, 0)) if tied
              else pl.BlockSpec((bh, 1, 1), lambda b, h, j: (h, 0, 0)))
    # B and C per head ([B, H, 1, N]: a few KB against the state's MB), so that a block of heads
    # may span groups.
    per_head = lambda m: jnp.repeat(m.astype(F32), H // G, axis=1)[:, :, None]
    rows = pl.BlockSpec((None, bh, 1, N), lambda b, h, j: (b, h, 0, 0))
    column = pl.BlockSpec((None, bh, bp, 1), lambda b, h, j: (b, h, j, 0))
    tile = pl.BlockSpec((None, bh, bp, N), lambda b, h, j: (b, h, j, 0))
    outs = tpu_kernel_call(
        _ssd_step_kernel,
        grid=(batch, H // bh, pl.cdiv(P, bp)),
        inputs={"state": operand(call.state, tile), "dt": operand(dt, column), "x": operand(x, column),
                "A": operand(A, a_spec), "B": operand(per_head(call.B), rows), "C": operand(per_head(call.C), rows)},
        outputs={"new_state": output(call.state.shape, call.state.dtype, tile),
                 "y": output((batch, H, P, 1), F32, column)},
        dimension_semantics=("parallel", "parallel", "parallel"),
        name="ssd_step",
    )
    y = ssd_epilogue(outs.y[..., 0], call.x, call.D, call.z)
    return y.astype(call.x.dtype), outs.new_state


def _ssd_state_update(call: Call, arrays):
    """The new state ``h [B, H, P, N]`` float32 in XLA (the kernel's math):
    ``exp(dt·A)·state + (dt·x) ⊗ B_g``."""
    c = call.replace_arrays(**arrays)
    H = c.x.shape[1]
    dt, x = _ssd_step_columns(c)
    A = c.A.astype(F32) if c.A.ndim == 3 else c.A.astype(F32).reshape(H, 1, 1)
    Bh = jnp.repeat(c.B.astype(F32), H // c.B.shape[1], axis=1)
    return c.state.astype(F32) * jnp.exp(dt * A) + (dt * x) * Bh[:, :, None, :]


def _ssd_output(call: Call, arrays, h):
    """``y = h C_g + D·x``, ``· silu(z)`` (in x.dtype) from the new state ``h``."""
    c = call.replace_arrays(**arrays)
    Ch = jnp.repeat(c.C.astype(F32), c.x.shape[1] // c.C.shape[1], axis=1)
    y = jnp.einsum("bhpn,bhn->bhp", h, Ch, precision=c.precision)
    return ssd_epilogue(y, c.x, c.D, c.z).astype(c.x.dtype)


@dataclasses.dataclass(frozen=True)
class SsdStep:
    """The `ssd_step` kernel as a `core.vjp` rule (operand and ``options`` as in
    `FusedRecurrent`). The backward (XLA) takes the VJP of the output stage
    `_ssd_output` at the kernel's new state, then that of `_ssd_state_update`."""

    options: tuple
    config: Any

    def call(self, arrays) -> Call:
        return Call(arrays, dict(self.options))

    def forward(self, arrays):
        y, new_state = _ssd_step_forward(self.call(arrays), self.config)
        return (y, new_state), (arrays, new_state)

    def backward(self, residuals, cotangents):
        arrays, new_state = residuals
        call = self.call(arrays)
        d_y, d_new = cotangents
        _, output_vjp = jax.vjp(lambda a, h: _ssd_output(call, a, h), arrays, new_state.astype(F32))
        d_out, d_h = output_vjp(d_y)
        _, update_vjp = jax.vjp(lambda a: _ssd_state_update(call, a), arrays)
        (d_upd,) = update_vjp(d_h + d_new.astype(F32))
        return (jax.tree_util.tree_map(lambda u, o: (u + o).astype(u.dtype), d_upd, d_out),)


def ssd_step(call: Call, config: SsdStepTpuConfig):
    """`ssd_step` on the Mosaic TPU kernel (module docstring). Returns ``(y [B, H, P]
    in x.dtype, new_state [B, H, P, N] in state.dtype)``, differentiable (`SsdStep`)."""
    return vjp.apply(SsdStep(tuple(call.options.items()), config), dict(call.arrays))
