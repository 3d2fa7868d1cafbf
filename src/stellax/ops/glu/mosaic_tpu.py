"""Pallas Mosaic TPU kernels for the gated linear unit, forward and backward.

Every kernel is a tiled MXU matmul: a 3-D grid whose last axis steps along the
contraction (``arbitrary``: sequential, float32 accumulators in VMEM scratch,
zeroed on the first step, the epilogue on the last), the two output axes
``parallel``. Tiles are `GluTpuConfig` sizes, or a whole dimension when it is
smaller. A partial last tile along an output axis is computed on whatever the
buffer holds and never written back; a partial last tile along the
contraction is masked to zero in both operands (so garbage cannot reach a
sum). Nothing is padded or copied, except stacked weights whose ``N`` is not a
multiple of the N tile (split into two ``[K, N]`` arrays).

Weights: stacked ``[K, 2, N]`` are viewed as the panel ``[K, 2N]`` (gate at
column 0, up at column N) and passed twice with two index maps (the up tile
``j`` is panel tile ``j + N / block_n``); a pair is two ``[K, N]`` arrays.

Forward (tile ``[bm, bn]``, steps over K):
    gate += x[i, k] @ Wg[k, j];  up += x[i, k] @ Wu[k, j];  y = act(gate)·up
    (under differentiation the epilogue also writes gate and up in x's dtype)
Backward:
    1. dgate = dy·up·act'(gate), dup = dy·act(gate): from the forward's saved
       gate/up (one XLA elementwise fusion), or, without them, a kernel that
       recomputes gate/up as above
    2. dx[i, k]  = Σ_n dgate[i, n] @ Wg[k, n]ᵀ + dup[i, n] @ Wu[k, n]ᵀ
    3. dWg[k, n] = Σ_m x[m, k]ᵀ @ dgate[m, n],  dWu likewise with dup
Every sum runs in a fixed order: deterministic. Every product is an
`mxu_dot` at the call's resolved precision (`stellax.core.precision`): float32
operands at ``DEFAULT``/``HIGH`` as one/three bfloat16 passes, ``HIGHEST`` at
Mosaic's ``fp32``; narrower operands natively.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import mxu_dot, mxu_dot_nt, mxu_dot_tn, operand, output, tpu_kernel_call
from .activations import activation_fn, gate_up_grads
from .configs import GluTpuConfig, glu_tpu_vmem_bytes, glu_tpu_vmem_limit, tpu_tile

_SEMANTICS = ("parallel", "parallel", "arbitrary")


# -- kernel bodies -----------------------------------------------------------------------
def _masked(tile, axis: int, valid):
    """``tile`` with entries at index ≥ ``valid`` along ``axis`` set to 0."""
    index = jax.lax.broadcasted_iota(jnp.int32, tile.shape, axis)
    return jnp.where(index < valid, tile, jnp.zeros_like(tile))


def _operands(tiles, axes, *, block: int, total: int, dtype):
    """Load ``tiles`` (refs) as ``dtype``, masking the contraction tail (index ≥ ``total``
    along each ref's contraction ``axes``) when ``total`` is not a multiple of ``block``."""
    loaded = [ref[...].astype(dtype) for ref in tiles]
    if total % block:
        valid = total - pl.program_id(2) * block
        loaded = [_masked(a, axis, valid) for a, axis in zip(loaded, axes)]
    return loaded


def _accumulate(accumulators, updates):
    """Zero the scratch ``accumulators`` on the first contraction step, then add ``updates``."""
    @pl.when(pl.program_id(2) == 0)
    def _zero():
        for acc in accumulators:
            acc[...] = jnp.zeros(acc.shape, acc.dtype)

    for acc, update in zip(accumulators, updates):
        acc[...] += update


def _last_step():
    return pl.program_id(2) == pl.num_programs(2) - 1


def _gate_up_step(x, w_gate, w_up, acc_gate, acc_up, *, block_k, k, dtype, precision):
    """One K step: ``acc_gate += x @ Wg``, ``acc_up += x @ Wu`` on the current tiles."""
    xa, wg, wu = _operands((x, w_gate, w_up), (1, 0, 0), block=block_k, total=k, dtype=dtype)
    _accumulate((acc_gate, acc_up), (mxu_dot(xa, wg, precision), mxu_dot(xa, wu, precision)))


def _forward_kernel(*, x, w_gate, w_up, y, gate, up, acc_gate, acc_up, activation, **step):
    """Tile ``(i, j)``: ``y = act(Σ_k x @ Wg)·(Σ_k x @ Wu)`` (and ``gate``, ``up`` when asked for)."""
    _gate_up_step(x, w_gate, w_up, acc_gate, acc_up, **step)

    @pl.when(_last_step())
    def _epilogue():
        act = activation_fn(activation, in_kernel=True)
        y[...] = (act(acc_gate[...]) * acc_up[...]).astype(y.dtype)
        if gate is not None:
            gate[...] = acc_gate[...].astype(gate.dtype)
            up[...] = acc_up[...].astype(up.dtype)


def _act_grad_kernel(*, x, w_gate, w_up, dy, dgate, dup, acc_gate, acc_up, activation, **step):
    """Tile ``(i, j)``: ``dgate = dy·up·act'(gate)``, ``dup = dy·act(gate)`` (gate/up recomputed)."""
    _gate_up_step(x, w_gate, w_up, acc_gate, acc_up, **step)

    @pl.when(_last_step())
    def _epilogue():
        dgate[...], dup[...] = gate_up_grads(dy[...], acc_gate[...], acc_up[...], activation, dgate.dtype,
                                             in_kernel=True)


def _dx_kernel(*, dgate, dup, w_gate, w_up, dx, acc, block_n, n, dtype, precision):
    """Tile ``(i, kk)``: ``dx = Σ_n dgate @ Wgᵀ + dup @ Wuᵀ``."""
    dg, du, wg, wu = _operands((dgate, dup, w_gate, w_up), (1, 1, 1, 1), block=block_n, total=n, dtype=dtype)
    _accumulate((acc,), (mxu_dot_nt(dg, wg, precision) + mxu_dot_nt(du, wu, precision),))

    @pl.when(_last_step())
    def _store():
        dx[...] = acc[...].astype(dx.dtype)


def _dw_kernel(*, x, dgate, dup, dw_gate, dw_up, acc_gate, acc_up, block_m, m, dtype, precision):
    """Tile ``(kk, j)``: ``dWg = Σ_m xᵀ @ dgate``, ``dWu = Σ_m xᵀ @ dup``."""
    xa, dg, du = _operands((x, dgate, dup), (0, 0, 0), block=block_m, total=m, dtype=dtype)
    _accumulate((acc_gate, acc_up), (mxu_dot_tn(xa, dg, precision), mxu_dot_tn(xa, du, precision)))

    @pl.when(_last_step())
    def _store():
        dw_gate[...] = acc_gate[...].astype(dw_gate.dtype)
        dw_up[...] = acc_up[...].astype(dw_up.dtype)


# -- launch helpers ------------------------------------------------------------------------
class _Tiles:
    """The tiles one call really uses (`tpu_tile` of each dimension) and the weight layout."""

    def __init__(self, m: int, k: int, n: int, w_gate, w_up, config: GluTpuConfig):
        self.m, self.k, self.n = m, k, n
        self.bm, self.bn, self.bk = (tpu_tile(m, config.block_m), tpu_tile(n, config.block_n),
                                     tpu_tile(k, config.block_k))
        self.config = config
        self.panel = w_up is None and n % self.bn == 0 and self.bn % 128 == 0
        if w_up is None and self.panel:
            self.wg = self.wu = w_gate.reshape(k, 2 * n)
        elif w_up is None:
            self.wg, self.wu = w_gate[:, 0, :], w_gate[:, 1, :]
        else:
            self.wg, self.wu = w_gate, w_up
        self.up_offset = n // self.bn if self.panel else 0

    def weight_specs(self, k_axis: int, n_axis: int):
        """Block specs of the ``[bk, bn]`` gate and up tiles; ``k_axis``/``n_axis`` say which grid
        index walks K and N."""
        shift = self.up_offset
        gate = pl.BlockSpec((self.bk, self.bn), lambda *g: (g[k_axis], g[n_axis]))
        up = pl.BlockSpec((self.bk, self.bn), lambda *g: (g[k_axis], g[n_axis] + shift))
        return gate, up

    def vmem_limit(self, itemsize: int) -> int | None:
        return glu_tpu_vmem_limit(glu_tpu_vmem_bytes(self.m, self.k, self.n, itemsize, self.config))


def _compute_dtype(x, w):
    """The dtype both matmul operands are cast to (their promotion)."""
    return jnp.promote_types(x.dtype, w.dtype)


def _gate_up_launch(t: _Tiles, x, precision):
    """The operands, scratch and static arguments shared by the forward and ``dgate/dup`` kernels."""
    gate_spec, up_spec = t.weight_specs(k_axis=2, n_axis=1)
    dtype = _compute_dtype(x, t.wg)
    inputs = dict(x=operand(x, pl.BlockSpec((t.bm, t.bk), lambda i, j, kk: (i, kk))),
                  w_gate=operand(t.wg, gate_spec), w_up=operand(t.wu, up_spec))
    scratch = dict(acc_gate=pltpu.VMEM((t.bm, t.bn), jnp.float32), acc_up=pltpu.VMEM((t.bm, t.bn), jnp.float32))
    step = dict(block_k=t.bk, k=t.k, dtype=dtype, precision=precision)
    grid = (pl.cdiv(t.m, t.bm), pl.cdiv(t.n, t.bn), pl.cdiv(t.k, t.bk))
    return grid, inputs, scratch, step


def glu_forward(x, w_gate, w_up, *, activation, precision, config: GluTpuConfig, save_preactivations=False):
    """``x [M, K]``, weights ``[K, 2, N]`` or two ``[K, N]`` → ``y = act(x @ Wg)·(x @ Wu)``
    ``[M, N]`` in ``x.dtype`` (float32 accumulation); with ``save_preactivations`` the pair
    ``(y, (gate, up))``, ``gate = x @ Wg`` and ``up = x @ Wu`` in ``x.dtype``."""
    m, k = x.shape
    n = w_gate.shape[-1]
    t = _Tiles(m, k, n, w_gate, w_up, config)
    grid, inputs, scratch, step = _gate_up_launch(t, x, precision)
    mn = lambda: output((m, n), x.dtype, pl.BlockSpec((t.bm, t.bn), lambda i, j, kk: (i, j)))
    outs = tpu_kernel_call(
        functools.partial(_forward_kernel, activation=activation, **step), grid=grid,
        dimension_semantics=_SEMANTICS, name="stellax_glu_forward_tpu", inputs=inputs, scratch=scratch,
        outputs=dict(y=mn(), gate=mn() if save_preactivations else None, up=mn() if save_preactivations else None),
        vmem_limit_bytes=t.vmem_limit(x.dtype.itemsize),
    )
    return (outs.y, (outs.gate, outs.up)) if save_preactivations else outs.y


def _recomputed_gate_up_grads(t: _Tiles, dy, x, *, activation, precision):
    """``(dgate, dup)`` by the kernel that recomputes ``gate``/``up`` tile by tile."""
    m, n = dy.shape
    grid, inputs, scratch, step = _gate_up_launch(t, x, precision)
    mn_spec = pl.BlockSpec((t.bm, t.bn), lambda i, j, kk: (i, j))
    grads = tpu_kernel_call(
        functools.partial(_act_grad_kernel, activation=activation, **step), grid=grid,
        dimension_semantics=_SEMANTICS, name="stellax_glu_act_grad_tpu", scratch=scratch,
        inputs=dict(**inputs, dy=operand(dy, mn_spec)),
        outputs=dict(dgate=output((m, n), x.dtype, mn_spec), dup=output((m, n), x.dtype, mn_spec)),
        vmem_limit_bytes=t.vmem_limit(x.dtype.itemsize),
    )
    return grads.dgate, grads.dup


def glu_backward(dy, x, w_gate, w_up, *, activation, precision, config: GluTpuConfig, preactivations=None):
    """``dy [M, N]``, ``x [M, K]`` → ``(dx [M, K], dw_gate, dw_up)`` in the weights' form
    (stacked ``[K, 2, N]`` gives ``dw_gate [K, 2, N]`` and ``dw_up=None``); ``preactivations``:
    the forward's ``(gate, up)``, or None to recompute them."""
    m, k = x.shape
    n = w_gate.shape[-1]
    t = _Tiles(m, k, n, w_gate, w_up, config)
    limit = t.vmem_limit(x.dtype.itemsize)
    if preactivations is not None:
        dgate, dup = gate_up_grads(dy, *preactivations, activation, x.dtype)
    else:
        dgate, dup = _recomputed_gate_up_grads(t, dy, x, activation=activation, precision=precision)
    dtype = _compute_dtype(dgate, t.wg)

    # dx: grid (M tiles, K tiles, N steps).
    gate_spec, up_spec = t.weight_specs(k_axis=1, n_axis=2)
    row_spec = pl.BlockSpec((t.bm, t.bn), lambda i, kk, j: (i, j))
    dx = tpu_kernel_call(
        functools.partial(_dx_kernel, block_n=t.bn, n=n, dtype=dtype, precision=precision),
        grid=(pl.cdiv(m, t.bm), pl.cdiv(k, t.bk), pl.cdiv(n, t.bn)), dimension_semantics=_SEMANTICS,
        name="stellax_glu_dx_tpu",
        inputs=dict(dgate=operand(dgate, row_spec), dup=operand(dup, row_spec),
                    w_gate=operand(t.wg, gate_spec), w_up=operand(t.wu, up_spec)),
        outputs=dict(dx=output((m, k), x.dtype, pl.BlockSpec((t.bm, t.bk), lambda i, kk, j: (i, kk)))),
        scratch=dict(acc=pltpu.VMEM((t.bm, t.bk), jnp.float32)), vmem_limit_bytes=limit,
    ).dx

    # dW: grid (K tiles, N tiles, M steps).
    dtype_w = _compute_dtype(x, dgate)
    grad_spec = pl.BlockSpec((t.bm, t.bn), lambda kk, j, i: (i, j))
    dw_spec = pl.BlockSpec((t.bk, t.bn), lambda kk, j, i: (kk, j))
    dw = tpu_kernel_call(
        functools.partial(_dw_kernel, block_m=t.bm, m=m, dtype=dtype_w, precision=precision),
        grid=(pl.cdiv(k, t.bk), pl.cdiv(n, t.bn), pl.cdiv(m, t.bm)), dimension_semantics=_SEMANTICS,
        name="stellax_glu_dw_tpu",
        inputs=dict(x=operand(x, pl.BlockSpec((t.bm, t.bk), lambda kk, j, i: (i, kk))),
                    dgate=operand(dgate, grad_spec), dup=operand(dup, grad_spec)),
        outputs=dict(dw_gate=output((k, n), w_gate.dtype, dw_spec), dw_up=output((k, n), w_gate.dtype, dw_spec)),
        scratch=dict(acc_gate=pltpu.VMEM((t.bk, t.bn), jnp.float32), acc_up=pltpu.VMEM((t.bk, t.bn), jnp.float32)),
        vmem_limit_bytes=limit,
    )
    if w_up is None:
        return dx, jnp.stack([dw.dw_gate, dw.dw_up], axis=1), None
    return dx, dw.dw_gate, dw.dw_up
