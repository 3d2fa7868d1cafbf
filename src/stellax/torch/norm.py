"""Torch front ends of `stellax.layer_norm` / `stellax.rms_norm` (last axis)."""

from __future__ import annotations

import torch
from jax import Array

import stellax

from .registry import define_op


def _layer_norm(x: Array, scale: Array | None, offset: Array | None, *, epsilon: float, subtract_mean: bool,
                implementation: str | None) -> Array:
    return stellax.layer_norm(x, scale, offset, axis=-1, epsilon=epsilon, subtract_mean=subtract_mean,
                              implementation=implementation)


def _layer_norm_residual(x: Array, residual: Array, scale: Array | None, offset: Array | None, *, epsilon: float,
                         subtract_mean: bool, implementation: str | None) -> tuple[Array, Array]:
    return stellax.layer_norm(x, scale, offset, axis=-1, epsilon=epsilon, subtract_mean=subtract_mean,
                              residual=residual, implementation=implementation)


layer_norm_op = define_op("layer_norm", _layer_norm)
layer_norm_residual_op = define_op("layer_norm_residual", _layer_norm_residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
               eps: float = 1e-6, subtract_mean: bool = True, residual: torch.Tensor | None = None,
               implementation: str | None = None):
    """`stellax.layer_norm` over the last dimension of a torch tensor.

    ``weight``/``bias`` are ``[D]`` (γ/β); ``subtract_mean=False`` gives RMSNorm.
    With ``residual`` (same shape/dtype as ``x``) it normalizes
    ``h = x + residual`` and returns ``(y, h)``. Differentiable in every
    tensor argument.
    """
    if residual is not None:
        return layer_norm_residual_op(x, residual, weight, bias, float(eps), bool(subtract_mean), implementation)
    return layer_norm_op(x, weight, bias, float(eps), bool(subtract_mean), implementation)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float = 1e-6,
             residual: torch.Tensor | None = None, implementation: str | None = None):
    """`stellax.rms_norm` over the last dimension: ``x / sqrt(mean(x²) + eps) * weight``."""
    return layer_norm(x, weight, None, eps=eps, subtract_mean=False, residual=residual,
                      implementation=implementation)
