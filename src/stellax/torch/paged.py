"""Torch front ends of paged-KV-cache attention (serving): `paged_attention`
(decode / multi-token decode), `ragged_paged_attention` (mixed prefill +
decode steps) and `mla_decode`, vLLM / FlashAttention cache layout
``[num_pages, page_size, K, H]``, over dense or quantized page pools, plus
the cache helpers `init_kv_cache`, `quantize_pages`, `dequantize_pages`,
`update_kv_cache` (functional, dense or quantized pools) and
`update_kv_cache_` (dense pools, in place, pure torch).

A quantized pool is a `QuantizedPages` here too: the same fields as
`stellax.QuantizedPages` (``data`` codes, ``scale``, ``zero``,
``signs``, ``window``, the `KVQuant` spec and the head dim), as torch
tensors that cross DLPack as they are.

Forward only: the JAX serving ops declare no gradient (the Triton kernels
have no backward). Asking for a gradient through any of them raises
`ForwardOnlyError` naming the op; train with `dot_product_attention` /
`dot_product_attention_varlen` and serve with these.
"""

from __future__ import annotations

import dataclasses

import torch
from jax import Array

import stellax
from stellax import KVQuant
from stellax.core.runtime_checks import checks_enabled
from stellax.ops import paged_attention as _paged

from . import bridge
from .options import int32, left_window, opt_float
from .registry import define_op
from .structs import PAGES, decode_kvquant, encode_kvquant, register_twin

_FORWARD_ONLY = ("a serving op over a paged KV cache; stellax (JAX) defines no gradient for it (its kernels have "
                 "no backward). Train with stellax.torch.dot_product_attention(_varlen) instead.")
_CACHE_ONLY = "a KV-cache helper that writes or reads quantized codes; it has no gradient."

Pages = stellax.QuantizedPages  # the JAX pool type, in the custom ops' annotations


# -- quantized pools ---------------------------------------------------------------------
def _kvquant(spec):
    """A `KVQuant`, a format name or None → a `KVQuant` or None."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return KVQuant(spec)
    if not isinstance(spec, KVQuant):
        raise TypeError(f"quant: expected a stellax.KVQuant, a format name or None, got {type(spec).__name__}")
    return spec


_encode_spec = encode_kvquant  # the name the tests know


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """A quantized page pool as torch tensors (see the module docstring and
    `stellax.QuantizedPages` for the layout).

    Attributes:
      data: codes ``[num_pages, page_size, (K,) H / values_per_byte]``
        (int8, float8_e4m3fn or packed uint8).
      scale, zero: per-group scales / zero points (``zero`` None for symmetric formats).
      signs: ``[H]`` float32 rotation signs or None.
      window: full-precision sink/recent windows ``[max_seqs, W, (K,) H]`` or None.
      spec: the `stellax.KVQuant`.
      head_dim: ``H``.
      quant: the spec encoded for the custom ops (filled in from ``spec``;
        carried along so that `torch.compile` never re-encodes it).
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    signs: torch.Tensor | None
    window: torch.Tensor | None
    spec: object
    head_dim: int
    quant: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.quant is None:
            object.__setattr__(self, "quant", _encode_spec(self.spec))

    @property
    def shape(self) -> tuple:
        """The logical shape ``[num_pages, page_size, (K,) H]``."""
        return (*self.data.shape[:-1], self.head_dim)

    def to_jax(self):
        """The JAX `stellax.QuantizedPages` with the same buffers (zero-copy)."""
        conv = lambda t: None if t is None else bridge.to_jax(t)
        return Pages(conv(self.data), conv(self.scale), conv(self.zero), conv(self.signs),
                                       conv(self.window), self.spec, int(self.head_dim))

    @classmethod
    def from_jax(cls, pages) -> "QuantizedPages":
        """From a JAX `stellax.QuantizedPages` (zero-copy)."""
        conv = lambda a: None if a is None else bridge.to_torch(a)
        return cls(conv(pages.data), conv(pages.scale), conv(pages.zero), conv(pages.signs), conv(pages.window),
                   pages.spec, int(pages.head_dim))


register_twin(PAGES, QuantizedPages)


def _pool(name: str, pool):
    """A pool argument: a dense tensor, a torch `QuantizedPages` or None (checked; `structs.PAGES` flattens it)."""
    if pool is None or isinstance(pool, (torch.Tensor, QuantizedPages)):
        return pool
    raise TypeError(f"{name}: expected a torch.Tensor or a stellax.torch.QuantizedPages, got {type(pool).__name__}")


# -- paged_attention ------------------------------------------------------------------------
def _paged_attention(q: Array, k: Pages | Array, v: Pages | Array | None, block_tables: Array, lengths: Array,
                     sinks: Array | None, *, scale: float | None, logits_soft_cap: float | None,
                     local_window_size: int | None, implementation: str | None, precision: str | None) -> Array:
    return _paged.paged_attention(q, k, v, block_tables, lengths, scale=scale, logits_soft_cap=logits_soft_cap,
                                   local_window_size=local_window_size, sinks=sinks, implementation=implementation,
                                   precision=precision)


