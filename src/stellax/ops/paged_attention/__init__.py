"""Serving attention over paged KV caches: decode, ragged batches, MLA, quantized caches.

The public functions and ops (`paged_attention`, `ragged_paged_attention`,
`mla_decode`) and the cache helpers are in `api`; the shared checks, cost
models and backend tables in `base`; the cache layout and updates in
`cache` / `quant_cache`, calibrated rotations in `rotation`, `validate` in
`validation`; one internal problem for every path in `plan`, run by `xla`,
the Triton kernels in `triton` and the Mosaic TPU kernels in `mosaic_tpu` /
`mosaic_tpu_mla`; all configs in `configs`."""

from .api import (
    KVClip, KVQuant, KVRotation, MlaConfig, PagedConfig, QuantizedPages, RaggedConfig, TpuMlaConfig, TpuPagedConfig,
    TpuRaggedConfig, calibrate_kv_clip, calibrate_kv_rotation, dequantize_pages, hadamard, init_kv_cache,
    load_kv_rotation, mla_decode, mla_decode_op, mla_inputs, pack_codes, paged_attention, paged_attention_op,
    paged_inputs, quantize_pages, ragged_inputs, ragged_paged_attention, ragged_paged_attention_op,
    random_block_tables, rotate, rotation_signs, save_kv_rotation, unpack_codes, unrotate, update_kv_cache, validate,
)
from .api import __all__
