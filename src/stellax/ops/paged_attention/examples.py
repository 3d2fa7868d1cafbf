"""Random paged caches for examples, tests and benchmarks.

`random_paged_cache` builds a page pool whose block tables point at shuffled
pages (and, optionally, a shared prefix: several sequences' first pages are
the same physical pages), so kernels that assume contiguous pages fail.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example, Platform
from ...core.pallas import cdiv
from .quant_cache import KVQuant, quantize_pages


def random_block_tables(rng: np.random.Generator, lengths, page_size: int, max_pages: int, *,
                        shared_prefix_pages: int = 0, extra_pages: int = 3):
    """Block tables ``[B, max_pages]`` over shuffled physical pages.

    Every sequence gets its own pages, except the first ``shared_prefix_pages``
    which all sequences share (prefix caching). Unused entries hold a random
    (valid) page. Returns ``(tables, num_pages)``."""
    lengths = np.asarray(lengths)
    need = [cdiv(int(n), page_size) for n in lengths]
    shared = min(shared_prefix_pages, max(need) if len(need) else 0)
    own = [max(0, k - shared) for k in need]
    num_pages = shared + sum(own) + extra_pages
    perm = rng.permutation(num_pages)
    tables = rng.integers(0, num_pages, size=(len(lengths), max_pages)).astype(np.int32)
    cursor = shared
    for b, k in enumerate(need):
        for j in range(k):
            if j < shared:
                tables[b, j] = perm[j]
            else:
                tables[b, j] = perm[cursor]
                cursor += 1
    return jnp.asarray(tables), num_pages


def random_pool(key, num_pages, page_size, kv_heads, head_dim, dtype, *, outlier_channels: int = 0,
                outlier_scale: float = 20.0):
    """Normal pages ``[num_pages, page_size, (K,) H]`` (``kv_heads=None``: no
    head axis), optionally with a few channels ``outlier_scale`` times larger."""
    heads = () if kv_heads is None else (kv_heads,)
    x = jax.random.normal(key, (num_pages, page_size, *heads, head_dim), jnp.float32)
    if outlier_channels:
        idx = jax.random.choice(jax.random.fold_in(key, 1), head_dim, (outlier_channels,), replace=False)
        x = x.at[..., idx].multiply(outlier_scale)
    return x.astype(dtype)


def _quantize_pools(k, v, quant, value_quant, tables, lengths):
    """``(k, v)`` quantized with ``quant`` (keys) and ``value_quant`` (values; ``None``: as the keys)."""
    if quant is not None:
        k = quantize_pages(k, quant, block_tables=tables, lengths=lengths)
    value_quant = quant if value_quant is None else value_quant
    if value_quant is not None:
        v = quantize_pages(v, value_quant, block_tables=tables, lengths=lengths)
    return k, v


def paged_inputs(seed: int, *, lengths, page_size: int, kv_heads: int, q_heads: int, head_dim: int, dtype,
                 q_tokens: int | None = None, max_pages: int | None = None, shared_prefix_pages: int = 0,
                 value_dim: int | None = None, quant: KVQuant | str | None = None,
                 value_quant: KVQuant | str | None = None, outlier_channels: int = 0):
    """``(q, k_pages, v_pages, block_tables, lengths)`` for `paged_attention`."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    if max_pages is None:
        max_pages = max(1, cdiv(int(lengths.max(initial=1)), page_size))
    tables, num_pages = random_block_tables(rng, lengths, page_size, max_pages,
                                            shared_prefix_pages=shared_prefix_pages)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    b = len(lengths)
    qshape = (b, q_heads, head_dim) if q_tokens is None else (b, q_tokens, q_heads, head_dim)
    q = jax.random.normal(kq, qshape, jnp.float32).astype(dtype)
    k = random_pool(kk, num_pages, page_size, kv_heads, head_dim, dtype, outlier_channels=outlier_channels)
    v = random_pool(kv, num_pages, page_size, kv_heads, value_dim or head_dim, dtype)
    lengths = jnp.asarray(lengths)
    k, v = _quantize_pools(k, v, quant, value_quant, tables, lengths)
    return q, k, v, tables, lengths


