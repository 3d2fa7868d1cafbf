"""`ragged_dot` with quantized expert weights: ``rhs`` a `QArray` ``[G, K, N]``.

Convention (the one `quantized_matmul` uses for ``w [K, N]``, with the expert
axis in front): the weights are quantized along **axis 1, the contraction
axis K** — ``stellax.quantize(w, fmt, axis=1, block_size=...)`` on
``w [G, K, N]``. Blocks have size 1 along G; along K a block (per channel =
the whole K, or 16/32/64/128/... elements) and along N 1 (or the N side of a
2-D block such as fp8 ``(128, 128)`` or nvfp4 ``(16, 16)``). 4-bit codes are
packed two per byte along K. Formats: every weight format of
`quantized_matmul` (int8, int8_asym, int4, int4_asym, fp8_e4m3, fp8_e5m2,
mxfp8_e4m3, mxfp8_e5m2, mxfp4, nvfp4); activations float32/bfloat16/float16.
The op takes the `QArray` flattened into named arrays (`checks.flatten_quantized`).

Golden: ``dequantize(rhs)`` in float32, then the float32 `ragged_dot` golden.

* ``triton``: the grouped-matmul tile schedule of `triton.py`; in the K loop
  each step loads the codes of ``rhs[g]`` (``[block_k, block_n]``, or
  ``[block_k/2, block_n]`` bytes for 4-bit), decodes them in registers to the
  activation dtype (minus zero points), and multiplies the float32 partial
  product by the step's scale row (blocked scales: ``block_k`` is capped at
  the K block so one step has one scale row) — or, per channel, the
  accumulator once in the epilogue; the NVFP4 tensor scale is applied in the
  epilogue, before the activation. No dequantized weight is ever written
  (`triton_quantized.py`).
* ``mosaic_tpu``: the visit schedule of the TPU grouped matmul (`mosaic_tpu.py`);
  each K step DMAs the code tile of ``rhs[g]`` and its scale rows and decodes
  them in VMEM (`mosaic_tpu_quantized.py`). fp8 codes need a generation with
  float8 (TPU7x); elsewhere the implementation is unsupported and dispatch
  falls back. Its dlhs is the XLA path.
* ``xla``: the row-tile loop of `xla.py`; each tile dequantizes only its own
  expert ``rhs[g]`` (`xla.gmm_quantized`).

Gradients: only w.r.t. ``lhs``. Quantized weights are frozen; the cotangents
of the QArray's arrays are zero (``None`` in the custom VJP).
``dlhs = dz @ dequantize(rhs[g])^T``: the Triton path decodes the weights in
the transposed kernel, the XLA path dequantizes per tile (transposed contraction).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, register
from ..quant.qarray import QArray
from ..quant.reference import dequantize_reference
from . import mosaic_tpu_quantized, triton_quantized
from .activations import activation_fn, activation_grad, fusable_in_kernel
from .base import FAMILY
from .checks import QUANTIZED_ARRAYS, check_ragged_dot_quantized, flatten_quantized, quantized_rhs
from .configs import (GroupedMatmulConfig, XlaGroupedMatmulConfig, quantized_dims, quantized_heuristic,
                      quantized_k_block, quantized_space, quantized_xla_heuristic, xla_space)
from .examples import QUANTIZED_PEERS, quantized_benchmarks, quantized_examples
from .reference import ragged_dot_reference
from .schedule import group_bounds
from .tpu_configs import (TpuGroupedMatmulConfig, quantized_tpu_heuristic, quantized_tpu_requirements,
                          quantized_tpu_space)
from .xla import gmm_quantized as xla_gmm_quantized


def reference(call: Call):
    """The golden: ``dequantize(rhs)`` in float32, then the float32 `ragged_dot` golden."""
    rhs = dequantize_reference(quantized_rhs(call), jnp.float32)
    return ragged_dot_reference(Call(
        {"lhs": call.lhs, "rhs": rhs, "group_sizes": call.group_sizes, "group_offset": call.group_offset},
        {"precision": call.precision, "out_dtype": call.out_dtype, "activation": call.activation,
         "transpose_rhs": False}))


def _preactivation(name: str, call: Call, config, k_block):
    """``lhs, rhs → z``: the pre-activation (no activation) of implementation ``name``."""
    options = dict(precision=call.precision, out_dtype=call.out_dtype)

    def pre(lhs, rhs):
        if name == "xla":
            return xla_gmm_quantized(lhs, rhs, call.group_sizes, call.group_offset, transpose=False,
                                     block_m=config.block_m, **options)
        if name == "mosaic_tpu":
            return mosaic_tpu_quantized.gmm(lhs, rhs, call.group_sizes, call.group_offset, activation=None,
                                            k_block=k_block, config=config, **options)
        return triton_quantized.gmm(lhs, rhs, call.group_sizes, call.group_offset, activation=None,
                                    k_block=k_block, config=config, **options)
    return pre


def _activated(call: Call, z):
    """The activation of the pre-activation ``z`` in XLA, zero outside the local groups."""
    if call.activation is None:
        return z
    m = call.lhs.shape[0]
    bounds = group_bounds(call.group_sizes, call.group_offset, call.rhs_shape[0], m)
    rows = jnp.arange(m)[:, None]
    y = activation_fn(call.activation)(z.astype(jnp.float32))
    return jnp.where((rows >= bounds.begin) & (rows < bounds.end), y, 0.0).astype(call.out_dtype)


def _dlhs(name: str, call: Call, config, k_block, dz, rhs):
    """``dz [M, N] @ dequantize(rhs[g])ᵀ`` in ``lhs.dtype``."""
    if name == "triton":
        return triton_quantized.gmm_transposed(dz, rhs, call.group_sizes, call.group_offset,
                                               precision=call.precision, out_dtype=call.lhs.dtype,
                                               k_block=k_block, config=config)
    block_m = quantized_xla_heuristic(call).block_m if name == "mosaic_tpu" else config.block_m  # XLA dlhs on TPU
    return xla_gmm_quantized(dz, rhs, call.group_sizes, call.group_offset, transpose=True,
                             precision=call.precision, out_dtype=call.lhs.dtype, block_m=block_m)


def _runner(name: str):
    def run(call: Call, config):
        act_name, k_block = call.activation, quantized_k_block(call)
        pre = _preactivation(name, call, config, k_block)

        @jax.custom_vjp
        def grouped(lhs, rhs):
            if name == "mosaic_tpu" and fusable_in_kernel(act_name):
                return mosaic_tpu_quantized.gmm(lhs, rhs, call.group_sizes, call.group_offset, activation=act_name,
                                                precision=call.precision, out_dtype=call.out_dtype,
                                                k_block=k_block, config=config)
            if name == "triton" and (act_name is None or fusable_in_kernel(act_name)):
                return triton_quantized.gmm(lhs, rhs, call.group_sizes, call.group_offset, activation=act_name,
                                            precision=call.precision, out_dtype=call.out_dtype, k_block=k_block,
                                            config=config)
            return _activated(call, pre(lhs, rhs))

        def forward(lhs, rhs):
            z = pre(lhs, rhs)
            return _activated(call, z), (rhs, z if act_name is not None else None)

        def backward(residuals, dy):
            rhs, z = residuals
            dz = dy if z is None else activation_grad(act_name, dy, z, False)
            return _dlhs(name, call, config, k_block, dz.astype(call.lhs.dtype), rhs), None  # frozen weights

        grouped.defvjp(forward, backward)
        return grouped(call.lhs, quantized_rhs(call))
    return run


def _triton_requirements(call: Call) -> str | None:
    if np.dtype(call.lhs.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"the Triton kernel needs float32/bfloat16/float16 lhs, got {np.dtype(call.lhs.dtype).name}"
    kb = quantized_k_block(call)
    if kb is not None and (kb < 16 or kb & (kb - 1)):
        return (f"the Triton kernel needs per-channel scales or K blocks that are powers of two >= 16 "
                f"(block_k is capped at the K block); rhs has K blocks of {kb}")
    return None


def _flops(call: Call) -> float:
    m, k, n, _ = quantized_dims(call)
    return 2.0 * m * k * n


def _bytes(call: Call) -> float:
    m, k, n, _ = quantized_dims(call)
    weights = sum(float(np.prod(call.arrays[a].shape)) * np.dtype(call.arrays[a].dtype).itemsize
                  for a in QUANTIZED_ARRAYS if call.arrays[a] is not None)
    return float(m * k * np.dtype(call.lhs.dtype).itemsize + weights + m * n * np.dtype(call.out_dtype).itemsize)


ragged_dot_quantized_op = register(Op(
    "ragged_dot_quantized", family=FAMILY, check=check_ragged_dot_quantized, reference=reference,
    implementations=[
        Implementation("mosaic_tpu", _runner("mosaic_tpu"), backend="mosaic_tpu", config_type=TpuGroupedMatmulConfig,
                       heuristic=quantized_tpu_heuristic, space=quantized_tpu_space,
                       requirements=quantized_tpu_requirements),
        Implementation("triton", _runner("triton"), backend="triton", config_type=GroupedMatmulConfig,
                       heuristic=quantized_heuristic, space=quantized_space, requirements=_triton_requirements),
        Implementation("xla", _runner("xla"), config_type=XlaGroupedMatmulConfig, heuristic=quantized_xla_heuristic,
                       space=xla_space),
    ],
    flops=_flops, bytes_accessed=_bytes, examples=quantized_examples, benchmarks=quantized_benchmarks,
    peers=QUANTIZED_PEERS, differentiable=("lhs",),
))


def ragged_dot_quantized(lhs, rhs: QArray, group_sizes, precision=None, preferred_element_type=None,
                         group_offset=None, *, activation=None, implementation=None, config=None):
    """`ragged_dot` with a `QArray` ``rhs [G, K, N]`` quantized along axis 1 (see the module doc).

    ``lhs [M, K]`` float32/bfloat16/float16 → ``act(lhs @ dequantize(rhs[g]))`` ``[M, N]``
    in ``preferred_element_type`` (default ``lhs.dtype``); gradients w.r.t. ``lhs`` only.
    ``precision``: of the float32 products (float32 ``lhs``; the weights are decoded to
    ``lhs.dtype``), forward and backward, as for `ragged_dot` (see `stellax.core.precision`)."""
    args, kwargs = flatten_quantized(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                     activation)
    return ragged_dot_quantized_op(*args, **kwargs, implementation=implementation, config=config)
