"""What the normalization implementations share: the argument checks, the cost models and the
backend table (one row per backend; its kernel module provides ``norm_forward`` and ``norm_backward``)."""

from __future__ import annotations

import numpy as np

from ...core import Call
from ...core import checks
from ...core.backends import Backend, BackendTable, Tuning
from . import mosaic_tpu as mosaic_tpu_kernels
from . import triton as triton_kernels
from . import xla as xla_kernels
from .configs import (NormConfig, NormTpuConfig, norm_heuristic, norm_requirements, norm_space,
                      norm_tpu_backward_defers_to_xla, norm_tpu_heuristic, norm_tpu_requirements, norm_tpu_space)


# -- argument checks -----------------------------------------------------------
def check_layer_norm(x, scale=None, offset=None, *, axis=-1, epsilon=1e-6, subtract_mean=True,
                     residual=None) -> Call:
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    axis = checks.normalize_axis("axis", axis, x.ndim)
    features = x.shape[axis]
    for name, value in (("scale", scale), ("offset", offset)):
        if value is not None:
            checks.require_float(name, value)
            checks.require_shape(name, value, (features,), f"x.shape[{axis}]")
    if residual is not None:
        checks.require_float("residual", residual)
        checks.require_shape("residual", residual, x.shape, "x.shape")
        checks.require_same_dtype("residual", residual, "x", x)
    epsilon = checks.require_positive_float("epsilon", epsilon)
    if not isinstance(subtract_mean, bool):
        raise TypeError(f"subtract_mean: expected a bool, got {type(subtract_mean).__name__}")
    return Call(
        {"x": x, "scale": scale, "offset": offset, "residual": residual},
        {"axis": axis, "epsilon": epsilon, "subtract_mean": subtract_mean},
    )


def check_backward(dy, x, scale, offset, mean, rstd, dh=None, *, epsilon=1e-6, subtract_mean=True) -> Call:
    x = checks.require_float("x", x)
    checks.require_ndim("x", x, 2)
    rows, features = x.shape
    checks.require_shape("dy", dy, x.shape, "x.shape")
    for name, value in (("scale", scale), ("offset", offset)):
        if value is not None:
            checks.require_shape(name, value, (features,), "x.shape[1]")
    for name, value in (("mean", mean), ("rstd", rstd)):
        checks.require_shape(name, value, (rows,), "x.shape[0]")
    if dh is not None:
        checks.require_shape("dh", dh, x.shape, "x.shape")
    return Call(
        {"dy": dy, "x": x, "scale": scale, "offset": offset, "mean": mean, "rstd": rstd, "dh": dh},
        {"axis": -1, "epsilon": float(epsilon), "subtract_mean": bool(subtract_mean)},
    )


# -- cost models ---------------------------------------------------------------
def _itemsize(a) -> int:
    return 0 if a is None else int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def forward_flops(call: Call) -> float:
    n = float(np.prod(call.x.shape))
    return n * (7 + (call.scale is not None) + (call.offset is not None) + (call.residual is not None))


def forward_bytes(call: Call) -> float:
    io = _itemsize(call.x) * (2 if call.residual is None else 4)
    return float(io + _itemsize(call.scale) + _itemsize(call.offset))


def backward_flops(call: Call) -> float:
    return float(np.prod(call.x.shape)) * 12


def backward_bytes(call: Call) -> float:
    return float(_itemsize(call.dy) + 2 * _itemsize(call.x) + _itemsize(call.dh)
                 + 2 * _itemsize(call.scale) + 2 * _itemsize(call.offset))


# -- backends ------------------------------------------------------------------
BACKENDS = BackendTable("norm", [
    Backend("mosaic_tpu", mosaic_tpu_kernels, "mosaic_tpu",
            Tuning(NormTpuConfig, norm_tpu_heuristic, norm_tpu_space, norm_tpu_requirements),
            backward_tuning=Tuning(NormTpuConfig, norm_tpu_heuristic, norm_tpu_space, norm_tpu_requirements,
                                   norm_tpu_backward_defers_to_xla)),
    Backend("triton", triton_kernels, "triton", Tuning(NormConfig, norm_heuristic, norm_space, norm_requirements)),
    Backend("xla", xla_kernels),
])
