"""Torch front ends of paged-KV-cache attention (serving): `paged_attention`
(decode / multi-token decode), `ragged_paged_attention` (mixed prefill +
decode steps) and `mla_decode`, vLLM / FlashAttention cache layout
``[num_pages, page_size, K, H]``, over dense or quantized page pools, plus
the cache helpers `init_kv_cache`, `quantize_pages`, `dequantize_pages`,
`update_kv_cache` (functional, dense or quantized pools) and
`update_kv_cache_` (dense pools, in place, pure torch).

A quantized pool is a `QuantizedPages` here too: the same fields as
`stellax.paged.QuantizedPages` (``data`` codes, ``scale``, ``zero``,
``signs``, ``window``, the `KVQuant` spec and the head dim), as torch
tensors that cross DLPack as they are.

Forward only: the JAX serving ops declare no gradient (the Triton kernels
have no backward). Asking for a gradient through any of them raises
`ForwardOnlyError` naming the op; train with `dot_product_attention` /
`dot_product_attention_varlen` and serve with these.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from . import bridge
from .registry import define_op

_FORWARD_ONLY = ("a serving op over a paged KV cache; stellax (JAX) defines no gradient for it (its kernels have "
                 "no backward). Train with stellax.torch.dot_product_attention(_varlen) instead.")
_CACHE_ONLY = "a KV-cache helper that writes or reads quantized codes; it has no gradient."


def _paged():
    from stellax.ops import paged_attention
    return paged_attention


# -- quantized pools ---------------------------------------------------------------------
def _kvquant(spec):
    """A `KVQuant`, a format name or None → a `KVQuant` or None."""
    if spec is None:
        return None
    kv = _paged().KVQuant
    if isinstance(spec, str):
        return kv(spec)
    if not isinstance(spec, kv):
        raise TypeError(f"quant: expected a stellax.paged.KVQuant, a format name or None, got {type(spec).__name__}")
    return spec


def _encode_spec(spec) -> str:
    """A `KVQuant` as the JSON string a custom-op option carries (static, part of the cache key)."""
    d = dataclasses.asdict(spec)
    d["scale_dtype"] = np.dtype(d["scale_dtype"]).name
    d["window_dtype"] = np.dtype(d["window_dtype"]).name
    return json.dumps(d, sort_keys=True)


def _decode_spec(text: str | None):
    if text is None:
        return None
    d = json.loads(text)
    import jax.numpy as jnp
    for key in ("scale_dtype", "window_dtype"):
        d[key] = getattr(jnp, d[key])
    return _paged().KVQuant(**d)


@dataclasses.dataclass(frozen=True)
class QuantizedPages:
    """A quantized page pool as torch tensors (see the module docstring and
    `stellax.paged.QuantizedPages` for the layout).

    Attributes:
      data: codes ``[num_pages, page_size, (K,) H / values_per_byte]``
        (int8, float8_e4m3fn or packed uint8).
      scale, zero: per-group scales / zero points (``zero`` None for symmetric formats).
      signs: ``[H]`` float32 rotation signs or None.
      window: full-precision sink/recent windows ``[max_seqs, W, (K,) H]`` or None.
      spec: the `stellax.paged.KVQuant`.
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
        """The JAX `stellax.paged.QuantizedPages` with the same buffers (zero-copy)."""
        conv = lambda t: None if t is None else bridge.to_jax(t)
        return _paged().QuantizedPages(conv(self.data), conv(self.scale), conv(self.zero), conv(self.signs),
                                       conv(self.window), self.spec, int(self.head_dim))

    @classmethod
    def from_jax(cls, pages) -> "QuantizedPages":
        """From a JAX `stellax.paged.QuantizedPages` (zero-copy)."""
        conv = lambda a: None if a is None else bridge.to_torch(a)
        return cls(conv(pages.data), conv(pages.scale), conv(pages.zero), conv(pages.signs), conv(pages.window),
                   pages.spec, int(pages.head_dim))


_POOL_PARTS = ("pages", "scale", "zero", "signs", "window")


def _pool_tensors(prefix: str, optional: bool = False) -> tuple[str, ...]:
    first = f"{prefix}_pages" + ("?" if optional else "")
    return (first,) + tuple(f"{prefix}_{p}?!" for p in _POOL_PARTS[1:])


def _pool_options(prefix: str) -> dict:
    return {f"{prefix}_quant": "str?", f"{prefix}_head_dim": "int?"}


