"""Deprecated alias of `stellax.ops.paged_attention` (its `api`), kept so that
``from stellax import paged`` / ``stellax.paged.validate(...)`` keep working.

Import the paged KV-cache helpers (`validate`, cache creation and update,
quantized cache formats, calibrated rotations and clip thresholds, random
test caches) from `stellax.ops.paged_attention`; the attention ops
themselves (`paged_attention`, `ragged_paged_attention`, `mla_decode`) are
in the top-level `stellax` namespace.
"""

from .ops.paged_attention.api import (  # noqa: F401  (re-exports)
    KVClip, KVQuant, KVRotation, MlaConfig, PagedConfig, QuantizedPages, RaggedConfig, calibrate_kv_clip,
    calibrate_kv_rotation, dequantize_pages, hadamard, init_kv_cache, load_kv_rotation, mla_decode, mla_inputs,
    pack_codes, paged_attention, paged_inputs, quantize_pages, ragged_inputs, ragged_paged_attention,
    random_block_tables, rotate, rotation_signs, save_kv_rotation, unpack_codes, unrotate, update_kv_cache, validate,
)

__all__ = [
    "KVClip", "KVRotation", "calibrate_kv_clip", "calibrate_kv_rotation", "load_kv_rotation", "save_kv_rotation",
    "KVQuant", "MlaConfig", "PagedConfig", "QuantizedPages", "RaggedConfig", "dequantize_pages", "hadamard",
    "init_kv_cache", "mla_decode", "mla_inputs", "pack_codes", "paged_attention", "paged_inputs", "quantize_pages",
    "ragged_inputs", "ragged_paged_attention", "random_block_tables", "rotate", "rotation_signs", "unpack_codes",
    "unrotate", "update_kv_cache", "validate",
]
