"""The `dequantize` op: a `QArray` → its float values
``(code - zero_point) · scale · tensor_scale`` (float32 math)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, checks, register
from ...core.pallas import cdiv
from . import examples
from . import mosaic_tpu as tpu_kernels
from . import triton as kernels
from .base import array_bytes
from .configs import DequantConfig, dequant_heuristic, dequant_space
from .kernel import kernel_operands
from .qarray import QArray, qarray_fields, qarray_from_call
from .reference import dequantize_reference
from .tpu_configs import QuantTpuConfig, dequantize_tpu_heuristic, dequantize_tpu_space


def check_dequantize(values, scales, zero_points=None, tensor_scale=None, *, format, shape, block_shape, axis,
                     dtype="float32", rotation=None) -> Call:
    """Checked `dequantize_op` arguments: the `QArray` fields (validated as a
    `QArray`) and the output ``dtype`` (float32/bfloat16/float16)."""
    q = QArray(values, scales, zero_points, tensor_scale, format=format, shape=shape, block_shape=block_shape,
               axis=axis, rotation=rotation)
    dtype = np.dtype(dtype)
    if dtype not in [np.dtype(d) for d in checks.FLOAT_DTYPES]:
        raise TypeError(f"dtype: expected one of float32/bfloat16/float16, got {dtype.name}")
    return Call({"values": values, "scales": scales, "zero_points": zero_points, "tensor_scale": tensor_scale},
                {"format": q.format, "shape": q.shape, "block_shape": q.block_shape, "axis": q.axis,
                 "dtype": dtype.name, "rotation": rotation})


_xla_jit = jax.jit(dequantize_reference, static_argnums=(1,))


def _xla(call: Call, config=None):
    del config
    return _xla_jit(qarray_from_call(call), jnp.dtype(call.dtype))


def _bytes(call: Call) -> float:
    """Read every field, write the values."""
    return array_bytes(call) + float(np.prod(call.shape)) * np.dtype(call.dtype).itemsize


def _triton_requirements(call: Call):
    ndim = len(call.shape)
    if call.axis != ndim - 1 or any(b != 1 for b in call.block_shape[:-1]):
        return ("the Triton dequantize kernel takes 1-D blocks along the last axis (quantize with axis=-1); "
                f"got axis {call.axis}, block_shape {call.block_shape}")
    g = call.block_shape[-1]
    if cdiv(call.shape[-1], g) > 1 and (g & (g - 1)):
        return f"the Triton dequantize kernel needs a power-of-two block along the axis, got {g}"
    return None


def _triton(call: Call, config: DequantConfig):
    """Rows of the last axis through `triton.dequantize`."""
    q = qarray_from_call(call)
    ops = kernel_operands(q)
    k = q.shape[-1]
    rows = int(np.prod(q.shape[:-1]))
    values = ops.values.reshape(rows, ops.values.shape[-1])
    scales = ops.scales.reshape(rows, ops.scales.shape[-1])
    zp = None if ops.zero_points is None else ops.zero_points.reshape(rows, -1)
    out = kernels.dequantize(values, scales, zp, ops.tensor_scale, rows=rows, k=k, group=ops.group,
                             one_block=scales.shape[-1] == 1, fmt=q.format, out_dtype=jnp.dtype(call.dtype),
                             config=config)
    return out.reshape(*q.shape[:-1], k)


dequantize_op = register(Op(
    "dequantize",
    family="quant",
    check=check_dequantize,
    reference=_xla,
    implementations=[
        Implementation("mosaic_tpu", tpu_kernels.dequantize_run, backend="mosaic_tpu", config_type=QuantTpuConfig,
                       heuristic=dequantize_tpu_heuristic, space=dequantize_tpu_space,
                       requirements=tpu_kernels.dequantize_requirements),
        Implementation("triton", _triton, backend="triton", config_type=DequantConfig,
                       heuristic=dequant_heuristic, space=dequant_space, requirements=_triton_requirements),
        Implementation("xla", _xla)],
    flops=lambda call: float(np.prod(call.shape)) * 3,
    bytes_accessed=_bytes,
    examples=examples.dequantize_examples,
    benchmarks=examples.dequantize_benchmarks,
))


def dequantize(qx: QArray, dtype=jnp.float32, *, implementation=None, config=None):
    """Values of a `QArray`: ``(code - zero_point) * scale * tensor_scale``
    computed in float32, returned in ``dtype`` (float32/bfloat16/float16).

    ``implementation``: ``None`` (the Mosaic TPU kernel on a TPU / the Triton
    kernel on a GPU when the blocks are 1-D along the last axis, else XLA),
    ``"mosaic_tpu"``, ``"triton"`` or ``"xla"``; ``config``: a
    `QuantTpuConfig` / `DequantConfig`."""
    if not isinstance(qx, QArray):
        raise TypeError(f"qx: expected a QArray, got {type(qx).__name__}")
    arrays, options = qarray_fields(qx)
    return dequantize_op(*arrays.values(), **options, dtype=np.dtype(dtype).name, implementation=implementation,
                         config=config)