def _pool_args(name: str, pool) -> tuple[list, list]:
    """A dense tensor / `QuantizedPages` / None → (5 tensors, 2 options)."""
    if pool is None or isinstance(pool, torch.Tensor):
        return [pool, None, None, None, None], [None, None]
    if isinstance(pool, QuantizedPages):
        return ([pool.data, pool.scale, pool.zero, pool.signs, pool.window], [pool.quant, int(pool.head_dim)])
    raise TypeError(f"{name}: expected a torch.Tensor or a stellax.torch.QuantizedPages, got {type(pool).__name__}")


def _jax_pool(data, scale, zero, signs, window, quant, head_dim):
    spec = _decode_spec(quant)
    if spec is None:
        return data
    return _paged().QuantizedPages(data, scale, zero, signs, window, spec, head_dim)


def _pool_outputs(pool):
    """A JAX pool → 5 arrays (empty placeholders where a part is absent)."""
    import jax.numpy as jnp
    empty = jnp.zeros((0,), jnp.float32)
    if not isinstance(pool, _paged().QuantizedPages):
        return pool, empty, empty, empty, empty
    fill = lambda a: empty if a is None else a
    return pool.data, pool.scale, fill(pool.zero), fill(pool.signs), fill(pool.window)


def _torch_pool(parts, like, head_dim=None, spec=None, quant=None):
    """5 torch outputs of `_pool_outputs` → a dense tensor, or a torch
    `QuantizedPages` with the spec of ``like`` (a `QuantizedPages`) or ``spec``."""
    data, scale, zero, signs, window = parts
    if isinstance(like, QuantizedPages):
        spec, quant, head_dim = like.spec, like.quant, like.head_dim
    if spec is None:
        return data
    return QuantizedPages(data, scale, None if spec.symmetric else zero, signs if spec.rotation else None,
                          window if spec.window else None, spec, int(head_dim), quant)


def _window(local_window_size):
    if local_window_size is None:
        return None
    return int(local_window_size[0]) if isinstance(local_window_size, (tuple, list)) else int(local_window_size)


def _opt_float(value):
    return None if value is None else float(value)


# -- paged_attention ------------------------------------------------------------------------
def _paged_attention(q, kp, ks, kz, ksg, kw, vp, vs, vz, vsg, vw, block_tables, lengths, sinks, *, k_quant,
                     k_head_dim, v_quant, v_head_dim, scale, logits_soft_cap, local_window_size, implementation):
    return _paged().paged_attention(q, _jax_pool(kp, ks, kz, ksg, kw, k_quant, k_head_dim),
                                    _jax_pool(vp, vs, vz, vsg, vw, v_quant, v_head_dim), block_tables, lengths,
                                    scale=scale, logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                                    sinks=sinks, implementation=implementation)


_OPTIONS = {"scale": "float?", "logits_soft_cap": "float?", "local_window_size": "int?", "implementation": "str?"}
_KV_OPTIONS = {**_pool_options("k"), **_pool_options("v"), **_OPTIONS}


def _value_dim(k_pages, v_pages, v_head_dim, k_head_dim):
    if v_pages is not None:
        return v_head_dim if v_head_dim is not None else v_pages.shape[-1]
    return k_head_dim if k_head_dim is not None else k_pages.shape[-1]  # combined kv_pages


paged_attention_op = define_op(
    "paged_attention", _paged_attention,
    tensors=("q", *_pool_tensors("k"), *_pool_tensors("v", optional=True), "block_tables!", "lengths!", "sinks?"),
    options=_KV_OPTIONS, differentiable=False, forward_only_reason=_FORWARD_ONLY,
    fake=lambda q, k_pages, *r, k_head_dim, v_head_dim, **_: q.new_empty(
        (*q.shape[:-1], _value_dim(k_pages, r[4], v_head_dim, k_head_dim))))


def _kv_args(k_pages, v_pages):
    kt, ko = _pool_args("k_pages", k_pages)
    vt, vo = _pool_args("v_pages", v_pages)
    return kt + vt, ko + vo


