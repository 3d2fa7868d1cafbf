"""Pallas Triton kernels for the gated linear unit, forward and backward.

Weights reach the kernels as 2-D column panels: stacked ``[K, 2, N]``
weights are viewed (free reshape) as ``[K, 2N]`` with the gate panel at column
0 and the up panel at column N; a pair ``(w_gate, w_up)`` is two arrays at
column 0. No weight copy is made. Operands are read with masked loads, so no
dimension needs to be a multiple of a tile.

Forward (tile [bm, bn], loop over K):
    gate += x[i, k] @ Wg[k, j];  up += x[i, k] @ Wu[k, j];  y = act(gate)·up
    (under differentiation also writes gate and up in x's dtype)
Backward:
    1. dgate = dy·up·act'(gate), dup = dy·act(gate): from the forward's saved
       gate/up (XLA elementwise), or a kernel that recomputes them as above
    2. dx[i, k]  = Σ_n dgate[i, n] @ Wg[k, n]ᵀ + dup[i, n] @ Wu[k, n]ᵀ
    3. dWg[k, n] = Σ_m x[m, k]ᵀ @ dgate[m, n],  dWu likewise with dup
Every sum runs in a fixed order inside one program: deterministic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ...core.pallas import dot, dot_nt, dot_tn, iota, operand, output, triton_kernel_call, triton_precision
from .activations import activation_fn, gate_up_grads
from .configs import GluConfig

#: Operands the kernels index themselves (masked loads of any tile).
_FULL = pl.no_block_spec


def _load(ref, row0, nrows_block, row_limit, col0, ncols_block, col_limit, col_base=0):
    """``ref[row0 : row0 + nrows_block, col_base + col0 : ... + ncols_block]`` with
    rows ≥ ``row_limit`` and columns ≥ ``col_limit`` read as 0."""
    rows = row0 + iota(nrows_block)
    cols = col0 + iota(ncols_block)
    mask = (rows < row_limit)[:, None] & (cols < col_limit)[None, :]
    return pltriton.load(ref.at[pl.ds(row0, nrows_block), pl.ds(col_base + col0, ncols_block)],
                         mask=mask, other=0)


def _gate_up(x, w_gate, w_up, i, j, *, m, k, n, gate_col, up_col, cfg, precision):
    """``(gate, up)`` float32 ``[bm, bn]`` tiles ``(i, j)``: ``Σ_k x[i, k] @ W[k, j]``."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    def body(kb, carry):
        gate, up = carry
        xa = _load(x, i * bm, bm, m, kb * bk, bk, k)
        wg = _load(w_gate, kb * bk, bk, k, j * bn, bn, n, gate_col)
        wu = _load(w_up, kb * bk, bk, k, j * bn, bn, n, up_col)
        return gate + dot(xa, wg, precision=precision), up + dot(xa, wu, precision=precision)

    zeros = jnp.zeros((bm, bn), jnp.float32)
    return jax.lax.fori_loop(0, pl.cdiv(k, bk), body, (zeros, zeros))


def _forward_kernel(*, x, w_gate, w_up, y, gate_out, up_out, activation, **dims):
    """Tile ``(i, j)``: ``y = act(gate)·up`` (and ``gate``, ``up`` when asked for)."""
    gate, up = _gate_up(x, w_gate, w_up, pl.program_id(0), pl.program_id(1), **dims)
    y[...] = (activation_fn(activation, in_kernel=True)(gate) * up).astype(y.dtype)
    if gate_out is not None:
        gate_out[...] = gate.astype(gate_out.dtype)
        up_out[...] = up.astype(up_out.dtype)


def _act_grad_kernel(*, x, w_gate, w_up, dy, dgate, dup, activation, **dims):
    """Tile ``(i, j)``: ``dgate = dy·up·act'(gate)``, ``dup = dy·act(gate)`` (gate/up recomputed)."""
    gate, up = _gate_up(x, w_gate, w_up, pl.program_id(0), pl.program_id(1), **dims)
    dgate[...], dup[...] = gate_up_grads(dy[...], gate, up, activation, dgate.dtype, in_kernel=True)


def _dx_kernel(*, dgate, dup, w_gate, w_up, dx, m, k, n, gate_col, up_col, cfg, precision):
    """Tile ``(i, kk)``: ``dx = Σ_n dgate[i, n] @ Wg[kk, n]ᵀ + dup[i, n] @ Wu[kk, n]ᵀ``."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    i, kk = pl.program_id(0), pl.program_id(1)

    def body(nb, acc):
        dg = _load(dgate, i * bm, bm, m, nb * bn, bn, n)
        du = _load(dup, i * bm, bm, m, nb * bn, bn, n)
        wg = _load(w_gate, kk * bk, bk, k, nb * bn, bn, n, gate_col)
        wu = _load(w_up, kk * bk, bk, k, nb * bn, bn, n, up_col)
        return acc + dot_nt(dg, wg, precision=precision) + dot_nt(du, wu, precision=precision)

    acc = jax.lax.fori_loop(0, pl.cdiv(n, bn), body, jnp.zeros((bm, bk), jnp.float32))
    dx[...] = acc.astype(dx.dtype)


def _dw_kernel(*, x, dgate, dup, dw_gate, dw_up, m, k, n, cfg, precision):
    """Tile ``(kk, j)``: ``dWg = Σ_m x[m, kk]ᵀ @ dgate[m, j]``, ``dWu`` likewise with ``dup``."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    kk, j = pl.program_id(0), pl.program_id(1)

    def body(mb, carry):
        accg, accu = carry
        xa = _load(x, mb * bm, bm, m, kk * bk, bk, k)
        dg = _load(dgate, mb * bm, bm, m, j * bn, bn, n)
        du = _load(dup, mb * bm, bm, m, j * bn, bn, n)
        return accg + dot_tn(xa, dg, precision=precision), accu + dot_tn(xa, du, precision=precision)

    zeros = jnp.zeros((bk, bn), jnp.float32)
    accg, accu = jax.lax.fori_loop(0, pl.cdiv(m, bm), body, (zeros, zeros))
    dw_gate[...] = accg.astype(dw_gate.dtype)
    dw_up[...] = accu.astype(dw_up.dtype)


