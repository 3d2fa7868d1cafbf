"""PyTorch front ends of stellax: every op as a ``stellax::`` torch custom op
(autograd through the JAX VJP, fake implementations for ``torch.compile``),
zero-copy DLPack exchange, ``nn.Module`` drop-ins and a Hugging Face
transformers attention backend. See docs/torch.md."""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise ImportError("stellax.torch needs PyTorch: pip install 'stellax[torch]'") from e

from .bridge import PackedTensor, jax_dtype, to_jax, to_torch, torch_dtype
from .registry import ForwardOnlyError, TorchOp, cache_info, clear_cache, define_op, registered_torch_ops

from .attention import dot_product_attention, dot_product_attention_varlen
from .attention_fp8 import quantize_for_attention
from .glu import gated_linear_unit
from .linear_attention import (GatedDeltaNet, chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule,
                               fused_recurrent_kda, ssd, ssd_step)
from .loss import linear_cross_entropy
from .moe import (MoE, load_balancing_loss, moe_mlp, permute, ragged_dot, ragged_dot_general, ragged_dot_tgmm, route,
                  router_z_loss, unpermute)
from .norm import layer_norm, rms_norm
from .paged import (QuantizedPages, dequantize_pages, init_kv_cache, mla_decode, paged_attention, quantize_pages,
                    ragged_paged_attention, update_kv_cache, update_kv_cache_)
from .quant import QTensor, dequantize, hadamard_transform, quantize, quantized_matmul
from .quantized_linear import QuantizedLinear, quantized_linear
from .modules import GatedMLP, LayerNorm, RMSNorm
from .hf import register_transformers_attention
from .patching import PatchReport, apply_kernels
from .parallel import (context_parallel_attention, context_parallel_gated_delta_rule, context_parallel_kda,
                       moe_mlp_expert_parallel, register_mesh, reorder_for_load_balance,
                       restore_from_load_balance)
from stellax.ops.paged_attention import KVQuant  # the cache format spec (plain Python; shared with JAX)

__all__ = [
    "ForwardOnlyError", "GatedDeltaNet", "QuantizedLinear", "quantized_linear", "PatchReport", "apply_kernels", "GatedMLP", "KVQuant", "LayerNorm", "MoE", "PackedTensor", "QTensor", "QuantizedPages", "RMSNorm", "TorchOp", "cache_info", "context_parallel_attention",
    "context_parallel_gated_delta_rule", "context_parallel_kda",
    "chunk_gated_delta_rule", "chunk_kda", "clear_cache", "define_op", "dequantize", "dequantize_pages", "dot_product_attention",
    "dot_product_attention_varlen", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "gated_linear_unit",
    "hadamard_transform", "init_kv_cache", "jax_dtype", "layer_norm", "linear_cross_entropy", "load_balancing_loss", "mla_decode", "moe_mlp", "moe_mlp_expert_parallel", "permute", "paged_attention", "quantize", "quantize_for_attention", "quantize_pages", "quantized_matmul",
    "ragged_dot", "ragged_dot_general", "ragged_dot_tgmm", "ragged_paged_attention", "register_mesh", "register_transformers_attention", "reorder_for_load_balance",
    "restore_from_load_balance",
    "registered_torch_ops", "rms_norm", "route", "router_z_loss", "unpermute", "ssd", "ssd_step", "to_jax", "update_kv_cache", "update_kv_cache_", "to_torch", "torch_dtype",
]
