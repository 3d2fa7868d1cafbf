"""Paged KV-cache helpers: `stellax.paged.validate(...)`, cache creation and
update, quantized cache formats, calibrated rotations and clip thresholds
(`calibrate_kv_rotation`, `calibrate_kv_clip`, saved with `save_kv_rotation`)
and random test caches.

The attention ops themselves (`paged_attention`, `ragged_paged_attention`,
`mla_decode`) are in the top-level `stellax` namespace and re-exported here.
"""

from .ops.paged_attention import (
    KVQuant, MlaConfig, PagedConfig, QuantizedPages, RaggedConfig, dequantize_pages, hadamard, init_kv_cache,
    mla_decode, pack_codes, paged_attention, quantize_pages, ragged_paged_attention, rotate, rotation_signs,
    unpack_codes, unrotate, update_kv_cache, validate,
)
from .ops.paged_attention.rotation import (
    KVClip, KVRotation, calibrate_kv_clip, calibrate_kv_rotation, load_kv_rotation, save_kv_rotation,
)
from .ops.paged_attention.examples import mla_inputs, paged_inputs, ragged_inputs, random_block_tables

__all__ = [
    "KVClip", "KVRotation", "calibrate_kv_clip", "calibrate_kv_rotation", "load_kv_rotation", "save_kv_rotation",
    "KVQuant", "MlaConfig", "PagedConfig", "QuantizedPages", "RaggedConfig", "dequantize_pages", "hadamard",
    "init_kv_cache", "mla_decode", "mla_inputs", "pack_codes", "paged_attention", "paged_inputs", "quantize_pages",
    "ragged_inputs", "ragged_paged_attention", "random_block_tables", "rotate", "rotation_signs", "unpack_codes",
    "unrotate", "update_kv_cache", "validate",
]
