"""The loss of token rows from their per-token stats, and back: a call's shapes,
the static options of its loss (`Loss`), the per-token loss and its reductions,
and the map from the cotangents of the outputs to the backward's per-token
coefficients. Below the golden, the configs and the backend table (`base`), so
that every one of them can use it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ...core import Call


# -- shapes ------------------------------------------------------------------------------
def vocab_size(call: Call) -> int:
    return call.w.shape[0] if call.transpose_w else call.w.shape[1]


def dims(call: Call) -> tuple[int, int, int]:
    """``(T, D, V)``."""
    return int(np.prod(call.x.shape[:-1], dtype=np.int64)), call.x.shape[-1], vocab_size(call)


# -- per-token loss and reductions -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Loss:
    """The static options that turn per-token stats into a call's outputs (hashable, so a
    `core.vjp` rule can hold it): ``vocab`` = V, ``labels_shape`` the shape of the labels."""

    ignore_index: int
    label_smoothing: float
    z_loss: float
    reduction: str
    vocab: int
    labels_shape: tuple[int, ...]
    return_lse: bool
    return_z_loss: bool

    @classmethod
    def of(cls, call: Call) -> "Loss":
        return cls(call.ignore_index, call.label_smoothing, call.z_loss, call.reduction, vocab_size(call),
                   tuple(call.labels.shape), call.return_lse, call.return_z_loss)

    @property
    def scalar_only(self) -> bool:
        """The outputs are the reduced loss alone (no per-token ``lse``, no z-loss)."""
        return self.reduction != "none" and not self.return_lse and not self.return_z_loss


def _valid(loss: Loss, labels):
    return labels != loss.ignore_index


def count(loss: Loss, labels):
    """``max(#valid tokens, 1)`` in float32 (the "mean" denominator; 0 valid tokens give loss 0)."""
    return jnp.maximum(jnp.sum(_valid(loss, labels).astype(jnp.float32)), 1.0)


def token_loss(loss: Loss, lse, target, total, labels):
    """Per-token loss ``[T]`` (0 for ignored tokens, NaN for a label outside ``[0, V)``) and z-loss ``[T]``."""
    eps, lam = loss.label_smoothing, loss.z_loss
    valid = _valid(loss, labels)
    z = lam * lse * lse
    per_token = lse - (1.0 - eps) * target - (eps / loss.vocab) * total + z
    in_vocab = (labels >= 0) & (labels < loss.vocab)
    per_token = jnp.where(valid, jnp.where(in_vocab, per_token, jnp.nan), 0.0)
    return per_token, jnp.where(valid, z, 0.0)


def reduce(loss: Loss, per_token, labels):
    """``per_token [T]`` reduced as ``loss.reduction`` asks (``labels.shape`` for "none")."""
    if loss.reduction == "sum":
        return jnp.sum(per_token)
    if loss.reduction == "mean":
        return jnp.sum(per_token) / count(loss, labels)
    return per_token.reshape(loss.labels_shape)


def reduced(loss: Loss, lse, target, total, labels):
    """``(loss, lse [T], z_loss)``: the reduced loss and z-loss from the per-token stats."""
    per_token, z = token_loss(loss, lse, target, total, labels)
    return reduce(loss, per_token, labels), lse, reduce(loss, z, labels)


def outputs(loss: Loss, value, lse, z):
    """The op's outputs: ``value``, or ``(value, [lse], [z])`` with the extras ``return_lse`` /
    ``return_z_loss`` ask for (``lse [T]`` reshaped to the labels' shape)."""
    extras = ([lse.reshape(loss.labels_shape)] if loss.return_lse else []) + ([z] if loss.return_z_loss else [])
    return (value, *extras) if extras else value


def finalize(call: Call, lse, target, total, labels):
    """The op's outputs from the per-token stats: ``loss``, or ``(loss, [lse], [z_loss])``
    with the extras ``return_lse`` / ``return_z_loss`` ask for."""
    loss = Loss.of(call)
    return outputs(loss, *reduced(loss, lse, target, total, labels))


def token_scale(loss: Loss, labels, denominator=None):
    """How a token's loss enters the reduced loss: ``valid / max(#valid, 1)`` for "mean"
    (``denominator`` overrides the count), ``valid`` otherwise (float32 ``[T]``)."""
    scale = _valid(loss, labels).astype(jnp.float32)
    if loss.reduction == "mean":
        scale = scale / (count(loss, labels) if denominator is None else denominator)
    return scale


def coefficients(loss: Loss, scale, lse, d_loss, d_lse, d_z):
    """The backward coefficients ``(a, b, e)`` per token (float32 ``[T]``) for the
    cotangents of the reduced loss, of lse and of the reduced z-loss (``d_loss``/``d_z``
    scalars for "mean"/"sum", ``[T]`` for "none"; ``d_lse`` ``[T]`` or None); ``scale``
    from `token_scale`::

        a = g·(1 + 2λ·lse) + 2λ·lse·k + d_lse,   b = −(1 − ε)·g,   e = −(ε / V)·g
        with g = d_loss·scale, k = d_z·scale
    """
    eps, lam = loss.label_smoothing, loss.z_loss
    g = jnp.reshape(d_loss, (-1,)).astype(jnp.float32) * scale
    a = g * (1.0 + 2.0 * lam * lse)
    if d_z is not None:
        a = a + 2.0 * lam * lse * (jnp.reshape(d_z, (-1,)).astype(jnp.float32) * scale)
    if d_lse is not None:
        a = a + jnp.reshape(d_lse, (-1,)).astype(jnp.float32)
    return a, -(1.0 - eps) * g, -(eps / loss.vocab) * g
