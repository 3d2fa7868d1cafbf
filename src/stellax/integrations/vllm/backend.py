"""The stellax attention backend for vLLM's v1 engine (``STELLAX``).

* `StellaxAttentionBackend`: what vLLM asks of a backend: the name, the
  implementation and metadata-builder classes, the dtypes, cache dtypes,
  block sizes and KV-cache layouts it runs, and which model features it has
  (sliding window, sinks; no ALiBi, no MLA, no encoder attention).
* `StellaxMetadataBuilder`: vLLM's `CommonAttentionMetadata` of a step →
  `StellaxAttentionMetadata` (`metadata.build_metadata`: the step's
  ``cu_q_lens`` / ``kv_lens`` / block tables, padded to compile-once shapes).
* `StellaxAttentionImpl`: the layer. ``do_kv_cache_update`` writes the
  step's new keys and values into the layer's pages in place
  (`stellax.torch.update_kv_cache_`); ``forward`` runs
  `stellax.torch.ragged_paged_attention` over the same pages: the cache
  crosses to JAX over DLPack without a copy, the result comes back the same
  way and is written into vLLM's output buffer.
* fp8 caches (``--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2``): the write
  quantizes with the layer's ``_k_scale_float`` / ``_v_scale_float`` exactly
  as vLLM's CPU backend does (`fp8.fp8_codes`, truncating, bit for bit the
  same codes); ``forward`` reads the codes in place as two
  `stellax.torch.QuantizedPages` sharing the page buffer, with per-tensor
  scales (`KVQuant(group_axis="tensor", part=0|1)`): ``k ≈ code · k_scale``.

On a CPU stellax runs its XLA path; on a GPU or TPU the same call runs the
device kernels (``implementation=None`` picks the best available).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionType, CommonAttentionMetadata, MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from . import fp8, support
from .metadata import StellaxAttentionMetadata, build_metadata, paged_kv_view

NAME = "STELLAX"


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StellaxAttentionBackend(AttentionBackend):
    """vLLM's view of the stellax backend (see the module docstring)."""

    # vLLM calls do_kv_cache_update before forward (separately, so the write is its own op).
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(support.KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type["StellaxAttentionImpl"]:
        return StellaxAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["StellaxMetadataBuilder"]:
        return StellaxMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Any page size runs; multiples of 16 keep the GPU / TPU kernels' tiles whole.
        return [MultipleOf(16)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Layer-compact layouts whose pages are contiguous: `paged_kv_view` reads them in place.
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class StellaxMetadataBuilder(AttentionMetadataBuilder[StellaxAttentionMetadata]):
    """Builds one `StellaxAttentionMetadata` per step for a KV-cache group.

    No batch reordering: `stellax.ragged_paged_attention` takes prefills and
    decodes in any order."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Built with the KV cache, before the first request: what only the cache spec tells is checked here.
        head_size = kv_cache_spec.head_size
        support.check_layer(num_heads=kv_cache_spec.num_kv_heads, num_kv_heads=kv_cache_spec.num_kv_heads,
                            head_size=head_size, head_size_v=getattr(kv_cache_spec, "head_size_v", head_size))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> StellaxAttentionMetadata:
        m = common_attn_metadata
        if isinstance(m.causal, torch.Tensor) or not m.causal:
            raise support.UnsupportedByStellax("causal: the stellax attention backend runs causal attention only, "
                                               f"got causal={m.causal!r}")
        # The device tensors: the metadata lives where the cache does (a GPU's stellax call gets no host arrays).
        return build_metadata(query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                              block_table=m.block_table_tensor, slot_mapping=m.slot_mapping, num_reqs=m.num_reqs,
                              num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                              max_seq_len=m.max_seq_len)


class StellaxAttentionImpl(AttentionImpl[StellaxAttentionMetadata]):
    """One attention layer on stellax's ragged paged attention.

    Options are checked here, when vLLM builds the model (`support.check_layer`),
    so an unsupported model or cache dtype fails at start-up, never at the first request."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None, **extra) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        support.check_kv_cache_dtype(kv_cache_dtype)
        support.check_layer(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                            alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                            logits_soft_cap=logits_soft_cap, attn_type=attn_type,
                            kv_sharing_target_layer_name=kv_sharing_target_layer_name, extra=extra)
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise support.UnsupportedByStellax(f"sinks: expected one logit per query head, shape ({num_heads},), "
                                               f"got {tuple(sinks.shape)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self.window_left = support.window_left(sliding_window)
        self.logits_soft_cap = support.soft_cap(logits_soft_cap)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._pages: dict[tuple, torch.Tensor] = {}  # (data_ptr, shape, dtype) → kv_pages view of the bound cache
        # fp8 caches: the code dtype, and the layer's scales as float32 tensors (keyed by their values).
        self.code_dtype = fp8.FP8_CACHE_DTYPES.get(kv_cache_dtype)
        self._scales: tuple[tuple[float, float], torch.Tensor, torch.Tensor] | None = None

    # -- the cache -------------------------------------------------------------------------
    def kv_pages(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer's cache as ``kv_pages [num_blocks, block_size, 2, K, D]`` in ``dtype``
        (a view, cached per buffer and dtype)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape), dtype)
        view = self._pages.get(key)
        if view is None:
            if len(self._pages) > 4:  # a rebound cache: drop the old buffer's views
                self._pages.clear()
            view = self._pages[key] = paged_kv_view(kv_cache, block_size=self._block_size(kv_cache),
                                                    num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                                                    dtype=dtype)
        return view

    def _block_size(self, kv_cache: torch.Tensor) -> int:
        """Tokens per page of vLLM's logical ``[num_blocks, H, N, C]`` layer view."""
        if kv_cache.ndim != 4 or kv_cache.shape[1] != self.num_kv_heads:
            raise ValueError(f"kv_cache: expected vLLM's [num_blocks, num_kv_heads={self.num_kv_heads}, "
                             f"block_size, 2 * head_size] layer view, got shape {tuple(kv_cache.shape)}")
        return int(kv_cache.shape[2])

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys / values ``[T, K, D]`` into the pages, in place."""
        from stellax.torch import update_kv_cache_

        n = slot_mapping.shape[0]
        if self.code_dtype is not None:  # vLLM's fp8 codes, written as its CPU backend writes them
            fp8.write_kv(self.kv_pages(kv_cache, torch.uint8), key[:n], value[:n], slot_mapping,
                         *self._scale_floats(layer), self.kv_cache_dtype)
            return
        pages = self.kv_pages(kv_cache, key.dtype)
        update_kv_cache_(pages[:, :, 0], pages[:, :, 1], key[:n], value[:n], slot_mapping)

    @staticmethod
    def _scale_floats(layer) -> tuple[float, float]:
        """The layer's per-tensor fp8 scales (the floats vLLM's CPU backend reads)."""
        return float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0))

    def _pools(self, layer, kv_cache: torch.Tensor):
        """fp8: the key and value pools over the layer's pages (one buffer, read in place)."""
        codes = self.kv_pages(kv_cache, self.code_dtype)
        floats = self._scale_floats(layer)
        if self._scales is None or self._scales[0] != floats:  # traced operands: no recompilation per value
            self._scales = (floats, *(torch.tensor(f, dtype=torch.float32, device=codes.device) for f in floats))
        return fp8.kv_pools(codes, self._scales[1], self._scales[2], self.kv_cache_dtype, self.head_size)

    # -- attention -------------------------------------------------------------------------
    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: StellaxAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``output[:T] = ragged_paged_attention(query[:T], pages, ...)``; ``query [T', N, D]``."""
        if output_scale is not None or output_block_scale is not None:
            raise support.UnsupportedByStellax("output_scale: fused output quantization is not supported by the "
                                               "stellax attention backend")
        if attn_metadata is None:  # vLLM's profiling / warm-up run: no cache yet
            return output
        from stellax.torch import ragged_paged_attention

        m = attn_metadata
        t = m.num_actual_tokens
        if self.code_dtype is not None:
            k_pages, v_pages = self._pools(layer, kv_cache)
        else:
            k_pages, v_pages = self.kv_pages(kv_cache, query.dtype), None
        q = query.new_zeros((m.padded_tokens, self.num_heads, self.head_size))
        q[:t] = query[:t]
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()
        out = ragged_paged_attention(q, k_pages, v_pages, m.kv_lens, m.block_tables, m.cu_q_lens, m.num_seqs,
                                     scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                                     local_window_size=self.window_left, sinks=sinks)
        output[:t].copy_(out[:t].view(output[:t].shape))
        return output
