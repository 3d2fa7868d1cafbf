"""Public gated linear unit API: `gated_linear_unit` and its backward op."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ...core import Call, backward_implementation
from ...core import vjp
from ...core.backends import Backend
from .base import (BACKENDS, backward_bytes, backward_flops, check_backward, check_glu, forward_bytes,
                   forward_flops)
from .examples import backward_examples, benchmarks, forward_examples
from .reference import glu_backward_reference, glu_reference


def _run_backward(backend: Backend, call: Call, config):
    preactivations = None if call.gate is None else (call.gate, call.up)
    return backend.kernels.glu_backward(call.dy, call.x, call.w_gate, call.w_up, activation=call.activation,
                                        precision=call.precision, config=config, preactivations=preactivations)


gated_linear_unit_backward_op = BACKENDS.op(
    "gated_linear_unit_backward", _run_backward, backward=True, check=check_backward, reference=glu_backward_reference,
    flops=backward_flops, bytes_accessed=backward_bytes, examples=backward_examples)


@dataclasses.dataclass(frozen=True)
class _Glu:
    """The fused GLU of rows ``x [M, K]`` by one backend (a `core.vjp` rule): operands
    ``(x, w_gate, w_up | None)``, output ``[M, N]``. Differentiated, the forward also keeps
    ``gate = x @ Wg`` and ``up = x @ Wu`` (``[M, N]`` each, in x's dtype, as the plain ``jnp``
    version keeps its matmul outputs), so the backward does the two gradient matmuls only;
    under `jax.checkpoint` they are recomputed with the forward like any residual."""

    backend: Backend
    config: Any
    activation: Any
    precision: Any

    def _forward(self, x, w_gate, w_up, save: bool):
        return self.backend.kernels.glu_forward(x, w_gate, w_up, config=self.config, activation=self.activation,
                                                precision=self.precision, save_preactivations=save)

    def primal(self, x, w_gate, w_up):
        return self._forward(x, w_gate, w_up, False)

    def forward(self, x, w_gate, w_up):
        y, (gate, up) = self._forward(x, w_gate, w_up, True)
        return y, (x, w_gate, w_up, gate, up)

    def backward(self, residuals, dy):
        return gated_linear_unit_backward_op(
            dy, *residuals, activation=self.activation, precision=self.precision,
            implementation=backward_implementation(gated_linear_unit_backward_op, self.backend.name))


def _run_forward(backend: Backend, call: Call, config):
    x = call.x
    lead, k = x.shape[:-1], x.shape[-1]
    if x.size == 0:  # no rows: an empty output; K = 0: both projections are 0, so act(0)·0 = 0
        return jax.numpy.zeros((*lead, call.w_gate.shape[-1]), x.dtype)
    rule = _Glu(backend, config, call.activation, call.precision)
    y = vjp.apply(rule, x.reshape(-1, k), call.w_gate, call.w_up)
    return y.reshape(*lead, y.shape[-1])


gated_linear_unit_op = BACKENDS.op(
    "gated_linear_unit", _run_forward, check=check_glu, reference=glu_reference, flops=forward_flops,
    bytes_accessed=forward_bytes, examples=forward_examples, benchmarks=benchmarks,
    differentiable=("x", "w_gate", "w_up"))


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
