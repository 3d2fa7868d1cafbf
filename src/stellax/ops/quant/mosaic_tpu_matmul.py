"""Pallas Mosaic TPU quantized matmul ``y [M, N] = x [M, K] @ w [K, N]``.

Grid ``(M / bm, N / bn, K steps)`` (``parallel, parallel, arbitrary``), a
float32 (int32 for int8 × int8 with per-channel scales) VMEM accumulator
``[bm, bn]`` zeroed at the first K step and written out at the last.

Weight-only (``x`` float32 / bfloat16, ``w`` a `QArray` in any format): each
K step loads ``tk`` rows of weight codes ``[tk, bn]`` (int8, fp8 as bytes, or
4-bit pairs: ``tk`` bytes = ``2·tk`` logical rows) and decodes them in VMEM:

    w_k = (decode(codes_k) - zero_point_k) · scale_k        (float32, then x's dtype)
    acc += x_k @ w_k                                         (MXU, float32 accumulation)

The scales are float32 rows (``scale · tensor_scale`` as the golden forms
them; E8M0 / E4M3 converted outside, a ``[K / group, N]`` array, 1/group the
size of the weights), laid out ``[steps, groups per step, N]`` so a step's
block is whole; inside they are broadcast over each group's ``group`` rows.
Packed 4-bit weights are not interleaved: byte row ``j`` holds logical rows
``2j`` (low nibble) and ``2j + 1`` (high), so with ``x`` split into its even
and odd columns outside (``x_even = x[:, 0::2]``, ``x_odd = x[:, 1::2]``),
``acc += x_even_k @ w_lo_k + x_odd_k @ w_hi_k``. The decoded weights never
leave VMEM.

int8 × int8 (``x`` and ``w`` int8 `QArray` s, per-channel / per-row scales
or K blocks that are multiples of the step): the codes go to the MXU's int8
path (``dot(int8, int8) → int32``):

    acc_i32 += x_k @ w_k;  y = acc · sx · sw                 (per-channel: the XLA path's order)
    acc += float(x_k @ w_k) · sx_k · sw_k                    (K-blocked scales, one block per step)

A K tail that is not a multiple of the step is masked to zero in both
operands (the unread part of an edge block is undefined).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import F32, HIGHEST, cdiv, dot, mxu_dot, operand, output, tpu_kernel_call
from ...core.platform import target_generation
from . import formats as F
from .mosaic_tpu import _vmem_limit, decode_nibbles, float8_values
from .qarray import QArray, qarray_from_call
from .configs import QMatmulTpuConfig, qmm_vmem_bytes

_SEMANTICS = ("parallel", "parallel", "arbitrary")


def _round_up(x: int, to: int) -> int:
    return max(to, -(-x // to) * to)


@dataclasses.dataclass(frozen=True)
class _Steps:
    """Static K-loop geometry: ``kw`` weight rows (bytes rows when packed),
    ``tk`` rows per step, scale rows of ``gr`` weight rows (``None``: one
    scale row for all of K), ``ng`` scale rows per step."""

    kw: int
    tk: int
    gr: int | None
    ng: int

    @property
    def steps(self) -> int:
        return cdiv(self.kw, self.tk)

    @property
    def tail(self) -> bool:
        return self.kw % self.tk != 0


def _per_column(a, block_n: int, n: int):
    """Per-(K block, N block) array → per-(K block, column) ``[kb, n]``."""
    if block_n > 1:
        a = jnp.repeat(a, block_n, axis=1, total_repeat_length=a.shape[1] * block_n)[:, :n]
    return a


def _steps(kw: int, rows_per_step: int, gr: int | None) -> _Steps:
    tk = min(rows_per_step, _round_up(kw, 128))
    if gr is not None and gr >= kw:
        gr = None
    if gr is not None:  # make the step and the group divide one another
        tk = 1 << (tk.bit_length() - 1) if gr >= tk else tk // gr * gr
    ng = 1 if gr is None or gr >= tk else tk // gr
    return _Steps(kw, tk, gr, ng)


def _step_rows(a, st: _Steps):
    """``[kb, N]`` per-group rows → ``[blocks, ng, N]`` with its block index map
    for grid step ``(i, j, kk)`` (see the module docstring)."""
    n = a.shape[1]
    if st.gr is None:
        return a[:1].reshape(1, 1, n), (lambda i, j, kk: (0, 0, j))
    if st.ng == 1:
        ratio = st.gr // st.tk
        return a.reshape(a.shape[0], 1, n), (lambda i, j, kk: (kk // ratio, 0, j))
    rows = st.steps * st.ng
    if a.shape[0] < rows:
        a = jnp.pad(a, ((0, rows - a.shape[0]), (0, 0)))
    return a[:rows].reshape(st.steps, st.ng, n), (lambda i, j, kk: (kk, 0, j))


def _expand(block, st: _Steps):
    """A step's ``[ng, bn]`` scale rows → per weight row ``[tk, bn]`` (``[1, bn]`` when one row covers the step)."""
    if st.ng == 1:
        return block
    bn = block.shape[1]
    return jnp.broadcast_to(block[:, None, :], (st.ng, st.gr, bn)).reshape(st.tk, bn)


