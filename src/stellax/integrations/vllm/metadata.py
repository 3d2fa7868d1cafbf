"""The per-step metadata of the stellax vLLM backend and the cache view.

Pure torch (no vLLM import). One step of vLLM's v1 engine is a packed batch
of query tokens from many requests: prefills, chunked prefills, decodes and
prefix-cache hits mixed. vLLM describes it with ``query_start_loc [R + 1]``
(cumulative query lengths), ``seq_lens [R]`` (tokens in the cache after this
step, new ones included), ``block_table [R, W]`` (page ids) and
``slot_mapping [T]`` (where each new token is written). That is exactly the
contract of `stellax.ragged_paged_attention` (``cu_q_lens``, ``kv_lens``,
``block_tables``, ``num_seqs``), so building the metadata is padding, not
translation:

* token and request counts are padded up to powers of two (`bucket`), and
  the padding requests get no tokens and an empty cache, because every new
  shape is a new XLA compilation; with buckets a whole generation compiles a
  handful of programs instead of one per step;
* ``num_seqs`` carries the live request count, so padded rows are ignored.

The KV cache: vLLM allocates each layer's cache as one buffer of pages and
hands the backend a logical ``[num_blocks, H, N, C]`` view (``C`` bytes per
cell) in the resolved layout. The backend declares only layer-compact,
block-contiguous layouts, so the layer's pages are one contiguous run;
`paged_kv_view` reinterprets it, without a copy, as stellax's combined pool
``kv_pages [num_blocks, block_size, 2, K, D]`` (keys at ``[:, :, 0]``,
values at ``[:, :, 1]``). vLLM never reads the page contents (prefix caching
and scheduling only move page ids), so the backend owns their order.
"""

from __future__ import annotations

import dataclasses

import torch

#: Smallest padded token / request count.
MIN_TOKENS = 16
MIN_SEQS = 8


def bucket(n: int, minimum: int) -> int:
    """The smallest power of two ``>= max(n, minimum)``."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass
class StellaxAttentionMetadata:
    """One step's arguments of `stellax.ragged_paged_attention`, padded.

    Attributes:
      num_actual_tokens: real query tokens this step (``T``).
      padded_tokens: ``T`` rounded up by `bucket` (the query rows passed to stellax).
      num_reqs: live requests (``R``).
      cu_q_lens: int32 ``[S + 1]``, ``S = bucket(R)``: ``query_start_loc``
        padded with its last value (padding requests own no tokens).
      kv_lens: int32 ``[S]``: ``seq_lens`` padded with zeros.
      block_tables: int32 ``[S, W]``: vLLM's block table padded with page 0 rows.
      num_seqs: int32 ``[1]``: ``R``.
      slot_mapping: int64 ``[T]``: cache slot of each new token (``page * block_size + offset``,
        negative = padding), for the cache write.
      max_query_len, max_seq_len: as vLLM computed them (diagnostics).
    """

    num_actual_tokens: int
    padded_tokens: int
    num_reqs: int
    cu_q_lens: torch.Tensor
    kv_lens: torch.Tensor
    block_tables: torch.Tensor
    num_seqs: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int = 0
    max_seq_len: int = 0


def build_metadata(*, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                   slot_mapping: torch.Tensor, num_reqs: int, num_actual_tokens: int, max_query_len: int = 0,
                   max_seq_len: int = 0) -> StellaxAttentionMetadata:
    """Pad vLLM's step description (`CommonAttentionMetadata` fields) into
    `StellaxAttentionMetadata` (see the module docstring)."""
    num_reqs, num_actual_tokens = int(num_reqs), int(num_actual_tokens)
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < num_reqs + 1:
        raise ValueError(f"query_start_loc: expected at least num_reqs + 1 = {num_reqs + 1} entries, "
                         f"got shape {tuple(query_start_loc.shape)}")
    if seq_lens.ndim != 1 or seq_lens.shape[0] < num_reqs:
        raise ValueError(f"seq_lens: expected at least num_reqs = {num_reqs} entries, got shape "
                         f"{tuple(seq_lens.shape)}")
    if block_table.ndim != 2 or block_table.shape[0] < num_reqs:
        raise ValueError(f"block_table: expected [>= num_reqs = {num_reqs}, W], got shape "
                         f"{tuple(block_table.shape)}")
    device = query_start_loc.device
    seqs = bucket(num_reqs, MIN_SEQS)
    tokens = bucket(num_actual_tokens, MIN_TOKENS)
    cu = torch.empty(seqs + 1, dtype=torch.int32, device=device)
    cu[: num_reqs + 1] = query_start_loc[: num_reqs + 1]
    cu[num_reqs + 1:] = cu[num_reqs]
    kv = torch.zeros(seqs, dtype=torch.int32, device=device)
    kv[:num_reqs] = seq_lens[:num_reqs]
    tables = torch.zeros(seqs, block_table.shape[1], dtype=torch.int32, device=device)
    tables[:num_reqs] = block_table[:num_reqs]
    return StellaxAttentionMetadata(
        num_actual_tokens=num_actual_tokens, padded_tokens=tokens, num_reqs=num_reqs, cu_q_lens=cu, kv_lens=kv,
        block_tables=tables, num_seqs=torch.tensor([num_reqs], dtype=torch.int32, device=device),
        slot_mapping=slot_mapping[:num_actual_tokens].to(torch.int64), max_query_len=int(max_query_len),
        max_seq_len=int(max_seq_len))


def paged_kv_view(kv_cache: torch.Tensor, *, block_size: int, num_kv_heads: int, head_size: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """A layer's cache as ``kv_pages [num_blocks, block_size, 2, K, D]`` in
    ``dtype``, sharing its memory (see the module docstring).

    ``kv_cache`` is vLLM's logical ``[num_blocks, ...]`` view of the layer:
    its dimensions, sorted by stride, must tile one contiguous run of memory
    (true of the layer-compact layouts the backend declares); otherwise this
    raises naming the layout problem instead of copying.
    """
    num_blocks = kv_cache.shape[0]
    order = sorted(range(kv_cache.ndim), key=lambda d: (-kv_cache.stride(d), d))
    physical = kv_cache.permute(*order)
    if physical.ndim and order[0] != 0 and kv_cache.shape[order[0]] != 1:
        raise ValueError(f"kv_cache: pages must be the outermost dimension of a layer's cache (a layer-compact "
                         f"layout such as LBNHC), got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    if not physical.is_contiguous():
        raise ValueError(f"kv_cache: expected one contiguous run of pages (no padding between pages), got shape "
                         f"{tuple(kv_cache.shape)} strides {kv_cache.stride()}")
    flat = physical.reshape(-1)
    if flat.dtype != dtype:
        flat = flat.view(dtype)
    per_block = block_size * 2 * num_kv_heads * head_size
    if flat.numel() != num_blocks * per_block:
        raise ValueError(f"kv_cache: expected {num_blocks} pages of {per_block} {dtype} values "
                         f"(block_size={block_size} x 2 x num_kv_heads={num_kv_heads} x head_size={head_size}), "
                         f"got {flat.numel()} values in shape {tuple(kv_cache.shape)}")
    return flat.view(num_blocks, block_size, 2, num_kv_heads, head_size)
