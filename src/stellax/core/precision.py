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


_F32 = np.dtype(jnp.float32)
_BF16 = jnp.bfloat16


# -- float32 exp, log and softplus ---------------------------------------------------------------
# A TPU's own float32 transcendental functions are approximations. Measured on a v5e (XLA and Mosaic
# alike, against float64; benchmarks/tpu_float32_diagnosis.py): exp up to 5.4e-6 relative, log 6.5e-6
# rms (3e-4 near 1), tanh 8e-5. A row's log-sum-exp carries the log's error into every probability
# of the row alike, so softmax gradients and losses built on it missed float32's 1e-5 by 1.5-3x. The
# functions below are written with multiplies, adds and exponent bit manipulation, which a TPU
# computes exactly as IEEE float32, so they are float32-accurate (< 2e-7 relative) on every chip.
_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375      # ln 2 to 12 significant bits: e·_LN2_HI is exact for |e| < 2^12
_LN2_LO = -2.12194440e-4   # ln 2 - _LN2_HI
#: 1/n! for n = 7..2: exp(r) on |r| <= ln2/2 to below float32's ulp (remainder |r|^8/8! < 6e-9).
_EXP_TAYLOR = tuple(1.0 / float(np.prod(np.arange(1, n + 1))) for n in range(7, 1, -1))
_EXP_MIN, _EXP_MAX = -87.33, 88.7228  # exp underflows to float32 zero below, overflows above
_SQRT2 = 1.4142135623730951


def _reciprocal(d):
    """``1/d`` refined by one Newton step (the hardware's float32 division may be approximate)."""
    r = 1.0 / d
    return r * (2.0 - d * r)


def _pow2(k):
    """``2^k`` for integral float32 ``k`` in [-126, 127], built from its exponent bits."""
    return jax.lax.bitcast_convert_type(jax.lax.shift_left(k.astype(jnp.int32) + 127, jnp.int32(23)), jnp.float32)


def _exp(x):
    """The value of `float32_exp` (its derivative rule aside)."""
    x = jnp.asarray(x, jnp.float32)
    clipped = jnp.clip(x, _EXP_MIN, _EXP_MAX)
    k = jnp.floor(clipped * jnp.float32(_LOG2E) + jnp.float32(0.5))
    r = (clipped - k * jnp.float32(_LN2_HI)) - k * jnp.float32(_LN2_LO)
    poly = jnp.full_like(r, _EXP_TAYLOR[0])
    for c in _EXP_TAYLOR[1:]:
        poly = poly * r + jnp.float32(c)
    exp_r = (poly * r + 1.0) * r + 1.0
    # k reaches 128 at the top of the range, past float32's largest power of two: scale by 2^127
    # and double the remainder there.
    k_low = jnp.minimum(k, 127.0)
    y = (exp_r * (1.0 + (k - k_low))) * _pow2(k_low)
    y = jnp.where(x > _EXP_MAX, jnp.inf, y)
    y = jnp.where(x < _EXP_MIN, 0.0, y)
    return jnp.where(jnp.isnan(x), x, y)


def _log(x):
    """The value of `float32_log` (its derivative rule aside)."""
    x = jnp.asarray(x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    biased = jax.lax.shift_right_logical(bits, jnp.int32(23)) & 0xFF
    # x = 2^e · m with m in [sqrt(1/2), sqrt(2)): f = m - 1 is exact, log m = 2·atanh(f / (2 + f)).
    m = jax.lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)
    big = m > _SQRT2
    m = jnp.where(big, 0.5 * m, m)
    e = (biased - 127).astype(jnp.float32) + big.astype(jnp.float32)
    f = m - 1.0
    s = f * _reciprocal(2.0 + f)
    s2 = s * s
    # atanh(s)/s = 1 + s²/3 + s⁴/5 + ...; |s| < 0.172, so terms past s⁸/9 are below 2e-9.
    series = (((s2 * (1.0 / 9.0) + 1.0 / 7.0) * s2 + 1.0 / 5.0) * s2 + 1.0 / 3.0) * s2
    log_m = 2.0 * s + 2.0 * s * series
    y = e * jnp.float32(_LN2_HI) + (log_m + e * jnp.float32(_LN2_LO))
    y = jnp.where(biased == 0, -jnp.inf, y)          # zero (and subnormals, which a TPU flushes)
    y = jnp.where(x == jnp.inf, jnp.inf, y)
    return jnp.where((x < 0) | jnp.isnan(x), jnp.nan, y)


@jax.custom_jvp
def float32_exp(x):
    """``exp(x)`` of float32 ``x`` to < 2e-7 relative on every device (a TPU's own
    ``exp`` is off by up to 5.4e-6). ``-inf`` gives 0, NaN gives NaN, values past
    float32's range give 0 or ``inf``. Differentiable (``d exp = exp · dx``)."""
    return _exp(x)


@float32_exp.defjvp
def _float32_exp_jvp(primals, tangents):
    y = float32_exp(primals[0])
    return y, y * tangents[0]


@jax.custom_jvp
def float32_log(x):
    """``log(x)`` of float32 ``x`` to < 2e-7 relative (away from ``x = 1``, where
    the absolute error is < 1e-7) on every device; a TPU's own ``log`` is off by
    6.5e-6 rms. 0 gives ``-inf``, negative or NaN gives NaN. Differentiable."""
    return _log(x)


@float32_log.defjvp
def _float32_log_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return float32_log(x), dx / x


