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
  expert ``rhs[g]`` (`xla_quantized.py`).

The three kernel modules are the rows of `base.QUANTIZED_BACKENDS`, each with
``gmm`` (forward; the pre-activation with ``activation=None``) and
``gmm_transposed`` (dlhs) of one contract.

Gradients: only w.r.t. ``lhs``. Quantized weights are frozen; the cotangents
of the QArray's arrays are zero (``None`` in the `core.vjp` rule).
``dlhs = dz @ dequantize(rhs[g])^T``: the Triton path decodes the weights in
the transposed kernel, the XLA path dequantizes per tile (transposed contraction).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from ...core import Call, vjp
from ...core.backends import Backend
from ..quant.qarray import QArray
from ..quant.reference import dequantize_reference
from .activations import activation_grad, fusable_in_kernel
from .base import QUANTIZED_BACKENDS
from .checks import QUANTIZED_ARRAYS, check_ragged_dot_quantized, flatten_quantized, quantized_rhs
from .configs import quantized_dims, quantized_k_block
from .examples import QUANTIZED_PEERS, quantized_benchmarks, quantized_examples
from .reference import ragged_dot_reference
from .schedule import poison_bad_offset
from .xla_quantized import activated


def reference(call: Call):
    """The golden: ``dequantize(rhs)`` in float32, then the float32 `ragged_dot` golden."""
    rhs = dequantize_reference(quantized_rhs(call), jnp.float32)
    return ragged_dot_reference(Call(
        {"lhs": call.lhs, "rhs": rhs, "group_sizes": call.group_sizes, "group_offset": call.group_offset},
        {"precision": call.precision, "out_dtype": call.out_dtype, "activation": call.activation,
         "transpose_rhs": False}))


@dataclasses.dataclass(frozen=True)
class _QuantizedRaggedDot:
    """The quantized ``ragged_dot`` by one backend (a `core.vjp` rule): operands ``(lhs, rhs
    (a QArray), group_sizes, group_offset)``, gradients w.r.t. ``lhs`` only. A named activation
    is fused into the kernel when nothing differentiates the call; differentiated, the kernel
    computes the pre-activation ``z`` (saved for the activation gradient) and XLA activates it."""

    backend: Backend
    config: Any
    activation: Any
    precision: Any
    out_dtype: Any
    lhs_dtype: Any
    k_block: int | None

    def _gmm(self, lhs, rhs, group_sizes, group_offset, activation):
        return self.backend.kernels.gmm(lhs, rhs, group_sizes, group_offset, activation=activation,
                                        precision=self.precision, out_dtype=self.out_dtype, k_block=self.k_block,
                                        config=self.config)

    def _activated(self, z, rhs, group_sizes, group_offset):
        return activated(z, self.activation, group_sizes, group_offset, rhs.shape[0], self.out_dtype)

    def primal(self, lhs, rhs, group_sizes, group_offset):
        if fusable_in_kernel(self.activation):
            return self._gmm(lhs, rhs, group_sizes, group_offset, self.activation)
        return self._activated(self._gmm(lhs, rhs, group_sizes, group_offset, None), rhs, group_sizes, group_offset)

    def forward(self, lhs, rhs, group_sizes, group_offset):
        z = self._gmm(lhs, rhs, group_sizes, group_offset, None)
        saved = z if self.activation is not None else None
        return self._activated(z, rhs, group_sizes, group_offset), (rhs, group_sizes, group_offset, saved)

    def backward(self, residuals, dy):
        rhs, group_sizes, group_offset, z = residuals
        dz = dy if z is None else activation_grad(self.activation, dy, z, False)
        dlhs = self.backend.kernels.gmm_transposed(dz.astype(self.lhs_dtype), rhs, group_sizes, group_offset,
                                                   precision=self.precision, out_dtype=self.lhs_dtype,
                                                   k_block=self.k_block, config=self.config)
        return dlhs, None, None, None  # frozen weights


def _run(backend: Backend, call: Call, config):
    rule = _QuantizedRaggedDot(backend, config, call.activation, call.precision, call.out_dtype,
                               np.dtype(call.lhs.dtype), quantized_k_block(call))
    out = vjp.apply(rule, call.lhs, quantized_rhs(call), call.group_sizes, call.group_offset)
    return poison_bad_offset(out, call.group_sizes, call.group_offset, call.rhs_shape[0])


def _flops(call: Call) -> float:
    m, k, n, _ = quantized_dims(call)
    return 2.0 * m * k * n


def _bytes(call: Call) -> float:
    m, k, n, _ = quantized_dims(call)
    weights = sum(float(np.prod(call.arrays[a].shape)) * np.dtype(call.arrays[a].dtype).itemsize
                  for a in QUANTIZED_ARRAYS if call.arrays[a] is not None)
    return float(m * k * np.dtype(call.lhs.dtype).itemsize + weights + m * n * np.dtype(call.out_dtype).itemsize)


ragged_dot_quantized_op = QUANTIZED_BACKENDS.op(
    "ragged_dot_quantized", _run, check=check_ragged_dot_quantized, reference=reference,
    flops=_flops, bytes_accessed=_bytes, examples=quantized_examples, benchmarks=quantized_benchmarks,
    peers=QUANTIZED_PEERS, differentiable=("lhs",))


def ragged_dot_quantized(lhs, rhs: QArray, group_sizes, precision=None, preferred_element_type=None,
                         group_offset=None, *, activation=None, implementation=None, config=None):
    """`ragged_dot` with a `QArray` ``rhs [G, K, N]`` quantized along axis 1 (see the module doc).

    ``lhs [M, K]`` float32/bfloat16/float16 → ``act(lhs @ dequantize(rhs[g]))`` ``[M, N]``
    in ``preferred_element_type`` (default ``lhs.dtype``); gradients w.r.t. ``lhs`` only.
    ``precision``: of the float32 products (float32 ``lhs``; the weights are decoded to
    ``lhs.dtype``), forward and backward, as for `ragged_dot` (see `stellax.core.precision`).

    ``implementation``: ``None`` (the best available), ``"mosaic_tpu"`` (config:
    `TpuGroupedMatmulConfig`; fp8 codes only on generations with float8; its dlhs is the XLA
    loop), ``"triton"`` (`GroupedMatmulConfig`, ``block_k`` capped at the scales' K block),
    ``"xla"`` (`XlaGroupedMatmulConfig`) or a sequence tried in order."""
    args, kwargs = flatten_quantized(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                     activation)
    return ragged_dot_quantized_op(*args, **kwargs, implementation=implementation, config=config)
