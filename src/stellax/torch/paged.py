"""Torch front ends of paged-KV-cache attention (serving): `paged_attention`
(decode / multi-token decode) and `ragged_paged_attention` (mixed prefill +
decode steps), vLLM / FlashAttention cache layout ``[num_pages, page_size,
K, H]``. Inference ops: no autograd (dense caches only; quantized pages stay
on the JAX side)."""

from __future__ import annotations

import torch

from .registry import define_op


def _paged():
    from stellax.ops import paged_attention
    return paged_attention


def _window(local_window_size):
    if local_window_size is None:
        return None
    return int(local_window_size[0]) if isinstance(local_window_size, (tuple, list)) else int(local_window_size)


def _paged_attention(q, k_pages, v_pages, block_tables, lengths, sinks, *, scale, logits_soft_cap,
                     local_window_size, implementation):
    return _paged().paged_attention(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                    logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                                    sinks=sinks, implementation=implementation)


_OPTIONS = {"scale": "float?", "logits_soft_cap": "float?", "local_window_size": "int?", "implementation": "str?"}

paged_attention_op = define_op(
    "paged_attention", _paged_attention,
    tensors=("q", "k_pages", "v_pages", "block_tables!", "lengths!", "sinks?"), options=_OPTIONS,
    differentiable=False,
    fake=lambda q, k_pages, v_pages, *r, **_: q.new_empty((*q.shape[:-1], v_pages.shape[-1])))


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                    lengths: torch.Tensor, *, scale: float | None = None, logits_soft_cap: float | None = None,
                    local_window_size=None, sinks: torch.Tensor | None = None,
                    implementation: str | None = None) -> torch.Tensor:
    """Attention of new tokens against a paged KV cache.

    ``q [B, N, H]`` (one new token) or ``[B, Q, N, H]`` (the last ``Q``
    positions, bottom-right causal); ``k_pages``/``v_pages`` ``[num_pages,
    page_size, K, H]``; ``block_tables [B, max_pages]`` and ``lengths [B]``
    integers (tokens in the cache, new ones included). Returns
    ``[B, (Q,) N, Hv]``."""
    return paged_attention_op(q, k_pages, v_pages, block_tables.to(torch.int32), lengths.to(torch.int32), sinks,
                              None if scale is None else float(scale),
                              None if logits_soft_cap is None else float(logits_soft_cap),
                              _window(local_window_size), implementation)


def _ragged(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, *, scale, logits_soft_cap,
            local_window_size, implementation):
    return _paged().ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
                                           scale=scale, logits_soft_cap=logits_soft_cap,
                                           local_window_size=local_window_size, sinks=sinks,
                                           implementation=implementation)


ragged_paged_attention_op = define_op(
    "ragged_paged_attention", _ragged,
    tensors=("q", "k_pages", "v_pages", "kv_lens!", "block_tables!", "cu_q_lens!", "num_seqs!", "sinks?"),
    options=_OPTIONS, differentiable=False,
    fake=lambda q, k_pages, v_pages, *r, **_: q.new_empty((*q.shape[:-1], v_pages.shape[-1])))


def ragged_paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, kv_lens: torch.Tensor,
                           block_tables: torch.Tensor, cu_q_lens: torch.Tensor, num_seqs, *,
                           scale: float | None = None, logits_soft_cap: float | None = None, local_window_size=None,
                           sinks: torch.Tensor | None = None, implementation: str | None = None) -> torch.Tensor:
    """One serving step over packed new tokens ``q [total_q, N, H]`` of many
    sequences (prefills, chunked prefills and decodes mixed): sequence ``s``
    owns ``q[cu_q_lens[s]:cu_q_lens[s+1]]``, the last positions of its
    ``kv_lens[s]`` cached tokens. ``num_seqs`` (int or tensor) live sequences.
    Returns ``[total_q, N, Hv]``."""
    if not isinstance(num_seqs, torch.Tensor):
        num_seqs = torch.tensor([int(num_seqs)], dtype=torch.int32, device=q.device)
    i32 = lambda t: t.to(torch.int32)
    return ragged_paged_attention_op(q, k_pages, v_pages, i32(kv_lens), i32(block_tables), i32(cu_q_lens),
                                     i32(num_seqs).reshape(1), sinks, None if scale is None else float(scale),
                                     None if logits_soft_cap is None else float(logits_soft_cap),
                                     _window(local_window_size), implementation)


def _mla(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, *, scale, logits_soft_cap, local_window_size,
         implementation):
    return _paged().mla_decode(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, scale=scale,
                               logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                               implementation=implementation)


mla_decode_op = define_op(
    "mla_decode", _mla, tensors=("q_nope", "q_pe", "latent_pages", "pe_pages", "block_tables!", "lengths!"),
    options={"scale": "float", "logits_soft_cap": "float?", "local_window_size": "int?", "implementation": "str?"},
    differentiable=False, fake=lambda q_nope, *r, **_: torch.empty_like(q_nope))


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_pages: torch.Tensor, pe_pages: torch.Tensor,
               block_tables: torch.Tensor, lengths: torch.Tensor, *, scale: float,
               logits_soft_cap: float | None = None, local_window_size=None,
               implementation: str | None = None) -> torch.Tensor:
    """DeepSeek multi-head latent attention decode (weight-absorbed):
    ``q_nope [B, (Q,) N, R]``, ``q_pe [B, (Q,) N, P]`` against the shared
    latent cache ``latent_pages [num_pages, page_size, R]`` and
    ``pe_pages [num_pages, page_size, P]``. Returns ``[B, (Q,) N, R]``."""
    return mla_decode_op(q_nope, q_pe, latent_pages, pe_pages, block_tables.to(torch.int32),
                         lengths.to(torch.int32), float(scale),
                         None if logits_soft_cap is None else float(logits_soft_cap), _window(local_window_size),
                         implementation)


def update_kv_cache_(k_pages: torch.Tensor, v_pages: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Write new tokens into dense page pools **in place** (pure torch, the
    torch counterpart of `stellax.paged.update_kv_cache`): row ``i`` of
    ``new_k``/``new_v [T_new, K, H]`` goes to slot ``slot_mapping[i] = page *
    page_size + offset``; negative slots are padding and skipped."""
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, new_k, new_v = slots[keep], new_k[keep], new_v[keep]
    k_pages.view(-1, *k_pages.shape[2:]).index_copy_(0, slots, new_k.to(k_pages.dtype))
    v_pages.view(-1, *v_pages.shape[2:]).index_copy_(0, slots, new_v.to(v_pages.dtype))
