"""Serving attention over paged KV caches: decode, ragged batches, MLA, quantized caches."""

from .api import (
    mla_decode, mla_decode_op, paged_attention, paged_attention_op, ragged_paged_attention,
    ragged_paged_attention_op,
)
from .cache import init_kv_cache, update_kv_cache, validate
from .configs import MlaConfig, PagedConfig, RaggedConfig
from .quant_cache import (
    KVQuant, QuantizedPages, dequantize_pages, hadamard, pack_codes, quantize_pages, rotate, rotation_signs,
    unpack_codes, unrotate,
)

__all__ = [
    "KVQuant", "MlaConfig", "PagedConfig", "QuantizedPages", "RaggedConfig", "dequantize_pages", "hadamard",
    "init_kv_cache", "mla_decode", "mla_decode_op", "pack_codes", "paged_attention", "paged_attention_op",
    "quantize_pages", "ragged_paged_attention", "ragged_paged_attention_op", "rotate", "rotation_signs",
    "unpack_codes", "unrotate", "update_kv_cache", "validate",
]