def weight_panels(w_gate, w_up):
    """``(wg_2d, wu_2d, gate_col, up_col, n)`` for either weight form (no copies)."""
    if w_up is None:
        k, _, n = w_gate.shape
        panel = w_gate.reshape(k, 2 * n)
        return panel, panel, 0, n, n
    return w_gate, w_up, 0, 0, w_gate.shape[1]


def _precision(precision, dtype):
    """The in-kernel precision of a resolved ``precision`` (`stellax.core.precision`):
    float32 operands as `triton_precision` says (one TF32 pass at ``DEFAULT``,
    three otherwise); narrower operands at the tensor core's native precision."""
    if jnp.dtype(dtype) == jnp.float32:
        return triton_precision(precision)
    return None


def _tiles(cfg: GluConfig, rows: str, cols: str):
    """The ``[block_rows, block_cols]`` block spec of a 2-D output tiled by the grid."""
    shape = (getattr(cfg, f"block_{rows}"), getattr(cfg, f"block_{cols}"))
    return pl.BlockSpec(shape, lambda i, j: (i, j))


def glu_forward(x, w_gate, w_up, *, activation, precision, config: GluConfig, save_preactivations=False):
    """``x [M, K]``, weights ``[K, 2, N]`` or two ``[K, N]`` → ``y = act(x @ Wg)·(x @ Wu)``
    ``[M, N]`` in ``x.dtype``; with ``save_preactivations`` the pair ``(y, (gate, up))`` (``x.dtype``)."""
    m, k = x.shape
    wg, wu, gate_col, up_col, n = weight_panels(w_gate, w_up)
    cfg = config
    dims = dict(m=m, k=k, n=n, gate_col=gate_col, up_col=up_col, cfg=cfg,
                precision=_precision(precision, x.dtype))
    outs = triton_kernel_call(
        functools.partial(_forward_kernel, activation=activation, **dims),
        grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n)),
        inputs=dict(x=operand(x, _FULL), w_gate=operand(wg, _FULL), w_up=operand(wu, _FULL)),
        outputs=dict(y=output((m, n), x.dtype, _tiles(cfg, "m", "n")),
                     gate_out=output((m, n), x.dtype, _tiles(cfg, "m", "n")) if save_preactivations else None,
                     up_out=output((m, n), x.dtype, _tiles(cfg, "m", "n")) if save_preactivations else None),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, name="stellax_glu_forward",
    )
    return (outs.y, (outs.gate_out, outs.up_out)) if save_preactivations else outs.y


def glu_backward(dy, x, w_gate, w_up, *, activation, precision, config: GluConfig, preactivations=None):
    """``dy [M, N]``, ``x [M, K]`` → ``(dx [M, K], dw_gate, dw_up)`` in the weights' form
    (stacked ``[K, 2, N]`` gives ``dw_gate [K, 2, N]`` and ``dw_up=None``); ``preactivations``:
    the forward's ``(gate, up)``, or None to recompute them."""
    m, k = x.shape
    wg, wu, gate_col, up_col, n = weight_panels(w_gate, w_up)
    cfg = config
    prec = _precision(precision, x.dtype)
    dims = dict(m=m, k=k, n=n, gate_col=gate_col, up_col=up_col, cfg=cfg, precision=prec)
    common = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    mn_spec, kn_spec = _tiles(cfg, "m", "n"), _tiles(cfg, "k", "n")
    weights = dict(w_gate=operand(wg, _FULL), w_up=operand(wu, _FULL))
    if preactivations is not None:
        dgate, dup = gate_up_grads(dy, *preactivations, activation, x.dtype)
    else:
        grads = triton_kernel_call(
            functools.partial(_act_grad_kernel, activation=activation, **dims),
            grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n)),
            inputs=dict(x=operand(x, _FULL), **weights, dy=operand(dy, mn_spec)),
            outputs=dict(dgate=output((m, n), x.dtype, mn_spec), dup=output((m, n), x.dtype, mn_spec)),
            name="stellax_glu_act_grad", **common,
        )
        dgate, dup = grads.dgate, grads.dup
    dgate, dup = operand(dgate, _FULL), operand(dup, _FULL)
    dx = triton_kernel_call(
        functools.partial(_dx_kernel, **dims),
        grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(k, cfg.block_k)),
        inputs=dict(dgate=dgate, dup=dup, **weights),
        outputs=dict(dx=output((m, k), x.dtype, _tiles(cfg, "m", "k"))),
        name="stellax_glu_dx", **common,
    ).dx
    dw = triton_kernel_call(
        functools.partial(_dw_kernel, m=m, k=k, n=n, cfg=cfg, precision=prec),
        grid=(pl.cdiv(k, cfg.block_k), pl.cdiv(n, cfg.block_n)),
        inputs=dict(x=operand(x, _FULL), dgate=dgate, dup=dup),
        outputs=dict(dw_gate=output((k, n), w_gate.dtype, kn_spec), dw_up=output((k, n), w_gate.dtype, kn_spec)),
        name="stellax_glu_dw", **common,
    )
    if w_up is None:
        return dx, jnp.stack([dw.dw_gate, dw.dw_up], axis=1), None
    return dx, dw.dw_gate, dw.dw_up
