"""Fused quantization: formats (int8/int4/fp8/MXFP8/MXFP4/NVFP4), `QArray`,
Hadamard rotations and quantized matmuls. See docs/quant.md."""

from .api import dequantize, dequantize_op, hadamard_op, hadamard_transform, quantize, quantize_op
from .configs import DequantConfig, HadamardConfig, QMatmulConfig, QuantizeConfig
from .formats import FORMATS, get_format
from .matmul import quantized_matmul, quantized_matmul_op
from .qarray import QArray

__all__ = ["FORMATS", "DequantConfig", "HadamardConfig", "QArray", "QMatmulConfig", "QuantizeConfig", "dequantize", "dequantize_op", "get_format",
           "hadamard_op", "hadamard_transform", "quantize", "quantize_op",
           "quantized_matmul", "quantized_matmul_op"]
