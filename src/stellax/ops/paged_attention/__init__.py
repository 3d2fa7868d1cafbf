"""Serving attention over paged KV caches: decode, ragged batches, MLA, quantized caches.

One op per module: `paged` (`paged_attention`), `ragged`
(`ragged_paged_attention`) and `mla` (`mla_decode`); their shared checks,
cost-model pieces and op constructor in `base`; the cache layout and updates
in `cache` / `quant_cache`, `validate` in `validation`; one internal problem
for both paths in `plan`, run by `xla` and the Triton kernels in `triton`."""

from .cache import init_kv_cache, update_kv_cache
from .configs import MlaConfig, PagedConfig, RaggedConfig
from .mla import mla_decode, mla_decode_op
from .paged import paged_attention, paged_attention_op
from .quant_cache import (
    KVQuant, QuantizedPages, dequantize_pages, hadamard, pack_codes, quantize_pages, rotate, rotation_signs,
    unpack_codes, unrotate,
)
from .ragged import ragged_paged_attention, ragged_paged_attention_op
from .rotation import KVClip, KVRotation, calibrate_kv_clip, calibrate_kv_rotation, load_kv_rotation, save_kv_rotation
from .validation import validate

__all__ = [
    "KVQuant", "MlaConfig", "PagedConfig", "QuantizedPages", "RaggedConfig", "dequantize_pages", "hadamard",
    "init_kv_cache", "mla_decode", "mla_decode_op", "pack_codes", "paged_attention", "paged_attention_op",
    "quantize_pages", "ragged_paged_attention", "ragged_paged_attention_op", "rotate", "rotation_signs",
    "unpack_codes", "unrotate", "update_kv_cache", "validate",
    "KVClip", "KVRotation", "calibrate_kv_clip", "calibrate_kv_rotation", "load_kv_rotation", "save_kv_rotation",
]
