"""Public normalization API: `layer_norm` (LayerNorm / RMSNorm, optional fused
residual add) and its backward op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, backward_implementation, register
from ...core import checks
from . import mosaic_tpu as mosaic_tpu_kernels
from . import triton as triton_kernels
from . import xla as xla_kernels
from .configs import (NormConfig, NormTpuConfig, norm_heuristic, norm_requirements, norm_space, norm_tpu_heuristic,
                      norm_tpu_requirements, norm_tpu_space)
from .examples import backward_examples, benchmarks, forward_examples
from .reference import layer_norm_backward_reference, layer_norm_reference


# -- argument checks -----------------------------------------------------------
def _check_layer_norm(x, scale=None, offset=None, *, axis=-1, epsilon=1e-6, subtract_mean=True,
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


def _check_backward(dy, x, scale, offset, mean, rstd, dh=None, *, epsilon=1e-6, subtract_mean=True) -> Call:
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


def _forward_flops(call: Call) -> float:
    n = float(np.prod(call.x.shape))
    return n * (7 + (call.scale is not None) + (call.offset is not None) + (call.residual is not None))


def _forward_bytes(call: Call) -> float:
    io = _itemsize(call.x) * (2 if call.residual is None else 4)
    return float(io + _itemsize(call.scale) + _itemsize(call.offset))


def _backward_flops(call: Call) -> float:
    return float(np.prod(call.x.shape)) * 12


def _backward_bytes(call: Call) -> float:
    return float(_itemsize(call.dy) + 2 * _itemsize(call.x) + _itemsize(call.dh)
                 + 2 * _itemsize(call.scale) + 2 * _itemsize(call.offset))


# -- backward op ---------------------------------------------------------------
def _backward_runner(kernels):
    def run(call: Call, config):
        dx, dscale, doffset = kernels.norm_backward(
            call.dy, call.x, call.scale, call.offset, call.mean, call.rstd, call.dh,
            subtract_mean=call.subtract_mean, config=config,
        )
        return (
            dx,
            None if dscale is None else dscale.astype(call.scale.dtype),
            None if doffset is None else doffset.astype(call.offset.dtype),
        )
    return run


layer_norm_backward_op = register(Op(
    "layer_norm_backward",
    family="norm",
    check=_check_backward,
    reference=layer_norm_backward_reference,
    implementations=[
        Implementation("mosaic_tpu", _backward_runner(mosaic_tpu_kernels), backend="mosaic_tpu",
                       config_type=NormTpuConfig, heuristic=norm_tpu_heuristic, space=norm_tpu_space,
                       requirements=norm_tpu_requirements),
        Implementation("triton", _backward_runner(triton_kernels), backend="triton",
                       config_type=NormConfig, heuristic=norm_heuristic, space=norm_space,
                       requirements=norm_requirements),
        Implementation("xla", _backward_runner(xla_kernels)),
    ],
    flops=_backward_flops,
    bytes_accessed=_backward_bytes,
    examples=backward_examples,
))


# -- forward op ----------------------------------------------------------------
def _forward_runner(kernels, name: str):
    def run(call: Call, config):
        x, axis = call.x, call.axis
        if x.size == 0:  # empty rows or D = 0: empty outputs (no statistics to compute)
            y = jnp.zeros_like(x)
            return y if call.residual is None else (y, (x.astype(jnp.float32) + call.residual).astype(x.dtype))
        moved = jnp.moveaxis(x, axis, -1)
        moved_shape = moved.shape
        features = moved_shape[-1]
        rows2d = lambda a: None if a is None else jnp.moveaxis(a, axis, -1).reshape(-1, features)
        unrows = lambda a: jnp.moveaxis(a.reshape(moved_shape), -1, axis)
        options = dict(epsilon=call.epsilon, subtract_mean=call.subtract_mean)
        has_residual = call.residual is not None

        @jax.custom_vjp
        def normalize(x2, r2, scale, offset):
            y, h, _, _ = kernels.norm_forward(x2, r2, scale, offset, config=config, **options)
            return (y, h) if has_residual else y

        def forward(x2, r2, scale, offset):
            y, h, mean, rstd = kernels.norm_forward(x2, r2, scale, offset, config=config, **options)
            out = (y, h) if has_residual else y
            return out, (x2 if h is None else h, scale, offset, mean, rstd)

        def backward(residuals, cotangent):
            normed, scale, offset, mean, rstd = residuals
            dy, dh = cotangent if has_residual else (cotangent, None)
            dx, dscale, doffset = layer_norm_backward_op(
                dy, normed, scale, offset, mean, rstd, dh, epsilon=call.epsilon,
                subtract_mean=call.subtract_mean,
                implementation=backward_implementation(layer_norm_backward_op, name),
            )
            return dx, (dx if has_residual else None), dscale, doffset

        normalize.defvjp(forward, backward)
        out = normalize(rows2d(x), rows2d(call.residual), call.scale, call.offset)
        if has_residual:
            return unrows(out[0]), unrows(out[1])
        return unrows(out)
    return run


layer_norm_op = register(Op(
    "layer_norm",
    family="norm",
    check=_check_layer_norm,
    reference=layer_norm_reference,
    implementations=[
        Implementation("mosaic_tpu", _forward_runner(mosaic_tpu_kernels, "mosaic_tpu"), backend="mosaic_tpu",
                       config_type=NormTpuConfig, heuristic=norm_tpu_heuristic, space=norm_tpu_space,
                       requirements=norm_tpu_requirements),
        Implementation("triton", _forward_runner(triton_kernels, "triton"), backend="triton",
                       config_type=NormConfig, heuristic=norm_heuristic, space=norm_space,
                       requirements=norm_requirements),
        Implementation("xla", _forward_runner(xla_kernels, "xla")),
    ],
    flops=_forward_flops,
    bytes_accessed=_forward_bytes,
    examples=forward_examples,
    benchmarks=benchmarks,
    differentiable=("x", "scale", "offset", "residual"),
))


def layer_norm(x, scale=None, offset=None, *, axis=-1, epsilon=1e-6, subtract_mean=True, residual=None,
               implementation=None, config=None):
    """Layer normalization (RMSNorm with ``subtract_mean=False``) over one axis.

    Args:
      x: ``[..., D, ...]`` float32/bfloat16/float16; ``D = x.shape[axis]``.
      scale: ``[D]`` multiplier (γ) or ``None``.
      offset: ``[D]`` bias (β) or ``None``.
      axis: the normalized axis.
      epsilon: added to the variance.
      subtract_mean: ``False`` gives RMSNorm (no centering).
      residual: optional, same shape and dtype as ``x``: normalize
        ``h = x + residual`` and return ``(y, h)`` (the pre-norm residual
        stream of a transformer block), fused into one pass.
      implementation: ``None`` (best available, ending in ``"xla"``),
        ``"mosaic_tpu"``, ``"triton"``, ``"xla"`` or a sequence tried in order.
      config: an explicit `NormConfig` for the Triton kernels or `NormTpuConfig`
        for the Mosaic TPU kernels.

    Returns:
      ``y`` in ``x.dtype`` where, along ``axis`` in float32,
      ``y = (h - mean(h)) / sqrt(var(h) + epsilon) * scale + offset``;
      or ``(y, h)`` when ``residual`` is given.
    """
    return layer_norm_op(x, scale, offset, axis=axis, epsilon=epsilon, subtract_mean=subtract_mean,
                         residual=residual, implementation=implementation, config=config)


def rms_norm(x, scale=None, *, axis=-1, epsilon=1e-6, residual=None, implementation=None, config=None):
    """RMSNorm: ``x / sqrt(mean(x²) + epsilon) * scale`` — `layer_norm` with
    ``subtract_mean=False`` and no offset."""
    return layer_norm(x, scale, None, axis=axis, epsilon=epsilon, subtract_mean=False, residual=residual,
                      implementation=implementation, config=config)
