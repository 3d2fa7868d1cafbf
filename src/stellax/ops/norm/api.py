"""Public normalization API: `layer_norm` (LayerNorm / RMSNorm, optional fused
residual add) and its backward op."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from ...core import Call, backward_implementation
from ...core import vjp
from ...core.op import chosen_explicitly
from ...core.backends import Backend
from .base import (BACKENDS, backward_bytes, backward_flops, check_backward, check_layer_norm, forward_bytes,
                   forward_flops)
from .examples import backward_examples, benchmarks, forward_examples
from .reference import layer_norm_backward_reference, layer_norm_reference


# -- backward op ---------------------------------------------------------------
def _run_backward(backend: Backend, call: Call, config):
    dx, dscale, doffset = backend.kernels.norm_backward(
        call.dy, call.x, call.scale, call.offset, call.mean, call.rstd, call.dh,
        subtract_mean=call.subtract_mean, config=config,
    )
    return (
        dx,
        None if dscale is None else dscale.astype(call.scale.dtype),
        None if doffset is None else doffset.astype(call.offset.dtype),
    )


layer_norm_backward_op = BACKENDS.op(
    "layer_norm_backward", _run_backward, backward=True, check=check_backward, reference=layer_norm_backward_reference,
    flops=backward_flops, bytes_accessed=backward_bytes, examples=backward_examples)


# -- forward op ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Normalize:
    """The normalization of rows ``[R, D]`` by one backend (a `core.vjp` rule): operands
    ``(x, residual | None, scale | None, offset | None)``; outputs ``y`` or ``(y, h)``."""

    backend: Backend
    config: Any
    epsilon: float
    subtract_mean: bool
    has_residual: bool
    #: Whether the caller named the forward's implementation: then the backward runs the same
    #: backend; else the backward op's own default rule may pass its kernel over (`defers_to_xla`).
    explicit: bool = True

    def forward(self, x, residual, scale, offset):
        y, h, mean, rstd = self.backend.kernels.norm_forward(
            x, residual, scale, offset, config=self.config, epsilon=self.epsilon, subtract_mean=self.subtract_mean)
        out = (y, h) if self.has_residual else y
        return out, (x if h is None else h, scale, offset, mean, rstd)

    def backward(self, residuals, cotangents):
        normed, scale, offset, mean, rstd = residuals
        dy, dh = cotangents if self.has_residual else (cotangents, None)
        dx, dscale, doffset = layer_norm_backward_op(
            dy, normed, scale, offset, mean, rstd, dh, epsilon=self.epsilon, subtract_mean=self.subtract_mean,
            implementation=backward_implementation(layer_norm_backward_op, self.backend.name, explicit=self.explicit),
        )
        return dx, (dx if self.has_residual else None), dscale, doffset


def _run_forward(backend: Backend, call: Call, config):
    x, axis = call.x, call.axis
    if x.size == 0:  # empty rows or D = 0: empty outputs (no statistics to compute)
        y = jnp.zeros_like(x)
        return y if call.residual is None else (y, (x.astype(jnp.float32) + call.residual).astype(x.dtype))
    moved_shape = jnp.moveaxis(x, axis, -1).shape
    rows = lambda a: None if a is None else jnp.moveaxis(a, axis, -1).reshape(-1, moved_shape[-1])
    unrows = lambda a: jnp.moveaxis(a.reshape(moved_shape), -1, axis)
    rule = _Normalize(backend, config, call.epsilon, call.subtract_mean, call.residual is not None,
                      chosen_explicitly())
    out = vjp.apply(rule, rows(x), rows(call.residual), call.scale, call.offset)
    if rule.has_residual:
        return unrows(out[0]), unrows(out[1])
    return unrows(out)


layer_norm_op = BACKENDS.op(
    "layer_norm", _run_forward, check=check_layer_norm, reference=layer_norm_reference, flops=forward_flops,
    bytes_accessed=forward_bytes, examples=forward_examples, benchmarks=benchmarks,
    differentiable=("x", "scale", "offset", "residual"))


def layer_norm(x, scale=None, offset=None, *, axis=-1, epsilon=1e-6, subtract_mean=True, residual=None,
               implementation=None, config=None):
    """Layer normalization (RMSNorm with ``subtract_mean=False``) over one axis.

    Args:
      x: ``[..., D, ...]`` float32/bfloat16/float16; ``D = x.shape[axis]``.
      scale: ``[D]`` multiplier (γ) or ``None``.
      offset: ``[D]`` bias (β) or ``None``.
      axis: the normalized axis.
      epsilon: added to the variance.
      subtract_mean: ``False`` gives RMSNorm (no centering).
      residual: optional, same shape and dtype as ``x``: normalize
        ``h = x + residual`` and return ``(y, h)`` (the pre-norm residual
        stream of a transformer block), fused into one pass.
      implementation: ``None`` (best available, ending in ``"xla"``),
        ``"mosaic_tpu"``, ``"triton"``, ``"xla"`` or a sequence tried in order.
      config: an explicit `NormConfig` for the Triton kernels or `NormTpuConfig`
        for the Mosaic TPU kernels.

    Returns:
      ``y`` in ``x.dtype`` where, along ``axis`` in float32,
      ``y = (h - mean(h)) / sqrt(var(h) + epsilon) * scale + offset``;
      or ``(y, h)`` when ``residual`` is given.
    """
    return layer_norm_op(x, scale, offset, axis=axis, epsilon=epsilon, subtract_mean=subtract_mean,
                         residual=residual, implementation=implementation, config=config)


def rms_norm(x, scale=None, *, axis=-1, epsilon=1e-6, residual=None, implementation=None, config=None):
    """RMSNorm: ``x / sqrt(mean(x²) + epsilon) * scale`` — `layer_norm` with
    ``subtract_mean=False`` and no offset; the other arguments as there (``implementation``:
    ``None``, ``"mosaic_tpu"``, ``"triton"``, ``"xla"`` or a sequence tried in order)."""
    return layer_norm(x, scale, None, axis=axis, epsilon=epsilon, subtract_mean=False, residual=residual,
                      implementation=implementation, config=config)