def _log1p_unit(y):
    """``log(1 + y)`` for ``y`` in [0, 1], relative-accurate for tiny ``y`` too: ``2·atanh(s)``
    with ``s = y / (2 + y) <= 1/3`` (no ``(1 + y) - 1``, which compilers may fold to ``y``)."""
    s = y * _reciprocal(2.0 + y)
    s2 = s * s
    series = jnp.full_like(s, 1.0 / 15.0)
    for n in (13, 11, 9, 7, 5, 3, 1):  # Σ s^(2i)/(2i+1), remainder (1/3)^16/17 < 2e-9
        series = series * s2 + 1.0 / n
    return 2.0 * s * series


@jax.custom_jvp
def float32_softplus(x):
    """``softplus(x) = log(1 + exp(x))`` of float32 ``x``, float32-accurate on every
    device (`jax.nn.softplus` on a TPU inherits its ``log``'s 6.5e-6 error), as
    ``max(x, 0) + log1p(exp(-|x|))``. Differentiable (``d = sigmoid(x)·dx``)."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.maximum(x, 0.0) + _log1p_unit(_exp(-jnp.abs(x)))


@float32_softplus.defjvp
def _float32_softplus_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    x = jnp.asarray(x, jnp.float32)
    e = _exp(-jnp.abs(x))
    sigmoid = jnp.where(x >= 0, 1.0, e) * _reciprocal(1.0 + e)
    return float32_softplus(x), sigmoid * dx


#: Taylor coefficients of tanh(x)/x in x²: 1, -1/3, 2/15, -17/315, 62/2835, -1382/155925, 21844/6081075.
_TANH_TAYLOR = (1.0, -1.0 / 3, 2.0 / 15, -17.0 / 315, 62.0 / 2835, -1382.0 / 155925, 21844.0 / 6081075)
_TANH_SERIES_BELOW = 0.4  # the series' remainder there is < 1e-7 relative; above, 1 - e^{-2|x|} cannot cancel


def _tanh(x):
    """The value of `float32_tanh` (its derivative rule aside)."""
    x = jnp.asarray(x, jnp.float32)
    a = jnp.abs(x)
    x2 = x * x
    series = jnp.full_like(x, _TANH_TAYLOR[-1])
    for c in _TANH_TAYLOR[-2::-1]:
        series = series * x2 + c
    e = _exp(-2.0 * a)
    large = (1.0 - e) * _reciprocal(1.0 + e)
    y = jnp.where(a < _TANH_SERIES_BELOW, x * series, jnp.where(x < 0, -large, large))
    return jnp.where(jnp.isnan(x), x, y)


@jax.custom_jvp
def float32_tanh(x):
    """``tanh(x)`` of float32 ``x`` to < 3e-7 relative on every device (a TPU's own
    ``tanh`` is off by up to 8e-5): a series below |x| = 0.4, ``(1 - e^{-2|x|}) /
    (1 + e^{-2|x|})`` above. Differentiable (``d = (1 - tanh²)·dx``)."""
    return _tanh(x)


@float32_tanh.defjvp
def _float32_tanh_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    # 1 - tanh² as 4e/(1 + e)², e = exp(-2|x|): no cancellation where tanh is near ±1
    e = _exp(-2.0 * jnp.abs(jnp.asarray(x, jnp.float32)))
    r = _reciprocal(1.0 + e)
    return float32_tanh(x), 4.0 * e * r * r * dx


def accurate_functions(dtype, precision: Any) -> bool:
    """Whether elementwise ``tanh`` (a soft cap) over operands of ``dtype`` contracted at
    ``precision`` uses `float32_tanh`: float32 operands at ``HIGHEST`` (resolved as
    `resolve_precision` does); lower precisions keep the hardware's faster function.
    Per-row logs (a log-sum-exp): `float32_logsumexp` always takes `float32_log`; the Mosaic TPU
    attention kernels take it by this rule (else the hardware's log, ~6.5e-6 relative)."""
    return np.dtype(dtype) == _F32 and resolve_precision(precision) == HIGHEST


def soft_cap_tanh(dtype, precision: Any):
    """The ``tanh`` of a soft cap ``cap·tanh(s / cap)`` over operands of ``dtype`` contracted at
    ``precision``: `float32_tanh` where `accurate_functions` says so (float32 at ``HIGHEST``),
    else `jax.numpy.tanh` (the hardware's, faster). Works inside Pallas kernel bodies too."""
    return float32_tanh if accurate_functions(dtype, precision) else jnp.tanh


def soft_cap(s, cap: float | None, dtype=_F32, precision: Any = HIGHEST):
    """``cap·tanh(s / cap)`` of float32 logits ``s`` (``s`` itself when ``cap`` is None), with the
    `soft_cap_tanh` of operands of ``dtype`` at ``precision`` (by default `float32_tanh`: the golden's)."""
    if cap is None:
        return s
    return cap * soft_cap_tanh(dtype, precision)(s * (1.0 / cap))


#: `float32_tanh` under its former name (the functions with derivative rules run inside Pallas
#: kernel bodies, interpreted and lowered by Mosaic alike); use `soft_cap_tanh` or `float32_tanh`.
float32_tanh_raw = float32_tanh


def float32_logsumexp(x, axis: int = -1):
    """``log Σ exp(x)`` over ``axis`` of float32 ``x`` with `float32_log` for the
    row's log (the exp errors of single terms average out in the sum; the log's
    would not). A row of ``-inf`` gives ``-inf``. Differentiable (softmax)."""
    x = jnp.asarray(x, jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(x - m), axis=axis)
    return jnp.squeeze(m, axis) + float32_log(total)


# -- float32 contractions inside Mosaic TPU kernels -------------------------------------------

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
