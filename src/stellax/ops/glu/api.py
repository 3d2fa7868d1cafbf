"""Public gated linear unit API: `gated_linear_unit` and its backward op."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ...core import Call, Op, backward_implementation, register
from ...core import checks, vjp
from ...core.backends import Backend, BackendTable, Tuning
from ...core.precision import resolve_precision
from . import mosaic_tpu as mosaic_tpu_kernels
from . import triton as triton_kernels
from . import xla as xla_kernels
from .activations import ACTIVATIONS
from .configs import (GluConfig, GluTpuConfig, glu_heuristic, glu_space, glu_tpu_heuristic, glu_tpu_requirements,
                      glu_tpu_space)
from .examples import backward_examples, benchmarks, forward_examples
from .reference import glu_backward_reference, glu_reference

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


def _check_glu(x, weights, *, activation="silu", precision=None) -> Call:
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    w_gate, w_up = _check_weights(weights, x.shape[-1], x)
    return Call({"x": x, "w_gate": w_gate, "w_up": w_up},
                {"activation": _check_activation(activation), "precision": resolve_precision(precision)})


def _check_backward(dy, x, w_gate, w_up=None, *, activation="silu", precision=None) -> Call:
    x = checks.require_float("x", x)
    checks.require_ndim("x", x, 2)
    weights = (w_gate, w_up) if w_up is not None else w_gate
    w_gate, w_up = _check_weights(weights, x.shape[1], x)
    n = w_gate.shape[-1]
    checks.require_shape("dy", dy, (x.shape[0], n), "x.shape[0], N")
    return Call({"dy": dy, "x": x, "w_gate": w_gate, "w_up": w_up},
                {"activation": _check_activation(activation), "precision": resolve_precision(precision)})


def _dims(call: Call):
    k = call.x.shape[-1]
    m = int(np.prod(call.x.shape[:-1]))
    return m, k, call.w_gate.shape[-1]


def _flops(call: Call) -> float:
    m, k, n = _dims(call)
    return 2.0 * m * k * (2 * n) + 3.0 * m * n


def _bytes(call: Call) -> float:
    m, k, n = _dims(call)
    xs, ws = np.dtype(call.x.dtype).itemsize, np.dtype(call.w_gate.dtype).itemsize
    return float(m * k * xs + 2 * k * n * ws + m * n * xs)


def _backward_flops(call: Call) -> float:
    m, k, n = _dims(call)
    return 3 * 2.0 * m * k * (2 * n)  # recompute + dx + dW


def _backward_bytes(call: Call) -> float:
    m, k, n = _dims(call)
    xs, ws = np.dtype(call.x.dtype).itemsize, np.dtype(call.w_gate.dtype).itemsize
    return float(2 * m * k * xs + 4 * k * n * ws + 5 * m * n * xs)


BACKENDS = BackendTable("glu", [
    Backend("mosaic_tpu", mosaic_tpu_kernels, "mosaic_tpu",
            Tuning(GluTpuConfig, glu_tpu_heuristic, glu_tpu_space, glu_tpu_requirements)),
    Backend("triton", triton_kernels, "triton", Tuning(GluConfig, glu_heuristic, glu_space)),
    Backend("xla", xla_kernels),
])


def _run_backward(backend: Backend, call: Call, config):
    return backend.kernels.glu_backward(call.dy, call.x, call.w_gate, call.w_up, activation=call.activation,
                                        precision=call.precision, config=config)


gated_linear_unit_backward_op = register(Op(
    "gated_linear_unit_backward",
    family="glu",
    check=_check_backward,
    reference=glu_backward_reference,
    implementations=BACKENDS.backward(_run_backward),
    flops=_backward_flops,
    bytes_accessed=_backward_bytes,
    examples=backward_examples,
))


@dataclasses.dataclass(frozen=True)
class _Glu:
    """The fused GLU of rows ``x [M, K]`` by one backend (a `core.vjp` rule): operands
    ``(x, w_gate, w_up | None)``, output ``[M, N]``."""

    backend: Backend
    config: Any
    activation: Any
    precision: Any

    def forward(self, x, w_gate, w_up):
        y = self.backend.kernels.glu_forward(x, w_gate, w_up, config=self.config, activation=self.activation,
                                             precision=self.precision)
        return y, (x, w_gate, w_up)

    def backward(self, residuals, dy):
        x, w_gate, w_up = residuals
        return gated_linear_unit_backward_op(
            dy, x, w_gate, w_up, activation=self.activation, precision=self.precision,
            implementation=backward_implementation(gated_linear_unit_backward_op, self.backend.name))


def _run_forward(backend: Backend, call: Call, config):
    x = call.x
    lead, k = x.shape[:-1], x.shape[-1]
    if x.size == 0:  # no rows: an empty output; K = 0: both projections are 0, so act(0)·0 = 0
        return jax.numpy.zeros((*lead, call.w_gate.shape[-1]), x.dtype)
    rule = _Glu(backend, config, call.activation, call.precision)
    y = vjp.apply(rule, x.reshape(-1, k), call.w_gate, call.w_up)
    return y.reshape(*lead, y.shape[-1])


gated_linear_unit_op = register(Op(
    "gated_linear_unit",
    family="glu",
    check=_check_glu,
    reference=glu_reference,
    implementations=BACKENDS.forward(_run_forward),
    flops=_flops,
    bytes_accessed=_bytes,
    examples=forward_examples,
    benchmarks=benchmarks,
    differentiable=("x", "w_gate", "w_up"),
))


def gated_linear_unit(x, weights, *, activation="silu", precision=None, implementation=None, config=None):
    """Gated linear unit: ``activation(x @ w_gate) * (x @ w_up)``, fused.

    Args:
      x: ``[..., K]`` float32/bfloat16/float16.
      weights: ``[K, 2, N]`` (``[:, 0]`` is the gate, ``[:, 1]`` the up
        projection) or a pair ``(w_gate [K, N], w_up [K, N])``, float.
      activation: ``"silu"`` (SwiGLU), ``"gelu"`` (exact, GeGLU),
        ``"gelu_tanh"``, ``"relu"`` (ReGLU), ``"sigmoid"`` (the original GLU),
        or a callable of float32 arrays (its derivative comes from JAX
        autodiff; inside Triton kernels it must use primitives Triton supports).
      precision: the float32 matmul precision, forward and backward: ``None``
        (float32-accurate unless `jax.default_matmul_precision` is set),
        ``"default"``, ``"high"``, ``"highest"`` or a `jax.lax.Precision`;
        see `stellax.core.precision` for what each means per backend.
      implementation: ``None`` (best available), ``"mosaic_tpu"``, ``"triton"``,
        ``"xla"`` or a sequence tried in order.
      config: an explicit `GluConfig` for the Triton kernels or `GluTpuConfig`
        for the Mosaic TPU kernels.

    Returns:
      ``[..., N]`` in ``x.dtype``; matmuls accumulate in float32.

    Overflow: every implementation computes ``act(x @ Wg)·(x @ Wu)`` in float32 and rounds once to
    ``x.dtype``, so the output is ``±inf`` (or ``nan`` for ``inf·0``) exactly where that float32 value is,
    or where it exceeds the range of ``x.dtype`` — never a finite clipped value. Unlike an unfused
    float16 ``jnp`` version, a gate or up projection beyond float16's range does not overflow by itself
    when the product is back in range.
    """
    return gated_linear_unit_op(x, weights, activation=activation, precision=precision,
                                implementation=implementation, config=config)