paged_attention_op = define_op("paged_attention", _paged_attention, differentiable=False,
                               forward_only_reason=_FORWARD_ONLY)


def paged_attention(q: torch.Tensor, k_pages, v_pages, block_tables: torch.Tensor, lengths: torch.Tensor, *,
                    scale: float | None = None, logits_soft_cap: float | None = None, local_window_size=None,
                    sinks: torch.Tensor | None = None, implementation: str | None = None,
                    precision: str | None = None) -> torch.Tensor:
    """Attention of new tokens against a paged KV cache (`stellax.paged_attention`).

    Args:
      q: ``[B, N, H]`` (one new token) or ``[B, Q, N, H]`` (the last ``Q``
        positions, bottom-right causal); float32/bfloat16/float16.
      k_pages, v_pages: ``[num_pages, page_size, K, H]`` dense in ``q.dtype``
        or `QuantizedPages` (int8/fp8/int4/int2, dequantized in the kernels);
        or a combined dense ``kv_pages [num_pages, page_size, 2, K, H]`` as
        ``k_pages`` with ``v_pages=None``.
      block_tables: ``[B, max_pages]`` integers; lengths: ``[B]`` integers
        (tokens in the cache, new ones included).
      scale, logits_soft_cap, local_window_size, sinks (``[N]`` float32),
        implementation, precision (float32 contractions, docs/precision.md): as in JAX.

    Returns ``[B, (Q,) N, Hv]`` in ``q.dtype``. Forward only (`ForwardOnlyError`
    on backward)."""
    return paged_attention_op(q, _pool("k_pages", k_pages), _pool("v_pages", v_pages), int32(block_tables, "block_tables"),
                              int32(lengths, "lengths"), sinks, opt_float(scale), opt_float(logits_soft_cap),
                              left_window(local_window_size), implementation, precision)


# -- ragged_paged_attention -------------------------------------------------------------------
def _ragged(q: Array, k: Pages | Array, v: Pages | Array | None, kv_lens: Array, block_tables: Array,
            cu_q_lens: Array, num_seqs: Array, sinks: Array | None, *, scale: float | None,
            logits_soft_cap: float | None, local_window_size: int | None, implementation: str | None,
            precision: str | None) -> Array:
    return _paged.ragged_paged_attention(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, scale=scale,
                                          logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                                          sinks=sinks, implementation=implementation, precision=precision)


ragged_paged_attention_op = define_op("ragged_paged_attention", _ragged, differentiable=False,
                                      forward_only_reason=_FORWARD_ONLY)


def ragged_paged_attention(q: torch.Tensor, k_pages, v_pages, kv_lens: torch.Tensor, block_tables: torch.Tensor,
                           cu_q_lens: torch.Tensor, num_seqs, *, scale: float | None = None,
                           logits_soft_cap: float | None = None, local_window_size=None,
                           sinks: torch.Tensor | None = None, implementation: str | None = None,
                           precision: str | None = None) -> torch.Tensor:
    """One serving step over packed new tokens ``q [total_q, N, H]`` of many
    sequences (prefills, chunked prefills and decodes mixed;
    `stellax.ragged_paged_attention`): sequence ``s`` owns
    ``q[cu_q_lens[s]:cu_q_lens[s+1]]``, the last positions of its
    ``kv_lens[s]`` cached tokens. ``kv_lens [S]``, ``block_tables [S, max_pages]``,
    ``cu_q_lens [S + 1]`` integers; ``num_seqs`` (int or integer tensor) live
    sequences. Pools dense or `QuantizedPages` as in `paged_attention`.
    ``precision``: float32 contractions, as in JAX (docs/precision.md).
    Returns ``[total_q, N, Hv]``. Forward only."""
    if not isinstance(num_seqs, torch.Tensor):
        num_seqs = torch.tensor([int(num_seqs)], dtype=torch.int32, device=q.device)
    return ragged_paged_attention_op(q, _pool("k_pages", k_pages), _pool("v_pages", v_pages), int32(kv_lens, "kv_lens"),
                                     int32(block_tables, "block_tables"), int32(cu_q_lens, "cu_q_lens"), int32(num_seqs, "num_seqs").reshape(1), sinks,
                                     opt_float(scale), opt_float(logits_soft_cap), left_window(local_window_size),
                                     implementation, precision)


