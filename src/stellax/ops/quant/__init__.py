"""Fused quantization: formats (int8/int4/fp8/MXFP8/MXFP4/NVFP4), `QArray`,
Hadamard rotations and quantized matmuls. See docs/quant.md.

One op per module: `quantize`, `dequantize`, `hadamard_transform` and
`matmul` (`quantized_matmul`); what they share is in `base`, their examples
in `examples`, the Pallas Triton kernels in `triton`, the Mosaic TPU kernels in
`mosaic_tpu` / `mosaic_tpu_matmul` (configs in `tpu_configs`)."""

from .configs import DequantConfig, HadamardConfig, QMatmulConfig, QuantizeConfig
from .dequantize import dequantize, dequantize_op
from .formats import FORMATS, get_format
from .hadamard_transform import hadamard_op, hadamard_transform
from .matmul import quantized_matmul, quantized_matmul_op
from .qarray import QArray
from .quantize import quantize, quantize_op
from .tpu_configs import HadamardTpuConfig, QMatmulTpuConfig, QuantTpuConfig
from .recipes import QuantRecipe, get_recipe
from .training import quantized_linear, quantized_linear_reference

__all__ = ["FORMATS", "DequantConfig", "HadamardConfig", "HadamardTpuConfig", "QMatmulTpuConfig", "QuantTpuConfig", "QArray", "QMatmulConfig", "QuantizeConfig", "dequantize", "dequantize_op", "get_format",
           "hadamard_op", "hadamard_transform", "quantize", "quantize_op",
           "quantized_matmul", "quantized_matmul_op",
           "QuantRecipe", "get_recipe", "quantized_linear", "quantized_linear_reference"]