def _valid(shape, axis: int, st: _Steps):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis) < st.kw - pl.program_id(2) * st.tk


def _accumulate(acc, part):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)

    acc[...] += part


def _is_last():
    return pl.program_id(2) == pl.num_programs(2) - 1


# -- weight-only -------------------------------------------------------------------------
def _weight_only_kernel(*, x, x_odd, w, w_scale, w_zero, y, acc, st: _Steps, fmt: str, precision):
    """Decode the step's weight codes in VMEM, multiply, accumulate (module docstring)."""
    f = F.get_format(fmt)
    el = f.element
    codes = w[...].astype(jnp.int32)
    scale = _expand(w_scale[0], st)
    zero = None if w_zero is None else _expand(w_zero[0], st)

    def finish(values):
        if zero is not None:
            values = values - zero
        values = values * scale
        if st.tail:
            values = jnp.where(_valid(values.shape, 0, st), values, 0.0)
        return values

    if f.packed:
        halves = [finish(decode_nibbles(codes, el)), finish(decode_nibbles(codes >> 4, el))]
        tiles = [x[...], x_odd[...]]
    elif el.kind == "int":
        halves, tiles = [finish(codes.astype(F32))], [x[...]]
    else:
        halves, tiles = [finish(float8_values(codes & 0xFF, el))], [x[...]]
    part = None
    for xt, wt in zip(tiles, halves):
        if st.tail:
            xt = jnp.where(_valid(xt.shape, 1, st), xt, jnp.zeros_like(xt))
        d = mxu_dot(xt, wt.astype(xt.dtype), precision)
        part = d if part is None else part + d
    _accumulate(acc, part)

    @pl.when(_is_last())
    def _():
        y[...] = acc[...].astype(y.dtype)


