"""What the gated linear unit implementations share: the argument checks, the cost models and
the backend table (one row per backend; its kernel module provides ``glu_forward`` and
``glu_backward``)."""

from __future__ import annotations

import numpy as np

from ...core import Call
from ...core import checks
from ...core.backends import Backend, BackendTable, Tuning
from ...core.precision import resolve_precision
from . import mosaic_tpu as mosaic_tpu_kernels
from . import triton as triton_kernels
from . import xla as xla_kernels
from .activations import ACTIVATIONS
from .configs import (GluConfig, GluTpuConfig, glu_heuristic, glu_space, glu_tpu_defers_to_xla, glu_tpu_heuristic,
                      glu_tpu_requirements, glu_tpu_space)


def _check_activation(activation):
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)} or a callable, got {activation!r}")
    return activation


def _check_weights(weights, features: int, x):
    """Canonical ``(w_gate, w_up)``: ``([K, 2, N], None)`` or two ``[K, N]``."""
    if isinstance(weights, (tuple, list)):
        if len(weights) != 2:
            raise ValueError(f"weights: expected a [K, 2, N] array or a pair of [K, N] arrays, got a sequence of "
                             f"{len(weights)}")
        w_gate = checks.require_float("weights[0]", weights[0])
        w_up = checks.require_float("weights[1]", weights[1])
        checks.require_ndim("weights[0]", w_gate, 2)
        checks.require_shape("weights[0]", w_gate, (features, None), "x.shape[-1], N")
        checks.require_shape("weights[1]", w_up, w_gate.shape, "the shape of weights[0]")
        checks.require_same_dtype("weights[1]", w_up, "weights[0]", w_gate)
    else:
        w_gate = checks.require_float("weights", weights)
        checks.require_ndim("weights", w_gate, 3)
        checks.require_shape("weights", w_gate, (features, 2, None), "x.shape[-1], 2, N")
        w_up = None
    # No silent promotion: the weights have x's dtype.
    checks.require_same_dtype("weights" if w_up is None else "weights[0]", w_gate, "x", x)
    return w_gate, w_up


def check_glu(x, weights, *, activation="silu", precision=None) -> Call:
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    w_gate, w_up = _check_weights(weights, x.shape[-1], x)
    return Call({"x": x, "w_gate": w_gate, "w_up": w_up},
                {"activation": _check_activation(activation), "precision": resolve_precision(precision)})


def check_backward(dy, x, w_gate, w_up=None, gate=None, up=None, *, activation="silu", precision=None) -> Call:
    """``gate``/``up``: the forward's ``x @ Wg`` and ``x @ Wu`` (``[M, N]``, both or neither); given,
    the backward starts from them instead of recomputing them."""
    x = checks.require_float("x", x)
    checks.require_ndim("x", x, 2)
    weights = (w_gate, w_up) if w_up is not None else w_gate
    w_gate, w_up = _check_weights(weights, x.shape[1], x)
    n = w_gate.shape[-1]
    checks.require_shape("dy", dy, (x.shape[0], n), "x.shape[0], N")
    if (gate is None) != (up is None):
        raise ValueError(f"gate, up: pass both pre-activations or neither, got gate={'None' if gate is None else 'an array'}"
                         f" and up={'None' if up is None else 'an array'}")
    if gate is not None:
        gate, up = checks.require_float("gate", gate), checks.require_float("up", up)
        checks.require_shape("gate", gate, (x.shape[0], n), "x.shape[0], N")
        checks.require_shape("up", up, (x.shape[0], n), "x.shape[0], N")
    return Call({"dy": dy, "x": x, "w_gate": w_gate, "w_up": w_up, "gate": gate, "up": up},
                {"activation": _check_activation(activation), "precision": resolve_precision(precision)})


def _dims(call: Call):
    k = call.x.shape[-1]
    m = int(np.prod(call.x.shape[:-1]))
    return m, k, call.w_gate.shape[-1]


def forward_flops(call: Call) -> float:
    m, k, n = _dims(call)
    return 2.0 * m * k * (2 * n) + 3.0 * m * n


def forward_bytes(call: Call) -> float:
    m, k, n = _dims(call)
    xs, ws = np.dtype(call.x.dtype).itemsize, np.dtype(call.w_gate.dtype).itemsize
    return float(m * k * xs + 2 * k * n * ws + m * n * xs)


def backward_flops(call: Call) -> float:
    m, k, n = _dims(call)
    passes = 2 if call.gate is not None else 3  # (recompute +) dx + dW
    return passes * 2.0 * m * k * (2 * n)


def backward_bytes(call: Call) -> float:
    m, k, n = _dims(call)
    xs, ws = np.dtype(call.x.dtype).itemsize, np.dtype(call.w_gate.dtype).itemsize
    saved = 0 if call.gate is None else 2 * m * n * np.dtype(call.gate.dtype).itemsize
    return float(2 * m * k * xs + 4 * k * n * ws + 5 * m * n * xs + saved)


BACKENDS = BackendTable("glu", [
    Backend("mosaic_tpu", mosaic_tpu_kernels, "mosaic_tpu",
            Tuning(GluTpuConfig, glu_tpu_heuristic, glu_tpu_space, glu_tpu_requirements, glu_tpu_defers_to_xla)),
    Backend("triton", triton_kernels, "triton", Tuning(GluConfig, glu_heuristic, glu_space)),
    Backend("xla", xla_kernels),
])
