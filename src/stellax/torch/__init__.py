"""PyTorch front ends of stellax: every op as a ``stellax::`` torch custom op
(autograd, fake implementations for ``torch.compile``), zero-copy DLPack
exchange, ``nn.Module`` drop-ins and a Hugging Face transformers attention
backend. See docs/torch.md."""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise ImportError("stellax.torch needs PyTorch: pip install 'stellax[torch]'") from e

from .bridge import PackedTensor, jax_dtype, to_jax, to_torch, torch_dtype
from .registry import TorchOp, cache_info, clear_cache, define_op, registered_torch_ops
from .norm import layer_norm, rms_norm
from .glu import gated_linear_unit
from .modules import GatedMLP, LayerNorm, RMSNorm
from .attention import dot_product_attention, dot_product_attention_varlen
from .hf import register_transformers_attention
from .moe import MoE, moe_mlp, ragged_dot, route
from .linear_attention import (GatedDeltaNet, chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule,
                               fused_recurrent_kda, ssd)
from .quant import QTensor, dequantize, hadamard_transform, quantize, quantized_matmul
from .paged import paged_attention, ragged_paged_attention
