"""Activations for gated linear units, usable in XLA code and inside kernels."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def silu(x):
    return x * jax.nn.sigmoid(x)


def gelu(x):
    """Exact GELU: x·Φ(x) with the error function."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * _SQRT_HALF))


def gelu_tanh(x):
    """GELU with the tanh approximation (as in GPT-2 / Gemma)."""
    return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def relu(x):
    return jnp.maximum(x, 0.0)


def sigmoid(x):
    return jax.nn.sigmoid(x)


ACTIVATIONS: dict[str, Callable] = {
    "silu": silu, "swish": silu, "gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "sigmoid": sigmoid,
}


def activation_fn(activation) -> Callable:
    """The function for a name in `ACTIVATIONS` or a callable (used as is)."""
    if callable(activation):
        return activation
    return ACTIVATIONS[activation]


def activation_and_grad(activation, x):
    """``(act(x), act'(x))`` elementwise (float32 in, float32 out)."""
    value, vjp = jax.vjp(activation_fn(activation), x)
    (grad,) = vjp(jnp.ones_like(x))
    return value, grad
