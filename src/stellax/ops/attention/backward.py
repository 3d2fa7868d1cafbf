"""The ``attention_backward`` op and the VJP of the forward ops.

``attention_backward``: the gradients of ``(out, lse)`` w.r.t. ``(q, k, v,
bias, sinks)`` on canonical operands (see `base.Canonical`), given the
forward's ``out`` and ``lse`` (FlashAttention-2 style). Context parallelism
(ring) calls it directly with merged statistics. Implementations (from
`base.BACKENDS`) and their configs: ``mosaic_tpu`` (dq and dk/dv Pallas Mosaic
TPU kernels, `SplashBackwardConfig`), ``triton`` (three Pallas Triton kernels,
`FlashBackwardConfig`), ``xla_chunked`` (two blocked XLA passes,
`ChunkedConfig`) and ``xla`` (the VJP of the float32 golden, no config).

`run_forward` is the ``run`` of every forward implementation (``attention``,
``attention_fp8``): a flash backend's forward kernel is differentiated by
this op through one `core.vjp` rule (`_Attend`), the golden by autodiff."""

from __future__ import annotations

import dataclasses
from typing import Any

from ...core import Call, backward_implementation, checks, vjp
from ...core.backends import Backend
from ...core.precision import resolve_precision
from . import examples
from .base import BACKENDS, Canonical, backward_bytes, backward_canonical, backward_flops, canonicalize, finalize
from .masks import MaskSpec


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


def _run_backward(backend: Backend, call: Call, config):
    return backend.kernels.backward(backward_canonical(call), call.out, call.lse, call.d_out, call.d_lse, config)


def attention_backward_reference(call: Call, config=None):
    """Golden gradients: the VJP of the float32 golden forward (the ``xla``
    implementation). Returns ``(dq, dk, dv, dbias, dsinks)`` in the operands'
    dtypes."""
    return _run_backward(BACKENDS["xla"], call, config)


attention_backward_op = BACKENDS.op(
    "attention_backward", _run_backward, backward=True, check=check_attention_backward,
    reference=attention_backward_reference, flops=backward_flops, bytes_accessed=backward_bytes,
    examples=examples.backward_examples)


def backward_kernels() -> tuple[str, ...]:
    """The backward implementations that are kernels on the forward's
    statistics (``p = exp(s − lse)``, ``delta = rowsum(dO·O) − dlse``), in
    dispatch order: the flash rows of `base.BACKENDS` (every implementation
    but the ``xla`` golden, which recomputes its own softmax)."""
    return tuple(row.name for row in BACKENDS.rows if row.backward and row.kernels.flash)


# -- the forward ops' VJP ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Attend:
    """A flash backend's forward kernel differentiated by ``attention_backward`` (a `core.vjp`
    rule): operand the `Canonical` form, outputs ``(out, lse)``, both differentiable w.r.t. the
    float operands (fp8 codes and their scales are constants)."""

    backend: Backend
    config: Any

    def forward(self, c: Canonical):
        out, lse = self.backend.kernels.forward(c, self.config)
        return (out, lse), (c, out, lse)

    def backward(self, residuals, cotangents):
        c, out, lse = residuals
        d_out, d_lse = cotangents
        f = c.dequantized()  # the backward kernels take float operands
        dq, dk, dv, dbias, dsinks = attention_backward_op(
            f.q, f.k, f.v, f.bias, f.mask, f.sinks, out, lse, d_out.astype(out.dtype), d_lse, f.q_pos, f.kv_pos,
            f.q_seg, f.kv_seg, **f.statics,
            implementation=backward_implementation(attention_backward_op, self.backend.name))
        quantized = c.row_scales or (None, None, None)
        dq, dk, dv = (None if s is not None else g.astype(x.dtype)
                      for g, x, s in zip((dq, dk, dv), (c.q, c.k, c.v), quantized))
        # None: a zero cotangent (integer/bool operands, fp8 codes and their scales).
        return (dataclasses.replace(c, q=dq, k=dk, v=dv, bias=dbias, sinks=dsinks, mask=None, q_pos=None,
                                    kv_pos=None, q_seg=None, kv_seg=None, row_scales=None),)


def run_forward(backend: Backend, call: Call, config):
    """The ``run`` of a forward implementation: canonicalize, the row's forward kernel (a flash
    kernel through `_Attend`; the golden differentiated by autodiff), back to the caller's dims."""
    c = canonicalize(call)
    if backend.kernels.flash:
        out, lse = vjp.apply(_Attend(backend, config), c)
    else:
        out, lse = backend.kernels.forward(c, config)
    return finalize(call, out, lse)
