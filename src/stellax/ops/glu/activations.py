"""Activations for gated linear units, usable in XLA code and inside kernels."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ...core.precision import float32_tanh

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def silu(x):
    """SiLU / swish: ``x·σ(x)``."""
    return x * jax.nn.sigmoid(x)


def gelu(x):
    """Exact GELU: x·Φ(x) with the error function."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * _SQRT_HALF))


def erf_polynomial(x):
    """erf from exp only (Abramowitz & Stegun 7.1.26, |error| ≤ 1.5e-7), for
    kernels: the Pallas Triton lowering has no erf primitive."""
    z = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    magnitude = 1.0 - poly * jnp.exp(-z * z)
    # A select, not jnp.sign: Mosaic TPU lowers sign by querying the device's TPU generation,
    # which fails when compiling for a TPU from a CPU host.
    return jnp.where(x < 0, -magnitude, magnitude)


def _gelu_kernel(x):
    return 0.5 * x * (1.0 + erf_polynomial(x * _SQRT_HALF))


def _gelu_grad(x):
    # d/dx x·Φ(x) = Φ(x) + x·φ(x)
    cdf = 0.5 * (1.0 + erf_polynomial(x * _SQRT_HALF))
    return cdf + x * jnp.exp(-0.5 * x * x) * (_SQRT_HALF / 1.7724538509055159)


def gelu_tanh(x):
    """GELU with the tanh approximation (as in GPT-2 / Gemma). The tanh is
    `core.precision.float32_tanh`: a TPU's own is off by up to 8e-5 relative,
    past float32's 1e-5 (measured on a v5e), and the extra multiplies hide
    under the matmuls this activation follows."""
    return 0.5 * x * (1.0 + float32_tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))


def relu(x):
    """``max(x, 0)``."""
    return jnp.maximum(x, 0.0)


def sigmoid(x):
    """``σ(x) = 1 / (1 + e^{-x})`` (the original GLU gate)."""
    return jax.nn.sigmoid(x)


ACTIVATIONS: dict[str, Callable] = {
    "silu": silu, "swish": silu, "gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "sigmoid": sigmoid,
}


def activation_fn(activation, *, in_kernel: bool = False) -> Callable:
    """The function for a name in `ACTIVATIONS` or a callable (used as is).
    ``in_kernel`` picks the forms built from primitives Triton can lower."""
    if callable(activation):
        return activation
    if in_kernel and activation == "gelu":
        return _gelu_kernel
    return ACTIVATIONS[activation]


def activation_and_grad(activation, x, *, in_kernel: bool = False):
    """``(act(x), act'(x))`` elementwise (float32 in, float32 out)."""
    if in_kernel and activation == "gelu":
        return _gelu_kernel(x), _gelu_grad(x)
    value, vjp = jax.vjp(activation_fn(activation), x)
    (grad,) = vjp(jnp.ones_like(x))
    return value, grad


def gate_up_grads(dy, gate, up, activation, dtype, *, in_kernel: bool = False):
    """The GLU's elementwise backward: ``dgate = dy·up·act'(gate)`` and ``dup = dy·act(gate)``
    (``[M, N]`` each or a kernel's tiles, computed in float32, returned in ``dtype``), from saved
    pre-activations or, ``in_kernel``, from the tiles a kernel recomputed."""
    f32 = lambda a: a.astype(jnp.float32)
    act, act_grad = activation_and_grad(activation, f32(gate), in_kernel=in_kernel)
    dy32 = f32(dy)
    return (dy32 * f32(up) * act_grad).astype(dtype), (dy32 * act).astype(dtype)
