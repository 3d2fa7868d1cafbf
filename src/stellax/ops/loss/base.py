"""What the linear cross-entropy implementations share: argument checks, the
per-token loss and reductions (`Loss`), the cotangent → coefficient map of the
backward and the cost models. The backend table and the `core.vjp` rule are in `api`.

Every backend's kernel module (a row of `api.BACKENDS`: `triton`, `xla_chunked`,
`xla`) provides two functions over token rows:

* ``forward_stats(x [T, D], w, labels [T], *, transpose_w, logit_soft_cap, precision, config)
  -> (lse, target, total)``, float32 ``[T]`` each (see `reference.token_stats`);
* ``backward(x, w, labels, lse, softmax_coef, target_coef, uniform_coef, *, transpose_w,
  logit_soft_cap, precision, config) -> (dx [T, D], dw)``: the VJP of
  ``F = Σ_t a_t·lse_t + b_t·c_{t,y_t} + e_t·Σ_j c_tj`` (``dc = a·softmax(c) + b·onehot(y) + e``,
  through the soft cap ``dz = dc·(1 − (c/cap)²)``, then ``dx = dz @ wᵀ``, ``dw = xᵀ @ dz``).

A module may also provide ``fused_forward_backward``: the stats and the
gradients of the scalar loss in one pass over the chunks (see `xla_chunked`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call
from ...core import checks
from ...core.precision import resolve_precision

REDUCTIONS = ("mean", "sum", "none")


# -- argument checks -----------------------------------------------------------------
def _check_float_option(name, value, *, minimum=0.0, below=None):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    value = float(value)
    if not (value >= minimum and (below is None or value < below)):
        bound = f"[{minimum}, {below})" if below is not None else f">= {minimum}"
        raise ValueError(f"{name}: expected a float in {bound}, got {value}")
    return value


def _check_labels_in_range(labels, vocab: int, ignore_index: int):
    """Concrete labels must be in ``[0, V)`` or ``ignore_index`` (under ``jit`` they are
    traced and cannot be checked here: an out-of-range label then gives a NaN loss)."""
    if isinstance(labels, jax.core.Tracer) or isinstance(labels, jax.ShapeDtypeStruct):
        return
    values = np.asarray(labels)
    bad = (values != ignore_index) & ((values < 0) | (values >= vocab))
    if bad.any():
        first = values[bad].reshape(-1)[0]
        raise ValueError(f"labels: expected values in [0, {vocab}) (V, the vocabulary size of w) or "
                         f"ignore_index={ignore_index}, got {int(first)} ({int(bad.sum())} labels out of range)")


def check_forward(x, w, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_soft_cap=None,
                  reduction="mean", transpose_w=False, return_lse=False, return_z_loss=False, precision=None) -> Call:
    """Validate `linear_cross_entropy` arguments into a `Call`."""
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1 ([..., D]), got rank 0")
    w = checks.require_float("w", w)
    checks.require_same_dtype("w", w, "x", x)
    checks.require_ndim("w", w, 2)
    if not isinstance(transpose_w, bool):
        raise TypeError(f"transpose_w: expected a bool, got {type(transpose_w).__name__}")
    features = x.shape[-1]
    if transpose_w:
        checks.require_shape("w", w, (None, features), "[V, D] with transpose_w=True, D = x.shape[-1]")
    else:
        checks.require_shape("w", w, (features, None), "[D, V], D = x.shape[-1]")
    labels = checks.require_int("labels", labels)
    checks.require_shape("labels", labels, x.shape[:-1], "x.shape[:-1]")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    label_smoothing = _check_float_option("label_smoothing", label_smoothing, below=1.0)
    z_loss = _check_float_option("z_loss", z_loss)
    if logit_soft_cap is not None:
        logit_soft_cap = checks.require_positive_float("logit_soft_cap", logit_soft_cap)
    reduction = checks.require_choice("reduction", reduction, REDUCTIONS)
    for name, value in (("return_lse", return_lse), ("return_z_loss", return_z_loss)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    vocab = w.shape[0] if transpose_w else w.shape[1]
    _check_labels_in_range(labels, vocab, int(ignore_index))
    return Call({"x": x, "w": w, "labels": labels},
                {"ignore_index": int(ignore_index), "label_smoothing": label_smoothing, "z_loss": z_loss,
                 "logit_soft_cap": logit_soft_cap, "reduction": reduction, "transpose_w": transpose_w,
                 "return_lse": return_lse, "return_z_loss": return_z_loss, "precision": resolve_precision(precision)})


def check_backward(x, w, labels, lse, softmax_coef, target_coef, uniform_coef, *, logit_soft_cap=None,
                   transpose_w=False, precision=None) -> Call:
    """Validate `linear_cross_entropy_backward` arguments (token rows ``x [T, D]``)."""
    x = checks.require_float("x", x)
    checks.require_ndim("x", x, 2)
    w = checks.require_float("w", w)
    checks.require_same_dtype("w", w, "x", x)
    checks.require_ndim("w", w, 2)
    tokens, features = x.shape
    checks.require_shape("w", w, (None, features) if transpose_w else (features, None), "D = x.shape[1]")
    labels = checks.require_int("labels", labels)
    checks.require_shape("labels", labels, (tokens,), "x.shape[0]")
    for name, value in (("lse", lse), ("softmax_coef", softmax_coef), ("target_coef", target_coef),
                        ("uniform_coef", uniform_coef)):
        checks.require_float(name, value, (jnp.float32,))
        checks.require_shape(name, value, (tokens,), "x.shape[0]")
    if logit_soft_cap is not None:
        logit_soft_cap = checks.require_positive_float("logit_soft_cap", logit_soft_cap)
    return Call({"x": x, "w": w, "labels": labels, "lse": lse, "softmax_coef": softmax_coef,
                 "target_coef": target_coef, "uniform_coef": uniform_coef},
                {"logit_soft_cap": logit_soft_cap, "transpose_w": bool(transpose_w),
                 "precision": resolve_precision(precision)})


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


# -- cost models ---------------------------------------------------------------------------------
def forward_flops(call: Call) -> float:
    t, d, v = dims(call)
    return 2.0 * t * d * v + 6.0 * t * v


def forward_bytes(call: Call) -> float:
    t, d, v = dims(call)
    size = np.dtype(call.x.dtype).itemsize
    return float(size * (t * d + d * v) + 4 * t)


def backward_flops(call: Call) -> float:
    t, d, v = dims(call)
    return 3 * 2.0 * t * d * v + 8.0 * t * v  # logits recomputed, dx, dw


def backward_bytes(call: Call) -> float:
    t, d, v = dims(call)
    size = np.dtype(call.x.dtype).itemsize
    return float(2 * size * (t * d + d * v) + 4 * 5 * t)
