"""Torch front end of `stellax.linear_cross_entropy` (a fused LM head + cross-entropy)."""

from __future__ import annotations

import torch
from jax import Array

import stellax

from .options import precision_name
from .registry import define_op


def _linear_cross_entropy(x: Array, w: Array, labels: Array, *, ignore_index: int, label_smoothing: float,
                          z_loss: float, logit_soft_cap: float | None, reduction: str, transpose_w: bool,
                          precision: str | None, implementation: str | None) -> Array:
    return stellax.linear_cross_entropy(x, w, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                        z_loss=z_loss, logit_soft_cap=logit_soft_cap, reduction=reduction,
                                        transpose_w=transpose_w, precision=precision, implementation=implementation)


def _check_labels(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels: expected values in [0, {vocab}) (V, the vocabulary size of w) or "
                         f"ignore_index={ignore_index}, got {int(labels[bad].reshape(-1)[0])} "
                         f"({int(bad.sum())} labels out of range)")


linear_cross_entropy_op = define_op("linear_cross_entropy", _linear_cross_entropy)


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, logit_soft_cap: float | None = None,
                         reduction: str = "mean", transpose_w: bool = False, precision=None,
                         implementation: str | None = None) -> torch.Tensor:
    """`stellax.linear_cross_entropy` on torch tensors: the cross-entropy of
    ``softmax(x @ w)`` against ``labels`` without building the ``[T, V]`` logits.

    ``x [..., D]`` float32/bfloat16/float16, ``w [D, V]`` — or, for a Hugging Face
    ``lm_head.weight`` (``[V, D]``), pass it with ``transpose_w=True`` — and integer
    ``labels [...]`` (``ignore_index`` tokens contribute nothing). Options as in the JAX
    function: ``label_smoothing`` (as ``torch.nn.functional.cross_entropy``), ``z_loss``
    (``λ·lse²`` added per token), ``logit_soft_cap``, ``reduction`` ``"mean"`` (over the
    non-ignored tokens; 0, not NaN, when every token is ignored) / ``"sum"`` / ``"none"``;
    ``precision`` of the float32 matmuls (``None`` or a `jax.lax.Precision` / its name,
    see `stellax.core.precision`).
    Returns a float32 scalar (``[...]`` for ``"none"``); differentiable in ``x`` and ``w``
    (autograd through the JAX VJP), and traceable by ``torch.compile(fullgraph=True)``.

    Labels outside ``[0, V)`` (other than ``ignore_index``) raise ``ValueError`` when called
    eagerly; under ``torch.compile`` they are not checked and give a NaN loss.
    """
    if not torch.compiler.is_compiling():
        _check_labels(labels, w.shape[0] if transpose_w else w.shape[-1], int(ignore_index))
    return linear_cross_entropy_op(x, w, labels, int(ignore_index), float(label_smoothing), float(z_loss),
                                   None if logit_soft_cap is None else float(logit_soft_cap), str(reduction),
                                   bool(transpose_w), precision_name(precision), implementation)