def paged_attention(q: torch.Tensor, k_pages, v_pages, block_tables: torch.Tensor, lengths: torch.Tensor, *,
                    scale: float | None = None, logits_soft_cap: float | None = None, local_window_size=None,
                    sinks: torch.Tensor | None = None, implementation: str | None = None) -> torch.Tensor:
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
        implementation: as in JAX.

    Returns ``[B, (Q,) N, Hv]`` in ``q.dtype``. Forward only (`ForwardOnlyError`
    on backward)."""
    tensors, opts = _kv_args(k_pages, v_pages)
    return paged_attention_op(q, *tensors, block_tables.to(torch.int32), lengths.to(torch.int32), sinks, *opts,
                              _opt_float(scale), _opt_float(logits_soft_cap), _window(local_window_size),
                              implementation)


# -- ragged_paged_attention -------------------------------------------------------------------
def _ragged(q, kp, ks, kz, ksg, kw, vp, vs, vz, vsg, vw, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, *,
            k_quant, k_head_dim, v_quant, v_head_dim, scale, logits_soft_cap, local_window_size, implementation):
    return _paged().ragged_paged_attention(q, _jax_pool(kp, ks, kz, ksg, kw, k_quant, k_head_dim),
                                           _jax_pool(vp, vs, vz, vsg, vw, v_quant, v_head_dim), kv_lens,
                                           block_tables, cu_q_lens, num_seqs, scale=scale,
                                           logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                                           sinks=sinks, implementation=implementation)


ragged_paged_attention_op = define_op(
    "ragged_paged_attention", _ragged,
    tensors=("q", *_pool_tensors("k"), *_pool_tensors("v", optional=True), "kv_lens!", "block_tables!",
             "cu_q_lens!", "num_seqs!", "sinks?"),
    options=_KV_OPTIONS, differentiable=False, forward_only_reason=_FORWARD_ONLY,
    fake=lambda q, k_pages, *r, k_head_dim, v_head_dim, **_: q.new_empty(
        (*q.shape[:-1], _value_dim(k_pages, r[4], v_head_dim, k_head_dim))))


def ragged_paged_attention(q: torch.Tensor, k_pages, v_pages, kv_lens: torch.Tensor, block_tables: torch.Tensor,
                           cu_q_lens: torch.Tensor, num_seqs, *, scale: float | None = None,
                           logits_soft_cap: float | None = None, local_window_size=None,
                           sinks: torch.Tensor | None = None, implementation: str | None = None) -> torch.Tensor:
    """One serving step over packed new tokens ``q [total_q, N, H]`` of many
    sequences (prefills, chunked prefills and decodes mixed;
    `stellax.ragged_paged_attention`): sequence ``s`` owns
    ``q[cu_q_lens[s]:cu_q_lens[s+1]]``, the last positions of its
    ``kv_lens[s]`` cached tokens. ``kv_lens [S]``, ``block_tables [S, max_pages]``,
    ``cu_q_lens [S + 1]`` integers; ``num_seqs`` (int or integer tensor) live
    sequences. Pools dense or `QuantizedPages` as in `paged_attention`.
    Returns ``[total_q, N, Hv]``. Forward only."""
    if not isinstance(num_seqs, torch.Tensor):
        num_seqs = torch.tensor([int(num_seqs)], dtype=torch.int32, device=q.device)
    i32 = lambda t: t.to(torch.int32)
    tensors, opts = _kv_args(k_pages, v_pages)
    return ragged_paged_attention_op(q, *tensors, i32(kv_lens), i32(block_tables), i32(cu_q_lens),
                                     i32(num_seqs).reshape(1), sinks, *opts, _opt_float(scale),
                                     _opt_float(logits_soft_cap), _window(local_window_size), implementation)


# -- mla_decode -------------------------------------------------------------------------------
def _mla(q_nope, q_pe, lp, ls, lz, lsg, lw, pp, ps, pz, psg, pw, block_tables, lengths, *, latent_quant,
         latent_head_dim, pe_quant, pe_head_dim, scale, logits_soft_cap, local_window_size, implementation):
    return _paged().mla_decode(q_nope, q_pe, _jax_pool(lp, ls, lz, lsg, lw, latent_quant, latent_head_dim),
                               _jax_pool(pp, ps, pz, psg, pw, pe_quant, pe_head_dim), block_tables, lengths,
                               scale=scale, logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                               implementation=implementation)


mla_decode_op = define_op(
    "mla_decode", _mla,
    tensors=("q_nope", "q_pe", *_pool_tensors("latent"), *_pool_tensors("pe"), "block_tables!", "lengths!"),
    options={**_pool_options("latent"), **_pool_options("pe"), "scale": "float", "logits_soft_cap": "float?",
             "local_window_size": "int?", "implementation": "str?"},
    differentiable=False, forward_only_reason=_FORWARD_ONLY, fake=lambda q_nope, *r, **_: torch.empty_like(q_nope))


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_pages, pe_pages, block_tables: torch.Tensor,
               lengths: torch.Tensor, *, scale: float, logits_soft_cap: float | None = None, local_window_size=None,
               implementation: str | None = None) -> torch.Tensor:
    """DeepSeek multi-head latent attention decode (weight-absorbed,
    `stellax.mla_decode`): ``q_nope [B, (Q,) N, R]``, ``q_pe [B, (Q,) N, P]``
    against the shared latent cache ``latent_pages [num_pages, page_size, R]``
    (dense or `QuantizedPages`) and ``pe_pages [num_pages, page_size, P]``.
    Returns ``[B, (Q,) N, R]``. Forward only."""
    lt, lo = _pool_args("latent_pages", latent_pages)
    pt, po = _pool_args("pe_pages", pe_pages)
    return mla_decode_op(q_nope, q_pe, *lt, *pt, block_tables.to(torch.int32), lengths.to(torch.int32), *lo, *po,
                         float(scale), _opt_float(logits_soft_cap), _window(local_window_size), implementation)


# -- cache helpers ----------------------------------------------------------------------------
def _quantize_pages(pages, block_tables, lengths, *, quant, max_seqs):
    return _pool_outputs(_paged().quantize_pages(pages, _decode_spec(quant), max_seqs=max_seqs,
                                                 block_tables=block_tables, lengths=lengths))


quantize_pages_op = define_op("quantize_pages", _quantize_pages, tensors=("pages", "block_tables?!", "lengths?!"),
                              options={"quant": "str", "max_seqs": "int?"}, outputs=5, differentiable=False,
                              forward_only_reason=_CACHE_ONLY)


def quantize_pages(pages: torch.Tensor, spec, *, max_seqs: int | None = None, block_tables: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None) -> QuantizedPages:
    """Quantize a dense page pool ``[num_pages, page_size, (K,) H]``
    (`stellax.paged.quantize_pages`) with ``spec`` (a `stellax.paged.KVQuant`
    or a format name ``"int8"``/``"fp8"``/``"int4"``/``"int2"``). With
    sink/recent windows, ``block_tables`` and ``lengths`` say which positions
    the windows hold. Returns a `QuantizedPages`."""
    spec = _kvquant(spec)
    quant = _encode_spec(spec)
    i32 = lambda t: None if t is None else t.to(torch.int32)
    parts = quantize_pages_op(pages, i32(block_tables), i32(lengths), quant, None if max_seqs is None else int(max_seqs))
    return _torch_pool(parts, None, pages.shape[-1], spec, quant)


def _dequantize_pages(data, scale, zero, signs, window, *, quant, head_dim, rotated):
    return _paged().dequantize_pages(_jax_pool(data, scale, zero, signs, window, quant, head_dim), rotated=rotated)


dequantize_pages_op = define_op("dequantize_pages", _dequantize_pages, tensors=_pool_tensors("pool"),
                                options={"quant": "str", "head_dim": "int", "rotated": "bool"}, differentiable=False,
                                forward_only_reason=_CACHE_ONLY)


def dequantize_pages(pages: QuantizedPages, *, rotated: bool = False) -> torch.Tensor:
    """Dense float32 pages ``[num_pages, page_size, (K,) H]`` of a quantized
    pool (windows not applied; `stellax.paged.dequantize_pages`).
    ``rotated=True`` keeps the rotated basis."""
    if not isinstance(pages, QuantizedPages):
        raise TypeError(f"pages: expected a stellax.torch.QuantizedPages, got {type(pages).__name__}")
    tensors, (quant, head_dim) = _pool_args("pages", pages)
    return dequantize_pages_op(*tensors, quant, head_dim, bool(rotated))


def _update(kp, ks, kz, ksg, kw, vp, vs, vz, vsg, vw, new_k, new_v, slot_mapping, positions, seq_ids, *, k_quant,
            k_head_dim, v_quant, v_head_dim):
    k, v = _paged().update_kv_cache(_jax_pool(kp, ks, kz, ksg, kw, k_quant, k_head_dim),
                                    _jax_pool(vp, vs, vz, vsg, vw, v_quant, v_head_dim), new_k, new_v, slot_mapping,
                                    positions=positions, seq_ids=seq_ids)
    import jax.numpy as jnp
    v_parts = _pool_outputs(v) if v is not None else (jnp.zeros((0,), jnp.float32),) * 5
    return (*_pool_outputs(k), *v_parts)


update_kv_cache_op = define_op(
    "update_kv_cache", _update,
    tensors=(*_pool_tensors("k"), *_pool_tensors("v", optional=True), "new_k", "new_v?", "slot_mapping!",
             "positions?!", "seq_ids?!"),
    options={**_pool_options("k"), **_pool_options("v")}, outputs=10, differentiable=False,
    forward_only_reason=_CACHE_ONLY)


def update_kv_cache(k_pages, v_pages, new_k: torch.Tensor, new_v: torch.Tensor | None, slot_mapping: torch.Tensor, *,
                    positions: torch.Tensor | None = None, seq_ids: torch.Tensor | None = None):
    """Write new tokens into a paged cache and return the new ``(k_pages,
    v_pages)`` (functional, `stellax.paged.update_kv_cache`; the inputs are not
    modified). Pools dense or `QuantizedPages` (quantized on write), or a
    combined dense ``kv_pages`` with ``v_pages=None`` (returns ``(kv_pages,
    None)``). ``new_k``/``new_v [T_new, (K,) H]``; ``slot_mapping [T_new]``
    integers (``page * page_size + offset``, negative = padding);
    ``positions``/``seq_ids [T_new]`` only for pools with windows. For dense
    pools `update_kv_cache_` writes in place without a copy."""
    tensors, opts = _kv_args(k_pages, v_pages)
    i32 = lambda t: None if t is None else t.to(torch.int32)
    out = update_kv_cache_op(*tensors, new_k, new_v, i32(slot_mapping), i32(positions), i32(seq_ids), *opts)
    k = _torch_pool(out[:5], k_pages)
    return k, None if v_pages is None else _torch_pool(out[5:], v_pages)


def init_kv_cache(num_pages: int, page_size: int, num_kv_heads: int | None, head_dim: int, *,
                  dtype: torch.dtype = torch.bfloat16, quant=None, value_quant="same",
                  value_head_dim: int | None = None, max_seqs: int | None = None, combined: bool = False,
                  device=None):
    """An empty (zero) paged cache ``(k_pages, v_pages)`` (`stellax.paged.init_kv_cache`):
    dense ``[num_pages, page_size, (K,) H]`` tensors in ``dtype``, or
    `QuantizedPages` with ``quant`` / ``value_quant`` (a `KVQuant` or a format
    name; ``value_quant="same"`` follows ``quant``). ``combined=True`` gives
    ``(kv_pages [num_pages, page_size, 2, K, H], None)``. Built by JAX on the
    CPU, then moved to ``device``."""
    def conv(pool):
        if pool is None:
            return None
        if isinstance(pool, _paged().QuantizedPages):
            qp = QuantizedPages.from_jax(pool)
            move = lambda t: None if t is None else t.to(device) if device is not None else t.clone()
            return QuantizedPages(move(qp.data), move(qp.scale), move(qp.zero), move(qp.signs), move(qp.window),
                                  qp.spec, qp.head_dim, qp.quant)
        t = bridge.to_torch(pool)
        return t.to(device) if device is not None else t.clone()
    k, v = _paged().init_kv_cache(num_pages, page_size, num_kv_heads, head_dim, dtype=bridge.jax_dtype(dtype),
                                  quant=quant, value_quant=value_quant, value_head_dim=value_head_dim,
                                  max_seqs=max_seqs, combined=combined)
    return conv(k), conv(v)


def update_kv_cache_(k_pages: torch.Tensor, v_pages: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """Write new tokens into dense page pools **in place** (pure torch, the
    torch counterpart of `stellax.paged.update_kv_cache`): row ``i`` of
    ``new_k``/``new_v [T_new, K, H]`` goes to slot ``slot_mapping[i] = page *
    page_size + offset``; negative slots are padding and skipped. Quantized
    pools: use the functional `update_kv_cache`."""
    if not isinstance(k_pages, torch.Tensor) or not isinstance(v_pages, torch.Tensor):
        raise TypeError("k_pages/v_pages: update_kv_cache_ writes dense torch.Tensor pools in place; for "
                        "QuantizedPages use the functional update_kv_cache")
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, new_k, new_v = slots[keep], new_k[keep], new_v[keep]
    k_pages.view(-1, *k_pages.shape[2:]).index_copy_(0, slots, new_k.to(k_pages.dtype))
    v_pages.view(-1, *v_pages.shape[2:]).index_copy_(0, slots, new_v.to(v_pages.dtype))
