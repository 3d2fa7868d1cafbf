"""Pallas Mosaic TPU kernel of the chunked recurrence's backward: the reverse
state scan and every chunk's gradients in one kernel, ``dS`` carried in VMEM.

The forward kernel runs again storing each chunk's initial state ``S_c``
(`mosaic_tpu.recurrence_forward` with ``with_states``; recomputed, not kept
from the forward). Then on grid ``(BH/hb, V/BV, NT)`` (``hb`` heads per step, one chunk function
batched over them as in the forward: `mosaic_tpu`) with the chunk axis
``"arbitrary"`` and walked from the last chunk back, each step holds
``dS'`` (the cotangent of the chunk's final state) in a float32 scratch and
differentiates the chunk's own function (`mosaic_tpu.scalar_chunk` /
`mosaic_tpu.channel_chunk`: ``(O, S') = f(q, k, v, g, β, S_c)``) at the
cotangents ``(dO, dS')``:

    (dq, dk, dv, dg, dβ, dS_c) = f'(q, k, v, g, β, S_c)ᵀ · (dO, dS')

— the same math as the forward chunk (scores, the MXU inverse, W/U, the state
step), transposed by ``jax.vjp`` while the kernel is traced, so every
exponent stays a masked span sum ≤ 0 and no ``inf·0`` appears. ``dS_c`` is
the next (earlier) chunk's ``dS'``. A packed sequence's last chunk starts
from ``dfinal[seq]`` and its first chunk writes ``dh0[seq] = dS_c``
(int32 ``first, seq, last`` by scalar prefetch, as in the forward).

`backward` is the backward ops' Mosaic TPU implementation (the entry of the
backend's row in `base.BACKENDS`): head sizes padded to 128 lanes (a no-op
when the forward's kernels padded them already), gradients sliced back.

The gradients of ``q, k, g, β`` collect over the value blocks: each block
writes its partial into a leading ``V/BV`` axis, summed in XLA (a fixed
order: deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core import Call
from ...core.pallas import F32, HIGHEST, operand, output, pad_axis, tpu_kernel_call
from .configs import TpuLinearAttentionConfig, lanes, tpu_vmem_limit
from .layout import call_meta, dfinal_of, flat, pass_empty_sequences
from .mxu import operand_dtype
from .mosaic_tpu import (Specs, channel_chunk, check_layout, decay_operands, dense_meta, kernel_products, load_tile,
                         recurrence_forward, row_to_column, scalar_chunk)


def _backward_kernel(*, first, seq, last, q, k, v, g, g_row, beta, states, do, dfinal, dq, dk, dv, dg, dg_row,
                     dbeta, dh0, dstate, chunk, chunks, per_channel, products):
    """One chunk of the step's heads (the blocks' leading axis, batched as in the
    forward), walked in reverse (module docstring)."""
    del seq
    rc = chunks - 1 - pl.program_id(2)

    @pl.when(pl.program_id(2) == 0)
    def _():  # chunks after the last sequence (a traced cu_seqlens' padding) get no cotangent
        dstate[...] = jnp.zeros(dstate.shape, F32)

    @pl.when(last[rc] != 0)
    def _():
        dstate[...] = dfinal[...]

    # The step's heads as one batched chunk function (a leading head axis; as the forward), transposed.
    # β and the scalar decays come as rows [hb, 1, C] (as the forward's): their columns are formed
    # inside the differentiated function, so the rows get the whole cotangent.
    fixed = dict(chunk=chunk, products=products)
    col = lambda row: None if row is None else row_to_column(row, chunk)
    if per_channel:
        f = lambda q_, k_, v_, g_, b_, s_: channel_chunk(q_, k_, v_, g_, col(b_), s_, **fixed)
        decays = load_tile(g)
    else:
        f = lambda q_, k_, v_, r_, b_, s_: scalar_chunk(q_, k_, v_, col(r_), r_, col(b_), s_, **fixed)
        decays = load_tile(g_row)
    qkv = (load_tile(q), load_tile(k), load_tile(v))  # float32 tiles: float32 cotangents
    grads = jax.vjp(f, *qkv, decays, load_tile(beta), states[...])[1]((do[...], dstate[...]))
    gq, gk, gv, gd, gb, gs = grads
    if per_channel:
        dg[...] = gd
    else:
        dg_row[...] = gd
    dq[...] = gq
    dk[...] = gk
    dv[...] = gv
    if dbeta is not None:
        dbeta[...] = gb
    dstate[...] = gs

    @pl.when(first[rc] != 0)
    def _():
        dh0[...] = gs


def recurrence_backward(q, k, v, g, beta, h0, do, dfinal, meta, *, heads: int, per_channel: bool,
                        config: TpuLinearAttentionConfig, precision=HIGHEST):
    """The gradients of `mosaic_tpu.recurrence_forward` (same layout and arguments;
    ``do [BH, Tp, Vp]``, ``dfinal [N·HV, Kp, Vp]`` or ``None``), float32:
    ``(dq, dk, dv, dg, dβ or None, dh0)`` shaped as their primals. ``dh0`` of a
    packed sequence with no chunk is left unwritten (the caller passes ``dfinal``). ``precision``:
    the forward's (a resolved `jax.lax.Precision`), of every matmul of float32 ``q, k, v``,
    forward and transposed; bfloat16 ``q, k, v`` take `mxu.BF16_PRODUCTS` (each transposed
    product at its forward product's precision, the cotangents float32)."""
    states, _ = recurrence_forward(q, k, v, g, beta, h0, meta, heads=heads, per_channel=per_channel,
                                   config=config, with_states=True, precision=precision)
    return backward_from_states(q, k, v, g, beta, h0, states, do, dfinal, meta, heads=heads,
                                per_channel=per_channel, config=config, precision=precision)


def backward_from_states(q, k, v, g, beta, h0, states, do, dfinal, meta, *, heads: int, per_channel: bool,
                         config: TpuLinearAttentionConfig, precision=HIGHEST):
    """The backward kernel alone (`recurrence_backward` after its states pass): ``states
    [BH, NT, Kp, Vp]`` float32, each chunk's initial state (`mosaic_tpu.recurrence_forward`
    with ``with_states``); the other arguments and the result as `recurrence_backward`'s."""
    bh, tp, kp = k.shape
    vp = v.shape[-1]
    chunk, bv = config.chunk, min(config.block_v, vp)
    check_layout(k, v, chunk, bv)
    nt, nv = tp // chunk, vp // bv
    products = kernel_products(q, k, v, precision)
    first, seq, last = dense_meta(nt) if meta is None else meta
    dfinal = jnp.zeros(h0.shape, F32) if dfinal is None else dfinal.astype(F32)
    hb = config.heads_per_step
    specs = Specs(kp, bv, chunk, heads, nt, reverse=True, hb=hb)
    # β and the scalar decays as lane-dense rows [BH, NT, 1, C] in and out (no [BH, Tp, 1] column:
    # its lane pads to 128 in HBM; `mosaic_tpu.row_to_column`).
    inputs = {"q": operand(q, specs.tokens(kp)), "k": operand(k, specs.tokens(kp)), "v": operand(v, specs.cols),
              "beta": operand(None if beta is None else beta.reshape(bh, nt, 1, chunk), specs.rows()),
              "states": operand(states, specs.per_chunk), "do": operand(do.astype(F32), specs.cols),
              "dfinal": operand(dfinal, specs.state), **decay_operands(g, specs, per_channel)}
    parts = lambda *shape: jax.ShapeDtypeStruct((nv,) + shape, F32)
    outputs = {
        "dq": output(parts(bh, tp, kp).shape, F32, specs.tokens(kp, parts=True)),
        "dk": output(parts(bh, tp, kp).shape, F32, specs.tokens(kp, parts=True)),
        "dv": output((bh, tp, vp), F32, specs.cols),
        "dg": output((nv, bh, tp, kp), F32, specs.tokens(kp, parts=True)) if per_channel else None,
        "dg_row": None if per_channel else output((nv, bh, nt, 1, chunk), F32, specs.rows(parts=True)),
        "dbeta": None if beta is None else output((nv, bh, nt, 1, chunk), F32, specs.rows(parts=True)),
        "dh0": output(h0.shape, F32, specs.state),
    }
    outs = tpu_kernel_call(
        functools.partial(_backward_kernel, chunk=chunk, chunks=nt, per_channel=per_channel, products=products),
        grid=(bh // hb, nv, nt),
        inputs=inputs,
        outputs=outputs,
        scratch={"dstate": pltpu.VMEM((hb, kp, bv), F32)},
        scalar_prefetch={"first": first, "seq": seq, "last": last},
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=tpu_vmem_limit(kp, bv, chunk, per_channel, backward=True, heads=hb),
        name="linear_attention_channel_backward" if per_channel else "linear_attention_scalar_backward",
    )
    total = lambda x: x[0] if nv == 1 else jnp.sum(x, axis=0)
    dg = total(outs.dg) if per_channel else total(outs.dg_row).reshape(bh, tp)
    dbeta = None if beta is None else total(outs.dbeta).reshape(bh, tp)
    return total(outs.dq), total(outs.dk), outs.dv, dg, dbeta, outs.dh0


def _pad_operands(call: Call, per_channel: bool):
    """The backward call's arrays on the kernel's flat layout, head sizes padded to
    128 lanes: ``q, k, v`` in `mxu.operand_dtype` of their dtype (bfloat16 when all
    three are), the rest float32."""
    q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    kp, vp = lanes(k.shape[-1]), lanes(v.shape[-1])
    pad = lambda x, d, dtype=F32: None if x is None else pad_axis(x.astype(dtype), x.ndim - 1, d)
    state = lambda x: None if x is None else pad(pad_axis(x.astype(F32), x.ndim - 2, kp), vp)
    gp = pad(g, kp) if per_channel else g.astype(F32)
    dtype = operand_dtype(jnp.result_type(q, k, v))
    return (flat(pad(q, kp, dtype)), flat(pad(k, kp, dtype)), flat(pad(v, vp, dtype)), flat(gp),
            flat(None if beta is None else beta.astype(F32)), flat(state(h0)), flat(pad(call.do, vp)),
            flat(state(call.dfinal)))


def backward(call: Call, config: TpuLinearAttentionConfig, *, per_channel: bool):
    """The backward ops' Mosaic TPU implementation: `recurrence_backward` of
    scalar or per-channel (``per_channel``) decays on the backward call's layout
    (`backward`), ``(dq, dk, dv, dg, dβ or None, dh0)`` in the operands' dtypes."""
    q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    kdim, vdim = k.shape[-1], v.shape[-1]
    kp, vp = lanes(kdim), lanes(vdim)
    grads = recurrence_backward(*_pad_operands(call, per_channel), call_meta(call), heads=v.shape[1],
                                per_channel=per_channel, config=config, precision=call.precision)
    dq, dk, dv, dg, dbeta, dh0 = grads
    out = [dq.reshape(q.shape[:3] + (kp,))[..., :kdim], dk.reshape(k.shape[:3] + (kp,))[..., :kdim],
           dv.reshape(v.shape[:3] + (vp,))[..., :vdim],
           dg.reshape(g.shape[:3] + (kp,))[..., :kdim] if per_channel else dg.reshape(g.shape),
           None if dbeta is None else dbeta.reshape(beta.shape)]
    out = [None if d is None else d.astype(x.dtype) for d, x in zip(out, (q, k, v, g, beta))]
    dh0 = dh0.reshape(h0.shape[:2] + (kp, vp))[..., :kdim, :vdim]
    dh0 = pass_empty_sequences(call, dh0, dfinal_of(call))
    return tuple(out) + (dh0.astype(h0.dtype),)
