"""`Attention`: multi-head / grouped-query self-attention over
`stellax.dot_product_attention`, with rotary embeddings and an optional paged
KV cache for decoding over `stellax.paged_attention`."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import stellax

from ..core.precision import check_precision
from ..ops.paged_attention import update_kv_cache
from ._params import check_sharding, dense, param, positive, zeros

_default_kernel = nnx.initializers.lecun_normal()


def rotary(x, positions, theta: float):
    """Rotary position embedding (the half-split convention of Llama / HF):
    ``x [B, T, N, H]``, ``positions [B, T]``; pairs ``(x_i, x_{i+H/2})`` rotate
    by ``positions · theta^(-2i/H)``."""
    h = x.shape[-1]
    inv = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    ang = positions.astype(jnp.float32)[..., None] * inv          # [B, T, H/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class PagedKVCache(nnx.Module):
    """The decode state of an `Attention` layer, as ``nnx.Cache`` variables:
    page pools ``k``/``v [num_pages, page_size, K, H]``, block tables
    ``[B, max_pages]`` (sequence ``b`` owns pages ``b·P .. b·P+P-1``) and the
    per-sequence cached lengths ``[B]``."""

    def __init__(self, batch: int, max_length: int, page_size: int, kv_heads: int, head_dim: int, dtype):
        positive("PagedKVCache", batch=batch, max_length=max_length, page_size=page_size)
        pages = -(-max_length // page_size)
        shape = (batch * pages, page_size, kv_heads, head_dim)
        self.k = nnx.Cache(jnp.zeros(shape, dtype))
        self.v = nnx.Cache(jnp.zeros(shape, dtype))
        self.block_tables = nnx.Cache(jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages))
        self.lengths = nnx.Cache(jnp.zeros((batch,), jnp.int32))


class Attention(nnx.Module):
    """Self-attention with grouped-query heads.

    ``q = x W_q [B, T, N, H]``, ``k, v = x W_k, x W_v [B, T, K, H]`` (``N % K == 0``:
    each of the ``K`` key/value heads serves ``N / K`` query heads, never repeated),
    optional RoPE on q and k, ``o = softmax(s · q kᵀ (+ soft cap, sinks, masks)) v``
    and ``y = o W_o``.

    Args:
      features: ``D``; num_heads: ``N``; num_kv_heads: ``K`` (default ``N``); head_dim: ``H``
        (default ``D // N``).
      rope_theta: RoPE base (``None``: no position embedding).
      logits_soft_cap: ``cap · tanh(s / cap)`` on the logits.
      use_sinks: a learned per-head sink logit ``sinks [N]`` (gpt-oss).
      output_gate: a learned output gate ``gate [D, N, H]`` (Qwen3-Next's gated
        attention): ``o ← o · sigmoid(x W_gate)`` per head before ``W_o``.
      local_window_size: sliding window (as `stellax.dot_product_attention`).
      precision: float32 contraction precision of the attention (as
        `stellax.dot_product_attention`, docs/precision.md; the projections stay ``'highest'``).
      kernel_init: of ``q [D, N, H]``, ``k``/``v [D, K, H]``, ``o [N, H, D]`` (and ``gate [D, N, H]``).
      sharding: logical axes for ``"q"``, ``"k"``, ``"v"``, ``"o"``, ``"gate"`` (3 each), ``"sinks"`` (1).

    Call ``layer(x, positions=None, mask=None, segment_ids=None, is_causal=True)``.
    After ``init_cache(batch, max_length, page_size)``, calls append their tokens
    to the paged cache and attend over everything cached (prefill and decode).
    """

    def __init__(self, features: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
                 *, rope_theta: float | None = 10000.0, logits_soft_cap: float | None = None,
                 use_sinks: bool = False, output_gate: bool = False, local_window_size=None, precision=None, dtype=None, param_dtype=jnp.float32,
                 kernel_init=_default_kernel, sharding: Mapping[str, Sequence[str | None]] | None = None,
                 rngs: nnx.Rngs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        positive("Attention", features=features, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads}) for grouped-query attention")
        if head_dim is None:
            if features % num_heads:
                raise ValueError(f"Attention: features ({features}) is not divisible by num_heads ({num_heads}); "
                                 "give head_dim")
            head_dim = features // num_heads
        positive("Attention", head_dim=head_dim)
        if rope_theta is not None and head_dim % 2:
            raise ValueError(f"Attention: rotary embeddings need an even head_dim, got {head_dim}")
        shard = check_sharding("Attention", sharding, ["q", "k", "v", "o", "gate", "sinks"])
        self.features, self.num_heads, self.num_kv_heads, self.head_dim = features, num_heads, num_kv_heads, head_dim
        self.rope_theta, self.logits_soft_cap = rope_theta, logits_soft_cap
        self.local_window_size, self.dtype = local_window_size, dtype
        self.precision = check_precision(precision)  # a bad value fails here, naming it
        p = lambda name, shape, init=kernel_init: param("Attention", rngs, name, init, shape, param_dtype, shard)
        self.q = p("q", (features, num_heads, head_dim))
        self.k = p("k", (features, num_kv_heads, head_dim))
        self.v = p("v", (features, num_kv_heads, head_dim))
        self.o = p("o", (num_heads, head_dim, features))
        self.sinks = p("sinks", (num_heads,), zeros) if use_sinks else None
        self.gate = p("gate", (features, num_heads, head_dim)) if output_gate else None
        self.cache = nnx.data(None)  # a PagedKVCache after init_cache

    # -- decode cache -------------------------------------------------------------------
    def init_cache(self, batch: int, max_length: int, page_size: int = 16, dtype=jnp.float32) -> None:
        """Allocate a paged KV cache (`PagedKVCache`) for ``batch`` sequences of
        up to ``max_length`` tokens; later calls append to it."""
        self.cache = PagedKVCache(batch, max_length, page_size, self.num_kv_heads, self.head_dim, dtype)

    def _cached_attention(self, q, k, v):
        c = self.cache
        tables = c.block_tables[...]
        b, t = q.shape[:2]
        if b != tables.shape[0]:
            raise ValueError(f"Attention: the cache holds {tables.shape[0]} sequences, x has batch {b}")
        page_size = c.k[...].shape[1]
        pos = c.lengths[...][:, None] + jnp.arange(t, dtype=jnp.int32)[None]            # [B, T]
        if not isinstance(pos, jax.core.Tracer) and int(pos.max()) >= tables.shape[1] * page_size:
            raise ValueError(f"Attention: the KV cache holds {tables.shape[1] * page_size} tokens per sequence; "
                             f"appending {t} would exceed it")
        page = jnp.take_along_axis(tables, pos // page_size, axis=1, mode="clip")
        slots = (page * page_size + pos % page_size).reshape(-1)
        k_pages, v_pages = update_kv_cache(
            c.k[...], c.v[...], k.reshape(b * t, *k.shape[2:]).astype(c.k.dtype),
            v.reshape(b * t, *v.shape[2:]).astype(c.v.dtype), slots)
        lengths = c.lengths[...] + t
        c.k[...], c.v[...], c.lengths[...] = k_pages, v_pages, lengths
        window = self.local_window_size
        return stellax.paged_attention(
            q.astype(k_pages.dtype), k_pages, v_pages, tables, lengths,
            logits_soft_cap=self.logits_soft_cap, sinks=None if self.sinks is None else self.sinks[...],
            local_window_size=window[0] if isinstance(window, tuple) else window,
            precision=self.precision).astype(q.dtype)

    # -- forward ------------------------------------------------------------------------------
    def __call__(self, x, *, positions=None, mask=None, segment_ids=None, is_causal: bool = True):
        """``x [B, T, D]`` -> ``[B, T, D]``.

        positions: ``[B, T]`` for RoPE (default ``0..T-1``, or the cached
        lengths onward with a cache); mask: boolean, broadcastable to
        ``[B, N, T, T]`` (True = attend); segment_ids: ``[B, T]`` packed sequences.
        """
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(f"Attention: x must be [B, T, {self.features}], got shape {x.shape}")
        b, t, _ = x.shape
        q, k, v = (dense(x, w[...]) for w in (self.q, self.k, self.v))
        if positions is None:
            start = self.cache.lengths[...][:, None] if self.cache is not None else 0
            positions = start + jnp.arange(t, dtype=jnp.int32)[None, :] + jnp.zeros((b, 1), jnp.int32)
        if self.rope_theta is not None:
            q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        if self.cache is not None:
            if mask is not None or segment_ids is not None or not is_causal:
                raise ValueError("Attention: with a KV cache only causal attention without mask/segment_ids runs")
            o = self._cached_attention(q, k, v)
        else:
            o = stellax.dot_product_attention(
                q, k, v, mask=mask, is_causal=is_causal, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                logits_soft_cap=self.logits_soft_cap, sinks=None if self.sinks is None else self.sinks[...],
                local_window_size=self.local_window_size, precision=self.precision)
        if self.gate is not None:
            o = o * jax.nn.sigmoid(dense(x, self.gate[...])).astype(o.dtype)
        y = jnp.einsum("btnh,nhd->btd", o, self.o[...].astype(o.dtype), precision="highest")
        return y if self.dtype is None else y.astype(self.dtype)
