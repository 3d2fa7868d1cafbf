"""Pallas Triton flash attention, backward kernels (FlashAttention-2 style).

Three kernels, deterministic (no atomics; every sum runs in a fixed order):

1. preprocess, per (q block, b, n): ``delta = rowsum(dO·O) - dlse`` and,
   with sinks, the per-row sink gradient ``-exp(σ - lse)·delta`` (summed over
   rows in XLA: ``dsinks``).
2. dq, per (q block, b, n), over the q block's key-block schedule:

       p  = 2^(s₂ - lse₂);  dp = dO·vᵀ;  ds = p·(dp - delta)
       dbias tile = ds (written for every key block, zeros where skipped)
       ds *= 1 - tanh² [soft cap];  dq += ds·k;  dq *= scale

3. dk/dv, per (k block, b, kv head), over the G query heads of the group and
   the key block's query-block schedule (the transposed schedule):

       dv += pᵀ·dO;  dk += dsᵀ·q;  dk *= scale

``lse`` of a fully masked row is ``-inf``; the kernels use ``+inf`` there so
``p = 0`` and every gradient of the row is zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import triton_call
from .triton import (
    LOG2E, TileMath, Tiling, _schedule, bcast_index, pad_axis, prepare_dense,
)


def _preprocess_kernel(*refs, hv, has_dlse, has_sinks):
    refs = list(refs)
    o_ref, do_ref = refs.pop(0), refs.pop(0)
    dlse_ref = refs.pop(0) if has_dlse else None
    lse_ref = refs.pop(0) if has_sinks else None
    sink_ref = refs.pop(0) if has_sinks else None
    delta_ref = refs.pop(0)
    dsink_ref = refs.pop(0) if has_sinks else None
    hvp = o_ref.shape[-1]
    vmask = (jnp.arange(hvp) < hv)[None, :]
    o = plgpu.load(o_ref, mask=vmask, other=0.0).astype(jnp.float32)
    do = plgpu.load(do_ref, mask=vmask, other=0.0).astype(jnp.float32)
    delta = jnp.sum(o * do, axis=1)
    if has_dlse:
        delta = delta - dlse_ref[...]
    delta_ref[...] = delta
    if has_sinks:
        p_sink = jnp.exp(sink_ref[0] - lse_ref[...])
        dsink_ref[...] = -p_sink * delta


def _pop_inputs(refs: list, math_: TileMath, segments: bool) -> tuple:
    """Pop the dq / dkdv kernels' common inputs off ``refs`` (in launch order):
    q, k, v, bias?, mask?, do, lse, delta, q/kv positions, q/kv segments?,
    the block schedule (``None`` for an absent optional input)."""
    take = lambda present=True: refs.pop(0) if present else None
    q_ref, k_ref, v_ref = take(), take(), take()
    bias_ref, mask_ref = take(math_.has_bias), take(math_.has_mask)
    do_ref, lse_ref, delta_ref = take(), take(), take()
    qpos_ref, kvpos_ref = take(), take()
    qseg_ref, kvseg_ref = take(segments), take(segments)
    return (q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, lse_ref, delta_ref, qpos_ref, kvpos_ref, qseg_ref,
            kvseg_ref, take())


def _dq_kernel(*refs, math_: TileMath, block_q, block_k, nk, h, hv, segments):
    refs = list(refs)
    (q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, lse_ref, delta_ref, qpos_ref, kvpos_ref, qseg_ref, kvseg_ref,
     sched_ref) = _pop_inputs(refs, math_, segments)
    dq_ref = refs.pop(0)
    dbias_ref = refs.pop(0) if math_.has_bias else None

    hp, hvp = q_ref.shape[-1], v_ref.shape[-1]
    head_mask = (jnp.arange(hp) < h)[None, :]
    vhead_mask = (jnp.arange(hvp) < hv)[None, :]
    q = plgpu.load(q_ref, mask=head_mask, other=0.0)
    do = plgpu.load(do_ref, mask=vhead_mask, other=0.0)
    lse2 = lse_ref[...] * jnp.float32(LOG2E)
    delta = delta_ref[...]
    q_pos = qpos_ref[...]
    q_seg = qseg_ref[...] if segments else None
    lo, full_lo, full_hi, hi = sched_ref[0], sched_ref[1], sched_ref[2], sched_ref[3]

    def step(masked):
        def body(j, dq):
            ks = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
            k = plgpu.load(k_ref.at[ks, :], mask=head_mask, other=0.0)
            v = plgpu.load(v_ref.at[ks, :], mask=vhead_mask, other=0.0)
            bias = bias_ref[:, ks] if bias_ref is not None else None
            s, tanh = math_.logits(q, k, bias)
            p = jnp.exp2(s * jnp.float32(LOG2E) - lse2[:, None])
            ok = math_.valid(masked, q_pos, kvpos_ref[ks], q_seg, kvseg_ref[ks] if segments else None,
                             j * block_k, block_k, mask_ref[:, ks] if mask_ref is not None else None)
            if ok is not None:
                p = jnp.where(ok, p, 0.0)
            dp = math_.dot(do, v, trans_b=True)
            ds = p * (dp - delta[:, None])
            if dbias_ref is not None:
                dbias_ref[:, ks] = ds
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            return dq + math_.dot(ds.astype(k.dtype), k)
        return body

    dq = jnp.zeros((block_q, hp), jnp.float32)
    dq = lax.fori_loop(lo, full_lo, step(True), dq)
    dq = lax.fori_loop(full_lo, full_hi, step(False), dq)
    dq = lax.fori_loop(full_hi, hi, step(True), dq)
    plgpu.store(dq_ref, (dq * jnp.float32(math_.scale)).astype(dq_ref.dtype), mask=head_mask)
    if dbias_ref is not None:
        zeros = jnp.zeros((block_q, block_k), jnp.float32)

        def zero(j, carry):
            dbias_ref[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)] = zeros
            return carry

        lax.fori_loop(0, lo, zero, 0)
        lax.fori_loop(hi, nk, zero, 0)


def _dkdv_kernel(*refs, math_: TileMath, block_q, block_k, group, h, hv, segments, bias_per_head, mask_per_head):
    refs = list(refs)
    (q_ref, k_ref, v_ref, bias_ref, mask_ref, do_ref, lse_ref, delta_ref, qpos_ref, kvpos_ref, qseg_ref, kvseg_ref,
     sched_ref) = _pop_inputs(refs, math_, segments)
    dk_ref, dv_ref = refs.pop(0), refs.pop(0)

    j = pl.program_id(0)
    hp, hvp = k_ref.shape[-1], v_ref.shape[-1]
    head_mask = (jnp.arange(hp) < h)[None, :]
    vhead_mask = (jnp.arange(hvp) < hv)[None, :]
    k = plgpu.load(k_ref, mask=head_mask, other=0.0)
    v = plgpu.load(v_ref, mask=vhead_mask, other=0.0)
    kv_pos = kvpos_ref[...]
    kv_seg = kvseg_ref[...] if segments else None
    lo, full_lo, full_hi, hi = sched_ref[0], sched_ref[1], sched_ref[2], sched_ref[3]

    def head(gi, carry):
        def step(masked):
            def body(i, carry):
                dk, dv = carry
                qs = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
                q = plgpu.load(q_ref.at[qs, gi, :], mask=head_mask, other=0.0)
                do = plgpu.load(do_ref.at[qs, gi, :], mask=vhead_mask, other=0.0)
                lse2 = lse_ref[gi, qs] * jnp.float32(LOG2E)
                delta = delta_ref[gi, qs]
                bias = bias_ref[gi if bias_per_head else 0, qs, :] if bias_ref is not None else None
                s, tanh = math_.logits(q, k, bias)
                p = jnp.exp2(s * jnp.float32(LOG2E) - lse2[:, None])
                dense = mask_ref[gi if mask_per_head else 0, qs, :] if mask_ref is not None else None
                ok = math_.valid(masked, qpos_ref[qs], kv_pos, qseg_ref[qs] if segments else None, kv_seg,
                                 j * block_k, block_k, dense)
                if ok is not None:
                    p = jnp.where(ok, p, 0.0)
                dv = dv + math_.dot(p.astype(do.dtype), do, trans_a=True)
                dp = math_.dot(do, v, trans_b=True)
                ds = p * (dp - delta[:, None])
                if tanh is not None:
                    ds = ds * (1.0 - tanh * tanh)
                dk = dk + math_.dot(ds.astype(q.dtype), q, trans_a=True)
                return dk, dv
            return body

        carry = lax.fori_loop(lo, full_lo, step(True), carry)
        carry = lax.fori_loop(full_lo, full_hi, step(False), carry)
        return lax.fori_loop(full_hi, hi, step(True), carry)

    dk, dv = lax.fori_loop(0, group, head, (jnp.zeros((block_k, hp), jnp.float32),
                                            jnp.zeros((block_k, hvp), jnp.float32)))
    plgpu.store(dk_ref, (dk * jnp.float32(math_.scale)).astype(dk_ref.dtype), mask=head_mask)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=vhead_mask)


def backward(c, out, lse, d_out, d_lse, config):
    """``(dq, dk, dv, dbias, dsinks)`` in the operands' dtypes."""
    q, k, v = c.q, c.k, c.v
    b, t, n, h, s, g, hv, bq, bk, nq, nk, tp, sp, hp, hvp = Tiling.of(c, config)
    kh = n // g
    spec = c.spec
    segments = spec.segments
    math_ = TileMath(spec, c.scale, c.logits_soft_cap, s, c.bias is not None, c.mask is not None,
                     allow_tf32=q.dtype != jnp.float32)
    warps, stages = config.num_warps, config.num_stages

    qp, kp, vp = pad_axis(q, 1, tp), pad_axis(k, 1, sp), pad_axis(v, 1, sp)
    op, dop = pad_axis(out, 1, tp), pad_axis(d_out.astype(out.dtype), 1, tp)
    lse_safe = pad_axis(jnp.where(lse == -jnp.inf, jnp.inf, lse), 2, tp)

    # 1. preprocess: delta (and the sink gradient per row).
    row_spec = pl.BlockSpec((None, bq, None, hvp), lambda i, bb, nn: (bb, i, nn, 0))
    stat_spec = pl.BlockSpec((None, None, bq), lambda i, bb, nn: (bb, nn, i))
    inputs, in_specs = [op, dop], [row_spec, row_spec]
    if d_lse is not None:
        inputs.append(pad_axis(d_lse.astype(jnp.float32), 2, tp))
        in_specs.append(stat_spec)
    out_shape = [jax.ShapeDtypeStruct((b, n, tp), jnp.float32)]
    out_specs = [stat_spec]
    if c.sinks is not None:
        inputs += [pad_axis(lse, 2, tp, 0.0), c.sinks.astype(jnp.float32)]
        in_specs += [stat_spec, pl.BlockSpec((1,), lambda i, bb, nn: (nn,))]
        out_shape.append(jax.ShapeDtypeStruct((b, n, tp), jnp.float32))
        out_specs.append(stat_spec)
    pre = triton_call(functools.partial(_preprocess_kernel, hv=hv, has_dlse=d_lse is not None,
                                        has_sinks=c.sinks is not None),
                      out_shape=out_shape, grid=(nq, b, n), in_specs=in_specs, out_specs=out_specs,
                      num_warps=4, num_stages=1, name="stellax_flash_attention_backward_preprocess")(*inputs)
    if c.sinks is not None:
        delta, dsink_rows = pre
        dsinks = jnp.sum(dsink_rows[:, :, :t], axis=(0, 2)).astype(c.sinks.dtype)
    else:
        delta, dsinks = (pre[0] if isinstance(pre, (tuple, list)) else pre), None

    bias = prepare_dense(c.bias, tp, sp)
    mask = prepare_dense(c.mask, tp, sp, jnp.int8)
    segb = max(c.q_seg.shape[0], c.kv_seg.shape[0]) if segments else 1
    qseg = pad_axis(jnp.broadcast_to(c.q_seg, (segb, t)), 1, tp) if segments else None
    kvseg = pad_axis(jnp.broadcast_to(c.kv_seg, (segb, s)), 1, sp) if segments else None
    qpos, kvpos = pad_axis(c.q_pos, 1, tp), pad_axis(c.kv_pos, 1, sp)
    fp, fs = bcast_index(qpos.shape[0]), bcast_index(segb)

    # 2. dq (and dbias), q-block major.
    sched = _schedule(spec, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg, bq, bk)
    fc = bcast_index(sched.shape[0])
    inputs = [qp, kp, vp]
    in_specs = [pl.BlockSpec((None, bq, None, hp), lambda i, bb, nn: (bb, i, nn, 0)),
                pl.BlockSpec((None, sp, None, hp), lambda i, bb, nn: (bb, 0, nn // g, 0)),
                pl.BlockSpec((None, sp, None, hvp), lambda i, bb, nn: (bb, 0, nn // g, 0))]
    for x in (bias, mask):
        if x is not None:
            fb, fn = bcast_index(x.shape[0]), bcast_index(x.shape[1])
            inputs.append(x)
            in_specs.append(pl.BlockSpec((None, None, bq, sp),
                                         lambda i, bb, nn, fb=fb, fn=fn: (fb(bb), fn(nn), i, 0)))
    inputs += [dop, lse_safe, delta, qpos, kvpos]
    in_specs += [pl.BlockSpec((None, bq, None, hvp), lambda i, bb, nn: (bb, i, nn, 0)), stat_spec, stat_spec,
                 pl.BlockSpec((None, bq), lambda i, bb, nn: (fp(bb), i)),
                 pl.BlockSpec((None, sp), lambda i, bb, nn: (fp(bb), 0))]
    if segments:
        inputs += [qseg, kvseg]
        in_specs += [pl.BlockSpec((None, bq), lambda i, bb, nn: (fs(bb), i)),
                     pl.BlockSpec((None, sp), lambda i, bb, nn: (fs(bb), 0))]
    inputs.append(sched)
    in_specs.append(pl.BlockSpec((None, None, 4), lambda i, bb, nn: (fc(bb), i, 0)))
    out_shape = [jax.ShapeDtypeStruct((b, tp, n, h), q.dtype)]
    out_specs = [pl.BlockSpec((None, bq, None, hp), lambda i, bb, nn: (bb, i, nn, 0))]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, bq, sp), lambda i, bb, nn: (bb, nn, i, 0)))
    res = triton_call(functools.partial(_dq_kernel, math_=math_, block_q=bq, block_k=bk, nk=nk, h=h, hv=hv,
                                        segments=segments),
                      out_shape=out_shape, grid=(nq, b, n), in_specs=in_specs, out_specs=out_specs,
                      num_warps=warps, num_stages=stages, name="stellax_flash_attention_backward_dq")(*inputs)
    if bias is not None:
        dq, dbias_full = res
    else:
        dq, dbias_full = (res[0] if isinstance(res, (tuple, list)) else res), None

    # 3. dk/dv, k-block major, looping over the group's query heads.
    sched_t = _schedule(spec, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg, bq, bk, kv_major=True)  # [Bc, nk, 4]
    fc = bcast_index(sched_t.shape[0])
    inputs = [qp, kp, vp]
    in_specs = [pl.BlockSpec((None, tp, g, hp), lambda j, bb, kk: (bb, 0, kk, 0)),
                pl.BlockSpec((None, bk, None, hp), lambda j, bb, kk: (bb, j, kk, 0)),
                pl.BlockSpec((None, bk, None, hvp), lambda j, bb, kk: (bb, j, kk, 0))]
    heads = {}
    for name, x in (("bias", bias), ("mask", mask)):
        if x is not None:
            fb = bcast_index(x.shape[0])
            per_head = x.shape[1] > 1
            heads[name] = per_head
            inputs.append(x)
            in_specs.append(pl.BlockSpec((None, g if per_head else 1, tp, bk),
                                         lambda j, bb, kk, fb=fb, ph=per_head: (fb(bb), kk if ph else 0, 0, j)))
    gstat = pl.BlockSpec((None, g, tp), lambda j, bb, kk: (bb, kk, 0))
    inputs += [dop, lse_safe, delta, qpos, kvpos]
    in_specs += [pl.BlockSpec((None, tp, g, hvp), lambda j, bb, kk: (bb, 0, kk, 0)), gstat, gstat,
                 pl.BlockSpec((None, tp), lambda j, bb, kk: (fp(bb), 0)),
                 pl.BlockSpec((None, bk), lambda j, bb, kk: (fp(bb), j))]
    if segments:
        inputs += [qseg, kvseg]
        in_specs += [pl.BlockSpec((None, tp), lambda j, bb, kk: (fs(bb), 0)),
                     pl.BlockSpec((None, bk), lambda j, bb, kk: (fs(bb), j))]
    inputs.append(sched_t)
    in_specs.append(pl.BlockSpec((None, None, 4), lambda j, bb, kk: (fc(bb), j, 0)))
    out_shape = [jax.ShapeDtypeStruct((b, sp, kh, h), k.dtype), jax.ShapeDtypeStruct((b, sp, kh, hv), v.dtype)]
    out_specs = [pl.BlockSpec((None, bk, None, hp), lambda j, bb, kk: (bb, j, kk, 0)),
                 pl.BlockSpec((None, bk, None, hvp), lambda j, bb, kk: (bb, j, kk, 0))]
    dk, dv = triton_call(functools.partial(_dkdv_kernel, math_=math_, block_q=bq, block_k=bk, group=g, h=h, hv=hv,
                                           segments=segments, bias_per_head=heads.get("bias", False),
                                           mask_per_head=heads.get("mask", False)),
                         out_shape=out_shape, grid=(nk, b, kh), in_specs=in_specs, out_specs=out_specs,
                         num_warps=warps, num_stages=stages,
                         name="stellax_flash_attention_backward_dkdv")(*inputs)

    dbias = None
    if c.bias is not None:
        bx, nx, tx, sx = c.bias.shape
        db = dbias_full[:, :, :t, :s]
        axes = tuple(a for a, (full, want) in enumerate(zip(db.shape, (bx, nx, tx, sx))) if want == 1 and full > 1)
        if axes:
            db = jnp.sum(db, axis=axes, keepdims=True)
        dbias = db.astype(c.bias.dtype)
    return dq[:, :t], dk[:, :s], dv[:, :s], dbias, dsinks
