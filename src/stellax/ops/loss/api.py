"""Public loss API: `linear_cross_entropy` (a fused language-model head + cross-entropy)
and its backward op."""

from __future__ import annotations

from ...core import Implementation, Op, register
from . import triton as triton_kernels
from . import xla as xla_kernels
from .base import (backward_bytes, backward_flops, backward_runner, check_backward, check_forward, forward_bytes,
                   forward_flops, forward_runner)
from .configs import (ChunkedConfig, LinearCrossEntropyConfig, chunked_heuristic, chunked_space, triton_heuristic,
                      triton_space)
from .examples import backward_examples, benchmarks, forward_examples
from .reference import linear_cross_entropy_backward_reference, linear_cross_entropy_reference


def _implementations(runner):
    return [
        Implementation("triton", runner(triton_kernels.kernels, "triton"), backend="triton",
                       config_type=LinearCrossEntropyConfig, heuristic=triton_heuristic, space=triton_space),
        Implementation("xla_chunked", runner(xla_kernels.chunked, "xla_chunked"), config_type=ChunkedConfig,
                       heuristic=chunked_heuristic, space=chunked_space),
        Implementation("xla", runner(xla_kernels.naive, "xla")),
    ]


linear_cross_entropy_backward_op = register(Op(
    "linear_cross_entropy_backward",
    family="loss",
    check=check_backward,
    reference=linear_cross_entropy_backward_reference,
    implementations=_implementations(lambda kernels, name: backward_runner(kernels)),
    flops=backward_flops,
    bytes_accessed=backward_bytes,
    examples=backward_examples,
))


linear_cross_entropy_op = register(Op(
    "linear_cross_entropy",
    family="loss",
    check=check_forward,
    reference=linear_cross_entropy_reference,
    implementations=_implementations(
        lambda kernels, name: forward_runner(kernels, name, linear_cross_entropy_backward_op)),
    flops=forward_flops,
    bytes_accessed=forward_bytes,
    examples=forward_examples,
    benchmarks=benchmarks,
    differentiable=("x", "w"),
))


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
      implementation: ``None`` (best available: ``"triton"`` on a GPU, else
        ``"xla_chunked"``), ``"triton"``, ``"xla_chunked"``, ``"xla"`` (the naive formula,
        materializes the logits) or a sequence tried in order.
      config: a `ChunkedConfig` (``xla_chunked``) or `LinearCrossEntropyConfig` (``triton``).

    Returns:
      ``loss`` float32 (a scalar, or ``[...]`` for ``reduction="none"``); with
      ``return_lse`` / ``return_z_loss``, the tuple ``(loss, lse, z_loss)`` of those asked for.

    Math (per token, float32 accumulation; ``c = x @ w``, soft-capped)::

        lse  = log Σ_j exp(c_j)
        loss = lse − (1 − ε)·c_label − (ε / V)·Σ_j c_j + λ·lse²

    The gradients for ``x`` and ``w`` (custom VJP) come from the same chunked sweep:
    ``dc = a·softmax(c) + b·onehot + e`` per token, ``dx = dz @ wᵀ``, ``dw = xᵀ @ dz``.
    """
    return linear_cross_entropy_op(x, w, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   z_loss=z_loss, logit_soft_cap=logit_soft_cap, reduction=reduction,
                                   transpose_w=transpose_w, return_lse=return_lse, return_z_loss=return_z_loss,
                                   precision=precision, implementation=implementation, config=config)
