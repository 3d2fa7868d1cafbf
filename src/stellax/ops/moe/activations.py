"""Activations of the fused grouped matmul (the names of `stellax.ops.glu`).

`activation_fn` is the exact function (XLA code, the golden, gradients);
`kernel_activation_fn` is the same function written with primitives the
Pallas Triton lowering supports (exact GELU needs ``erf``, which it does not
lower, so the kernel uses the Abramowitz–Stegun 7.1.26 rational
approximation, |error| < 1.5e-7). ``None`` is the identity.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ..glu.activations import ACTIVATIONS

_SQRT_HALF = 0.7071067811865476


def check_activation(activation):
    """``None``, a name in ``ACTIVATIONS`` or a callable; else ValueError."""
    if activation is None or callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None, one of {sorted(ACTIVATIONS)} or a callable, "
                         f"got {activation!r}")
    return activation


def activation_fn(activation) -> Callable:
    """``None`` → identity, a callable as is, a name → its float32 activation (XLA code)."""
    if activation is None:
        return lambda x: x
    if callable(activation):
        return activation
    return ACTIVATIONS[activation]


def _erf(x):
    """erf for float32 from exp only (A&S 7.1.26)."""
    a = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    y = 1.0 - poly * jnp.exp(-a * a)
    return jnp.where(x < 0, -y, y)


def kernel_activation_fn(activation) -> Callable:
    """The activation as traced inside a Triton kernel (float32 in and out)."""
    if activation == "gelu":
        return lambda x: 0.5 * x * (1.0 + _erf(x * _SQRT_HALF))
    if activation in ("silu", "swish"):
        return lambda x: x / (1.0 + jnp.exp(-x))
    if activation == "sigmoid":
        return lambda x: 1.0 / (1.0 + jnp.exp(-x))
    return activation_fn(activation)


def fusable_in_kernel(activation) -> bool:
    """Callables are applied by XLA after the kernel (not fused)."""
    return activation is None or isinstance(activation, str)


def activation_grad(activation, dy, preact, gated: bool):
    """Cotangent of the pre-activation (float32): ``dz`` for ``y = act(z)``,
    or ``[M, 2, N]`` (``d gate``, ``d up``) for ``y = act(gate) * up``."""
    act = activation_fn(activation)
    dy = dy.astype(jnp.float32)
    z = preact.astype(jnp.float32)
    if not gated:
        _, vjp = jax.vjp(act, z)
        return vjp(dy)[0]
    gate, up = z[:, 0], z[:, 1]
    value, vjp = jax.vjp(act, gate)
    (dgate,) = vjp(dy * up)
    return jnp.stack([dgate, dy * value], axis=1)
