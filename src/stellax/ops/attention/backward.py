"""The ``attention_backward`` op: the gradients of ``(out, lse)`` w.r.t.
``(q, k, v, bias, sinks)`` on canonical operands (see `base.Canonical`),
given the forward's ``out`` and ``lse`` (FlashAttention-2 style). The forward
ops' custom VJP (`base.attend`) calls it; context parallelism (ring) calls
it directly with merged statistics.

Implementations: ``mosaic_tpu`` (dq and dk/dv Pallas Mosaic TPU kernels),
``triton`` (three Pallas Triton kernels), ``xla_chunked``
(two blocked XLA passes) and ``xla`` (the VJP of the float32 golden)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call, Implementation, Op, checks, register
from ...core.precision import resolve_precision
from . import configs, examples, mosaic_tpu_backward, triton_backward, xla_chunked
from .base import backward_bytes, backward_canonical, backward_flops, backward_runner
from .masks import MaskSpec
from .reference import attention_forward_reference


def check_attention_backward(query, key, value, bias, mask, sinks, out, lse, d_out, d_lse, q_positions,
                             kv_positions, q_segment_ids=None, kv_segment_ids=None, *, spec: MaskSpec,
                             scale: float, logits_soft_cap=None, precision=None) -> Call:
    """Checks canonical operands (rank-4 q/k/v, see `base.Canonical`)."""
    for name, x in (("query", query), ("key", key), ("value", value), ("out", out), ("d_out", d_out)):
        checks.require_float(name, x)
        checks.require_ndim(name, x, 4)
    b, t, n, h = query.shape
    s, kh = key.shape[1:3]
    hv = value.shape[-1]
    checks.require_shape("key", key, (b, s, kh, h))
    checks.require_shape("value", value, (b, s, kh, hv))
    checks.require_shape("out", out, (b, t, n, hv))
    checks.require_shape("d_out", d_out, (b, t, n, hv))
    checks.require_shape("lse", lse, (b, n, t))
    if d_lse is not None:
        checks.require_shape("d_lse", d_lse, (b, n, t))
    if n % kh:
        raise ValueError(f"key: the number of query heads ({n}) must be a multiple of key/value heads ({kh})")
    if not isinstance(spec, MaskSpec):
        raise TypeError(f"spec: expected a MaskSpec, got {type(spec).__name__}")
    checks.require_int("q_positions", q_positions)
    checks.require_int("kv_positions", kv_positions)
    if sinks is not None:
        checks.require_shape("sinks", sinks, (n,))
    return Call(
        {"query": query, "key": key, "value": value, "bias": bias, "mask": mask, "sinks": sinks, "out": out,
         "lse": lse, "d_out": d_out, "d_lse": d_lse, "q_positions": q_positions, "kv_positions": kv_positions,
         "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids},
        {"spec": spec, "scale": float(scale), "logits_soft_cap": logits_soft_cap,
         "precision": resolve_precision(precision)},
    )


def attention_backward_reference(call: Call, config=None):
    """Golden gradients: the VJP of the float32 golden forward (also the
    ``xla`` implementation's ``run``). Returns ``(dq, dk, dv, dbias, dsinks)``
    in the operands' dtypes."""
    c = backward_canonical(call)

    def forward(q, k, v, bias, sinks):
        return attention_forward_reference(q, k, v, bias, c.mask, sinks, c.q_pos, c.kv_pos, c.q_seg,
                                           c.kv_seg, **c.statics)

    f32 = lambda x: None if x is None else x.astype(jnp.float32)
    _, vjp = jax.vjp(forward, f32(c.q), f32(c.k), f32(c.v), f32(c.bias), f32(c.sinks))
    d_lse = call.d_lse if call.d_lse is not None else jnp.zeros(call.lse.shape, jnp.float32)
    grads = vjp((call.d_out.astype(jnp.float32), d_lse.astype(jnp.float32)))
    return tuple(None if g is None else g.astype(x.dtype)
                 for g, x in zip(grads, (c.q, c.k, c.v, c.bias, c.sinks)))


attention_backward_op = register(Op(
    "attention_backward",
    family="attention",
    check=check_attention_backward,
    reference=attention_backward_reference,
    implementations=[
        Implementation("mosaic_tpu", backward_runner(mosaic_tpu_backward.backward), backend="mosaic_tpu",
                       config_type=configs.SplashBackwardConfig, heuristic=configs.splash_backward_heuristic,
                       space=configs.splash_backward_space, requirements=configs.splash_requirements),
        Implementation("triton", backward_runner(triton_backward.backward), backend="triton",
                       config_type=configs.FlashBackwardConfig, heuristic=configs.flash_backward_heuristic,
                       space=configs.flash_backward_space, requirements=configs.flash_requirements),
        Implementation("xla_chunked", backward_runner(xla_chunked.backward), config_type=configs.ChunkedConfig,
                       heuristic=configs.chunked_heuristic, space=configs.chunked_space),
        Implementation("xla", attention_backward_reference),
    ],
    flops=backward_flops,
    bytes_accessed=backward_bytes,
    examples=examples.backward_examples,
))


def backward_kernels() -> tuple[str, ...]:
    """The backward implementations that are kernels on the forward's
    statistics (``p = exp(s − lse)``, ``delta = rowsum(dO·O) − dlse``), in
    dispatch order: every implementation but the ``xla`` golden, which
    recomputes its own softmax."""
    return tuple(name for name in attention_backward_op.implementations if name != "xla")