# -- mla_decode -------------------------------------------------------------------------------
def _mla(q_nope: Array, q_pe: Array, latent: Pages | Array, pe: Pages | Array, block_tables: Array,
         lengths: Array, *, scale: float, logits_soft_cap: float | None, local_window_size: int | None,
         implementation: str | None, precision: str | None) -> Array:
    return _paged.mla_decode(q_nope, q_pe, latent, pe, block_tables, lengths, scale=scale,
                              logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                              implementation=implementation, precision=precision)


mla_decode_op = define_op("mla_decode", _mla, differentiable=False, forward_only_reason=_FORWARD_ONLY)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_pages, pe_pages, block_tables: torch.Tensor,
               lengths: torch.Tensor, *, scale: float, logits_soft_cap: float | None = None, local_window_size=None,
               implementation: str | None = None, precision: str | None = None) -> torch.Tensor:
    """DeepSeek multi-head latent attention decode (weight-absorbed,
    `stellax.mla_decode`): ``q_nope [B, (Q,) N, R]``, ``q_pe [B, (Q,) N, P]``
    against the shared latent cache ``latent_pages [num_pages, page_size, R]``
    (dense or `QuantizedPages`) and ``pe_pages [num_pages, page_size, P]``.
    ``precision``: float32 contractions, as in JAX (docs/precision.md).
    Returns ``[B, (Q,) N, R]``. Forward only."""
    return mla_decode_op(q_nope, q_pe, _pool("latent_pages", latent_pages), _pool("pe_pages", pe_pages),
                         int32(block_tables, "block_tables"), int32(lengths, "lengths"), float(scale), opt_float(logits_soft_cap),
                         left_window(local_window_size), implementation, precision)


# -- cache helpers ----------------------------------------------------------------------------
def _quantize_pages(pages: Array, block_tables: Array | None, lengths: Array | None, *, quant: str,
                    max_seqs: int | None) -> Pages:
    return _paged.quantize_pages(pages, decode_kvquant(quant), max_seqs=max_seqs, block_tables=block_tables,
                                 lengths=lengths)


quantize_pages_op = define_op("quantize_pages", _quantize_pages, differentiable=False,
                              forward_only_reason=_CACHE_ONLY)


def quantize_pages(pages: torch.Tensor, spec, *, max_seqs: int | None = None, block_tables: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None) -> QuantizedPages:
    """Quantize a dense page pool ``[num_pages, page_size, (K,) H]``
    (`stellax.ops.paged_attention.quantize_pages`) with ``spec`` (a `stellax.KVQuant`
    or a format name ``"int8"``/``"fp8"``/``"int4"``/``"int2"``). With
    sink/recent windows, ``block_tables`` and ``lengths`` say which positions
    the windows hold. Returns a `QuantizedPages`."""
    spec = _kvquant(spec)
    quant = _encode_spec(spec)
    parts = quantize_pages_op(pages, int32(block_tables, "block_tables"), int32(lengths, "lengths"), quant,
                              None if max_seqs is None else int(max_seqs))
    return PAGES.to_torch(parts, (spec, int(pages.shape[-1]), quant))


def _dequantize_pages(pool: Pages, *, rotated: bool) -> Array:
    return _paged.dequantize_pages(pool, rotated=rotated)


dequantize_pages_op = define_op("dequantize_pages", _dequantize_pages, differentiable=False,
                                forward_only_reason=_CACHE_ONLY)


def dequantize_pages(pages: QuantizedPages, *, rotated: bool = False) -> torch.Tensor:
    """Dense float32 pages ``[num_pages, page_size, (K,) H]`` of a quantized
    pool (windows not applied; `stellax.ops.paged_attention.dequantize_pages`).
    ``rotated=True`` keeps the rotated basis."""
    if not isinstance(pages, QuantizedPages):
        raise TypeError(f"pages: expected a stellax.torch.QuantizedPages, got {type(pages).__name__}")
    return dequantize_pages_op(pages, bool(rotated))


def _update(k: Pages | Array, v: Pages | Array | None, new_k: Array, new_v: Array | None, slot_mapping: Array,
            positions: Array | None, seq_ids: Array | None) -> tuple[Pages | Array, Pages | Array | None]:
    return _paged.update_kv_cache(k, v, new_k, new_v, slot_mapping, positions=positions, seq_ids=seq_ids)


update_kv_cache_op = define_op("update_kv_cache", _update, differentiable=False, forward_only_reason=_CACHE_ONLY)


