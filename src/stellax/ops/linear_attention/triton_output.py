"""Pallas Triton kernels of stage 6: the output, grid ``(NT, BH, V/BV)``.

Per chunk and block of ``BV`` value columns, from the chunk-initial states
``S_c`` and the residuals ``Δ`` of the scan (`triton_scan`):

    O = (Q ⊙ Γ) S_c + P Δ

* `gdn_output_forward` (scalar decays): ``P = (Q Kᵀ) ⊙ exp(D)`` (``j ≤ i``)
  and ``Γ`` recomputed from ``g [BH, Tp]`` in the kernel;
* `kda_output_forward` (per-channel decays): ``Q⊙Γ`` and ``P`` as stored by
  `triton_intra.kda_intra_forward`.

Arrays are heads-major and flattened (`layout`); float32; the
matmuls run at the call's precision as Triton takes it (`core.pallas.triton_precision`:
`TF32X3`, three TF32 tensor-core passes, about float32 accuracy, for ``high`` /
``highest``; one TF32 pass for ``default``),
the K contractions in `BLOCK_K`-column blocks (a loop: whole ``[C, K]`` TF32X3
operands spilled registers).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import (F32, HIGHEST, dot, dot_nt, operand, output, square_iota, triton_kernel_call,
                            triton_precision)
from .configs import LinearAttentionConfig
from .decay import masked_decay, tile_spans
from .layout import check_flat_layout

#: Key columns per step of the output kernels' loops over K (64 still spilled on
#: sm_80 at K = 128, BV = 32: 492 B for SSD; 32: 0 B for SSD, 8 B for GDN).
BLOCK_K = 32


def _specs(chunk: int, kdim: int, bv: int):
    """``(rows [C, K], value block [C, BV], state [K, BV])`` specs of grid ``(NT, BH, V/BV)``."""
    return (pl.BlockSpec((None, chunk, kdim), lambda c, h, j: (h, c, 0)),
            pl.BlockSpec((None, chunk, bv), lambda c, h, j: (h, c, j)),
            pl.BlockSpec((None, None, kdim, bv), lambda c, h, j: (h, c, 0, j)))


def _gdn_output_kernel(*, q, k, g, delta, states, o, chunk, block_k, precision):
    """``O = (Q ⊙ Γ) S_c + ((Q Kᵀ) ⊙ exp(D))_{j≤i} Δ``, the K contractions in
    blocks of ``block_k`` columns (no dot holds more than a ``[C, block_k]`` tile)."""
    rows, cols = square_iota(chunk)
    gate = jnp.exp(jnp.sum(jnp.where(rows >= cols, g[...][None, :], 0.0), axis=1))  # Γ_i

    def keys(i, acc):
        qk, out = acc
        cs = pl.ds(i * block_k, block_k)
        qb = q[:, cs].astype(F32)
        qk = qk + dot_nt(qb, k[:, cs].astype(F32), precision=precision)
        return qk, out + dot(qb * gate[:, None], states[cs, :], precision=precision)

    zeros = (jnp.zeros((chunk, chunk), F32), jnp.zeros(o.shape, F32))
    qk, out = jax.lax.fori_loop(0, q.shape[-1] // block_k, keys, zeros)
    spans, _, _, _ = tile_spans(g[...], chunk)
    p = qk * masked_decay(spans, rows >= cols)
    o[...] = (out + dot(p, delta[...], precision=precision)).astype(o.dtype)


def gdn_output_forward(q, k, g, delta, states, *, chunk: int, config: LinearAttentionConfig, precision=HIGHEST):
    """``O [BH, Tp, V]`` float32 from ``q, k [BH, Tp, K]`` (q scaled), float32
    ``g [BH, Tp]``, the residuals ``delta [BH, Tp, V]`` and the chunk-initial
    ``states [BH, NT, K, V]``."""
    bh, tp, kdim = q.shape
    vdim = delta.shape[-1]
    bv = min(config.block_v, vdim)
    rows, block, state = _specs(chunk, kdim, bv)
    outs = triton_kernel_call(
        functools.partial(_gdn_output_kernel, chunk=chunk, block_k=min(BLOCK_K, kdim),
                          precision=triton_precision(precision)),
        grid=(tp // chunk, bh, vdim // bv),
        inputs=dict(q=operand(q, rows), k=operand(k, rows),
                    g=operand(g, pl.BlockSpec((None, chunk), lambda c, h, j: (h, c))),
                    delta=operand(delta, block), states=operand(states, state)),
        outputs=dict(o=output(delta.shape, F32, block)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_linear_attention_output",
    )
    return outs.o


def _kda_output_kernel(*, qg, p, delta, states, o, block_k, precision):
    """``O = (Q⊙Γ) S_c + P Δ``, the K contraction in blocks of ``block_k`` columns."""
    def keys(i, out):
        cs = pl.ds(i * block_k, block_k)
        return out + dot(qg[:, cs], states[cs, :], precision=precision)

    out = jax.lax.fori_loop(0, qg.shape[-1] // block_k, keys, jnp.zeros(o.shape, F32))
    o[...] = out + dot(p[...], delta[...], precision=precision)


def kda_output_forward(qg, p, delta, states, *, chunk: int, config: LinearAttentionConfig, precision=HIGHEST):
    """``O = (Q⊙Γ) S_c + P Δ``, float32 ``[BH, Tp, V]``, from ``qg [BH, Tp, K]``,
    ``p [BH, Tp, C]`` (`triton_intra.kda_intra_forward`), ``delta [BH, Tp, V]`` and the
    chunk-initial ``states [BH, NT, K, V]`` (`triton_scan.kda_state_forward`)."""
    bh, tp, kdim = qg.shape
    check_flat_layout(chunk, qg=(qg, (None, None, None)), p=(p, (bh, tp, chunk)), delta=(delta, (bh, tp, None)),
                      states=(states, (bh, tp // chunk, kdim, delta.shape[-1])))
    vdim = delta.shape[-1]
    bv = min(config.block_v, vdim)
    rows, block, state = _specs(chunk, kdim, bv)
    outs = triton_kernel_call(
        functools.partial(_kda_output_kernel, block_k=min(BLOCK_K, kdim), precision=triton_precision(precision)),
        grid=(tp // chunk, bh, vdim // bv),
        inputs=dict(qg=operand(qg, rows), p=operand(p, pl.BlockSpec((None, chunk, chunk), lambda c, h, j: (h, c, 0))),
                    delta=operand(delta, block), states=operand(states, state)),
        outputs=dict(o=output(delta.shape, F32, block)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_kda_output",
    )
    return outs.o
