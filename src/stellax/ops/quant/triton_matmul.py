"""Pallas Triton quantized matmul ``y[M, N] = x[M, K] @ w[K, N]``.

One program per output tile ``block_m × block_n``; the K loop steps ``block_k`` logical
elements, which divides every operand's K block, so each step reads one scale row:

    acc += dot(decode(x_k), decode(w_k)) · sx[:, kb] · sw[kb, :]     (in-loop scales)
    y    = acc · sx · sw · tensor_scale                                (epilogue scales)

``decode`` turns codes into the dot's input type in registers: int8/fp8
codes are used as is (int8×int8 accumulates in int32; fp8×fp8 feeds the fp8
tensor cores); weight-only decodes to the activation dtype (int4/e2m1
nibbles unpacked with a join+reshape, minus zero points). Scales stay in
their stored dtypes in memory (E8M0 codes decoded by bit construction).
The dequantized weights never exist in memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import HIGHEST, dot, dot_nt, operand, output, triton_kernel_call
from . import formats as F
from . import kernel as K
from .base import matmul_operands
from .qarray import QArray
from .triton import _ANY, _precision, _tile_spec, _zero


@dataclasses.dataclass(frozen=True)
class _Qmm:
    """Static geometry of one quantized-matmul launch (see `quantized_matmul`)."""

    m: int
    n: int
    k: int
    bm: int
    bn: int
    bk: int
    x_kind: str            # "float" (weight-only), "int" (int8 codes) or "fp8" (fp8 codes)
    w_format: str
    x_in_loop: bool        # x scaled per K block inside the loop (else in the epilogue)
    w_in_loop: bool
    gx: int                # K block of x's / w's scales
    gw: int
    compute_dtype: Any     # the weight-only dot's input dtype
    acc_dtype: Any         # int32 for int8 × int8 with epilogue scales, else float32
    precision: Any = HIGHEST  # the call's resolved precision (float32 weight-only dots)

    @property
    def packed(self) -> bool:
        return F.get_format(self.w_format).packed


def _load_x(x, g: _Qmm, i, s):
    """K step ``s`` of row block ``i``'s ``[bm, bk]`` tile of ``x`` (zeros outside)."""
    rows = i * g.bm + jax.lax.broadcasted_iota(jnp.int32, (g.bm, g.bk), 0)
    kcols = s * g.bk + jax.lax.broadcasted_iota(jnp.int32, (g.bm, g.bk), 1)
    return plgpu.load(x.at[pl.ds(i * g.bm, g.bm), pl.ds(s * g.bk, g.bk)], mask=(rows < g.m) & (kcols < g.k),
                      other=_zero(x))


def _load_w(w, g: _Qmm, j, s):
    """K step ``s`` of column block ``j``'s ``[bk, bn]`` weight codes (``[bk/2, bn]`` bytes when packed)."""
    bk, limit = (g.bk // 2, (g.k + 1) // 2) if g.packed else (g.bk, g.k)
    krow = s * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, g.bn), 0)
    ncol = j * g.bn + jax.lax.broadcasted_iota(jnp.int32, (bk, g.bn), 1)
    return plgpu.load(w.at[pl.ds(s * bk, bk), pl.ds(j * g.bn, g.bn)], mask=(krow < limit) & (ncol < g.n),
                      other=_zero(w))


def _w_row(ref, g: _Qmm, j, kb):
    """Row ``kb`` of a per-(K block, column) array (scales, zero points), column block ``j``: ``[1, bn]``."""
    cols_n = j * g.bn + jax.lax.broadcasted_iota(jnp.int32, (1, g.bn), 1)
    return plgpu.load(ref.at[pl.ds(kb, 1), pl.ds(j * g.bn, g.bn)], mask=cols_n < g.n, other=_zero(ref))