def update_kv_cache(k_pages, v_pages, new_k: torch.Tensor, new_v: torch.Tensor | None, slot_mapping: torch.Tensor, *,
                    positions: torch.Tensor | None = None, seq_ids: torch.Tensor | None = None):
    """Write new tokens into a paged cache and return the new ``(k_pages,
    v_pages)`` (functional, `stellax.update_kv_cache`; the inputs are not
    modified). Pools dense or `QuantizedPages` (quantized on write), or a
    combined dense ``kv_pages`` with ``v_pages=None`` (returns ``(kv_pages,
    None)``). ``new_k``/``new_v [T_new, (K,) H]``; ``slot_mapping [T_new]``
    integers (``page * page_size + offset``, negative = padding);
    ``positions``/``seq_ids [T_new]`` only for pools with windows. For dense
    pools `update_kv_cache_` writes in place without a copy."""
    out = update_kv_cache_op(_pool("k_pages", k_pages), _pool("v_pages", v_pages), new_k, new_v,
                             int32(slot_mapping, "slot_mapping"), int32(positions, "positions"), int32(seq_ids, "seq_ids"))
    n = PAGES.n_tensors
    k = PAGES.like(out[:n], k_pages)
    return k, None if v_pages is None else PAGES.like(out[n:], v_pages)


def init_kv_cache(num_pages: int, page_size: int, num_kv_heads: int | None, head_dim: int, *,
                  dtype: torch.dtype = torch.bfloat16, quant=None, value_quant="same",
                  value_head_dim: int | None = None, max_seqs: int | None = None, combined: bool = False,
                  device=None):
    """An empty (zero) paged cache ``(k_pages, v_pages)`` (`stellax.init_kv_cache`):
    dense ``[num_pages, page_size, (K,) H]`` tensors in ``dtype``, or
    `QuantizedPages` with ``quant`` / ``value_quant`` (a `KVQuant` or a format
    name; ``value_quant="same"`` follows ``quant``). ``combined=True`` gives
    ``(kv_pages [num_pages, page_size, 2, K, H], None)``. Built by JAX on the
    CPU, then moved to ``device``."""
    def conv(pool):
        if pool is None:
            return None
        if isinstance(pool, Pages):
            qp = QuantizedPages.from_jax(pool)
            move = lambda t: None if t is None else t.to(device) if device is not None else t.clone()
            return QuantizedPages(move(qp.data), move(qp.scale), move(qp.zero), move(qp.signs), move(qp.window),
                                  qp.spec, qp.head_dim, qp.quant)
        t = bridge.to_torch(pool)
        return t.to(device) if device is not None else t.clone()
    k, v = _paged.init_kv_cache(num_pages, page_size, num_kv_heads, head_dim, dtype=bridge.jax_dtype(dtype),
                                  quant=quant, value_quant=value_quant, value_head_dim=value_head_dim,
                                  max_seqs=max_seqs, combined=combined)
    return conv(k), conv(v)


def _written_again(slots: torch.Tensor) -> torch.Tensor:
    """Bool ``[T]``: a later token writes the same slot (equal slots sorted stably, in token order;
    all but the last of a run are overwritten)."""
    order = torch.argsort(slots, stable=True)
    ordered = slots[order]
    again_sorted = torch.zeros_like(slots, dtype=torch.bool)
    again_sorted[:-1] = ordered[1:] == ordered[:-1]
    again = torch.empty_like(again_sorted)
    again[order] = again_sorted
    return again


def update_kv_cache_(k_pages: torch.Tensor, v_pages: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Write new tokens into dense page pools **in place** (pure torch, the
    torch counterpart of `stellax.update_kv_cache`): row ``i`` of
    ``new_k``/``new_v [T_new, K, H]`` goes to slot ``slot_mapping[i] = page *
    page_size + offset``; negative slots are padding and skipped, as are slots
    past the pool. Of a slot written by several tokens the last write wins
    (deterministic on every device: ``index_copy_`` only sees unique slots).
    In checked mode (`stellax.checked` / ``STELLAX_CHECKS=1``) a slot past the
    pool or a repeated slot raises ``ValueError`` naming ``slot_mapping``, the
    index and the slot (`stellax.ops.paged_attention.validate`). Quantized pools: use the
    functional `update_kv_cache`."""
    if not isinstance(k_pages, torch.Tensor) or not isinstance(v_pages, torch.Tensor):
        raise TypeError("k_pages/v_pages: update_kv_cache_ writes dense torch.Tensor pools in place; for "
                        "QuantizedPages use the functional update_kv_cache")
    slots = int32(slot_mapping, "slot_mapping").to(torch.long)
    if slots.ndim != 1:
        raise ValueError(f"slot_mapping: expected rank 1 [T_new], got shape {tuple(slots.shape)}")
    if checks_enabled():
        _paged.validate(k_pages=k_pages, slot_mapping=slots.cpu().numpy())
    capacity = k_pages.shape[0] * k_pages.shape[1]
    keep = (slots >= 0) & (slots < capacity) & ~_written_again(slots)
    if not bool(keep.all()):
        slots, new_k, new_v = slots[keep], new_k[keep], new_v[keep]
    k_pages.view(-1, *k_pages.shape[2:]).index_copy_(0, slots, new_k.to(k_pages.dtype))
    v_pages.view(-1, *v_pages.shape[2:]).index_copy_(0, slots, new_v.to(v_pages.dtype))