def weight_only_matmul(x, w: QArray, *, out_dtype, config: QMatmulTpuConfig, precision=HIGHEST):
    """``x [M, K]`` (float32 / bfloat16) @ ``w`` (`QArray` ``[K, N]``, axis 0) → ``[M, N]`` ``out_dtype``."""
    m, k = x.shape
    n = w.shape[1]
    f = w.spec
    s = w.scales.astype(F32)
    if w.tensor_scale is not None:
        s = s * w.tensor_scale.astype(F32)
    s = _per_column(s, w.block_shape[1], n)
    zp = None if w.zero_points is None else _per_column(w.zero_points.astype(F32), w.block_shape[1], n)
    gw = w.block_shape[0] if w.scales.shape[0] > 1 else None
    codes = w.values if np.dtype(w.values.dtype) == np.dtype(jnp.int8) else jax.lax.bitcast_convert_type(
        w.values, jnp.int8)
    if f.packed:
        kw = codes.shape[0]
        xe = x[:, 0::2]
        xo = x[:, 1::2]
        if xo.shape[1] < kw:
            xo = jnp.pad(xo, ((0, 0), (0, kw - xo.shape[1])))
        st = _steps(kw, config.block_k // 2, None if gw is None else gw // 2)
        xs = [xe, xo]
    else:
        st = _steps(k, config.block_k, gw)
        xs = [x, None]
    bm = min(config.block_m, _round_up(m, 32))
    bn = config.block_n
    x_spec = pl.BlockSpec((bm, st.tk), lambda i, j, kk: (i, kk))
    s3, s_map = _step_rows(s, st)
    row_spec = pl.BlockSpec((1, st.ng, bn), s_map)
    z3 = None if zp is None else _step_rows(zp, st)[0]
    need = qmm_vmem_bytes(x.dtype.itemsize, np.dtype(out_dtype).itemsize, f.packed, bm, bn, config.block_k)
    outs = tpu_kernel_call(
        functools.partial(_weight_only_kernel, st=st, fmt=f.name, precision=precision),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), st.steps), dimension_semantics=_SEMANTICS,
        name="stellax_quantized_matmul_tpu",
        inputs=dict(x=operand(xs[0], x_spec), x_odd=operand(xs[1], x_spec),
                    w=operand(codes, pl.BlockSpec((st.tk, bn), lambda i, j, kk: (kk, j))),
                    w_scale=operand(s3, row_spec), w_zero=operand(z3, row_spec)),
        outputs=dict(y=output((m, n), out_dtype, pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)))),
        scratch=dict(acc=pltpu.VMEM((bm, bn), F32)),
        vmem_limit_bytes=_vmem_limit(need),
    )
    return outs.y


# -- int8 × int8 -------------------------------------------------------------------------
def _int8_kernel(*, x, x_scale, w, w_scale, y, acc, st: _Steps, x_in_loop: bool, w_in_loop: bool):
    """int8 codes on the MXU's int8 path; in-loop or epilogue scales (module docstring)."""
    xt, wt = x[...], w[...]
    if st.tail:
        xt = jnp.where(_valid(xt.shape, 1, st), xt, jnp.zeros_like(xt))
        wt = jnp.where(_valid(wt.shape, 0, st), wt, jnp.zeros_like(wt))
    part = dot(xt, wt, precision=None, out_dtype=jnp.int32)
    if x_in_loop or w_in_loop:
        part = part.astype(F32)
        if x_in_loop:
            part = part * x_scale[0]
        if w_in_loop:
            part = part * w_scale[0]
    _accumulate(acc, part)

    @pl.when(_is_last())
    def _():
        out = acc[...].astype(F32)
        if not x_in_loop:
            out = out * x_scale[0]
        if not w_in_loop:
            out = out * w_scale[0]
        y[...] = out.astype(y.dtype)


