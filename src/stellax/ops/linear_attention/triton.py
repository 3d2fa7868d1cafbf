"""Pallas Triton kernels for chunked GDN / SSD (scalar decays), chunk 64.

Arrays are heads-major, flattened to ``[BH, Tp, D]`` (``BH = Bs·HV``, ``Tp``
a multiple of the chunk, ``D`` padded to a power of two ≥ 16); ``g [BH, Tp]``
holds the per-step log decays, summed over spans inside the kernels
(`_spans`). Notation as in `chunk.py`.

Forward (three launches):

1. `wy_forward` — grid ``(NT, BH)``, delta rule only: per chunk
   ``A = strict_lower(β_i exp(G_i − G_j) k_i·k_j)``, ``T = (I + A)⁻¹`` by the
   nilpotent product ``(I − A)(I + A²)(I + A⁴)…(I + A³²)``, then
   ``U = T(β⊙V)`` and ``W = T(β⊙Γ⊙K)``.
2. `state_forward` — grid ``(BH, V/BV)``, a loop over chunks holding
   ``S [K, BV]`` in registers: stores the chunk-initial ``S_c``, then
   ``Δ = U − W S`` and ``S ← exp(G_C) S + (K ⊙ exp(G_C − G))ᵀ Δ``. Packed
   batches reset ``S`` to the sequence's initial state at its first chunk and
   store the final state at its last chunk.
3. `output_forward` — grid ``(NT, BH, V/BV)``:
   ``O = (Q ⊙ Γ) S_c + (QKᵀ ⊙ exp(G_i − G_j))_{j≤i} Δ``.

Backward: `state_backward` — grid ``(BH, V/BV)``, the reverse loop over chunks
carrying ``dS`` (the gradient of the chunk's final state):
``dΔ = Pᵀ dO + K̃ dS``, ``dS ← exp(G_C) dS + (Q⊙Γ)ᵀ dO − Wᵀ dΔ``; it stores
``dS`` per chunk and ``dΔ``. The per-chunk gradients of q, k, v, g and β
follow from those in parallel: `triton_backward.intra_backward`, grid
``(NT, BH, V/BV)``, recomputes the chunk's ``P``, ``A``, ``T``, ``U``, ``W``
and backpropagates through them (see that module for the math).

All matmuls run at ``Precision.HIGHEST`` (IEEE float32 on the tensor cores'
fallback path); exponents are ≤ 0 (masked to −inf before ``exp``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import triton_call
from .configs import LinearAttentionConfig

F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


def _dot(a, b):
    return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=F32)


def _dot_tn(a, b):
    """``aᵀ b``."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=F32)


