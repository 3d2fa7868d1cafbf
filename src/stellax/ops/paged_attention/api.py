"""Public serving-attention API: `paged_attention`, `ragged_paged_attention`
and `mla_decode` over paged (optionally quantized) KV caches.

Three registered ops, each with ``triton`` (split-K flash-decoding kernels,
GQA-packed, dequantizing in registers) and ``xla`` (a memory-linear loop over
page blocks; the CPU default) implementations and a float32 golden that
gathers the pages into dense K/V (`reference`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, checks, register
from . import examples as examples_mod
from . import triton as triton_kernels
from . import xla as xla_kernels
from .cache import pool_entries
from .configs import (
    MlaConfig, PagedConfig, RaggedConfig, mla_heuristic, mla_requirements, mla_space, paged_heuristic,
    paged_requirements, paged_space, ragged_heuristic, ragged_requirements, ragged_space,
)
from .quant_cache import QuantizedPages
from .reference import mla_decode_reference, paged_attention_reference, ragged_paged_attention_reference


# -- argument checks -------------------------------------------------------------------
def _pool(name: str, pages, ranks=(4,)):
    if isinstance(pages, QuantizedPages):
        if pages.ndim not in ranks:
            raise ValueError(f"{name}: expected a rank {ranks[0]} pool, got a quantized pool of shape {pages.shape}")
        return pages
    checks.require_float(name, pages)
    return checks.require_ndim(name, pages, ranks)


def _positive_float_or_none(name, value):
    return None if value is None else checks.require_positive_float(name, value)


def _window_left(local_window_size):
    """``None | int | (left, right)`` → ``left`` (``right`` beyond 0 is meaningless
    with causal queries and must be 0 or None)."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size: expected an int or a (left, right) pair, got {local_window_size!r}")
        left, right = local_window_size
        if right not in (None, 0):
            raise ValueError(f"local_window_size: the right window must be 0 or None for causal paged "
                             f"attention, got {right!r}")
        if left is None:
            return None
        local_window_size = left
    if isinstance(local_window_size, bool) or not isinstance(local_window_size, (int, np.integer)):
        raise TypeError(f"local_window_size: expected an int >= 0, got {type(local_window_size).__name__}")
    if local_window_size < 0:
        raise ValueError(f"local_window_size: expected an int >= 0, got {local_window_size}")
    return int(local_window_size)


def _scale(scale, head_dim: int):
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    return float(scale)


def _int_array(name: str, value, shape):
    checks.require_int(name, value)
    return checks.require_shape(name, value, shape)


def _check_windows(k_pages, v_pages, rows: int, what: str):
    specs = [p.spec for p in (k_pages, v_pages) if isinstance(p, QuantizedPages) and p.window is not None]
    if len(specs) == 2 and (specs[0].sink_tokens, specs[0].recent_tokens) != (specs[1].sink_tokens,
                                                                               specs[1].recent_tokens):
        raise ValueError(f"v_pages: sink/recent windows ({specs[1].sink_tokens}, {specs[1].recent_tokens}) must "
                         f"match k_pages' ({specs[0].sink_tokens}, {specs[0].recent_tokens})")
    for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):
        if isinstance(p, QuantizedPages) and p.window is not None and p.window.shape[0] < rows:
            raise ValueError(f"{name}: the full-precision windows have {p.window.shape[0]} sequence rows; "
                             f"expected at least {rows} ({what})")


