"""Public loss API: `linear_cross_entropy` (a fused language-model head + cross-entropy)
and its backward op."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from ...core import Call, backward_implementation
from ...core import vjp
from ...core.backends import Backend
from .base import BACKENDS, backward_bytes, backward_flops, check_backward, check_forward, forward_bytes, forward_flops
from .examples import backward_examples, benchmarks, forward_examples
from .reduction import Loss, coefficients, count, outputs, reduced, token_scale
from .reference import linear_cross_entropy_backward_reference, linear_cross_entropy_reference


# -- backward op ---------------------------------------------------------------------------------
def _run_backward(backend: Backend, call: Call, config):
    dx, dw = backend.kernels.backward(call.x, call.w, call.labels, call.lse, call.softmax_coef, call.target_coef,
                                      call.uniform_coef, transpose_w=call.transpose_w,
                                      logit_soft_cap=call.logit_soft_cap, precision=call.precision, config=config)
    return dx.astype(call.x.dtype), dw.astype(call.w.dtype)


linear_cross_entropy_backward_op = BACKENDS.op(
    "linear_cross_entropy_backward", _run_backward, backward=True, check=check_backward,
    reference=linear_cross_entropy_backward_reference, flops=backward_flops, bytes_accessed=backward_bytes,
    examples=backward_examples)


# -- forward op ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _CrossEntropy:
    """Linear cross-entropy of token rows by one backend (a `core.vjp` rule): operands
    ``(x [T, D], w, labels [T])``; outputs ``(loss, lse [T], z_loss)`` (reduced as ``loss`` says).
    Differentiated by the backward op, or, for a scalar loss on a backend whose kernels have
    ``fused_forward_backward``, by the gradients of a unit cotangent the forward sweep computes."""

    backend: Backend
    config: Any
    loss: Loss
    transpose_w: bool
    logit_soft_cap: float | None
    precision: Any
    dtype: str

    def _options(self) -> dict:
        return dict(transpose_w=self.transpose_w, logit_soft_cap=self.logit_soft_cap, precision=self.precision)

    def primal(self, x, w, labels):
        stats = self.backend.kernels.forward_stats(x, w, labels, config=self.config, **self._options())
        return reduced(self.loss, *stats, labels)

    def forward(self, x, w, labels):
        fused = getattr(self.backend.kernels, "fused_forward_backward", None) if self.loss.scalar_only else None
        if fused is None:
            stats = self.backend.kernels.forward_stats(x, w, labels, config=self.config, **self._options())
            return reduced(self.loss, *stats, labels), (x, w, labels, stats[0], None, None)
        denominator = count(self.loss, labels)

        def unit(lse_c, labels_c, rows_c):  # one token chunk's coefficients of a unit cotangent
            scale = token_scale(self.loss, labels_c, denominator) * rows_c.astype(jnp.float32)
            return coefficients(self.loss, scale, lse_c, jnp.ones((), jnp.float32), None, None)
        stats, (dx, dw) = fused(x, w, labels, unit, config=self.config, **self._options())
        return reduced(self.loss, *stats, labels), (None, None, labels, None, dx, dw)

    def backward(self, residuals, cotangents):
        x, w, labels, lse, dx, dw = residuals
        d_loss, d_lse, d_z = cotangents
        if dx is not None:  # fused: gradients of a unit cotangent (float32 or the operands' dtype), scaled
            scale = d_loss.astype(jnp.float32)
            return (dx * scale).astype(self.dtype), (dw * scale).astype(self.dtype), None
        a, b, e = coefficients(self.loss, token_scale(self.loss, labels), lse, d_loss, d_lse, d_z)
        dx, dw = linear_cross_entropy_backward_op(
            x, w, labels, lse, a, b, e, **self._options(),
            implementation=backward_implementation(linear_cross_entropy_backward_op, self.backend.name))
        return dx, dw, None


def _run_forward(backend: Backend, call: Call, config):
    loss = Loss.of(call)
    rule = _CrossEntropy(backend, config, loss, call.transpose_w, call.logit_soft_cap, call.precision,
                         np.dtype(call.x.dtype).name)
    return outputs(loss, *vjp.apply(rule, call.x.reshape(-1, call.x.shape[-1]), call.w, call.labels.reshape(-1)))


linear_cross_entropy_op = BACKENDS.op(
    "linear_cross_entropy", _run_forward, check=check_forward, reference=linear_cross_entropy_reference,
    flops=forward_flops, bytes_accessed=forward_bytes, examples=forward_examples, benchmarks=benchmarks,
    differentiable=("x", "w"))


def linear_cross_entropy(x, w, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_soft_cap=None,
                         reduction="mean", transpose_w=False, return_lse=False, return_z_loss=False,
                         precision=None, implementation=None, config=None):
    """Cross-entropy of ``softmax(x @ w)`` against integer labels, without the ``[T, V]`` logits.

    Args:
      x: ``[..., D]`` float32/bfloat16/float16 hidden states (``T`` = the product of the
        leading sizes).
      w: ``[D, V]`` (``[V, D]`` with ``transpose_w=True``, e.g. a Hugging Face
        ``lm_head.weight``), the same dtype as ``x``.
      labels: ``[...]`` integers in ``[0, V)`` or ``ignore_index``. Concrete labels are
        checked; under ``jit`` an out-of-range label gives a NaN loss.
      ignore_index: label value whose token contributes nothing (and is not counted by "mean").
      label_smoothing: ε in ``[0, 1)``: the target is ``(1 − ε)·onehot + ε/V`` (as
        ``torch.nn.functional.cross_entropy(label_smoothing=ε)``).
      z_loss: λ ≥ 0: adds ``λ·lse²`` per token (PaLM's z-loss) to the loss.
      logit_soft_cap: ``cap`` > 0: logits ``cap·tanh(z / cap)`` (Gemma 2), or None.
      reduction: ``"mean"`` over the non-ignored tokens (0 when there are none),
        ``"sum"``, or ``"none"`` (per token, shape ``labels.shape``, 0 at ignored tokens).
      transpose_w: ``w`` is ``[V, D]``.
      return_lse: also return the log-sum-exp ``[...]`` float32 of every token.
      return_z_loss: also return the z-loss part ``λ·lse²``, reduced like the loss
        (already included in the loss).
      precision: of the float32 matmuls (logits, ``dx``, ``dw``): ``None`` (float32-accurate
        unless `jax.default_matmul_precision` is set), ``"default"``, ``"high"``,
        ``"highest"`` or a `jax.lax.Precision`; see `stellax.core.precision`.
      implementation: ``None`` (best available: ``"mosaic_tpu"`` on a TPU, ``"triton"``
        on a GPU, else ``"xla_chunked"``), ``"mosaic_tpu"`` (Pallas Mosaic TPU kernels,
        `mosaic_tpu.py`), ``"triton"`` (Pallas Triton kernels, `triton.py`),
        ``"xla_chunked"`` (memory-linear XLA, `xla_chunked.py`), ``"xla"`` (the naive
        formula, materializes the logits, `xla.py`) or a sequence tried in order.
      config: a `LossTpuConfig` (``mosaic_tpu``), `LinearCrossEntropyConfig` (``triton``) or
        `ChunkedConfig` (``xla_chunked``); ``xla`` takes none.

    Returns:
      ``loss`` float32 (a scalar, or ``[...]`` for ``reduction="none"``); with
      ``return_lse`` / ``return_z_loss``, the tuple ``(loss, lse, z_loss)`` of those asked for.

    Math (per token, float32 accumulation; ``c = x @ w``, soft-capped)::

        lse  = log Σ_j exp(c_j)
        loss = lse − (1 − ε)·c_label − (ε / V)·Σ_j c_j + λ·lse²

    The gradients for ``x`` and ``w`` (custom VJP): ``dc = a·softmax(c) + b·onehot + e``
    per token, ``dz = dc·(1 − (c/cap)²)``, ``dx = dz @ wᵀ``, ``dw = xᵀ @ dz``. For a scalar
    loss (``"mean"``/``"sum"``, no ``lse``/z-loss outputs) ``xla_chunked`` and ``mosaic_tpu``
    compute them in the forward sweep from each logits tile once (three matmuls in all);
    per-token cotangents go through the backward op, which recomputes the logits.
    """
    return linear_cross_entropy_op(x, w, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   z_loss=z_loss, logit_soft_cap=logit_soft_cap, reduction=reduction,
                                   transpose_w=transpose_w, return_lse=return_lse, return_z_loss=return_z_loss,
                                   precision=precision, implementation=implementation, config=config)
