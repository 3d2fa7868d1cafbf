"""What the linear-attention ops share: their backend tables and argument checks
(the fla / mamba_ssm contracts).

The backend tables, one row per backend in dispatch order (`core.backends`):

* `BACKENDS`, the chunked recurrence: `chunk_gated_delta_rule`, `chunk_kda`,
  `ssd` and the backward ops ``gated_recurrence_backward`` /
  ``kda_recurrence_backward``. A row's `Kernels` give the forward on the
  kernels' heads-major layout (`recurrence`), the backward ops'
  implementation and the layout's head padding and chunk;
* `RECURRENT_BACKENDS`, `fused_recurrent_gated_delta_rule` /
  `fused_recurrent_kda` (a row's module has ``fused_recurrent(call, config)``);
* `STEP_BACKENDS`, `ssd_step` (``ssd_step(call, config)``).

The decode ops read the same kernel modules (`mosaic_tpu_decode`, `xla`) with
their own configs, hence their own tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from ...core import checks, current_platform
from ...core.backends import Backend, BackendTable, Tuning
from ...core.config import is_power_of_two
from ...core.pallas import padded_dim
from . import mosaic_tpu, mosaic_tpu_backward, mosaic_tpu_decode, pipeline, xla
from .configs import (FusedRecurrentTpuConfig, LinearAttentionConfig, SsdStepTpuConfig, TpuLinearAttentionConfig,
                      fused_recurrent_tpu_defers_to_xla, fused_recurrent_tpu_heuristic, fused_recurrent_tpu_requirements,
                      fused_recurrent_tpu_space, lanes,
                      linear_attention_heuristic, linear_attention_space, linear_attention_tpu_backward_heuristic,
                      linear_attention_tpu_backward_space, linear_attention_tpu_heuristic,
                      linear_attention_tpu_requirements, linear_attention_tpu_space, ssd_step_tpu_defers_to_xla,
                      ssd_step_tpu_heuristic, ssd_step_tpu_requirements, ssd_step_tpu_space, triton_requirements)
from .mxu import operand_dtype


# -- backend tables ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kernels:
    """One backend's chunked-recurrence kernels (the ``kernels`` of its `BACKENDS` row).

    Attributes:
      forward: ``forward(q, k, v, g, beta, h0, meta, config, *, per_channel, precision) -> (o, final)``
        on the kernels' heads-major layout (`recurrence`), differentiated by the backward ops;
        ``None``: the backend is XLA's token-major chunked scan (`xla.chunked_scan`),
        differentiated by JAX.
      backward: ``backward(call, config, *, per_channel) -> (dq, dk, dv, dg, dβ, dh0)``, the
        backward ops' implementation on their layout (`backward`).
      head_size: ``head_size(d)``, a head size padded as the kernels take it (with ``forward``).
      chunk: ``chunk(config)``, tokens per chunk of the kernels' layout (with ``forward``).
      operand_dtype: ``operand_dtype(dtype)``, the dtype the kernels take ``q, k, v`` in for
        inputs of ``dtype`` (with ``forward``; ``None``: float32).
      typed_output: ``forward`` takes ``out_dtype=`` and writes ``o`` in it (else ``o`` is float32).
      grouped: ``grouped(config, r)``, whether ``forward`` takes ``q, k`` with their own heads
        ``[Bs, HV / r, Tp, Kp]`` (``r`` value heads per key head) for ``config`` (``None``: never;
        they are expanded to ``HV`` heads first).
    """

    forward: Callable[..., tuple] | None
    backward: Callable[..., tuple]
    head_size: Callable[[int], int] | None = None
    chunk: Callable[[Any], int] | None = None
    operand_dtype: Callable[[Any], Any] | None = None
    typed_output: bool = False
    grouped: Callable[[Any, int], bool] | None = None


_TPU_CHUNKED = Tuning(TpuLinearAttentionConfig, linear_attention_tpu_heuristic, linear_attention_tpu_space,
                      linear_attention_tpu_requirements)
_TPU_CHUNKED_BACKWARD = Tuning(TpuLinearAttentionConfig, linear_attention_tpu_backward_heuristic,
                               linear_attention_tpu_backward_space, linear_attention_tpu_requirements)

#: The chunked recurrence's backends: the forward ops' (GDN, KDA, SSD) and the backward ops'
#: implementations are generated from it.
BACKENDS = BackendTable("linear_attention", [
    Backend("mosaic_tpu", Kernels(mosaic_tpu.forward, mosaic_tpu_backward.backward, lanes, mosaic_tpu.layout_chunk,
                                  operand_dtype, typed_output=True, grouped=mosaic_tpu.config_groups_fit),
            "mosaic_tpu", _TPU_CHUNKED, _TPU_CHUNKED_BACKWARD),
    Backend("triton", Kernels(pipeline.forward, pipeline.backward, padded_dim, pipeline.layout_chunk), "triton",
            Tuning(LinearAttentionConfig, linear_attention_heuristic, linear_attention_space, triton_requirements)),
    Backend("xla", Kernels(None, xla.backward)),
])

#: The fused recurrences' (decode) backends.
RECURRENT_BACKENDS = BackendTable("linear_attention_recurrent", [
    Backend("mosaic_tpu", mosaic_tpu_decode, "mosaic_tpu",
            Tuning(FusedRecurrentTpuConfig, fused_recurrent_tpu_heuristic, fused_recurrent_tpu_space,
                   fused_recurrent_tpu_requirements, fused_recurrent_tpu_defers_to_xla)),
    Backend("xla", xla),
])

#: `ssd_step`'s backends.
STEP_BACKENDS = BackendTable("linear_attention_ssd_step", [
    Backend("mosaic_tpu", mosaic_tpu_decode, "mosaic_tpu",
            Tuning(SsdStepTpuConfig, ssd_step_tpu_heuristic, ssd_step_tpu_space, ssd_step_tpu_requirements,
                   ssd_step_tpu_defers_to_xla)),
    Backend("xla", xla),
])


# -- argument checks ---------------------------------------------------------------------------
def require_bool(name: str, value) -> bool:
    """``value`` as a Python bool; ``TypeError`` naming ``name`` for anything but a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def check_scale(scale, head_dim: int) -> float:
    """The query scale: ``head_dim ** -0.5`` for ``None``, else a positive float."""
    if scale is None:
        return float(head_dim) ** -0.5
    return checks.require_positive_float("scale", scale)