def _x_col(ref, g: _Qmm, i, kb):
    """Column ``kb`` of x's per-(row, K block) scales, row block ``i``: ``[bm, 1]``."""
    row_ok = (i * g.bm + jax.lax.broadcasted_iota(jnp.int32, (g.bm, 1), 0)) < g.m
    return plgpu.load(ref.at[pl.ds(i * g.bm, g.bm), pl.ds(kb, 1)], mask=row_ok, other=_zero(ref))


def _weight_only_product(xt, wt, w_zero, g: _Qmm, j, s):
    """``x_tile · decode(w_tile)`` with the weights decoded into the activation dtype."""
    zp = None if w_zero is None else _w_row(w_zero, g, j, (s * g.bk) // g.gw).astype(jnp.float32)
    precision = _precision(g.precision, g.compute_dtype)
    if g.packed:
        wd = K.decode_packed_pairs(wt.T, g.w_format)  # [bn, bk], K interleaved back
        if zp is not None:
            wd = wd - zp.T
        return dot_nt(xt.astype(g.compute_dtype), wd.astype(g.compute_dtype), precision=precision)
    wd = K.decode_codes(wt, g.w_format)
    if zp is not None:
        wd = wd - zp
    return dot(xt.astype(g.compute_dtype), wd.astype(g.compute_dtype), precision=precision)


def _step_product(x, w, w_zero, g: _Qmm, i, j, s):
    """Tile ``(i, j)``'s unscaled partial product ``[bm, bn]`` of K step ``s`` (int32 for int8 × int8)."""
    xt = _load_x(x, g, i, s)
    wt = _load_w(w, g, j, s)
    if g.x_kind == "float":
        return _weight_only_product(xt, wt, w_zero, g, j, s)
    if g.x_kind == "int":
        return dot(xt, wt, precision=None, out_dtype=jnp.int32)
    if xt.dtype == wt.dtype:
        return dot(xt, wt, precision=None)
    return dot(xt.astype(jnp.bfloat16), wt.astype(jnp.bfloat16), precision=None)


def _qmm_kernel(*, x, x_scale, w, w_scale, w_zero, tensor_scale, y, g: _Qmm):
    """One ``[bm, bn]`` output tile: the K loop, in-loop scales, epilogue scales.

    ``acc += dot(decode(x_k), decode(w_k)) · sx[:, kb] · sw[kb, :]`` (in-loop
    scales), then ``y = acc · sx · sw · tensor_scale`` (epilogue scales).
    """
    i, j = pl.program_id(0), pl.program_id(1)  # outside the loop: the interpreter needs them at the top level

    def body(s, acc):
        part = _step_product(x, w, w_zero, g, i, j, s)
        if g.x_in_loop or g.w_in_loop:
            part = part.astype(jnp.float32)
            if g.x_in_loop:
                part = part * K.decode_scale(_x_col(x_scale, g, i, (s * g.bk) // g.gx))
            if g.w_in_loop:
                part = part * K.decode_scale(_w_row(w_scale, g, j, (s * g.bk) // g.gw))
        return acc + part.astype(acc.dtype)

    acc = jax.lax.fori_loop(0, pl.cdiv(g.k, g.bk), body, jnp.zeros((g.bm, g.bn), g.acc_dtype))
    out = acc.astype(jnp.float32)
    if x_scale is not None and not g.x_in_loop:
        out = out * K.decode_scale(_x_col(x_scale, g, i, 0))
    if not g.w_in_loop:
        out = out * K.decode_scale(_w_row(w_scale, g, j, 0))
    if tensor_scale is not None:
        out = out * plgpu.load(tensor_scale.at[pl.ds(0, 1)]).reshape(1, 1)
    y[...] = out.astype(y.dtype)


def quantized_matmul(x, sx, w, sw, zp, ts, *, m, n, k, x_kind, w_format, gx, gw, x_in_loop, w_in_loop, out_dtype,
                     config, precision=HIGHEST):
    """``y [M, N] = decode(x) @ decode(w)`` in ``out_dtype``.

    Args:
      x: ``[M, K]`` float activations (``x_kind="float"``, weight-only) or
        int8 / fp8 codes (``x_kind="int"`` / ``"fp8"``).
      sx: x's scales ``[M, ceil(K / gx)]`` or ``None`` (weight-only).
      w: ``[K, N]`` codes (``[ceil(K/2), N]`` bytes for 4-bit ``w_format``).
      sw: w's scales ``[ceil(K / gw), N]``; ``zp``: zero points like ``sw``
        or ``None``; ``ts``: float32 ``[1]`` tensor scale or ``None``. E8M0
        scales as their uint8 codes.
      gx, gw: the K blocks of the scales; ``x_in_loop`` / ``w_in_loop``:
        apply them per K step (else once, in the epilogue).
      config: a `QMatmulConfig` (``block_k`` divides the in-loop K blocks).
      precision: the resolved precision of float32 weight-only dots (`stellax.core.precision`).
    """
    compute_dtype = x.dtype if x_kind == "float" else jnp.float32
    acc_dtype = jnp.int32 if (x_kind == "int" and not (x_in_loop or w_in_loop)) else jnp.float32
    bm, bn = config.block_m, config.block_n
    g = _Qmm(m=m, n=n, k=k, bm=bm, bn=bn, bk=config.block_k, x_kind=x_kind, w_format=w_format,
             x_in_loop=x_in_loop, w_in_loop=w_in_loop, gx=gx, gw=gw, compute_dtype=compute_dtype,
             acc_dtype=acc_dtype, precision=precision)
    out = triton_kernel_call(
        functools.partial(_qmm_kernel, g=g), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        inputs=dict(x=operand(x, _ANY), x_scale=operand(sx, _ANY), w=operand(w, _ANY), w_scale=operand(sw, _ANY),
                    w_zero=operand(zp, _ANY), tensor_scale=operand(ts, _ANY)),
        outputs=dict(y=output((m, n), out_dtype, _tile_spec(bm, bn))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_quantized_matmul",
    )
    return out.y


# -- op entry point and requirements (a row of api.BACKENDS) ------------------------------------
def quantized_matmul_requirements(call) -> str | None:
    """Why the Triton quantized matmul cannot run ``call`` (None when it can)."""
    for name, g in (("x", call.x_group_k), ("w", call.w_group_k)):
        if g is not None and g % 16:
            return f"the Triton kernel needs K blocks that are multiples of 16; {name} has K blocks of {g}"
    if call.x_format is not None:
        for name, g in (("x", call.x_group_k), ("w", call.w_group_k)):
            if g is not None and g % 32:
                return f"int8/fp8 tensor-core dots need K steps of >= 32; {name} has K blocks of {g}"
    return None


def quantized_matmul_run(call, config):
    """`quantized_matmul` of ``call`` on ``x [M, K]`` (float, or a `QArray`'s codes) and ``w``'s kernel
    operands."""
    x, w = matmul_operands(call)
    m, n, k = call.m, call.n, call.k
    wk = K.kernel_operands(w)
    common = dict(m=m, n=n, k=k, w_format=w.format, gw=call.w_group_k or k, w_in_loop=call.w_group_k is not None,
                  out_dtype=jnp.dtype(call.preferred_element_type), config=config, precision=call.precision)
    if not isinstance(x, QArray):
        y = quantized_matmul(x.reshape(m, k), None, w.values, wk.scales, wk.zero_points, wk.tensor_scale,
                             x_kind="float", gx=1, x_in_loop=False, **common)
        return y.reshape(*x.shape[:-1], n)
    x_kind = "int" if x.spec.element.kind == "int" else "fp8"
    return quantized_matmul(x.values, K.kernel_operands(x).scales, w.values, wk.scales, wk.zero_points,
                            wk.tensor_scale, x_kind=x_kind, gx=call.x_group_k or k,
                            x_in_loop=call.x_group_k is not None, **common)