def int8_matmul(x: QArray, w: QArray, *, out_dtype, config: QMatmulTpuConfig):
    """int8 `QArray` ``x [M, K]`` (axis 1) @ int8 `QArray` ``w [K, N]`` (axis 0) → ``[M, N]``."""
    m, k = x.shape
    n = w.shape[1]
    gx = x.block_shape[1] if x.scales.shape[1] > 1 else None
    gw = w.block_shape[0] if w.scales.shape[0] > 1 else None
    rows = min(config.block_k, *[g for g in (gx, gw) if g is not None]) if (gx or gw) else config.block_k
    st = _steps(k, rows, None)
    sx = _per_column(x.scales.astype(F32).T, x.block_shape[0], m)  # [K blocks, M]
    sw = _per_column(w.scales.astype(F32), w.block_shape[1], n)     # [K blocks, N]
    bm = min(config.block_m, _round_up(m, 32))
    bn = config.block_n

    def scale_rows(a, g, last):
        """``[kb, L]`` → ``[kb, ·, ·]`` blocks: ``[1, bm, 1]`` columns of x's scales or ``[1, 1, bn]`` rows of w's."""
        if g is None:
            a = a[:1]
            ratio = None
        else:
            ratio = g // st.tk
        a3 = a[:, :, None] if last == "m" else a[:, None, :]
        block = (1, bm, 1) if last == "m" else (1, 1, bn)

        def index(i, j, kk):
            kb = 0 if ratio is None else kk // ratio
            return (kb, i, 0) if last == "m" else (kb, 0, j)
        return operand(a3, pl.BlockSpec(block, index))

    outs = tpu_kernel_call(
        functools.partial(_int8_kernel, st=st, x_in_loop=gx is not None, w_in_loop=gw is not None),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), st.steps), dimension_semantics=_SEMANTICS,
        name="stellax_int8_matmul_tpu",
        inputs=dict(x=operand(x.values, pl.BlockSpec((bm, st.tk), lambda i, j, kk: (i, kk))),
                    x_scale=scale_rows(sx, gx, "m"),
                    w=operand(w.values, pl.BlockSpec((st.tk, bn), lambda i, j, kk: (kk, j))),
                    w_scale=scale_rows(sw, gw, "n")),
        outputs=dict(y=output((m, n), out_dtype, pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)))),
        scratch=dict(acc=pltpu.VMEM((bm, bn), F32 if (gx or gw) else jnp.int32)),
    )
    return outs.y


# -- op entry point and requirements (a row of api.BACKENDS) ------------------------------------
def _power_of_two(g) -> bool:
    return g is not None and g > 0 and g & (g - 1) == 0


def quantized_matmul_requirements(call) -> str | None:
    """Why the Mosaic TPU quantized matmul cannot run ``call`` (None when it can)."""
    if call.x_format is None:
        dtype = np.dtype(call.x_values.dtype)
        if dtype.name not in ("float32", "bfloat16"):
            return f"the Mosaic TPU quantized matmul takes float32/bfloat16 activations, got {dtype.name}"
        g = call.w_group_k
        f = F.get_format(call.w_format)
        if g is not None and g < call.k:
            rows = g // 2 if f.packed else g
            if not _power_of_two(g) or rows < 8:
                return (f"the Mosaic TPU quantized matmul needs weight K blocks that are a power of two "
                        f"≥ {16 if f.packed else 8}; got {g}")
        return None
    if (call.x_format, call.w_format) != ("int8", "int8"):
        return (f"the Mosaic TPU quantized matmul runs weight-only (float x) and int8 × int8; "
                f"got x={call.x_format} × w={call.w_format}")
    generation = target_generation()
    if not generation.has_dtype("int8"):
        return f"TPU {generation.name} has no int8 MXU path (matmul dtypes {list(generation.matmul_dtypes)})"
    for name, g in (("x", call.x_group_k), ("w", call.w_group_k)):
        if g is not None and g < call.k and (g % 128 or not _power_of_two(g)):
            return (f"the Mosaic TPU int8 × int8 matmul needs K blocks that are powers of two and multiples "
                    f"of 128 (one block per K step); {name} has K blocks of {g}")
    return None


def quantized_matmul_run(call, config: QMatmulTpuConfig):
    """`quantized_matmul` of ``call`` through `weight_only_matmul` or `int8_matmul`."""
    w = qarray_from_call(call, "w_")
    out_dtype = jnp.dtype(call.preferred_element_type)
    if call.x_format is None:
        x = call.x_values
        y = weight_only_matmul(x.reshape(call.m, call.k), w, out_dtype=out_dtype, config=config,
                               precision=call.precision)
        return y.reshape(*x.shape[:-1], call.n)
    return int8_matmul(qarray_from_call(call, "x_"), w, out_dtype=out_dtype, config=config)