def _dot_nt(a, b):
    """``a bᵀ``."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=F32)


def _iota(c):
    rows = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    return rows, cols


def _spans(g, chunk):
    """Sums of the chunk's per-step log decays ``g [C]`` over spans (see `chunk.py`):
    ``D[i, j] = Σ_{j<t≤i} g_t`` (a matmul with a 0/1 matrix, exact products),
    ``G_i = Σ_{t≤i} g_t``, ``tail_j = Σ_{t>j} g_t`` and the chunk total."""
    rows, cols = _iota(chunk)
    later = jnp.where(rows > cols, g[:, None], 0.0)  # [t, j]: g_t for t > j
    spans = _dot((rows >= cols).astype(F32), later)
    prefix = jnp.sum(jnp.where(rows >= cols, g[None, :], 0.0), axis=1)
    return spans, prefix, jnp.sum(later, axis=0), jnp.sum(g)


def _decay(spans, mask):
    return jnp.exp(jnp.where(mask, spans, -jnp.inf))


def unit_lower_inverse(a, rows, cols, chunk):
    """``T = (I + A)⁻¹`` of a strictly lower ``A [C, C]`` (``rows, cols`` its
    `_iota`): ``(I − A)(I + A²)(I + A⁴)…`` — exact, as ``A^C = 0``."""
    inv = (rows == cols).astype(F32) - a
    power = a
    span = 2
    while span < chunk:
        power = _dot(power, power)
        inv = inv + _dot(inv, power)
        span *= 2
    return inv


def scan_chunks(step, *, chunks: int, heads: int, meta_refs, start_ref, store_ref, end_ref, reverse: bool = False):
    """The sequential loop of the state-scan kernels over one head's chunks,
    carrying a float32 ``[K, BV]`` state: ``store_ref[c]`` receives the state
    entering chunk ``c``, then ``state = step(c, state)``.

    Dense batches start from ``start_ref`` and write the last state to
    ``end_ref``. Packed batches (``meta_refs = (first, seq, last)`` per chunk)
    reset to ``start_ref[seq·heads + head]`` where a sequence begins and store
    into ``end_ref[…]`` where it ends. ``reverse`` runs the chunks backwards
    (the backward scans: a sequence begins at its last chunk)."""
    varlen = meta_refs is not None
    head = pl.program_id(0) % heads
    if varlen:
        first_ref, seq_ref, last_ref = meta_refs
        begin_ref, finish_ref = (last_ref, first_ref) if reverse else (first_ref, last_ref)

    def body(i, state):
        c = chunks - 1 - i if reverse else i
        if varlen:
            idx = seq_ref[c] * heads + head
            state = jnp.where(begin_ref[c] != 0, start_ref[idx].astype(F32), state)
        store_ref[c] = state
        state = step(c, state)
        if varlen:
            @pl.when(finish_ref[c] != 0)
            def _():
                end_ref[idx] = state
        return state

    init = jnp.zeros(store_ref.shape[1:], F32) if varlen else start_ref[...].astype(F32)
    state = jax.lax.fori_loop(0, chunks, body, init)
    if not varlen:
        end_ref[...] = state


# -- 1. WY representation -------------------------------------------------------
def _wy_kernel(k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref, *, chunk):
    k = k_ref[...].astype(F32)
    v = v_ref[...].astype(F32)
    g = g_ref[...]
    b = beta_ref[...]
    rows, cols = _iota(chunk)
    spans, prefix, _, _ = _spans(g, chunk)
    a = _dot_nt(k, k) * _decay(spans, rows > cols) * b[:, None]
    inv = unit_lower_inverse(a, rows, cols, chunk)
    u_ref[...] = _dot(inv, v * b[:, None]).astype(u_ref.dtype)
    w_ref[...] = _dot(inv, k * (b * jnp.exp(prefix))[:, None]).astype(w_ref.dtype)


def wy_forward(k, v, g, beta, *, chunk: int, config: LinearAttentionConfig):
    """``(U [BH, Tp, V], W [BH, Tp, K])``."""
    bh, tp, kdim = k.shape
    vdim = v.shape[-1]
    grid = (tp // chunk, bh)
    spec = lambda d: pl.BlockSpec((None, chunk, d), lambda c, h: (h, c, 0))
    vec = pl.BlockSpec((None, chunk), lambda c, h: (h, c))
    return triton_call(
        functools.partial(_wy_kernel, chunk=chunk),
        out_shape=[jax.ShapeDtypeStruct(v.shape, F32), jax.ShapeDtypeStruct(k.shape, F32)],
        grid=grid, in_specs=[spec(kdim), spec(vdim), vec, vec], out_specs=[spec(vdim), spec(kdim)],
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_gdn_wy",
    )(k, v, g, beta)


# -- 2. state scan --------------------------------------------------------------
def _state_kernel(*refs, chunks, chunk, heads, has_w, varlen):
    refs = list(refs)
    w_ref = refs.pop(0) if has_w else None
    u_ref, k_ref, g_ref, h0_ref = refs[:4]
    refs = refs[4:]
    meta_refs = None
    if varlen:
        meta_refs, refs = refs[:3], refs[3:]
    s_ref, d_ref, final_ref = refs
    rows_i, cols_i = _iota(chunk)

    def step(c, state):
        rows = pl.ds(c * chunk, chunk)
        g = g_ref[rows]
        later = jnp.where(rows_i > cols_i, g[:, None], 0.0)
        tail, total = jnp.sum(later, axis=0), jnp.sum(g)
        delta = u_ref[rows, :].astype(F32)
        if has_w:
            delta = delta - _dot(w_ref[rows, :].astype(F32), state)
        d_ref[rows, :] = delta
        k = k_ref[rows, :].astype(F32) * jnp.exp(tail)[:, None]
        return jnp.exp(total) * state + _dot_tn(k, delta)

    scan_chunks(step, chunks=chunks, heads=heads, meta_refs=meta_refs, start_ref=h0_ref, store_ref=s_ref,
                end_ref=final_ref)


@dataclasses.dataclass(frozen=True)
class ScanLayout:
    """The launch of a state-scan kernel: grid ``(BH, V/BV)``, one program per
    head and block of ``BV`` state columns, looping over the ``NT`` chunks of
    ``Tp`` padded tokens. ``n_states`` initial / final ``[K, V]`` states (all
    ``N·HV`` of a packed batch, indexed in the kernel; else one per head)."""

    bh: int
    tp: int
    chunk: int
    kdim: int
    vdim: int
    bv: int
    n_states: int
    varlen: bool

    @classmethod
    def of(cls, bh: int, tp: int, kdim: int, vdim: int, states, meta, *, chunk: int, config: LinearAttentionConfig):
        return cls(bh, tp, chunk, kdim, vdim, min(config.block_v, vdim), states.shape[0], meta is not None)

    @property
    def nt(self) -> int:
        return self.tp // self.chunk

    def rows(self, d: int):
        """A head's whole ``[Tp, d]`` rows."""
        return pl.BlockSpec((None, self.tp, d), lambda h, j: (h, 0, 0))

    @property
    def rows_v(self):
        """A head's ``[Tp, BV]`` columns of a value-sized array."""
        return pl.BlockSpec((None, self.tp, self.bv), lambda h, j: (h, 0, j))

    @property
    def per_token(self):
        """A head's ``[Tp]`` scalars."""
        return pl.BlockSpec((None, self.tp), lambda h, j: (h, 0))

    def per_chunk(self, d: int):
        """A head's ``[NT, d]`` per-chunk rows."""
        return pl.BlockSpec((None, self.nt, d), lambda h, j: (h, 0, 0))

    @property
    def states(self):
        if self.varlen:
            return pl.BlockSpec((self.n_states, self.kdim, self.bv), lambda h, j: (0, 0, j))
        return pl.BlockSpec((None, self.kdim, self.bv), lambda h, j: (h, 0, j))

    @property
    def meta(self) -> list:
        """Specs of the packed batch's ``first, seq, last [NT]`` (none when dense)."""
        return [pl.BlockSpec((self.nt,), lambda h, j: (0,))] * 3 if self.varlen else []

    def launch(self, kernel, inputs, in_specs, *, config: LinearAttentionConfig, name: str):
        """Run ``kernel`` (its ``chunks, chunk, varlen`` bound here); outputs float32
        ``(per-chunk states [BH, NT, K, V], per-token [BH, Tp, V], end states [n_states, K, V])``."""
        kernel = functools.partial(kernel, chunks=self.nt, chunk=self.chunk, varlen=self.varlen)
        return triton_call(
            kernel,
            out_shape=[jax.ShapeDtypeStruct((self.bh, self.nt, self.kdim, self.vdim), F32),
                       jax.ShapeDtypeStruct((self.bh, self.tp, self.vdim), F32),
                       jax.ShapeDtypeStruct((self.n_states, self.kdim, self.vdim), F32)],
            grid=(self.bh, self.vdim // self.bv), in_specs=in_specs,
            out_specs=[pl.BlockSpec((None, self.nt, self.kdim, self.bv), lambda h, j: (h, 0, 0, j)), self.rows_v,
                       self.states],
            num_warps=config.num_warps, num_stages=config.num_stages, name=name,
        )(*inputs)


def state_forward(w, u, k, g, h0, meta, *, chunk: int, heads: int, config: LinearAttentionConfig):
    """``(S_c [BH, NT, K, V], Δ [BH, Tp, V], final [N·HV, K, V])``.

    ``h0 [N·HV, K, V]``; ``meta`` is ``None`` or ``(first, seq, last)`` int32 ``[NT]``.
    """
    bh, tp, kdim = k.shape
    scan = ScanLayout.of(bh, tp, kdim, u.shape[-1], h0, meta, chunk=chunk, config=config)
    has_w = w is not None
    inputs = ([w] if has_w else []) + [u, k, g, h0] + list(meta or ())
    in_specs = ([scan.rows(kdim)] if has_w else []) + [scan.rows_v, scan.rows(kdim), scan.per_token, scan.states]
    return scan.launch(functools.partial(_state_kernel, heads=heads, has_w=has_w), inputs, in_specs + scan.meta,
                       config=config, name="stellax_linear_attention_state")


# -- 3. output ----------------------------------------------------------------
def _output_kernel(q_ref, k_ref, g_ref, d_ref, s_ref, o_ref, *, chunk):
    q = q_ref[...].astype(F32)
    k = k_ref[...].astype(F32)
    g = g_ref[...]
    rows, cols = _iota(chunk)
    spans, prefix, _, _ = _spans(g, chunk)
    p = _dot_nt(q, k) * _decay(spans, rows >= cols)
    o = _dot(q * jnp.exp(prefix)[:, None], s_ref[...]) + _dot(p, d_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)


def output_forward(q, k, g, delta, states, *, chunk: int, config: LinearAttentionConfig):
    """``O [BH, Tp, V]`` from the chunk-initial states and the residuals Δ."""
    bh, tp, kdim = q.shape
    vdim = delta.shape[-1]
    bv = min(config.block_v, vdim)
    qk = pl.BlockSpec((None, chunk, kdim), lambda c, h, j: (h, c, 0))
    dv = pl.BlockSpec((None, chunk, bv), lambda c, h, j: (h, c, j))
    return triton_call(
        functools.partial(_output_kernel, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct(delta.shape, F32),
        grid=(tp // chunk, bh, vdim // bv),
        in_specs=[qk, qk, pl.BlockSpec((None, chunk), lambda c, h, j: (h, c)), dv,
                  pl.BlockSpec((None, None, kdim, bv), lambda c, h, j: (h, c, 0, j))],
        out_specs=dv,
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_linear_attention_output",
    )(q, k, g, delta, states)


# -- backward: reverse state scan ---------------------------------------------
def _state_backward_kernel(*refs, chunks, chunk, heads, has_w, varlen):
    refs = list(refs)
    q_ref, k_ref, g_ref = refs[:3]
    refs = refs[3:]
    w_ref = refs.pop(0) if has_w else None
    do_ref, dht_ref = refs[:2]
    refs = refs[2:]
    meta_refs = None
    if varlen:
        meta_refs, refs = refs[:3], refs[3:]
    ds_ref, dd_ref, dh0_ref = refs
    rows_i, cols_i = _iota(chunk)

    def step(c, ds):
        rows = pl.ds(c * chunk, chunk)
        q = q_ref[rows, :].astype(F32)
        k = k_ref[rows, :].astype(F32)
        spans, prefix, tail, total = _spans(g_ref[rows], chunk)
        do = do_ref[rows, :].astype(F32)
        p = _dot_nt(q, k) * _decay(spans, rows_i >= cols_i)
        dd = _dot_tn(p, do) + _dot(k * jnp.exp(tail)[:, None], ds)
        dd_ref[rows, :] = dd
        ds = jnp.exp(total) * ds + _dot_tn(q * jnp.exp(prefix)[:, None], do)
        if has_w:
            ds = ds - _dot_tn(w_ref[rows, :].astype(F32), dd)
        return ds

    scan_chunks(step, chunks=chunks, heads=heads, meta_refs=meta_refs, start_ref=dht_ref, store_ref=ds_ref,
                end_ref=dh0_ref, reverse=True)


def state_backward(q, k, g, w, do, dht, meta, *, chunk: int, heads: int, config: LinearAttentionConfig):
    """``(dS [BH, NT, K, V] (gradient of each chunk's final state), dΔ [BH, Tp, V], dh0 [N·HV, K, V])``."""
    bh, tp, kdim = k.shape
    scan = ScanLayout.of(bh, tp, kdim, do.shape[-1], dht, meta, chunk=chunk, config=config)
    has_w = w is not None
    inputs = [q, k, g] + ([w] if has_w else []) + [do, dht] + list(meta or ())
    in_specs = ([scan.rows(kdim), scan.rows(kdim), scan.per_token] + ([scan.rows(kdim)] if has_w else [])
                + [scan.rows_v, scan.states])
    return scan.launch(functools.partial(_state_backward_kernel, heads=heads, has_w=has_w), inputs,
                       in_specs + scan.meta, config=config, name="stellax_linear_attention_state_bwd")
