"""Golden gated linear unit in float32.

    gate = x @ w_gate          [M, N]
    up   = x @ w_up            [M, N]
    y    = activation(gate) * up

``weights`` is either ``[K, 2, N]`` (``w_gate = weights[:, 0]``,
``w_up = weights[:, 1]``) or a pair ``(w_gate [K, N], w_up [K, N])``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call
from .activations import activation_fn


def split_weights(call: Call):
    """``(w_gate [K, N], w_up [K, N])`` of either weight form."""
    if call.w_up is None:
        return call.w_gate[:, 0, :], call.w_gate[:, 1, :]
    return call.w_gate, call.w_up


def glu_reference(call: Call):
    """Golden `gated_linear_unit`: float32 HIGHEST-precision matmuls, output in x's dtype."""
    w_gate, w_up = split_weights(call)
    x = call.x.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    gate = jnp.matmul(x, w_gate.astype(jnp.float32), precision=hi)
    up = jnp.matmul(x, w_up.astype(jnp.float32), precision=hi)
    return (activation_fn(call.activation)(gate) * up).astype(call.x.dtype)


def glu_backward_reference(call: Call):
    """Golden backward on 2-D rows ``x [M, K]``: the VJP of the float32 forward.

    Returns ``(dx [M, K], dw_gate, dw_up)`` with the weights' form: for
    stacked ``[K, 2, N]`` weights ``dw_gate`` is ``[K, 2, N]`` and ``dw_up``
    is ``None``. Saved ``gate``/``up`` in the call are the forward's values of
    the same products: the golden ignores them and recomputes in float32."""
    act = activation_fn(call.activation)
    hi = jax.lax.Precision.HIGHEST
    w_gate, w_up = split_weights(call)

    def forward(x, wg, wu):
        return act(jnp.matmul(x, wg, precision=hi)) * jnp.matmul(x, wu, precision=hi)

    f32 = lambda a: a.astype(jnp.float32)
    _, vjp = jax.vjp(forward, f32(call.x), f32(w_gate), f32(w_up))
    dx, dwg, dwu = vjp(f32(call.dy))
    if call.w_up is None:
        return dx.astype(call.x.dtype), jnp.stack([dwg, dwu], axis=1).astype(call.w_gate.dtype), None
    return dx.astype(call.x.dtype), dwg.astype(call.w_gate.dtype), dwu.astype(call.w_up.dtype)