def _check_pools(q_dtype, head_dim: int, n_heads: int, k_pages, v_pages):
    """Shapes of the key/value pools → (num_pages, page_size, kv_heads, value_dim)."""
    if v_pages is None:
        if isinstance(k_pages, QuantizedPages):
            raise ValueError("v_pages: None means a combined dense kv_pages [num_pages, page_size, 2, K, H]; "
                             "a quantized pool needs separate k_pages and v_pages")
        _pool("k_pages", k_pages, ranks=(5,))
        if k_pages.shape[2] != 2:
            raise ValueError(f"k_pages: a combined kv_pages must be [num_pages, page_size, 2, K, H], got "
                             f"{tuple(k_pages.shape)}")
        num_pages, page_size, _, kv_heads, hk = k_pages.shape
        hv = hk
        dense = [("k_pages", k_pages)]
    else:
        _pool("k_pages", k_pages)
        _pool("v_pages", v_pages)
        num_pages, page_size, kv_heads, hk = k_pages.shape
        vs = tuple(v_pages.shape)
        if vs[:3] != (num_pages, page_size, kv_heads):
            raise ValueError(f"v_pages: expected shape ({num_pages}, {page_size}, {kv_heads}, *) to match "
                             f"k_pages' [num_pages, page_size, K], got {vs}")
        hv = vs[3]
        dense = [(n, p) for n, p in (("k_pages", k_pages), ("v_pages", v_pages)) if not isinstance(p, QuantizedPages)]
    if hk != head_dim:
        raise ValueError(f"k_pages: expected head_dim {head_dim} (q.shape[-1]), got {hk}")
    if n_heads % kv_heads:
        raise ValueError(f"q: the number of query heads {n_heads} must be a multiple of the kv heads {kv_heads}")
    for name, p in dense:
        if np.dtype(p.dtype) != np.dtype(q_dtype):
            raise TypeError(f"{name}: expected dtype {np.dtype(q_dtype).name} (q's), got {np.dtype(p.dtype).name}")
    return num_pages, page_size, kv_heads, hv


def _check_sinks(sinks, n_heads):
    if sinks is None:
        return None
    checks.require_float("sinks", sinks)
    return checks.require_shape("sinks", sinks, (n_heads,), "one logit per query head")


def _common_options(scale, logits_soft_cap, local_window_size, head_dim):
    return {"scale": _scale(scale, head_dim),
            "logits_soft_cap": _positive_float_or_none("logits_soft_cap", logits_soft_cap),
            "window_left": _window_left(local_window_size)}


def check_paged(q, k_pages, v_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
                local_window_size=None, sinks=None) -> Call:
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, (3, 4))
    b, n, h = q.shape[0], q.shape[-2], q.shape[-1]
    _check_pools(q.dtype, h, n, k_pages, v_pages)
    checks.require_int("block_tables", block_tables)
    checks.require_ndim("block_tables", block_tables, 2)
    checks.require_shape("block_tables", block_tables, (b, None), "[batch, max_pages_per_seq]")
    _int_array("lengths", lengths, (b,))
    sinks = _check_sinks(sinks, n)
    _check_windows(k_pages, v_pages, b, "one per batch row")
    k_arrays, k_opts = pool_entries("k", k_pages)
    v_arrays, v_opts = pool_entries("v", v_pages)
    arrays = {"q": q, **k_arrays, **v_arrays, "block_tables": block_tables, "lengths": lengths, "sinks": sinks}
    return Call(arrays, {**_common_options(scale, logits_soft_cap, local_window_size, h), **k_opts, **v_opts})


def _num_seqs(value):
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return jnp.asarray([value], jnp.int32)
    checks.require_int("num_seqs", value)
    if value.size != 1:
        raise ValueError(f"num_seqs: expected a scalar or a [1] array, got shape {tuple(value.shape)}")
    return value.reshape(1)


def check_ragged(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale=None,
                 logits_soft_cap=None, local_window_size=None, sinks=None) -> Call:
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, 3)
    _, n, h = q.shape
    _check_pools(q.dtype, h, n, k_pages, v_pages)
    checks.require_int("kv_lens", kv_lens)
    checks.require_ndim("kv_lens", kv_lens, 1)
    s = kv_lens.shape[0]
    checks.require_int("block_tables", block_tables)
    checks.require_ndim("block_tables", block_tables, 2)
    checks.require_shape("block_tables", block_tables, (s, None), "[S, max_pages_per_seq], S = kv_lens.shape[0]")
    _int_array("cu_q_lens", cu_q_lens, (s + 1,))
    num_seqs = _num_seqs(num_seqs)
    sinks = _check_sinks(sinks, n)
    _check_windows(k_pages, v_pages, s, "one per sequence")
    k_arrays, k_opts = pool_entries("k", k_pages)
    v_arrays, v_opts = pool_entries("v", v_pages)
    arrays = {"q": q, **k_arrays, **v_arrays, "kv_lens": kv_lens, "block_tables": block_tables,
              "cu_q_lens": cu_q_lens, "num_seqs": num_seqs, "sinks": sinks}
    return Call(arrays, {**_common_options(scale, logits_soft_cap, local_window_size, h), **k_opts, **v_opts})


