"""`quantized_matmul`: ``x @ w`` with `QArray` operands, fused dequantization.

Supported pairs (anything else raises ``ValueError`` naming the pair):

* weight-only: ``x`` float32/bfloat16/float16 ``[..., K]``, ``w`` a `QArray`
  ``[K, N]`` quantized along axis 0 in any format (int8, int8_asym, int4,
  int4_asym, fp8_e4m3, fp8_e5m2, mxfp8_*, mxfp4, nvfp4);
* activation × weight: ``x`` a `QArray` ``[M, K]`` quantized along axis 1 and
  ``w`` ``[K, N]`` along axis 0: (fp8_*, fp8_*), (int8, int8), (mxfp8_*, mxfp8_*).

The golden is ``dequantize(x) @ dequantize(w)`` in float32 at highest
precision. The Triton kernel applies the scales per K block inside the K loop
or once in the epilogue (per-channel / per-tensor) and never writes the
dequantized weights to memory; the XLA path dequantizes and calls ``dot``
(XLA may or may not fuse the dequantization into the GEMM).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, checks, register
from ...core.precision import resolve_precision
from . import examples
from . import mosaic_tpu_matmul as tpu_kernels
from . import triton as kernels
from .base import array_bytes, flatten_operands
from .configs import QMatmulConfig, qmatmul_heuristic, qmatmul_space
from .kernel import kernel_operands
from .qarray import QArray, qarray_from_call
from .reference import dequantize_reference, expand_blocks
from .tpu_configs import QMatmulTpuConfig, qmatmul_tpu_heuristic, qmatmul_tpu_space

WEIGHT_FORMATS = ("int8", "int8_asym", "int4", "int4_asym", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2",
                  "mxfp4", "nvfp4")
PAIRS = {("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "fp8_e5m2"), ("fp8_e5m2", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"),
         ("int8", "int8"), ("mxfp8_e4m3", "mxfp8_e4m3"), ("mxfp8_e5m2", "mxfp8_e5m2"),
         ("mxfp8_e4m3", "mxfp8_e5m2"), ("mxfp8_e5m2", "mxfp8_e4m3")}
OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _check(x_values, x_scales, x_zero_points, x_tensor_scale, w_values, w_scales, w_zero_points, w_tensor_scale, *,
           x_format=None, x_shape=None, x_block_shape=None, x_axis=None, x_rotation=None, w_format, w_shape,
           w_block_shape, w_axis, w_rotation=None, preferred_element_type="bfloat16", precision=None) -> Call:
    """Checked `quantized_matmul_op` arguments: the `QArray` fields of ``w``
    (``w_`` prefix) and of ``x`` (``x_``; only ``x_values`` for a float ``x``),
    see `base.flatten_operands`; the options gain ``m``, ``n``, ``k`` and the
    K blocks of in-loop scales ``x_group_k`` / ``w_group_k`` (``None``: one
    scale along K)."""
    w = QArray(w_values, w_scales, w_zero_points, w_tensor_scale, format=w_format, shape=w_shape,
               block_shape=w_block_shape, axis=w_axis, rotation=w_rotation)
    if w.ndim != 2:
        raise ValueError(f"w: expected a rank-2 QArray [K, N], got shape {w.shape}")
    if w.axis != 0:
        raise ValueError(f"w: expected a QArray quantized along axis 0 (the contraction axis K of [K, N]), "
                         f"got axis {w.axis}; quantize the weights with axis=0")
    k, n = w.shape
    if x_format is None:
        x = checks.require_float("x", x_values)
        if x.ndim < 1 or x.shape[-1] != k:
            raise ValueError(f"x: expected shape [..., {k}] (K = w.shape[0]), got {tuple(x.shape)}")
        if w.format not in WEIGHT_FORMATS:
            raise ValueError(f"quantized_matmul: unsupported weight format {w.format}")
        m = int(np.prod(x.shape[:-1]))
        x_group = None
        if w.rotation is not None:
            raise ValueError("quantized_matmul: w was quantized with rotate=...; rotate x the same way "
                             "(quantize it with the same rotate, or hadamard_transform it) and pass a QArray x")
    else:
        xq = QArray(x_values, x_scales, x_zero_points, x_tensor_scale, format=x_format, shape=x_shape,
                    block_shape=x_block_shape, axis=x_axis, rotation=x_rotation)
        if (xq.format, w.format) not in PAIRS:
            raise ValueError(f"quantized_matmul: unsupported pair x={xq.format} × w={w.format}; supported: weight-only "
                             f"(float x, w in {list(WEIGHT_FORMATS)}) or {sorted(PAIRS)}")
        if xq.ndim != 2 or xq.axis != 1:
            raise ValueError(f"x: expected a rank-2 QArray [M, K] quantized along axis 1, got shape {xq.shape} "
                             f"axis {xq.axis}")
        if xq.shape[1] != k:
            raise ValueError(f"x: expected K = {k} (w.shape[0]), got shape {xq.shape}")
        if xq.rotation != w.rotation:
            raise ValueError(f"quantized_matmul: x and w must share a rotation, got x.rotation={xq.rotation} "
                             f"w.rotation={w.rotation}")
        m = xq.shape[0]
        x_group = xq.block_shape[1] if xq.scales.shape[1] > 1 else None
    dtype = np.dtype(preferred_element_type)
    if dtype not in [np.dtype(d) for d in OUT_DTYPES]:
        raise TypeError(f"preferred_element_type: expected float32/bfloat16/float16, got {dtype.name}")
    w_group = w.block_shape[0] if w.scales.shape[0] > 1 else None
    arrays = {"x_values": x_values, "x_scales": x_scales, "x_zero_points": x_zero_points,
              "x_tensor_scale": x_tensor_scale, "w_values": w_values, "w_scales": w_scales,
              "w_zero_points": w_zero_points, "w_tensor_scale": w_tensor_scale}
    options = {"x_format": x_format, "x_shape": None if x_shape is None else tuple(x_shape),
               "x_block_shape": None if x_block_shape is None else tuple(x_block_shape), "x_axis": x_axis,
               "x_rotation": x_rotation, "w_format": w.format, "w_shape": w.shape, "w_block_shape": w.block_shape,
               "w_axis": w.axis, "w_rotation": w.rotation, "preferred_element_type": dtype.name,
               "m": m, "n": n, "k": k, "x_group_k": x_group, "w_group_k": w_group,
               "precision": resolve_precision(precision)}
    return Call(arrays, options)


def _operands(call: Call):
    w = qarray_from_call(call, "w_")
    x = call.x_values if call.x_format is None else qarray_from_call(call, "x_")
    return x, w


def _reference(call: Call):
    x, w = _operands(call)
    xd = x.astype(jnp.float32) if not isinstance(x, QArray) else dequantize_reference(x)
    wd = dequantize_reference(w)
    y = jnp.matmul(xd, wd, precision=jax.lax.Precision.HIGHEST)
    return y.astype(call.preferred_element_type)


def _xla(call: Call, config=None):
    del config
    x, w = _operands(call)
    return _xla_jit(x, w, out=jnp.dtype(call.preferred_element_type), precision=call.precision)


@functools.partial(jax.jit, static_argnames=("out", "precision"))
def _xla_jit(x, w, *, out, precision):
    if not isinstance(x, QArray):
        wd = dequantize_reference(w, x.dtype)
        return jnp.matmul(x, wd, precision=precision, preferred_element_type=jnp.float32).astype(out)
    per_row = x.scales.shape[1] == 1 and w.scales.shape[0] == 1
    if per_row and x.format == "int8":
        acc = jnp.matmul(x.values, w.values, preferred_element_type=jnp.int32).astype(jnp.float32)
        sx = expand_blocks(x.scales.astype(jnp.float32), x.block_shape, x.shape)[:, :1]
        sw = expand_blocks(w.scales.astype(jnp.float32), w.block_shape, w.shape)[:1, :]
        return (acc * sx * sw).astype(out)
    xd = dequantize_reference(x)
    wd = dequantize_reference(w)
    return jnp.matmul(xd, wd, precision=precision).astype(out)


# -- Triton ------------------------------------------------------------------------


def _triton(call: Call, config: QMatmulConfig):
    """`triton.quantized_matmul` on ``x [M, K]`` (float, or a `QArray`'s codes) and ``w``'s kernel operands."""
    x, w = _operands(call)
    m, n, k = call.m, call.n, call.k
    wk = kernel_operands(w)
    common = dict(m=m, n=n, k=k, w_format=w.format, gw=call.w_group_k or k, w_in_loop=call.w_group_k is not None,
                  out_dtype=jnp.dtype(call.preferred_element_type), config=config, precision=call.precision)
    if not isinstance(x, QArray):
        y = kernels.quantized_matmul(x.reshape(m, k), None, w.values, wk.scales, wk.zero_points, wk.tensor_scale,
                                     x_kind="float", gx=1, x_in_loop=False, **common)
        return y.reshape(*x.shape[:-1], n)
    x_kind = "int" if x.spec.element.kind == "int" else "fp8"
    return kernels.quantized_matmul(x.values, kernel_operands(x).scales, w.values, wk.scales, wk.zero_points,
                                    wk.tensor_scale, x_kind=x_kind, gx=call.x_group_k or k,
                                    x_in_loop=call.x_group_k is not None, **common)


def _requirements(call: Call):
    for name, g in (("x", call.x_group_k), ("w", call.w_group_k)):
        if g is not None and g % 16:
            return f"the Triton kernel needs K blocks that are multiples of 16; {name} has K blocks of {g}"
    if call.x_format is not None:
        for name, g in (("x", call.x_group_k), ("w", call.w_group_k)):
            if g is not None and g % 32:
                return f"int8/fp8 tensor-core dots need K steps of >= 32; {name} has K blocks of {g}"
    return None


# -- cost models, examples ---------------------------------------------------------------


def _flops(call: Call) -> float:
    return 2.0 * call.m * call.n * call.k


def _bytes(call: Call) -> float:
    """Read every operand field, write the output."""
    return array_bytes(call) + call.m * call.n * np.dtype(call.preferred_element_type).itemsize


def _bf16_peer(x_values, *args, **kwargs):
    """bf16 matmul of the same shape (the speed baseline)."""
    w_shape = kwargs["w_shape"]
    x = x_values.astype(jnp.bfloat16) if x_values.ndim == 2 else x_values
    w = jnp.ones(w_shape, jnp.bfloat16)
    return jnp.matmul(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


quantized_matmul_op = register(Op(
    "quantized_matmul",
    family="quant",
    check=_check,
    reference=_reference,
    implementations=[
        Implementation("mosaic_tpu", tpu_kernels.qmatmul_tpu_run, backend="mosaic_tpu", config_type=QMatmulTpuConfig,
                       heuristic=qmatmul_tpu_heuristic, space=qmatmul_tpu_space,
                       requirements=tpu_kernels.qmatmul_tpu_requirements),
        Implementation("triton", _triton, backend="triton", config_type=QMatmulConfig, heuristic=qmatmul_heuristic,
                       space=qmatmul_space, requirements=_requirements),
        Implementation("xla", _xla),
    ],
    flops=_flops,
    bytes_accessed=_bytes,
    examples=examples.matmul_examples,
    benchmarks=examples.matmul_benchmarks,
    peers={"bf16_matmul": _bf16_peer},
))


def quantized_matmul(x, w, *, preferred_element_type=jnp.bfloat16, precision=None, implementation=None,
                     config=None):
    """``x @ w`` with quantized operands, dequantization fused into the kernel.

    Args:
      x: float32/bfloat16/float16 ``[..., K]`` (weight-only), or a `QArray`
        ``[M, K]`` quantized along axis 1 (activation × weight).
      w: a `QArray` ``[K, N]`` quantized along axis 0.
      preferred_element_type: the output dtype (float32/bfloat16/float16).
      precision: of the float32 products (a float32 ``x``, or the dequantized
        operands of the XLA path): ``None`` (float32-accurate unless
        `jax.default_matmul_precision` is set), ``"default"``, ``"high"``,
        ``"highest"`` or a `jax.lax.Precision`; see `stellax.core.precision`.
        Narrower operands contract natively.
      implementation: ``None`` (Mosaic TPU on a TPU for weight-only and int8 ×
        int8, Triton on a GPU, else XLA), ``"mosaic_tpu"``, ``"triton"``, ``"xla"``.
      config: a `QMatmulConfig` for the Triton kernel.

    Returns:
      ``[..., N]``: ``dequantize(x) @ dequantize(w)`` accumulated in float32
      (int32 for int8 × int8 with per-channel scales).

    Raises:
      ValueError for unsupported format pairs, mismatched K, weights not
      quantized along axis 0, or mismatched rotations.
    """
    args, kwargs = flatten_operands(x, w)
    return quantized_matmul_op(*args, **kwargs, preferred_element_type=np.dtype(preferred_element_type).name,
                               precision=precision, implementation=implementation, config=config)