def check_chunk_size(chunk_size) -> int | None:
    """``None`` or a power-of-two int in ``[1, 1024]`` (the XLA path's chunk)."""
    if chunk_size is None:
        return None
    is_int = isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool)
    if not is_int or not is_power_of_two(int(chunk_size)):
        raise ValueError(f"chunk_size: expected a positive power of two, got {chunk_size!r}")
    if not 1 <= chunk_size <= 1024:
        raise ValueError(f"chunk_size: expected a power of two in [1, 1024], got {chunk_size}")
    return int(chunk_size)


def check_cu_seqlens(cu_seqlens, batch: int, length: int, what: str = "q"):
    """``cu_seqlens [N+1]``: integers, batch 1, starting at 0, non-decreasing,
    ending at T (values are checked when concrete; traced values cannot be).
    Returns ``(cu_seqlens, N)``."""
    if cu_seqlens is None:
        return None, batch
    cu_seqlens = checks.require_int("cu_seqlens", cu_seqlens)
    checks.require_ndim("cu_seqlens", cu_seqlens, 1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 entries [0, ..., T], got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(
            f"cu_seqlens: a packed batch needs batch size 1 ({what}.shape[0] == 1) with the sequences "
            f"concatenated along T, got batch size {batch}")
    if not isinstance(cu_seqlens, jax.core.Tracer):
        values = np.asarray(cu_seqlens).astype(np.int64)
        if values[0] != 0:
            raise ValueError(f"cu_seqlens: expected to start at 0, got {values[0]}")
        steps = np.diff(values)
        if (steps < 0).any():
            i = int(np.argmax(steps < 0))
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {values[i]} then {values[i + 1]} "
                             f"at positions {i}, {i + 1}")
        if values[-1] != length:
            raise ValueError(f"cu_seqlens: expected to end at T = {length} ({what}.shape[1]), got {values[-1]}")
    return cu_seqlens, int(cu_seqlens.shape[0]) - 1


def check_state(name: str, state, shape, what: str):
    """``None`` or a float array of ``shape`` (``what`` describes it in the error)."""
    if state is None:
        return None
    state = checks.require_float(name, state)
    checks.require_ndim(name, state, len(shape))
    checks.require_shape(name, state, shape, what)
    return state


def check_optional_float(name: str, value):
    """``None`` or ``value`` as a Python float (``TypeError`` naming ``name`` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a float or None, got {type(value).__name__}")
    return float(value)


def xla_chunk(chunk_size: int | None, per_channel: bool) -> int:
    """The XLA path's chunk: the user's, else the fastest measured on a CPU
    (2-core x86, T=4096, H=16, K=V=128: GDN 32, KDA 16 — smaller chunks cost
    less intra-chunk work and, for KDA, fewer per-channel exps) and fla's 64
    on accelerators."""
    if chunk_size is not None:
        return chunk_size
    if current_platform().backend != "cpu":
        return 64
    return 16 if per_channel else 32
