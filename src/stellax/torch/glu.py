"""Torch front end of `stellax.gated_linear_unit` (SwiGLU / GeGLU / ReGLU)."""

from __future__ import annotations

import torch
from jax import Array

import stellax

from .options import precision_name
from .registry import define_op


def _glu(x: Array, w_gate: Array, w_up: Array | None, *, activation: str, precision: str | None,
         implementation: str | None) -> Array:
    weights = w_gate if w_up is None else (w_gate, w_up)
    return stellax.gated_linear_unit(x, weights, activation=activation, precision=precision,
                                     implementation=implementation)


gated_linear_unit_op = define_op("gated_linear_unit", _glu)


def gated_linear_unit(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor | None = None, *,
                      activation: str = "silu", precision=None, implementation: str | None = None) -> torch.Tensor:
    """`stellax.gated_linear_unit`: ``activation(x @ w_gate) * (x @ w_up)``, fused.

    The weights use the JAX twin's ``[in, out]`` layout (the transpose of
    ``nn.Linear.weight``): either one stacked ``w_gate`` of shape ``[K, 2, N]``
    (``[:, 0]`` gate, ``[:, 1]`` up) with ``w_up=None``, or two ``[K, N]``
    matrices. ``activation``: ``"silu"``, ``"gelu"``, ``"gelu_tanh"``,
    ``"relu"``, ``"sigmoid"``; ``precision`` of the float32 matmuls (``None`` or a
    `jax.lax.Precision` / its name, see `stellax.core.precision`). Returns ``[..., N]``
    in ``x.dtype``.
    """
    return gated_linear_unit_op(x, w_gate, w_up, str(activation), precision_name(precision), implementation)
