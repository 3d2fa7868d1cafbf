"""Pallas Triton kernels of stage 5: the state scan over chunks, forward and
reverse, grid ``(BH, V/BV)``.

One program per head and block of ``BV`` state columns loops over the head's
``NT`` chunks holding ``S [K, BV]`` in registers (`scan_loop`; launched by
`ScanLayout`). Arrays are heads-major and flattened (`layout`); packed
batches carry int32 ``first, seq, last [NT]`` per chunk: the state is reset
to the sequence's initial state at its first chunk and stored as its final
state at its last. Notation as in `scan.py`.

Forward, storing the chunk-initial ``S_c`` and ``Δ``:

* `gdn_state_forward` (scalar decays ``g [BH, Tp]``, summed over spans in the
  kernel): ``Δ = U − W S``, ``S ← exp(G_C) S + (K ⊙ exp(tail))ᵀ Δ``
  (SSD: no ``W``, ``U = V``);
* `kda_state_forward` (per-channel factors from `triton_intra.kda_intra_forward`):
  ``Δ = U − W S``, ``S ← diag(Γ_C) S + K̃ᵀ Δ``.

Reverse, carrying ``dS`` (the gradient of the chunk's final state) and
storing it per chunk, with ``dΔ`` and the initial states' gradients:

* `gdn_state_backward`: ``dΔ = Pᵀ dO + K̃ dS``,
  ``dS ← exp(G_C) dS + (Q⊙Γ)ᵀ dO − Wᵀ dΔ`` (``P`` recomputed per chunk);
* `kda_state_backward`: the same from the stored ``P``, ``Q⊙Γ``, ``K̃``, ``W``, ``Γ_C``.

The scans' matmuls run at the call's precision as Triton takes it
(`core.pallas.triton_precision`: `TF32X3`, three TF32 tensor-core passes, about
float32 accuracy, for ``high`` / ``highest``, one TF32 pass for ``default``; an
IEEE float32 dot is scalar FMA on a GPU), on ``[C, 64]``
column blocks of the ``[C, K]`` operands against the state's ``[64, BV]`` row
blocks (`BLOCK_K`). Exponents are ≤ 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import (F32, HIGHEST, dot, dot_nt, dot_tn, operand, output, square_iota, triton_kernel_call,
                            triton_precision)
from .configs import LinearAttentionConfig
from .decay import masked_decay, tile_spans
from .layout import check_flat_layout


#: Key rows per block of the carried state: the scans hold ``S [K, BV]`` as
#: ``K / BLOCK_K`` separate ``[BLOCK_K, BV]`` blocks, so no dot takes more than a
#: ``[C, BLOCK_K]`` tile of ``W``/``K``/``Q`` (whole-``K`` operands spilled at K = 128).
BLOCK_K = 64


def key_blocks(kdim: int) -> list:
    """The ``pl.ds`` key-row slices of the state blocks (`BLOCK_K` rows each)."""
    bk = min(BLOCK_K, kdim)
    return [pl.ds(b * bk, bk) for b in range(kdim // bk)]


def scan_loop(step, *, chunks: int, heads: int, first, seq, last, start, store, end, reverse: bool = False):
    """The sequential loop of a state-scan kernel over one head's chunks,
    carrying a float32 ``[K, BV]`` state as a tuple of `key_blocks` row blocks:
    ``store[c]`` receives the state entering chunk ``c``, then ``state =
    step(c, state)`` (``state`` the tuple of blocks).

    Dense batches (``first = seq = last = None``) start from ``start`` and
    write the last state to ``end``. Packed batches (int32 refs ``first, seq,
    last [NT]``) reset to ``start[seq·heads + head]`` where a sequence begins
    and store into ``end[…]`` where it ends. ``reverse`` runs the chunks
    backwards (the backward scans: a sequence begins at its last chunk)."""
    varlen = first is not None
    head = pl.program_id(0) % heads
    begins, finishes = (last, first) if reverse else (first, last)
    blocks = key_blocks(store.shape[1])

    def body(i, state):
        c = chunks - 1 - i if reverse else i
        if varlen:
            idx = seq[c] * heads + head
            state = tuple(jnp.where(begins[c] != 0, start[idx, ks, :].astype(F32), s)
                          for ks, s in zip(blocks, state))
        for ks, s in zip(blocks, state):
            store[c, ks, :] = s
        state = tuple(step(c, state))
        if varlen:
            @pl.when(finishes[c] != 0)
            def _():
                for ks, s in zip(blocks, state):
                    end[idx, ks, :] = s
        return state

    if varlen:
        init = tuple(jnp.zeros((ks.size, store.shape[2]), F32) for ks in blocks)
    else:
        init = tuple(start[ks, :].astype(F32) for ks in blocks)
    state = jax.lax.fori_loop(0, chunks, body, init)
    if not varlen:
        for ks, s in zip(blocks, state):
            end[ks, :] = s


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

    def meta(self, meta) -> dict:
        """The packed batch's named ``first, seq, last [NT]`` operands (``None`` when dense)."""
        spec = pl.BlockSpec((self.nt,), lambda h, j: (0,))
        first, seq, last = meta if meta is not None else (None, None, None)
        return dict(first=operand(first, spec), seq=operand(seq, spec), last=operand(last, spec))

    def launch(self, kernel, inputs: dict, meta, *, names: tuple[str, str, str], config: LinearAttentionConfig,
               name: str, precision=HIGHEST):
        """Run ``kernel`` (its ``chunks, chunk`` bound here) on the named ``inputs``
        and the packed batch's ``meta``; its float32 outputs, named by ``names``:
        ``(per-chunk states [BH, NT, K, V], per-token [BH, Tp, V], end states [n_states, K, V])``;
        ``precision`` (resolved) of the kernel's matmuls, as Triton runs it (`triton_precision`)."""
        kernel = functools.partial(kernel, chunks=self.nt, chunk=self.chunk, precision=triton_precision(precision))
        store, per_token, end = names
        outs = triton_kernel_call(
            kernel, grid=(self.bh, self.vdim // self.bv),
            inputs={**inputs, **self.meta(meta)},
            outputs={store: output((self.bh, self.nt, self.kdim, self.vdim), F32,
                                   pl.BlockSpec((None, self.nt, self.kdim, self.bv), lambda h, j: (h, 0, 0, j))),
                     per_token: output((self.bh, self.tp, self.vdim), F32, self.rows_v),
                     end: output((self.n_states, self.kdim, self.vdim), F32, self.states)},
            num_warps=config.num_warps, num_stages=config.num_stages, name=name,
        )
        return outs[store], outs[per_token], outs[end]


# -- forward --------------------------------------------------------------------------
def _gdn_state_kernel(*, w, u, k, g, h0, first, seq, last, states, delta, final, chunks, chunk, heads, precision):
    """``Δ = U − W S``, ``S ← exp(G_C) S + (K ⊙ exp(tail))ᵀ Δ`` chunk by chunk (``S`` in key blocks)."""
    rows_i, cols_i = square_iota(chunk)
    blocks = key_blocks(k.shape[-1])

    def step(c, state):
        rows = pl.ds(c * chunk, chunk)
        gc = g[rows]
        later = jnp.where(rows_i > cols_i, gc[:, None], 0.0)
        tail, total = jnp.sum(later, axis=0), jnp.sum(gc)
        d = u[rows, :].astype(F32)
        if w is not None:
            for ks, s in zip(blocks, state):
                d = d - dot(w[rows, ks].astype(F32), s, precision=precision)
        delta[rows, :] = d
        keep = jnp.exp(tail)[:, None]
        return [jnp.exp(total) * s + dot_tn(k[rows, ks].astype(F32) * keep, d, precision=precision)
                for ks, s in zip(blocks, state)]

    scan_loop(step, chunks=chunks, heads=heads, first=first, seq=seq, last=last, start=h0, store=states, end=final)


def gdn_state_forward(w, u, k, g, h0, meta, *, chunk: int, heads: int, config: LinearAttentionConfig,
                      precision=HIGHEST):
    """``(S_c [BH, NT, K, V], Δ [BH, Tp, V], final [N·HV, K, V])`` float32.

    Args: ``w [BH, Tp, K]`` or ``None`` (no delta rule), ``u [BH, Tp, V]``,
    ``k [BH, Tp, K]``, float32 ``g [BH, Tp]``, ``h0 [N·HV, K, V]``; ``meta`` is
    ``None`` or ``(first, seq, last)`` int32 ``[NT]``; ``heads = HV``.
    """
    bh, tp, kdim = k.shape
    scan = ScanLayout.of(bh, tp, kdim, u.shape[-1], h0, meta, chunk=chunk, config=config)
    inputs = dict(w=operand(w, scan.rows(kdim)), u=operand(u, scan.rows_v), k=operand(k, scan.rows(kdim)),
                  g=operand(g, scan.per_token), h0=operand(h0, scan.states))
    return scan.launch(functools.partial(_gdn_state_kernel, heads=heads), inputs, meta,
                       names=("states", "delta", "final"), config=config, name="stellax_linear_attention_state",
                       precision=precision)


def _kda_state_kernel(*, w, u, kg, gamma, h0, first, seq, last, states, delta, final, chunks, chunk, heads,
                      precision):
    """``Δ = U − W S``, ``S ← diag(Γ_C) S + K̃ᵀ Δ`` chunk by chunk (``S`` in key blocks)."""
    blocks = key_blocks(kg.shape[-1])

    def step(c, state):
        rows = pl.ds(c * chunk, chunk)
        d = u[rows, :]
        for ks, s in zip(blocks, state):
            d = d - dot(w[rows, ks], s, precision=precision)
        delta[rows, :] = d
        return [gamma[c, ks][:, None] * s + dot_tn(kg[rows, ks], d, precision=precision)
                for ks, s in zip(blocks, state)]

    scan_loop(step, chunks=chunks, heads=heads, first=first, seq=seq, last=last, start=h0, store=states, end=final)


def kda_state_forward(w, u, kg, gamma, h0, meta, *, chunk: int, heads: int, config: LinearAttentionConfig,
                      precision=HIGHEST):
    """The chunk scan ``S ← diag(Γ_C) S + K̃ᵀ(U − W S)``.

    Args: ``w, kg [BH, Tp, K]``, ``u [BH, Tp, V]``, ``gamma [BH, NT, K]`` (from
    `triton_intra.kda_intra_forward`), ``h0 [N·HV, K, V]``, ``meta`` ``None`` or int32
    ``(first, seq, last) [NT]`` (packed batches); ``heads = HV``.
    Returns float32 ``(S_c [BH, NT, K, V], Δ [BH, Tp, V], final [N·HV, K, V])``.
    """
    bh, tp, kdim = kg.shape
    check_flat_layout(chunk, kg=(kg, (None, None, None)), w=(w, kg.shape), u=(u, (bh, tp, None)),
                      gamma=(gamma, (bh, tp // chunk, kdim)), h0=(h0, (None, kdim, u.shape[-1])))
    scan = ScanLayout.of(bh, tp, kdim, u.shape[-1], h0, meta, chunk=chunk, config=config)
    inputs = dict(w=operand(w, scan.rows(kdim)), u=operand(u, scan.rows_v), kg=operand(kg, scan.rows(kdim)),
                  gamma=operand(gamma, scan.per_chunk(kdim)), h0=operand(h0, scan.states))
    return scan.launch(functools.partial(_kda_state_kernel, heads=heads), inputs, meta,
                       names=("states", "delta", "final"), config=config, name="stellax_kda_state",
                       precision=precision)


# -- reverse --------------------------------------------------------------------------
def _gdn_state_backward_kernel(*, q, k, g, w, do, dht, first, seq, last, ds, dd, dh0, chunks, chunk, heads,
                               precision):
    """``dΔ = Pᵀ dO + K̃ dS``, ``dS ← exp(G_C) dS + (Q⊙Γ)ᵀ dO − Wᵀ dΔ``, chunks in reverse
    (``dS`` in key blocks).

    The row scalings go on the other factor, ``K̃ dS = exp(tail) ⊙ (K dS)`` and
    ``(Q⊙Γ)ᵀ dO = Qᵀ (Γ⊙dO)``, so ``q`` and ``k`` enter the matmuls as loaded, and
    ``Qᵀ (Γ⊙dO)`` waits for ``dΔ`` (an added ``0·dΔ``, exact for finite ``dΔ``): ptxas
    otherwise overlaps it with ``dΔ``'s products, and at the examples with two stages
    (K = 32 / 16) the kernel spilled 32 B on sm_90 and 4 / 60 B on sm_80; none so."""
    rows_i, cols_i = square_iota(chunk)
    blocks = key_blocks(k.shape[-1])

    def step(c, d_state):
        rows = pl.ds(c * chunk, chunk)
        spans, prefix, tail, total = tile_spans(g[rows], chunk)
        doc = do[rows, :].astype(F32)
        qk = jnp.zeros((chunk, chunk), F32)
        for ks in blocks:
            qk = qk + dot_nt(q[rows, ks].astype(F32), k[rows, ks].astype(F32), precision=precision)
        d_delta = dot_tn(qk * masked_decay(spans, rows_i >= cols_i), doc, precision=precision)
        k_ds = jnp.zeros(doc.shape, F32)
        for ks, s in zip(blocks, d_state):
            k_ds = k_ds + dot(k[rows, ks].astype(F32), s, precision=precision)
        d_delta = d_delta + jnp.exp(tail)[:, None] * k_ds
        dd[rows, :] = d_delta
        do_gated = doc * jnp.exp(prefix)[:, None] + 0.0 * d_delta
        out = []
        for ks, s in zip(blocks, d_state):
            s = jnp.exp(total) * s + dot_tn(q[rows, ks].astype(F32), do_gated, precision=precision)
            if w is not None:
                s = s - dot_tn(w[rows, ks].astype(F32), d_delta, precision=precision)
            out.append(s)
        return out

    scan_loop(step, chunks=chunks, heads=heads, first=first, seq=seq, last=last, start=dht, store=ds, end=dh0,
              reverse=True)


def gdn_state_backward(q, k, g, w, do, dht, meta, *, chunk: int, heads: int, config: LinearAttentionConfig,
                       precision=HIGHEST):
    """The reverse chunk scan of `gdn_state_forward`: float32 ``(dS [BH, NT, K, V]``
    (gradient of each chunk's final state), ``dΔ [BH, Tp, V], dh0 [N·HV, K, V])``.

    Args: ``q, k [BH, Tp, K]`` (q scaled), float32 ``g [BH, Tp]``, ``w [BH, Tp, K]``
    or ``None``, float32 ``do [BH, Tp, V]``, ``dht [N·HV, K, V]`` (the final
    states' gradient), ``meta`` as in `gdn_state_forward`.
    """
    bh, tp, kdim = k.shape
    scan = ScanLayout.of(bh, tp, kdim, do.shape[-1], dht, meta, chunk=chunk, config=config)
    inputs = dict(q=operand(q, scan.rows(kdim)), k=operand(k, scan.rows(kdim)), g=operand(g, scan.per_token),
                  w=operand(w, scan.rows(kdim)), do=operand(do, scan.rows_v), dht=operand(dht, scan.states))
    return scan.launch(functools.partial(_gdn_state_backward_kernel, heads=heads), inputs, meta,
                       names=("ds", "dd", "dh0"), config=config, name="stellax_linear_attention_state_bwd",
                       precision=precision)


def _kda_state_backward_kernel(*, p, qg, kg, w, gamma, do, dht, first, seq, last, ds, dd, dh0, chunks, chunk,
                               heads, precision):
    """``dΔ = Pᵀ dO + K̃ dS``, ``dS ← diag(Γ_C) dS + (Q⊙Γ)ᵀ dO − Wᵀ dΔ``, chunks in reverse
    (``dS`` in key blocks)."""
    blocks = key_blocks(kg.shape[-1])

    def step(c, d_state):
        rows = pl.ds(c * chunk, chunk)
        doc = do[rows, :]
        d_delta = dot_tn(p[rows, :], doc, precision=precision)
        for ks, s in zip(blocks, d_state):
            d_delta = d_delta + dot(kg[rows, ks], s, precision=precision)
        dd[rows, :] = d_delta
        return [gamma[c, ks][:, None] * s + dot_tn(qg[rows, ks], doc, precision=precision)
                - dot_tn(w[rows, ks], d_delta, precision=precision) for ks, s in zip(blocks, d_state)]

    scan_loop(step, chunks=chunks, heads=heads, first=first, seq=seq, last=last, start=dht, store=ds, end=dh0,
              reverse=True)


def kda_state_backward(p, qg, kg, w, gamma, do, dht, meta, *, chunk: int, heads: int,
                       config: LinearAttentionConfig, precision=HIGHEST):
    """The reverse chunk scan of `kda_state_forward`.

    Args: ``p [BH, Tp, C]``, ``qg, kg, w [BH, Tp, K]``, ``gamma [BH, NT, K]``
    (`triton_intra.kda_intra_forward`), ``do [BH, Tp, V]`` float32, ``dht [N·HV, K, V]`` (the
    final states' gradient), ``meta`` as in `kda_state_forward`.
    Returns float32 ``(dS [BH, NT, K, V]`` (the gradient of each chunk's final
    state), ``dΔ [BH, Tp, V]``, ``dh0 [N·HV, K, V])``.
    """
    bh, tp, kdim = kg.shape
    check_flat_layout(chunk, kg=(kg, (None, None, None)), p=(p, (bh, tp, chunk)), qg=(qg, kg.shape),
                      w=(w, kg.shape), gamma=(gamma, (bh, tp // chunk, kdim)), do=(do, (bh, tp, None)),
                      dht=(dht, (None, kdim, do.shape[-1])))
    scan = ScanLayout.of(bh, tp, kdim, do.shape[-1], dht, meta, chunk=chunk, config=config)
    inputs = dict(p=operand(p, scan.rows(chunk)), qg=operand(qg, scan.rows(kdim)), kg=operand(kg, scan.rows(kdim)),
                  w=operand(w, scan.rows(kdim)), gamma=operand(gamma, scan.per_chunk(kdim)),
                  do=operand(do, scan.rows_v), dht=operand(dht, scan.states))
    return scan.launch(functools.partial(_kda_state_backward_kernel, heads=heads), inputs, meta,
                       names=("ds", "dd", "dh0"), config=config, name="stellax_kda_state_bwd",
                       precision=precision)