def ragged_inputs(seed: int, *, q_lens, kv_lens, page_size: int, kv_heads: int, q_heads: int, head_dim: int,
                  dtype, padding_seqs: int = 0, padding_tokens: int = 0, max_pages: int | None = None,
                  quant=None, value_quant=None):
    """``(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)``
    for `ragged_paged_attention`, with ``padding_seqs`` extra (dead) sequence
    slots and ``padding_tokens`` extra query rows."""
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(q_lens, np.int32)
    kv_all = np.concatenate([np.asarray(kv_lens, np.int32),
                             rng.integers(0, 3 * page_size, padding_seqs).astype(np.int32)])
    if max_pages is None:
        max_pages = max(1, cdiv(int(kv_all.max(initial=1)), page_size))
    tables, num_pages = random_block_tables(rng, kv_all, page_size, max_pages)
    total = int(q_lens.sum()) + padding_tokens
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu = np.concatenate([cu, np.full(padding_seqs, cu[-1] + padding_tokens // 2, np.int32)])
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (max(total, 1), q_heads, head_dim), jnp.float32).astype(dtype)
    k = random_pool(kk, num_pages, page_size, kv_heads, head_dim, dtype)
    v = random_pool(kv, num_pages, page_size, kv_heads, head_dim, dtype)
    kv_all = jnp.asarray(kv_all)
    k, v = _quantize_pools(k, v, quant, value_quant, tables, kv_all)
    return q, k, v, kv_all, tables, jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32)


def mla_inputs(seed: int, *, lengths, page_size: int, heads: int, latent_dim: int, rope_dim: int, dtype,
               q_tokens: int | None = None, quant=None):
    """``(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths)`` for `mla_decode`."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    max_pages = max(1, cdiv(int(lengths.max(initial=1)), page_size))
    tables, num_pages = random_block_tables(rng, lengths, page_size, max_pages)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    b = len(lengths)
    lead = (b, heads) if q_tokens is None else (b, q_tokens, heads)
    q_nope = jax.random.normal(k1, (*lead, latent_dim), jnp.float32).astype(dtype)
    q_pe = jax.random.normal(k2, (*lead, rope_dim), jnp.float32).astype(dtype)
    latent = random_pool(k3, num_pages, page_size, None, latent_dim, dtype)
    pe = random_pool(k4, num_pages, page_size, None, rope_dim, dtype)
    lengths = jnp.asarray(lengths)
    if quant is not None:
        latent = quantize_pages(latent, quant, block_tables=tables, lengths=lengths)
    return q_nope, q_pe, latent, pe, tables, lengths


# -- op examples (`stellax check`) and benchmarks (`stellax bench`) ------------------------------
def paged_examples(dtype):
    out = []
    for i, (lengths, ps, k, n, h, extra) in enumerate((
        ([5, 0, 16, 33], 16, 2, 8, 64, {}),
        ([1, 7, 64], 1, 1, 4, 32, {"local_window_size": 5}),
        ([70, 128], 64, 2, 2, 64, {"logits_soft_cap": 20.0}),
    )):
        q, kp, vp, tables, lens = paged_inputs(i, lengths=lengths, page_size=ps, kv_heads=k, q_heads=n,
                                               head_dim=h, dtype=dtype)
        out.append(Example(f"decode lengths={lengths} page={ps} K={k} N={n} H={h} {extra or ''}".strip(),
                           (q, kp, vp, tables, lens), extra))
    q, kp, vp, tables, lens = paged_inputs(7, lengths=[9, 40], page_size=16, kv_heads=2, q_heads=4, head_dim=64,
                                           dtype=dtype, q_tokens=3)
    out.append(Example("spec-decode Q=3 with sinks", (q, kp, vp, tables, lens),
                       {"sinks": jnp.asarray([0.5, -1.0, 0.0, 2.0], dtype)}))
    q, kp, vp, tables, lens = paged_inputs(8, lengths=[17, 50], page_size=16, kv_heads=2, q_heads=4, head_dim=64,
                                           dtype=dtype, quant="int8")
    out.append(Example("int8 cache", (q, kp, vp, tables, lens)))
    return out


def ragged_examples(dtype):
    out = []
    for i, (q_lens, kv_lens, ps, pad) in enumerate((
        ([1, 5, 1, 12], [9, 5, 33, 40], 16, 2),
        ([3, 1], [3, 70], 1, 0),
    )):
        args = ragged_inputs(i, q_lens=q_lens, kv_lens=kv_lens, page_size=ps, kv_heads=2, q_heads=4, head_dim=64,
                             dtype=dtype, padding_seqs=pad, padding_tokens=3)
        out.append(Example(f"ragged q_lens={q_lens} kv_lens={kv_lens} page={ps}", args))
    return out


def mla_examples(dtype):
    args = mla_inputs(0, lengths=[1, 20, 64], page_size=16, heads=16, latent_dim=128, rope_dim=32, dtype=dtype)
    return [Example("mla lengths=[1,20,64] R=128 P=32", args, {"scale": 0.1})]


def _bench_decode(batch, context, kv_heads, q_heads, head_dim, page_size, dtype=jnp.bfloat16, quant=None):
    q, kp, vp, tables, lens = paged_inputs(0, lengths=[context] * batch, page_size=page_size, kv_heads=kv_heads,
                                           q_heads=q_heads, head_dim=head_dim, dtype=dtype, quant=quant)
    label = f"decode B={batch} ctx={context} K={kv_heads} N={q_heads} H={head_dim} page={page_size}"
    return Example(label + (f" {quant}" if quant else ""), (q, kp, vp, tables, lens))


def paged_benchmarks(platform: Platform):
    if platform.backend == "cpu":
        return [_bench_decode(2, 512, 2, 8, 64, 16, jnp.float32)]
    return [_bench_decode(b, ctx, 8, 64, 128, 16) for b, ctx in ((8, 8192), (4, 32768), (1, 131072))]


def ragged_benchmarks(platform: Platform):
    small = platform.backend == "cpu"
    q_lens = [1] * 6 + [64, 200] if small else [1] * 60 + [512, 1024, 2048]
    kv_lens = [300] * 6 + [64, 400] if small else [8192] * 60 + [512, 4096, 8192]
    dtype = jnp.float32 if small else jnp.bfloat16
    args = ragged_inputs(0, q_lens=q_lens, kv_lens=kv_lens, page_size=16, kv_heads=2 if small else 8,
                         q_heads=8 if small else 64, head_dim=64 if small else 128, dtype=dtype)
    return [Example(f"mixed batch: {len(q_lens)} seqs, {sum(q_lens)} new tokens", args)]


def mla_benchmarks(platform: Platform):
    if platform.backend == "cpu":
        args = mla_inputs(0, lengths=[256, 256], page_size=16, heads=16, latent_dim=128, rope_dim=32,
                          dtype=jnp.float32)
        return [Example("mla B=2 ctx=256", args, {"scale": 0.1})]
    out = []
    for b, ctx in ((32, 4096), (8, 32768)):
        args = mla_inputs(0, lengths=[ctx] * b, page_size=64, heads=128, latent_dim=512, rope_dim=64,
                          dtype=jnp.bfloat16)
        out.append(Example(f"mla B={b} ctx={ctx} N=128 R=512 P=64", args, {"scale": 192 ** -0.5}))
    return out
