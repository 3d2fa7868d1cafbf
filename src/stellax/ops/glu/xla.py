"""XLA implementation of the gated linear unit (the CPU default).

One matmul against the ``[K, 2N]`` weight panel (or two for a weight pair),
the activation fused by XLA; under differentiation the forward also returns
``gate``/``up`` (in ``x.dtype``) and the backward starts from them (else it
recomputes them), then issues the gradient matmuls.
"""

from __future__ import annotations

import jax.numpy as jnp

from .activations import activation_fn, gate_up_grads
from .triton import weight_panels


def _gate_up(x, w_gate, w_up, precision):
    wg, wu, gate_col, up_col, n = weight_panels(w_gate, w_up)
    if w_up is None:
        both = jnp.matmul(x, wg, precision=precision, preferred_element_type=jnp.float32)
        return both[:, :n], both[:, n:]
    gate = jnp.matmul(x, wg, precision=precision, preferred_element_type=jnp.float32)
    up = jnp.matmul(x, wu, precision=precision, preferred_element_type=jnp.float32)
    return gate, up


def glu_forward(x, w_gate, w_up, *, activation, precision, config=None, save_preactivations=False):
    """``x [M, K]`` → ``act(x @ Wg)·(x @ Wu)`` ``[M, N]`` in ``x.dtype`` (float32 accumulation);
    with ``save_preactivations`` the pair ``(y, (gate, up))``, ``gate``/``up`` in ``x.dtype``."""
    del config
    gate, up = _gate_up(x, w_gate, w_up, precision)
    y = (activation_fn(activation)(gate) * up).astype(x.dtype)
    return (y, (gate.astype(x.dtype), up.astype(x.dtype))) if save_preactivations else y


def glu_backward(dy, x, w_gate, w_up, *, activation, precision, config=None, preactivations=None):
    """``dy [M, N]`` → ``(dx [M, K], dw_gate, dw_up)`` in the weights' form: ``dgate = dy·up·act'(gate)``,
    ``dup = dy·act(gate)``, ``dx = dgate @ Wgᵀ + dup @ Wuᵀ``, ``dW = xᵀ @ d(gate|up)``; ``gate``/``up``
    from ``preactivations`` (the forward's) or recomputed."""
    del config
    gate, up = preactivations if preactivations is not None else _gate_up(x, w_gate, w_up, precision)
    dgate, dup = gate_up_grads(dy, gate, up, activation, x.dtype)
    mm = lambda a, b: jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32)
    if w_up is None:
        k, _, n = w_gate.shape
        dboth = jnp.concatenate([dgate, dup], axis=1)  # [M, 2N], matches the [K, 2N] panel
        dx = mm(dboth, w_gate.reshape(k, 2 * n).T)
        dw = mm(x.T, dboth).reshape(k, 2, n)
        return dx.astype(x.dtype), dw.astype(w_gate.dtype), None
    dx = mm(dgate, w_gate.T) + mm(dup, w_up.T)
    return dx.astype(x.dtype), mm(x.T, dgate).astype(w_gate.dtype), mm(x.T, dup).astype(w_up.dtype)
