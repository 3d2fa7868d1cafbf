"""Torch front ends of the quantization family: `quantize` -> `QTensor`,
`dequantize`, weight-only `quantized_matmul` and `hadamard_transform`.

A `QTensor` is the torch twin of `stellax.ops.quant.QArray`: the same fields
and layout (4-bit codes packed two per ``uint8`` byte along ``axis``, low
nibble first; per-block scales in float32 / ``float8_e8m0fnu`` (MX) /
``float8_e4m3fn`` (NVFP4); optional ``int8`` zero points and a float32 tensor
scale), so every component crosses DLPack as is, zero-copy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import numpy as np
import torch
from jax import Array

import stellax
from stellax import QArray
from stellax.core import vjp

from . import bridge
from .options import dtype_name, opt_int, precision_name
from .registry import _cached, define_op
from .structs import QARRAY, register_twin


@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized tensor (see the module docstring)."""

    values: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    tensor_scale: torch.Tensor | None
    format: str
    shape: tuple
    block_shape: tuple
    axis: int
    rotation: int | None = None

    def to_qarray(self):
        """The JAX `QArray` with the same buffers (zero-copy)."""
        conv = lambda t: None if t is None else bridge.to_jax(t)
        return QArray(conv(self.values), conv(self.scales), conv(self.zero_points), conv(self.tensor_scale),
                      format=self.format, shape=self.shape, block_shape=self.block_shape, axis=self.axis,
                      rotation=self.rotation)

    @classmethod
    def from_qarray(cls, q) -> "QTensor":
        conv = lambda a: None if a is None else bridge.to_torch(a)
        return cls(conv(q.values), conv(q.scales), conv(q.zero_points), conv(q.tensor_scale), q.format,
                   tuple(q.shape), tuple(q.block_shape), int(q.axis), q.rotation)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`dequantize` of this tensor in ``dtype``."""
        return dequantize(self, dtype)


register_twin(QARRAY, QTensor)


def _block_size(spec: str | None):
    if spec is None or spec in ("tensor", "channel"):
        return spec
    if "x" in spec:
        rows, cols = spec.split("x")
        return int(rows), int(cols)
    return int(spec)


def _encode_block_size(block_size) -> str | None:
    if block_size is None or isinstance(block_size, str):
        return block_size
    if isinstance(block_size, (tuple, list)):
        return f"{int(block_size[0])}x{int(block_size[1])}"
    return str(int(block_size))


@dataclasses.dataclass(frozen=True)
class _XlaGradient:
    """``run(implementation, *arrays)`` as a `core.vjp` rule over the arrays: the forward uses the
    default implementation (the Triton kernel on a GPU), the VJP is JAX autodiff of the XLA
    implementation (the same math; a Pallas kernel has no autodiff rule)."""

    run: Callable[..., Any]

    def forward(self, *arrays):
        return self.run(None, *arrays), arrays

    def backward(self, arrays, cotangents):
        return jax.vjp(lambda *a: self.run("xla", *a), *arrays)[1](cotangents)


def _xla_vjp(run):
    """`_XlaGradient` of ``run`` as a function of the arrays (`core.vjp.apply`)."""
    return functools.partial(vjp.apply, _XlaGradient(run))


def _quantize(x: Array, *, format: str, axis: int, block_size: str | None, scale_dtype: str | None,
              rotate: int | None, seed: int | None, implementation: str | None) -> QArray:
    def run(impl, x):
        key = None if seed is None else jax.random.PRNGKey(seed)
        return stellax.quantize(x, format, axis=axis, block_size=_block_size(block_size), scale_dtype=scale_dtype,
                                rotate=rotate, stochastic_rounding_key=key, implementation=impl or implementation)
    return _xla_vjp(run)(x)


quantize_op = define_op("quantize", _quantize)


def quantize(x: torch.Tensor, format: str, *, axis: int = -1, block_size=None, scale_dtype=None,
             rotate=None, stochastic_rounding_seed: int | None = None,
             implementation: str | None = None) -> QTensor:
    """`stellax.quantize` on a torch tensor.

    Args:
      x: float32/bfloat16/float16 tensor, rank >= 1.
      format: ``int8``, ``int8_asym``, ``int4``, ``int4_asym``, ``fp8_e4m3``,
        ``fp8_e5m2``, ``mxfp8_e4m3``, ``mxfp8_e5m2``, ``mxfp4`` or ``nvfp4``.
      axis: the quantized (contraction) axis; 4-bit codes are packed along it.
      block_size: ``None`` (the format's default) / ``"tensor"`` /
        ``"channel"`` / int / ``(rows, cols)``.
      scale_dtype: ``None`` or a torch/numpy dtype for int/fp8 scales.
      rotate: ``None`` / ``True`` / a Hadamard block size.
      stochastic_rounding_seed: ``None`` (round to nearest even) or an int:
        stochastic rounding with ``jax.random.PRNGKey(seed)``.
      implementation: ``None`` or ``"xla"`` (``"triton"`` on a GPU).

    Returns a `QTensor`. Gradients (as JAX defines them, by autodiff of the
    XLA quantizer): the float32/bfloat16/float16 ``scales`` and the
    ``tensor_scale`` are differentiable functions of ``x`` (through the
    block maxima); the codes (``values``), zero points and fp8/E8M0 scales
    are data and carry no gradient. There is no straight-through estimator:
    to train through quantization, differentiate the dequantized values with
    respect to the scales (`dequantize`) or use `quantized_matmul`."""
    axis = axis % x.ndim
    if rotate is True:
        rotate = int(x.shape[axis])
    sd = None if scale_dtype is None else (str(scale_dtype).replace("torch.", "") if isinstance(
        scale_dtype, torch.dtype) else np.dtype(scale_dtype).name)
    opts = dict(format=str(format), axis=int(axis), block_size=_encode_block_size(block_size), scale_dtype=sd,
                rotate=None if rotate is None else int(rotate),
                seed=None if stochastic_rounding_seed is None else int(stochastic_rounding_seed),
                implementation=implementation)
    key = ("quantize", "aux", tuple(x.shape), x.dtype, tuple(opts.items()))

    def aux():
        struct = jax.ShapeDtypeStruct(tuple(x.shape), bridge.jax_dtype(x.dtype))
        q = jax.eval_shape(lambda a: stellax.quantize(a, format, axis=axis, block_size=_block_size(
            opts["block_size"]), scale_dtype=sd, rotate=opts["rotate"]), struct)
        return q.format, tuple(q.shape), tuple(q.block_shape), int(q.axis), q.rotation
    return QARRAY.to_torch(quantize_op(x, *opts.values()), _cached(key, aux))


def _dequantize(q: QArray, *, dtype: str, implementation: str | None) -> Array:
    def run(impl, values, scales, zero_points, tensor_scale):
        w = QArray.tree_unflatten(q.tree_flatten()[1], (values, scales, zero_points, tensor_scale))
        return stellax.dequantize(w, np.dtype(dtype), implementation=impl or implementation)
    return _xla_vjp(run)(q.values, q.scales, q.zero_points, q.tensor_scale)


#: Gradients reach the float32/bfloat16/float16 scales and tensor scale (learned scales).
dequantize_op = define_op("dequantize", _dequantize)


def _q_args(q: QTensor) -> tuple:
    """The custom-op arguments of a `QTensor`: its 4 tensors and 5 statics (`structs.QARRAY`)."""
    tensors, statics = QARRAY.flatten(q, "q", dense=False)
    return (*tensors, *statics)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32, *, implementation: str | None = None) -> torch.Tensor:
    """The values of a `QTensor` (logical shape ``q.shape``) in ``dtype``
    (float32/bfloat16/float16): ``(code - zero_point) * scale * tensor_scale``
    computed in float32.

    Gradients (as JAX defines them): with respect to float32/bfloat16/float16
    ``q.scales`` and ``q.tensor_scale`` (set ``requires_grad`` on them, e.g.
    for learned scales); the codes, zero points and fp8/E8M0 scales are data
    and get no gradient (``None``)."""
    if not isinstance(q, QTensor):
        raise TypeError(f"q: expected a QTensor, got {type(q).__name__}")
    return dequantize_op(q, dtype_name("dtype", dtype), implementation)


def _qmatmul(x: Array, w: QArray, *, dtype: str, precision: str | None, implementation: str | None) -> Array:
    return stellax.quantized_matmul(x, w, preferred_element_type=np.dtype(dtype), precision=precision,
                                    implementation=implementation)


#: Frozen quantized weights: no gradient reaches their float32 scales.
quantized_matmul_op = define_op("quantized_matmul", _qmatmul, no_grad=("w_scales", "w_tensor_scale"))


def quantized_matmul(x: torch.Tensor, w: QTensor, *, out_dtype: torch.dtype | None = None, precision=None,
                     implementation: str | None = None) -> torch.Tensor:
    """Weight-only quantized matmul ``x [..., K] @ dequantize(w [K, N])`` with
    the dequantization fused (``w`` quantized along axis 0). Output dtype
    ``out_dtype`` (default ``x.dtype``); ``precision`` of float32 products (``None``
    or a `jax.lax.Precision` / its name, see `stellax.core.precision`). Differentiable in ``x``."""
    if not isinstance(w, QTensor):
        raise TypeError(f"w: expected a QTensor (quantize the weights with axis=0), got {type(w).__name__}")
    return quantized_matmul_op(x, w, dtype_name("out_dtype", out_dtype or x.dtype), precision_name(precision),
                               implementation)


def _hadamard(x: Array, *, block_size: int | None, inverse: bool, seed: int | None, precision: str | None,
              implementation: str | None) -> Array:
    key = None if seed is None else jax.random.PRNGKey(seed)
    return stellax.hadamard_transform(x, block_size=block_size, random_signs_key=key, inverse=inverse,
                                      precision=precision, implementation=implementation)


hadamard_transform_op = define_op("hadamard_transform", _hadamard)


def hadamard_transform(x: torch.Tensor, *, block_size: int | None = None, seed: int | None = None,
                       inverse: bool = False, precision=None, implementation: str | None = None) -> torch.Tensor:
    """Normalized (blockwise) fast Walsh–Hadamard transform over the last
    dimension; ``seed`` gives random ±1 signs (``jax.random.PRNGKey(seed)``);
    ``precision`` as in `stellax.hadamard_transform`. Differentiable."""
    return hadamard_transform_op(x, opt_int(block_size), bool(inverse), opt_int(seed), precision_name(precision),
                                 implementation)
