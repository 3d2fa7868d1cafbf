"""Pallas Triton kernels for the gated linear unit, forward and backward.

Weights reach the kernels as 2-D column panels: stacked ``[K, 2, N]``
weights are viewed (free reshape) as ``[K, 2N]`` with the gate panel at column
0 and the up panel at column N; a pair ``(w_gate, w_up)`` is two arrays at
column 0. No weight copy is made. Operands are read with masked loads, so no
dimension needs to be a multiple of a tile.

Forward (tile [bm, bn], loop over K):
    gate += x[i, k] @ Wg[k, j];  up += x[i, k] @ Wu[k, j];  y = act(gate)·up
Backward:
    1. recompute gate/up as above; dgate = dy·up·act'(gate), dup = dy·act(gate)
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

from ...core.pallas import triton_call
from .activations import activation_and_grad, activation_fn
from .configs import GluConfig

_NN = (((1,), (0,)), ((), ()))  # a @ b
_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b


def _iota(n):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def _load(ref, row0, nrows_block, row_limit, col0, ncols_block, col_limit, col_base=0):
    rows = row0 + _iota(nrows_block)
    cols = col0 + _iota(ncols_block)
    mask = (rows < row_limit)[:, None] & (cols < col_limit)[None, :]
    return pltriton.load(ref.at[pl.ds(row0, nrows_block), pl.ds(col_base + col0, ncols_block)],
                         mask=mask, other=0)


def _dot(a, b, dims, precision):
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _gate_up(x_ref, wg_ref, wu_ref, i, j, *, m, k, n, gate_col, up_col, cfg, precision):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k

    def body(kb, carry):
        gate, up = carry
        xa = _load(x_ref, i * bm, bm, m, kb * bk, bk, k)
        wg = _load(wg_ref, kb * bk, bk, k, j * bn, bn, n, gate_col)
        wu = _load(wu_ref, kb * bk, bk, k, j * bn, bn, n, up_col)
        return gate + _dot(xa, wg, _NN, precision), up + _dot(xa, wu, _NN, precision)

    zeros = jnp.zeros((bm, bn), jnp.float32)
    return jax.lax.fori_loop(0, pl.cdiv(k, bk), body, (zeros, zeros))


def _forward_kernel(x_ref, wg_ref, wu_ref, y_ref, *, activation, **dims):
    gate, up = _gate_up(x_ref, wg_ref, wu_ref, pl.program_id(0), pl.program_id(1), **dims)
    y_ref[...] = (activation_fn(activation, in_kernel=True)(gate) * up).astype(y_ref.dtype)


def _act_grad_kernel(x_ref, wg_ref, wu_ref, dy_ref, dgate_ref, dup_ref, *, activation, **dims):
    gate, up = _gate_up(x_ref, wg_ref, wu_ref, pl.program_id(0), pl.program_id(1), **dims)
    act, act_grad = activation_and_grad(activation, gate, in_kernel=True)
    dy = dy_ref[...].astype(jnp.float32)
    dgate_ref[...] = (dy * up * act_grad).astype(dgate_ref.dtype)
    dup_ref[...] = (dy * act).astype(dup_ref.dtype)


def _dx_kernel(dgate_ref, dup_ref, wg_ref, wu_ref, dx_ref, *, m, k, n, gate_col, up_col, cfg, precision):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    i, kk = pl.program_id(0), pl.program_id(1)

    def body(nb, acc):
        dg = _load(dgate_ref, i * bm, bm, m, nb * bn, bn, n)
        du = _load(dup_ref, i * bm, bm, m, nb * bn, bn, n)
        wg = _load(wg_ref, kk * bk, bk, k, nb * bn, bn, n, gate_col)
        wu = _load(wu_ref, kk * bk, bk, k, nb * bn, bn, n, up_col)
        return acc + _dot(dg, wg, _NT, precision) + _dot(du, wu, _NT, precision)

    acc = jax.lax.fori_loop(0, pl.cdiv(n, bn), body, jnp.zeros((bm, bk), jnp.float32))
    dx_ref[...] = acc.astype(dx_ref.dtype)


def _dw_kernel(x_ref, dgate_ref, dup_ref, dwg_ref, dwu_ref, *, m, k, n, cfg, precision):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    kk, j = pl.program_id(0), pl.program_id(1)

    def body(mb, carry):
        accg, accu = carry
        xa = _load(x_ref, mb * bm, bm, m, kk * bk, bk, k)
        dg = _load(dgate_ref, mb * bm, bm, m, j * bn, bn, n)
        du = _load(dup_ref, mb * bm, bm, m, j * bn, bn, n)
        return accg + _dot(xa, dg, _TN, precision), accu + _dot(xa, du, _TN, precision)

    zeros = jnp.zeros((bk, bn), jnp.float32)
    accg, accu = jax.lax.fori_loop(0, pl.cdiv(m, bm), body, (zeros, zeros))
    dwg_ref[...] = accg.astype(dwg_ref.dtype)
    dwu_ref[...] = accu.astype(dwu_ref.dtype)


def weight_panels(w_gate, w_up):
    """``(wg_2d, wu_2d, gate_col, up_col, n)`` for either weight form (no copies)."""
    if w_up is None:
        k, _, n = w_gate.shape
        panel = w_gate.reshape(k, 2 * n)
        return panel, panel, 0, n, n
    return w_gate, w_up, 0, 0, w_gate.shape[1]


def _precision(precision, dtype):
    # float32 operands default to full float32 dots; callers may ask for less.
    if precision is None and jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return precision


_FULL = pl.no_block_spec


def glu_forward(x, w_gate, w_up, *, activation, precision, config: GluConfig):
    """``x [M, K]`` → ``y [M, N]`` in ``x.dtype``."""
    m, k = x.shape
    wg, wu, gate_col, up_col, n = weight_panels(w_gate, w_up)
    cfg = config
    dims = dict(m=m, k=k, n=n, gate_col=gate_col, up_col=up_col, cfg=cfg,
                precision=_precision(precision, x.dtype))
    out_spec = pl.BlockSpec((cfg.block_m, cfg.block_n), lambda i, j: (i, j))
    return triton_call(
        functools.partial(_forward_kernel, activation=activation, **dims),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n)),
        in_specs=[_FULL, _FULL, _FULL], out_specs=out_spec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, name="stellax_glu_forward",
    )(x, wg, wu)


def glu_backward(dy, x, w_gate, w_up, *, activation, precision, config: GluConfig):
    """→ ``(dx [M, K], dw_gate, dw_up)`` in the weights' form (stacked
    ``[K, 2, N]`` gives ``dw_gate [K, 2, N]`` and ``dw_up=None``)."""
    m, k = x.shape
    wg, wu, gate_col, up_col, n = weight_panels(w_gate, w_up)
    cfg = config
    prec = _precision(precision, x.dtype)
    dims = dict(m=m, k=k, n=n, gate_col=gate_col, up_col=up_col, cfg=cfg, precision=prec)
    common = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    mn_spec = pl.BlockSpec((cfg.block_m, cfg.block_n), lambda i, j: (i, j))
    dgate, dup = triton_call(
        functools.partial(_act_grad_kernel, activation=activation, **dims),
        out_shape=[jax.ShapeDtypeStruct((m, n), x.dtype)] * 2,
        grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n, cfg.block_n)),
        in_specs=[_FULL, _FULL, _FULL, mn_spec], out_specs=[mn_spec, mn_spec],
        name="stellax_glu_act_grad", **common,
    )(x, wg, wu, dy)
    dx = triton_call(
        functools.partial(_dx_kernel, **dims),
        out_shape=jax.ShapeDtypeStruct((m, k), x.dtype),
        grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(k, cfg.block_k)),
        in_specs=[_FULL] * 4, out_specs=pl.BlockSpec((cfg.block_m, cfg.block_k), lambda i, j: (i, j)),
        name="stellax_glu_dx", **common,
    )(dgate, dup, wg, wu)
    w_dtype = w_gate.dtype
    kn_spec = pl.BlockSpec((cfg.block_k, cfg.block_n), lambda i, j: (i, j))
    dwg, dwu = triton_call(
        functools.partial(_dw_kernel, m=m, k=k, n=n, cfg=cfg, precision=prec),
        out_shape=[jax.ShapeDtypeStruct((k, n), w_dtype)] * 2,
        grid=(pl.cdiv(k, cfg.block_k), pl.cdiv(n, cfg.block_n)),
        in_specs=[_FULL] * 3, out_specs=[kn_spec, kn_spec],
        name="stellax_glu_dw", **common,
    )(x, dgate, dup)
    if w_up is None:
        return dx, jnp.stack([dwg, dwu], axis=1), None
    return dx, dwg, dwu
