"""Ring attention: K/V blocks travel around a ring of devices (per shard).

Device ``d`` of a ring of ``P`` holds queries ``Q_d`` and the K/V block
``KV_d``. At step ``s = 0 … P−1`` it holds the block of device
``(d − s) mod P``, computes the partial attention ``(O_s, lse_s)`` of
``Q_d`` against it (`LocalAttention`, with the block's true positions) and
merges it exactly (`local.merge_partials`), while the block is sent on to
``d + 1`` with ``ppermute`` (issued before the step's compute, so XLA can
overlap the transfer with it). A step whose block is fully hidden by the
mask (causal: a block entirely in the query block's future; windows and
segments alike, decided by `LocalAttention.any_visible`) is skipped with
``lax.cond``. Memory stays O(T/P): one K/V block in flight.

Backward (``jax.custom_vjp``; residuals: inputs, merged ``out`` and ``lse``):
the blocks travel around the ring again, each with float32 ``dK/dV``
accumulators that move with it, so after the last step one more hop brings
every accumulator home. Per step:

* flash implementations (``mosaic_tpu``, ``triton``, ``xla_chunked``): the ``attention_backward``
  op is called on the block with the *merged* ``out``/``lse`` — its
  ``p = exp(s − lse)`` and ``delta = rowsum(dO·O) − dlse`` are then exactly
  the merged softmax's, so it returns this block's share of the gradients;
* otherwise (the ``xla`` golden): the block's partial is recomputed and
  differentiated through the local attention's own VJP with the merge's
  chain rule, ``w_s = exp(lse_s − lse)``:

      dO_s   = w_s · dO
      dlse_s = w_s · (Σ_h dO·(O_s − O) + dlse)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core.op import refuse_interpreted_tpu_collectives
from ..core.platform import current_platform
from ..core.precision import resolve_precision
from ..ops.attention import attention_backward_op, backward_kernels
from .local import F32, LocalAttention, merge_partials


def rotate(tree, axis_name, axis_size: int):
    """Send every array of ``tree`` from device ``d`` to ``d + 1`` (mod ``P``) along ``axis_name``."""
    perm = [(j, (j + 1) % axis_size) for j in range(axis_size)]
    return jax.tree.map(lambda x: lax.ppermute(x, axis_name, perm), tree)


def _maybe(pred, true_fn, false_fn, *operands):
    if pred is None:
        return true_fn(*operands)
    return lax.cond(pred, true_fn, false_fn, *operands)


#: Attention implementations whose backward kernels take the merged softmax
#: statistics (out, lse) as inputs — FlashAttention-2 style — in dispatch order:
#: the flash rows of the attention backend table (`stellax.ops.attention.base.BACKENDS`).
FLASH_BACKWARDS = backward_kernels()


def _flash_backward_chain(implementation):
    """The backward implementations to call directly for a forward
    ``implementation``, or ``()`` to differentiate through the block's VJP
    (the ``xla`` golden recomputes its own softmax, so it must not get the
    merged statistics)."""
    if implementation is None:
        # As the forward's own default: interpreted kernels are never picked by themselves on a CPU.
        on_cpu = current_platform().backend == "cpu"
        return tuple(n for n in FLASH_BACKWARDS
                     if not (on_cpu and attention_backward_op.implementations[n].is_kernel))
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    return names if all(n in FLASH_BACKWARDS for n in names) else ()


def _ring_loop(step, carry, block, axis_name, axis_size):
    """Run ``carry = step(carry, block)`` for the ``P`` blocks of the ring.

    ``lax.scan`` over the first ``P − 1`` steps, each sending its block on
    before computing on it (one block in flight: memory O(T/P)), then the last
    step without a send."""
    if axis_size > 1:
        def body(state, _):
            carry, block = state
            nxt = rotate(block, axis_name, axis_size)
            return (step(carry, block), nxt), None

        (carry, block), _ = lax.scan(body, (carry, block), None, length=axis_size - 1)
    return step(carry, block)


def _forward(local: LocalAttention, axis_name, axis_size, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    b, t, n, _ = q.shape
    out = jnp.zeros((b, t, n, v.shape[-1]), F32)
    lse = jnp.full((b, n, t), -jnp.inf, F32)

    def attend(kb, vb, kp, ks):
        o, l = local(q, kb, vb, q_pos, kp, q_seg, ks)
        return o.astype(F32), l.astype(F32)

    def skip(kb, vb, kp, ks):
        return jnp.zeros_like(out), jnp.full_like(lse, -jnp.inf)

    def step(carry, block):
        kb, vb, kp, ks = block
        o_s, l_s = _maybe(local.any_visible(q_pos, kp, q_seg, ks), attend, skip, kb, vb, kp, ks)
        return merge_partials(*carry, o_s, l_s)

    return _ring_loop(step, (out, lse), (k, v, kv_pos, kv_seg), axis_name, axis_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(local, axis_name, axis_size, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _forward(local, axis_name, axis_size, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    return out.astype(q.dtype), lse


def _ring_fwd(local, axis_name, axis_size, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    out, lse = _forward(local, axis_name, axis_size, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    return (out.astype(q.dtype), lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _ring_bwd(local, axis_name, axis_size, residuals, cotangents):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
    d_out_raw, d_lse = cotangents
    d_out = d_out_raw.astype(F32)
    d_lse = d_lse.astype(F32)
    lse_safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

    flash = _flash_backward_chain(local.implementation)
    b = q.shape[0]
    q_pos_b = jnp.broadcast_to(q_pos, (b, q.shape[1])).astype(jnp.int32)

    def grads_flash(kb, vb, kp, ks):
        # Flash-style backward kernels take the softmax statistics as inputs:
        # with the merged (out, lse) they give this block's share of the exact
        # gradients directly (p = exp(s − lse), delta = rowsum(dO·O) − dlse).
        scale = local.scale if local.scale is not None else 1.0 / float(q.shape[-1]) ** 0.5
        dq, dk, dv, _, _ = attention_backward_op(
            q, kb, vb, None, None, None, out.astype(q.dtype), lse, d_out_raw, d_lse, q_pos_b,
            jnp.broadcast_to(kp, (b, kb.shape[1])).astype(jnp.int32), q_seg if local.segments else None,
            ks if local.segments else None, spec=local.spec, scale=scale, logits_soft_cap=local.logits_soft_cap,
            precision=local.precision, implementation=flash)
        return dq.astype(F32), dk.astype(F32), dv.astype(F32)

    def grads_vjp(kb, vb, kp, ks):
        # Any implementation: recompute the block and differentiate it through
        # its own VJP with the merge's chain rule (module docstring).
        def f(q_, k_, v_):
            return local(q_, k_, v_, q_pos, kp, q_seg, ks)

        (o_s, l_s), vjp = jax.vjp(f, q, kb, vb)
        w = jnp.where(jnp.isfinite(l_s), jnp.exp(l_s - lse_safe), 0.0)  # [B, N, T]
        do_s = jnp.swapaxes(w, 1, 2)[..., None] * d_out
        dl_s = w * (jnp.einsum("btnh,btnh->bnt", d_out, o_s.astype(F32) - out,
                                precision=resolve_precision(local.precision)) + d_lse)
        dq, dk, dv = vjp((do_s.astype(o_s.dtype), dl_s.astype(l_s.dtype)))
        return dq.astype(F32), dk.astype(F32), dv.astype(F32)

    grads = grads_flash if flash else grads_vjp

    def skip(kb, vb, kp, ks):
        return (jnp.zeros(q.shape, F32), jnp.zeros(kb.shape, F32), jnp.zeros(vb.shape, F32))

    def step(carry, block):
        dq, dk_acc, dv_acc = carry
        kb, vb, kp, ks = block
        dq_s, dk_s, dv_s = _maybe(local.any_visible(q_pos, kp, q_seg, ks), grads, skip, kb, vb, kp, ks)
        # The accumulators travel with their block: one hop after every step,
        # so after the last step they are back on the block's owner.
        dk_acc, dv_acc = rotate((dk_acc + dk_s, dv_acc + dv_s), axis_name, axis_size)
        return dq + dq_s, dk_acc, dv_acc

    carry = (jnp.zeros(q.shape, F32), jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    dq, dk, dv = _ring_loop(step, carry, (k, v, kv_pos, kv_seg), axis_name, axis_size)
    acc = (dk, dv)
    return (dq.astype(q.dtype), acc[0].astype(k.dtype), acc[1].astype(v.dtype), None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention_shard(q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None, *, local: LocalAttention,
                         axis_name, axis_size: int):
    """Ring attention on one device's shard, inside ``shard_map`` over ``axis_name``.

    Args:
      q: ``[B, L, N, H]`` local queries; k, v: ``[B, L, K, H|Hv]`` local keys/values.
      q_pos, kv_pos: ``[B|1, L]`` int32 original positions of the local tokens.
      q_seg, kv_seg: ``[B, L]`` int32 segment ids or ``None``.
      local: the per-block attention (mask, scale, soft cap, implementation; no sinks).
      axis_name, axis_size: the ring's mesh axis and its size ``P``.
    Returns ``(out [B, L, N, Hv] q.dtype, lse [B, N, L] float32)``, differentiable in q, k, v.
    """
    refuse_interpreted_tpu_collectives("ring attention", local.implementation, int(axis_size))
    return _ring(local, axis_name, int(axis_size), q, k, v, q_pos, kv_pos, q_seg, kv_seg)
