"""Fused quantization: formats (int8/int4/fp8/MXFP8/MXFP4/NVFP4), `QArray`,
Hadamard rotations and quantized matmuls. See docs/quant.md.

The ops and public functions (`quantize`, `dequantize`, `hadamard_transform`,
`quantized_matmul`) and the backend table are in `api`; the argument checks and
what the ops share in `base`; the configs of every backend in `configs`; the
kernels in `mosaic_tpu` / `mosaic_tpu_matmul` (Pallas Mosaic TPU), `triton` /
`triton_matmul` (Pallas Triton) and `xla`; the formats, `QArray`, the goldens and
the training recipes in `formats`, `qarray`, `reference`, `recipes` and `training`."""

from .api import (dequantize, dequantize_op, hadamard_op, hadamard_transform, quantize, quantize_op,
                  quantized_matmul, quantized_matmul_op)
from .configs import (DequantConfig, HadamardConfig, HadamardTpuConfig, QMatmulConfig, QMatmulTpuConfig,
                      QuantizeConfig, QuantTpuConfig)
from .formats import FORMATS, get_format
from .qarray import QArray
from .recipes import QuantRecipe, get_recipe
from .training import quantized_linear, quantized_linear_reference

__all__ = ["FORMATS", "DequantConfig", "HadamardConfig", "HadamardTpuConfig", "QMatmulTpuConfig", "QuantTpuConfig",
           "QArray", "QMatmulConfig", "QuantizeConfig", "dequantize", "dequantize_op", "get_format",
           "hadamard_op", "hadamard_transform", "quantize", "quantize_op",
           "quantized_matmul", "quantized_matmul_op",
           "QuantRecipe", "get_recipe", "quantized_linear", "quantized_linear_reference"]