def check_mla(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
              local_window_size=None) -> Call:
    q_nope = checks.require_float("q_nope", q_nope)
    checks.require_ndim("q_nope", q_nope, (3, 4))
    q_pe = checks.require_float("q_pe", q_pe)
    checks.require_same_dtype("q_pe", q_pe, "q_nope", q_nope)
    checks.require_shape("q_pe", q_pe, (*q_nope.shape[:-1], None), "q_nope's leading dims")
    b, r, p = q_nope.shape[0], q_nope.shape[-1], q_pe.shape[-1]
    _pool("latent_pages", latent_pages, ranks=(3,))
    _pool("pe_pages", pe_pages, ranks=(3,))
    num_pages, page_size, lr = latent_pages.shape
    if lr != r:
        raise ValueError(f"latent_pages: expected latent dim {r} (q_nope.shape[-1]), got {lr}")
    if tuple(pe_pages.shape) != (num_pages, page_size, p):
        raise ValueError(f"pe_pages: expected shape {(num_pages, page_size, p)} ([num_pages, page_size, "
                         f"q_pe.shape[-1]]), got {tuple(pe_pages.shape)}")
    for name, pool in (("latent_pages", latent_pages), ("pe_pages", pe_pages)):
        if not isinstance(pool, QuantizedPages) and np.dtype(pool.dtype) != np.dtype(q_nope.dtype):
            raise TypeError(f"{name}: expected dtype {np.dtype(q_nope.dtype).name} (q_nope's), "
                            f"got {np.dtype(pool.dtype).name}")
    checks.require_int("block_tables", block_tables)
    checks.require_ndim("block_tables", block_tables, 2)
    checks.require_shape("block_tables", block_tables, (b, None), "[batch, max_pages_per_seq]")
    _int_array("lengths", lengths, (b,))
    if scale is None:
        raise TypeError("scale: mla_decode needs an explicit scale (1/sqrt(qk_nope_dim + qk_rope_dim) "
                        "of the un-absorbed model)")
    _check_windows(latent_pages, pe_pages, b, "one per batch row")
    l_arrays, l_opts = pool_entries("latent", latent_pages)
    p_arrays, p_opts = pool_entries("pe", pe_pages)
    arrays = {"q_nope": q_nope, "q_pe": q_pe, **l_arrays, **p_arrays, "block_tables": block_tables,
              "lengths": lengths}
    return Call(arrays, {**_common_options(scale, logits_soft_cap, local_window_size, r), **l_opts, **p_opts})


