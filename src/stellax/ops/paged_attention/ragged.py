"""The `ragged_paged_attention` op: one serving step over a batch mixing
prefills, chunked prefills and decodes (packed query tokens)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.pallas import nbytes
from . import examples, mosaic_tpu
from . import triton as triton_kernels
from . import xla as xla_kernels
from .base import (
    check_pools, check_sinks, check_windows, common_options, int_array, live_tokens, pool_bytes_per_token, serving_op,
    value_dim,
)
from .cache import pool_entries
from .configs import RaggedConfig, ragged_heuristic, ragged_requirements, ragged_space
from .reference import ragged_paged_attention_reference


def _num_seqs(value):
    """``num_seqs`` (an int or a size-1 int array) as an int32 ``[1]`` array."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return jnp.asarray([value], jnp.int32)
    checks.require_int("num_seqs", value)
    if value.size != 1:
        raise ValueError(f"num_seqs: expected a scalar or a [1] array, got shape {tuple(value.shape)}")
    if tuple(value.shape) == (1,):   # also abstract values (the compile tier's ShapeDtypeStructs)
        return value
    return value.reshape(1)


def check_ragged(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale=None,
                 logits_soft_cap=None, local_window_size=None, sinks=None, precision=None) -> Call:
    """Checked `ragged_paged_attention_op` arguments (see `ragged_paged_attention`)."""
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, 3)
    _, n, h = q.shape
    check_pools(q.dtype, h, n, k_pages, v_pages)
    checks.require_int("kv_lens", kv_lens)
    checks.require_ndim("kv_lens", kv_lens, 1)
    s = kv_lens.shape[0]
    checks.require_int("block_tables", block_tables)
    checks.require_ndim("block_tables", block_tables, 2)
    checks.require_shape("block_tables", block_tables, (s, None), "[S, max_pages_per_seq], S = kv_lens.shape[0]")
    int_array("cu_q_lens", cu_q_lens, (s + 1,))
    num_seqs = _num_seqs(num_seqs)
    sinks = check_sinks(sinks, n)
    check_windows(k_pages, v_pages, s, "one per sequence")
    k_arrays, k_opts = pool_entries("k", k_pages)
    v_arrays, v_opts = pool_entries("v", v_pages)
    arrays = {"q": q, **k_arrays, **v_arrays, "kv_lens": kv_lens, "block_tables": block_tables,
              "cu_q_lens": cu_q_lens, "num_seqs": num_seqs, "sinks": sinks}
    return Call(arrays, {**common_options(scale, logits_soft_cap, local_window_size, h, precision), **k_opts, **v_opts})


def _ragged_flops(call: Call) -> float:
    n, h = call.q.shape[-2], call.q.shape[-1]
    hv = value_dim(call, h)
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
    tokens = live_tokens(call, call.kv_lens, call.block_tables)
    kv = tokens * (pool_bytes_per_token(call, "k") + pool_bytes_per_token(call, "v"))
    return kv + 2 * nbytes(call.q) + nbytes(call.block_tables)


ragged_paged_attention_op = serving_op(
    "ragged_paged_attention", check=check_ragged, reference=ragged_paged_attention_reference,
    triton=triton_kernels.run_ragged, xla=xla_kernels.run_ragged, config_type=RaggedConfig,
    heuristic=ragged_heuristic, space=ragged_space, requirements=ragged_requirements, flops=_ragged_flops,
    bytes_accessed=_ragged_bytes, examples=examples.ragged_examples, benchmarks=examples.ragged_benchmarks,
    mosaic_tpu=mosaic_tpu.RAGGED_IMPLEMENTATION)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale=None,
                           logits_soft_cap=None, local_window_size=None, sinks=None, implementation=None,
                           config=None, precision=None):
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
      precision: float32 contraction precision, as in `paged_attention` (docs/precision.md).

    Returns ``[total_q_tokens, N, Hv]`` in ``q.dtype``.
    """
    return ragged_paged_attention_op(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
                                     scale=scale, logits_soft_cap=logits_soft_cap,
                                     local_window_size=local_window_size, sinks=sinks, precision=precision,
                                     implementation=implementation, config=config)
