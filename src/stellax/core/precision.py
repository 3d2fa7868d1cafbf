"""The float32 contract: what ``precision=`` means for every stellax op.

Every op that contracts (a matmul, an attention score, a chunked recurrence)
takes ``precision`` as `jax.lax.dot` does: ``None``, ``"default"``,
``"high"``, ``"highest"`` or a `jax.lax.Precision`. It applies to float32
operands; bfloat16 / float16 / float8 / int8 operands always contract at the
matrix unit's native precision, accumulating in float32.

=============  ===================================  ====================================
precision      TPU (XLA and Mosaic TPU kernels)      GPU (Triton kernels)
=============  ===================================  ====================================
``default``    one bfloat16 pass (~2e-3 relative)    one TF32 pass (~5e-4 relative)
``high``       three bfloat16 passes (~1e-5)         three TF32 passes (~1e-6)
``highest``    float32 (six passes, ~1e-7)           three TF32 passes (~1e-6)
=============  ===================================  ====================================

``None`` follows `jax.default_matmul_precision` when the caller has set it,
and is ``"highest"`` otherwise: **float32 in, float32-accurate out** by
default, on every implementation. That is stricter than JAX's own default on
a TPU (where a float32 ``jnp.dot`` at ``None`` is one bfloat16 pass); ask for
``"default"`` to get that speed. On a CPU every setting computes in float32.

Inside a Mosaic TPU kernel, ``default`` and ``high`` are written out as
explicit bfloat16 casts and passes (`mxu_dot_general`), so interpret mode
on a CPU reproduces the chip's numerics bit for bit where it can; Mosaic
itself accepts only the default and ``fp32`` contract precisions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Precision = jax.lax.Precision
DEFAULT, HIGH, HIGHEST = Precision.DEFAULT, Precision.HIGH, Precision.HIGHEST

#: The names `check_precision` accepts, as `jax.lax.Precision` spells them.
PRECISION_NAMES = {"default": DEFAULT, "high": HIGH, "highest": HIGHEST}

#: `jax.default_matmul_precision` values and the precision each means for a float32 contraction.
_CONFIG_PRECISIONS = {
    "default": DEFAULT, "bfloat16": DEFAULT, "fastest": DEFAULT,
    "high": HIGH, "tensorfloat32": HIGH, "bfloat16_3x": HIGH,
    "highest": HIGHEST, "float32": HIGHEST,
}


def check_precision(precision: Any, name: str = "precision") -> Precision | None:
    """Canonical form of a user's ``precision``: ``None`` or a `jax.lax.Precision`.

    Accepts ``None``, ``"default"`` / ``"high"`` / ``"highest"`` (any case), a
    `jax.lax.Precision`, or a pair of equal ones (as `jax.lax.dot` takes).
    Anything else is a ``ValueError`` naming the argument and the value."""
    if precision is None or isinstance(precision, Precision):
        return precision
    if isinstance(precision, str) and precision.lower() in PRECISION_NAMES:
        return PRECISION_NAMES[precision.lower()]
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        first, second = (check_precision(p, name) for p in precision)
        if first == second:
            return first
    raise ValueError(f"{name}: expected None, 'default', 'high', 'highest' or a jax.lax.Precision, "
                     f"got {precision!r}")


def resolve_precision(precision: Any, name: str = "precision") -> Precision:
    """The precision float32 contractions run at: ``precision`` checked, and
    ``None`` made concrete (`jax.default_matmul_precision` when set, else
    ``HIGHEST``). Called at trace time, so a ``with
    jax.default_matmul_precision(...)`` block around a jitted call counts."""
    precision = check_precision(precision, name)
    if precision is not None:
        return precision
    configured = jax.config.jax_default_matmul_precision
    if configured is None:
        return HIGHEST
    return _CONFIG_PRECISIONS.get(str(configured).lower(), HIGHEST)


def precision_name(precision: Any) -> str:
    """``"default"`` / ``"high"`` / ``"highest"`` of a resolved precision (for reports and JSON)."""
    return resolve_precision(precision).name.lower()


def describe_contract() -> str:
    """One line on what ``precision=None`` means here (`stellax info`)."""
    configured = jax.config.jax_default_matmul_precision
    source = (f"jax.default_matmul_precision={configured!r}" if configured is not None
              else "no jax.default_matmul_precision set")
    return (f"precision=None -> {precision_name(None)!r} for float32 operands ({source}); bfloat16/float16/fp8/int8 "
            f"operands contract at the matrix unit's native precision with float32 accumulation")


# -- float32 contractions inside Mosaic TPU kernels -------------------------------------------
_F32 = np.dtype(jnp.float32)
_BF16 = jnp.bfloat16


def _split_bf16(x):
    """``x`` (float32) as ``hi + lo`` with both bfloat16 (``lo`` the rounding remainder)."""
    hi = x.astype(_BF16)
    return hi, (x - hi.astype(jnp.float32)).astype(_BF16)


def mxu_dot_general(a, b, dimension_numbers, precision: Precision, out_dtype=jnp.float32):
    """``jax.lax.dot_general(a, b)`` inside a Mosaic TPU kernel at ``precision``
    (a resolved `jax.lax.Precision`), accumulated in ``out_dtype``.

    When neither operand is float32 the MXU's native product is used. With a
    float32 operand:

    * ``DEFAULT``: both operands rounded to bfloat16, one pass — what the MXU
      does to float32 at its default precision, written out so interpret mode
      computes the same;
    * ``HIGH``: ``a_hi·b_hi + a_hi·b_lo + a_lo·b_hi`` with ``x = x_hi + x_lo``
      split into bfloat16 halves (three passes; relative error ~1e-5, as
      XLA's ``HIGH``; Mosaic has no such contract precision);
    * ``HIGHEST``: float32 operands at Mosaic's ``fp32`` contract precision
      (~1e-7 relative on a v5e).
    """
    def product(x, y, prec=None):
        return jax.lax.dot_general(x, y, dimension_numbers, precision=prec, preferred_element_type=out_dtype)

    if np.dtype(a.dtype) != _F32 and np.dtype(b.dtype) != _F32:
        return product(a, b)
    if precision == HIGHEST:
        return product(a.astype(jnp.float32), b.astype(jnp.float32), HIGHEST)
    if precision == HIGH:
        a_hi, a_lo = _split_bf16(a.astype(jnp.float32))
        b_hi, b_lo = _split_bf16(b.astype(jnp.float32))
        return product(a_lo, b_hi) + product(a_hi, b_lo) + product(a_hi, b_hi)
    return product(a.astype(_BF16), b.astype(_BF16))