# -- cost models ----------------------------------------------------------------------------
def _nbytes(a) -> float:
    return 0.0 if a is None else float(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def _concrete_sum(x, default: float) -> float:
    try:
        return float(np.sum(np.asarray(x)))
    except Exception:  # traced or abstract: assume full tables
        return default


def _pool_bytes_per_token(call: Call, prefix: str) -> float:
    """Bytes read per cached token (all heads) of pool ``prefix``."""
    data = call.arrays.get(f"{prefix}_pages")
    if data is None:
        return 0.0
    per_token = _nbytes(data) / (data.shape[0] * data.shape[1])
    for extra in ("scale", "zero"):
        a = call.arrays.get(f"{prefix}_{extra}")
        if a is not None:
            per_token += _nbytes(a) / (data.shape[0] * data.shape[1])
    return per_token


def _live_tokens(call: Call, lengths, tables) -> float:
    page_size = call.arrays[[k for k in call.arrays if k.endswith("_pages")][0]].shape[1]
    return _concrete_sum(lengths, float(tables.shape[0] * tables.shape[1] * page_size))


def _paged_flops(call: Call) -> float:
    q = call.q
    nq = 1 if q.ndim == 3 else q.shape[1]
    n, h = q.shape[-2], q.shape[-1]
    return 2.0 * nq * n * (h + _value_dim(call, h)) * _live_tokens(call, call.lengths, call.block_tables)


def _value_dim(call: Call, head_dim: int) -> int:
    if call.v_pages is None:
        return head_dim
    if call.options.get("v_quant") is not None:
        return call.options["v_head_dim"]
    return call.v_pages.shape[-1]


def _paged_bytes(call: Call) -> float:
    tokens = _live_tokens(call, call.lengths, call.block_tables)
    kv = tokens * (_pool_bytes_per_token(call, "k") + _pool_bytes_per_token(call, "v"))
    return kv + 2 * _nbytes(call.q) + _nbytes(call.block_tables) + _nbytes(call.lengths)


def _ragged_flops(call: Call) -> float:
    n, h = call.q.shape[-2], call.q.shape[-1]
    hv = _value_dim(call, h)
    # Upper bound without concrete lengths: every token against its whole sequence.
    try:
        cu = np.asarray(call.cu_q_lens)
        kv = np.asarray(call.kv_lens)
        ns = int(np.asarray(call.num_seqs).reshape(-1)[0])
        q_len = np.diff(cu)[:ns]
        pairs = float(np.sum(q_len * kv[:ns] - q_len * (q_len - 1) / 2))
    except Exception:
        pairs = float(call.q.shape[0]) * call.block_tables.shape[1] * call.k_pages.shape[1]
    return 2.0 * n * (h + hv) * pairs


def _ragged_bytes(call: Call) -> float:
    tokens = _live_tokens(call, call.kv_lens, call.block_tables)
    kv = tokens * (_pool_bytes_per_token(call, "k") + _pool_bytes_per_token(call, "v"))
    return kv + 2 * _nbytes(call.q) + _nbytes(call.block_tables)


def _mla_flops(call: Call) -> float:
    q = call.q_nope
    nq = 1 if q.ndim == 3 else q.shape[1]
    n, r, p = q.shape[-2], q.shape[-1], call.q_pe.shape[-1]
    return 2.0 * nq * n * (2 * r + p) * _live_tokens(call, call.lengths, call.block_tables)


def _mla_bytes(call: Call) -> float:
    tokens = _live_tokens(call, call.lengths, call.block_tables)
    kv = tokens * (_pool_bytes_per_token(call, "latent") + _pool_bytes_per_token(call, "pe"))
    return kv + 2 * _nbytes(call.q_nope) + _nbytes(call.q_pe) + _nbytes(call.block_tables)


# -- ops -------------------------------------------------------------------------------------
def _serving_op(name, check, reference, run, config_type, heuristic, space, requirements, flops, bytes_accessed,
                examples, benchmarks) -> Op:
    """A serving op: the Triton kernel ``run`` (with its config type, heuristic,
    autotuning space and requirements) and the XLA path of the same name."""
    return register(Op(
        name,
        family="paged_attention",
        check=check,
        reference=reference,
        implementations=[
            Implementation("triton", getattr(triton_kernels, run), backend="triton", config_type=config_type,
                           heuristic=heuristic, space=space, requirements=requirements),
            Implementation("xla", getattr(xla_kernels, run)),
        ],
        flops=flops,
        bytes_accessed=bytes_accessed,
        examples=examples,
        benchmarks=benchmarks,
    ))


paged_attention_op = _serving_op("paged_attention", check_paged, paged_attention_reference, "run_paged", PagedConfig,
                                 paged_heuristic, paged_space, paged_requirements, _paged_flops, _paged_bytes,
                                 examples_mod.paged_examples, examples_mod.paged_benchmarks)
ragged_paged_attention_op = _serving_op("ragged_paged_attention", check_ragged, ragged_paged_attention_reference,
                                        "run_ragged", RaggedConfig, ragged_heuristic, ragged_space, ragged_requirements,
                                        _ragged_flops, _ragged_bytes, examples_mod.ragged_examples,
                                        examples_mod.ragged_benchmarks)
mla_decode_op = _serving_op("mla_decode", check_mla, mla_decode_reference, "run_mla", MlaConfig, mla_heuristic,
                            mla_space, mla_requirements, _mla_flops, _mla_bytes, examples_mod.mla_examples,
                            examples_mod.mla_benchmarks)


# -- public functions ------------------------------------------------------------------------
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
                    local_window_size=None, sinks=None, implementation=None, config=None):
    """Attention of new query tokens against a paged KV cache (decode, and
    speculative multi-token decode).

    Args:
      q: ``[B, N, H]`` (one new token per sequence) or ``[B, Q, N, H]`` (``Q``
        new tokens, the last ``Q`` positions of the sequence: bottom-right
        causal, query ``i`` at position ``L - Q + i``).
      k_pages, v_pages: ``[num_pages, page_size, K, H]`` (``v_pages`` may have
        its own head dim), dense in ``q.dtype`` or `QuantizedPages`
        (int8/fp8/int4/int2, dequantized inside the kernels); or a combined
        ``kv_pages [num_pages, page_size, 2, K, H]`` as ``k_pages`` with
        ``v_pages=None``. ``N`` must be a multiple of ``K`` (GQA).
      block_tables: ``[B, max_pages]`` int32: page of each sequence's ``i``-th
        ``page_size`` tokens. Only the first ``ceil(L / page_size)`` entries
        are read.
      lengths: ``[B]`` int32: tokens in each sequence's cache, the new ones
        included. ``0`` gives zeros.
      scale: logit scale (default ``1/sqrt(H)``).
      logits_soft_cap: ``cap · tanh(s / cap)`` on the scaled logits.
      local_window_size: ``left`` (or ``(left, 0)``): query at position ``qp``
        sees keys ``qp - left <= p <= qp`` (as `dot_product_attention`).
      sinks: ``[N]`` per-head sink logits (in the softmax denominator only).
      implementation: ``None`` (best available), ``"triton"`` or ``"xla"``.
      config: a `PagedConfig` for the Triton kernels.

    Returns ``[B, (Q,) N, Hv]`` in ``q.dtype``. Out-of-range metadata is
    clamped under jit; use `stellax.paged.validate` to get errors.
    """
    return paged_attention_op(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                              logits_soft_cap=logits_soft_cap, local_window_size=local_window_size, sinks=sinks,
                              implementation=implementation, config=config)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale=None,
                           logits_soft_cap=None, local_window_size=None, sinks=None, implementation=None,
                           config=None):
    """One serving step over a batch mixing prefills, chunked prefills and decodes.

    Args:
      q: ``[total_q_tokens, N, H]``: the new tokens of every sequence, packed;
        sequence ``s`` owns ``q[cu_q_lens[s]:cu_q_lens[s+1]]``, which are the
        last ``q_len`` positions of its ``kv_len`` (bottom-right causal).
      k_pages, v_pages: as in `paged_attention`.
      kv_lens: ``[S]`` int32 cached tokens per sequence (new ones included).
      block_tables: ``[S, max_pages]`` int32.
      cu_q_lens: ``[S + 1]`` int32 cumulative query lengths (``cu_q_lens[0] = 0``).
      num_seqs: int32 scalar / ``[1]`` array (may be traced): only the first
        ``num_seqs`` sequences are live; the rest of ``S`` is padding and
        query tokens past ``cu_q_lens[num_seqs]`` get zeros. Shapes are static,
        so one compilation serves every step.
      scale, logits_soft_cap, local_window_size, sinks: as in `paged_attention`.

    Returns ``[total_q_tokens, N, Hv]`` in ``q.dtype``.
    """
    return ragged_paged_attention_op(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
                                     scale=scale, logits_soft_cap=logits_soft_cap,
                                     local_window_size=local_window_size, sinks=sinks,
                                     implementation=implementation, config=config)


def mla_decode(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, *, scale, logits_soft_cap=None,
               local_window_size=None, implementation=None, config=None):
    """DeepSeek-style multi-head latent attention decode (weight-absorbed form).

    Every query head attends to one shared latent cache:

        s_t = scale · (q_nope · c_t + q_pe · pe_t),    out = Σ_t softmax(s)_t c_t

    Args:
      q_nope: ``[B, N, R]`` (or ``[B, Q, N, R]``): queries absorbed into the
        latent space (``R = kv_lora_rank``, 512 in DeepSeek V2/V3).
      q_pe: ``[B, N, P]`` (or ``[B, Q, N, P]``): the rotary part (``P = 64``).
      latent_pages: ``[num_pages, page_size, R]`` (dense or `QuantizedPages`).
      pe_pages: ``[num_pages, page_size, P]``.
      block_tables, lengths: as in `paged_attention`.
      scale: the logit scale of the un-absorbed model (required).

    Returns ``[B, (Q,) N, R]`` in ``q_nope.dtype`` (project with ``W_UV`` after).
    """
    return mla_decode_op(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, scale=scale,
                         logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                         implementation=implementation, config=config)
