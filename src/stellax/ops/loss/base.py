"""What the linear cross-entropy implementations share: argument checks, the
cost models and the backend table (`BACKENDS`). The per-token loss, its
reductions and the cotangent → coefficient map of the backward are in
`reduction`; the `core.vjp` rule and the ops in `api`.

Every backend's kernel module (a row of `BACKENDS`: `mosaic_tpu`, `triton`,
`xla_chunked`, `xla`) provides two functions over token rows:

* ``forward_stats(x [T, D], w, labels [T], *, transpose_w, logit_soft_cap, precision, config)
  -> (lse, target, total)``, float32 ``[T]`` each (see `reference.token_stats`);
* ``backward(x, w, labels, lse, softmax_coef, target_coef, uniform_coef, *, transpose_w,
  logit_soft_cap, precision, config) -> (dx [T, D], dw)``: the VJP of
  ``F = Σ_t a_t·lse_t + b_t·c_{t,y_t} + e_t·Σ_j c_tj`` (``dc = a·softmax(c) + b·onehot(y) + e``,
  through the soft cap ``dz = dc·(1 − (c/cap)²)``, then ``dx = dz @ wᵀ``, ``dw = xᵀ @ dz``).

A module may also provide ``fused_forward_backward(x, w, labels, coefficients_of, *,
transpose_w, logit_soft_cap, precision, config) -> ((lse, target, total), (dx, dw))``: the
stats and the gradients of a scalar loss (a unit cotangent) in one sweep over token chunks,
each logits tile computed once (`xla_chunked`, `mosaic_tpu`); ``dx`` and ``dw`` come back in
float32 or in the operands' dtype, and the VJP rule scales them by the cotangent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call
from ...core import checks
from ...core.backends import Backend, BackendTable, Tuning
from ...core.precision import resolve_precision
from . import mosaic_tpu as mosaic_tpu_kernels
from . import triton as triton_kernels
from . import xla as xla_kernels
from . import xla_chunked as xla_chunked_kernels
from .configs import (ChunkedConfig, LinearCrossEntropyConfig, LossTpuConfig, chunked_heuristic, chunked_space,
                      dw_slice, loss_tpu_heuristic, loss_tpu_requirements, loss_tpu_space, tpu_chunk, tpu_tile,
                      triton_heuristic, triton_space)
from .reduction import dims

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


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """One kernel launch kind of the fused sweep, summed over its launches: MXU flops and HBM bytes."""

    name: str
    flops: float
    hbm_bytes: float

    def seconds(self, peak_flops: float, hbm_bandwidth: float) -> float:
        """Roofline time: the larger of the MXU time and the HBM time (the DMAs overlap the MXU)."""
        return max(self.flops / peak_flops, self.hbm_bytes / hbm_bandwidth)


def fused_sweep_cost(tokens: int, features: int, vocab: int, itemsize: int, config: LossTpuConfig,
                     *, transpose_w: bool = True) -> list[KernelCost]:
    """The analytic cost of the fused training sweep (`mosaic_tpu.fused_forward_backward`) per
    kernel, all chunks together (padding rows included): flops ``2·Tc·D·V`` per kernel and chunk;
    bytes as the pipelines move them —

    * logits forward: ``x`` once, the weights once per token block, the kept logits written;
    * ``dz``/``dx``: the weights once per token block, the logits read, ``dz`` written over them,
      ``dx`` (float32) written;
    * ``dw``: ``x`` once (plus XLA's transpose of it for ``[D, V]`` weights), ``dz`` once per
      hidden slice, the running ``dw`` read (after the first chunk) and written: two parts of
      ``itemsize`` (bfloat16) or one float32 (the last chunk writes no ``lo`` when there is one
      chunk).

    The per-token vectors and the running maxima (``4·128·⌈V/(128·bv)⌉`` bytes per token) are
    counted too; XLA's small ops between the kernels are not."""
    chunks, chunk = tpu_chunk(tokens, config.block_t, config.chunk_t)
    bt, bv = tpu_tile(tokens, config.block_t), tpu_tile(vocab, config.block_v)
    blocks, weights = chunk // bt, float(vocab) * features * itemsize
    kept, x_bytes = float(chunk) * vocab * itemsize, float(chunk) * features * itemsize
    tiles = -(-vocab // bv)
    maxes, vectors = float(chunk) * 4 * 128 * -(-tiles // 128), float(chunk) * 4 * 8
    flops = 2.0 * chunk * features * vocab
    slices = -(-features // dw_slice(chunk, features, bv, itemsize))
    running = 4.0 * vocab * features  # hi + lo of 2 bytes, or one float32
    dw_running = (running if chunks > 1 else weights) + (chunks - 1) * 2 * running
    transpose = 0.0 if transpose_w else 2 * x_bytes
    return [
        KernelCost("logits", chunks * flops, chunks * (x_bytes + blocks * weights + kept + maxes + vectors)),
        KernelCost("dz_dx", chunks * flops,
                   chunks * (blocks * weights + 2 * kept + maxes + vectors + chunk * features * 4.0)),
        KernelCost("dw_chunk", chunks * flops, chunks * (x_bytes + transpose + slices * kept) + dw_running),
    ]


# -- backends: one row each; its kernel module provides forward_stats / backward (see above) -----------
BACKENDS = BackendTable("loss", [
    Backend("mosaic_tpu", mosaic_tpu_kernels, "mosaic_tpu",
            Tuning(LossTpuConfig, loss_tpu_heuristic, loss_tpu_space, loss_tpu_requirements)),
    Backend("triton", triton_kernels, "triton",
            Tuning(LinearCrossEntropyConfig, triton_heuristic, triton_space)),
    Backend("xla_chunked", xla_chunked_kernels, tuning=Tuning(ChunkedConfig, chunked_heuristic, chunked_space)),
    Backend("xla", xla_kernels),
])
