"""The Mosaic TPU chunked kernels' math run by XLA: their chunk functions
(`mosaic_tpu.scalar_chunk`, `mosaic_tpu.channel_chunk`) scanned over the
chunks, differentiated by JAX — for measuring the kernels' numerics at lengths
interpret mode cannot reach (tens of thousands of tokens on a CPU).

The forward kernel runs one chunk function per grid step with the state in
float32; the backward kernel differentiates the same function per chunk with
``jax.vjp`` from the recomputed chunk-initial states. `emulated_recurrence`
runs the same functions on the same layout (`layout.heads_major`, ``q, k, v``
in `mxu.operand_dtype`, head sizes padded to 128 lanes, packed sequences reset
at their first chunk), with ``products`` as the kernels pick them
(`mxu.chunk_products`) or chosen freely to compare policies. What differs
from the kernels: the value columns are one block, and XLA on a CPU orders a
float32 sum as it likes (a few ulps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core.pallas import F32
from .api import delta_rule_initial_state, delta_rule_preparer
from .configs import lanes
from .layout import chunk_meta, heads_major, make_stream
from .mosaic_tpu import channel_chunk, scalar_chunk
from .mxu import Products, chunk_products
from .mxu import operand_dtype as kernel_operands
from .reference import ssd_epilogue
from .ssd import ssd_initial_state, ssd_preparer


def _chunk_step(per_channel: bool, chunk: int, products: Products):
    """One chunk of every (batch·head) row: ``(S', O)`` from ``S [BH, Kp, Vp]`` and the chunk's tiles."""
    def one(s, q, k, v, g, beta):
        if per_channel:
            return channel_chunk(q, k, v, g, beta[:, None], s, chunk=chunk, products=products)
        b = None if beta is None else beta[:, None]
        return scalar_chunk(q, k, v, g[:, None], g[None, :], b, s, chunk=chunk, products=products)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(s, x):
        tiles = [None if x[n] is None else x[n].astype(F32) for n in ("q", "k", "v", "g", "beta")]
        o, new = jax.vmap(one)(s, *tiles)
        return new, o
    return step


def _scan(q, k, v, g, beta, h0, stream, *, heads: int, per_channel: bool, products: Products):
    """The chunks in order on the flat layout ``[BH, Tp, ...]``: ``(o [BH, Tp, Vp], final [N·HV, Kp, Vp])``."""
    chunk = stream.chunk
    per = lambda x: None if x is None else jnp.moveaxis(x.reshape((x.shape[0], -1, chunk) + x.shape[2:]), 1, 0)
    xs = {"q": per(q), "k": per(k), "v": per(v), "g": per(g), "beta": per(beta)}
    step = _chunk_step(per_channel, chunk, products)
    meta = chunk_meta(stream)
    if meta is None:  # dense: one sequence per row
        final, o = jax.lax.scan(step, h0, xs)
        return jnp.moveaxis(o, 0, 1).reshape(v.shape), final
    first, seq, _ = meta
    rows = jnp.arange(heads)

    def packed(s, x):
        s = jnp.where(x["first"] != 0, h0[x["seq"] * heads + rows], s)
        new, o = step(s, x)
        return new, (o, new)

    _, (o, ends) = jax.lax.scan(packed, h0[:heads], dict(xs, first=first, seq=seq))
    final = ends[stream.last_chunk].reshape(h0.shape)
    return jnp.moveaxis(o, 0, 1).reshape(v.shape), final


def emulated_recurrence(tokens: dict, prepare, h0, cu_seqlens, *, per_channel: bool, chunk: int,
                        products: Products, operand_dtype=F32):
    """`recurrence.recurrence` with the Mosaic TPU kernels' chunk functions run by
    XLA (module docstring): the same arguments, ``chunk`` the kernels' chunk,
    ``products`` their `mxu.Products`, ``q, k, v`` laid out in ``operand_dtype``.
    Returns float32 ``(o [B, T, HV, V], final [N, HV, K, V])``; differentiable."""
    q, k, v, g, beta = prepare(tokens)
    B, T, HV, K = k.shape
    V = v.shape[-1]
    stream = make_stream(B, T, chunk, cu_seqlens)
    kp, vp = lanes(K), lanes(V)
    flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])
    args = [flat(heads_major(stream, x, d, operand_dtype)) for x, d in ((q, kp), (k, kp), (v, vp))]
    gh = flat(heads_major(stream, g, kp) if per_channel else heads_major(stream, g))
    b = None if beta is None else flat(heads_major(stream, beta))
    h0p = jnp.pad(h0.astype(F32), [(0, 0), (0, 0), (0, kp - K), (0, vp - V)])
    o, final = _scan(*args, gh, b, flat(h0p), stream, heads=HV, per_channel=per_channel, products=products)
    o = stream.unpack(jnp.moveaxis(o.reshape(stream.rows, HV, stream.padded, vp), 1, 2))[..., :V]
    final = final.reshape(h0p.shape)[:, :, :K, :V]
    if stream.varlen:
        final = jnp.where(stream.empty[:, None, None, None], h0.astype(F32), final)
    return o, final


def emulated_call(op, *args, chunk: int = 64, products: Products | None = None, operand_dtype=None, **kwargs):
    """``op(*args, **kwargs)`` — `chunk_gated_delta_rule`, `chunk_kda` or `ssd` (their
    `Op`s) — with the Mosaic TPU kernels' math emulated (`emulated_recurrence`):
    the same outputs and dtypes as the op. ``operand_dtype`` of ``q, k, v`` in the
    kernels and their ``products`` (`mxu.Products`) default to what the kernels
    take for the inputs (`mxu.operand_dtype`, `mxu.chunk_products` at the call's precision)."""
    call = op.check(*args, **kwargs)
    if op.name == "ssd":
        tokens = {"x": call.x, "dt": call.dt, "B": call.B, "C": call.C}
        prepare, h0, per_channel = ssd_preparer(call), ssd_initial_state(call), False
        inputs = jnp.result_type(call.x, call.B, call.C)
    else:
        tokens = {n: call.arrays[n] for n in ("q", "k", "v", "g", "beta")}
        prepare, h0 = delta_rule_preparer(call), delta_rule_initial_state(call)
        per_channel, inputs = op.name == "chunk_kda", jnp.result_type(call.q, call.k, call.v)
    dtype = kernel_operands(inputs) if operand_dtype is None else operand_dtype
    products = chunk_products(dtype, call.precision) if products is None else products
    o, final = emulated_recurrence(tokens, prepare, h0, call.cu_seqlens, per_channel=per_channel, chunk=chunk,
                                   products=products, operand_dtype=dtype)
    if op.name == "ssd":
        y = ssd_epilogue(o, call.x, call.D, call.z).astype(call.x.dtype)
        return (y, jnp.swapaxes(final, -1, -2)) if call.return_final_states else y
    return o.astype(call.v.dtype), (final if call.output_final_state else None)
