"""Public paged-attention API: the serving ops `paged_attention`,
`ragged_paged_attention` and `mla_decode`, registered over the family's
backend tables (`base`), and the cache helpers (`init_kv_cache`,
`update_kv_cache`, `validate`, the quantized formats, calibrated rotations
and the random test caches) re-exported from the modules that define them.
"""

from __future__ import annotations

from ...core import Call
from ...core.backends import Backend
from . import examples
from .base import (MLA_BACKENDS, PAGED_BACKENDS, RAGGED_BACKENDS, check_mla, check_paged, check_ragged, mla_bytes,
                   mla_flops, paged_bytes, paged_flops, ragged_bytes, ragged_flops)
from .cache import init_kv_cache, update_kv_cache
from .configs import MlaConfig, PagedConfig, RaggedConfig, TpuMlaConfig, TpuPagedConfig, TpuRaggedConfig
from .examples import mla_inputs, paged_inputs, ragged_inputs, random_block_tables
from .quant_cache import (
    KVQuant, QuantizedPages, dequantize_pages, hadamard, pack_codes, quantize_pages, rotate, rotation_signs,
    unpack_codes, unrotate,
)
from .reference import mla_decode_reference, paged_attention_reference, ragged_paged_attention_reference
from .rotation import KVClip, KVRotation, calibrate_kv_clip, calibrate_kv_rotation, load_kv_rotation, save_kv_rotation
from .validation import bad_batch_rows, bad_ragged_tokens, poison, validate


# Every implementation and the golden give bad metadata the same documented result (NaN rows,
# `validation.bad_batch_rows` / `bad_ragged_tokens`), outside the kernels, which read clamped
# metadata; in checked mode the same conditions are checks, traced once per call.
def _run_paged(backend: Backend, call: Call, config):
    bad = bad_batch_rows(call, "k")
    return poison(backend.kernels.run_paged(call, config), bad)


def _run_ragged(backend: Backend, call: Call, config):
    bad = bad_ragged_tokens(call)
    return poison(backend.kernels.run_ragged(call, config), bad)


def _run_mla(backend: Backend, call: Call, config):
    bad = bad_batch_rows(call, "latent")
    return poison(backend.kernels.run_mla(call, config), bad)


def _paged_reference(call: Call):
    """The golden (`reference.paged_attention_reference`) with bad metadata's NaN rows."""
    return poison(paged_attention_reference(call), bad_batch_rows(call, "k"))


_paged_reference.__wrapped__ = paged_attention_reference  # what the lab shows as the golden (inspect.unwrap)


def _ragged_reference(call: Call):
    """The golden (`reference.ragged_paged_attention_reference`) with bad metadata's NaN tokens."""
    return poison(ragged_paged_attention_reference(call), bad_ragged_tokens(call))


_ragged_reference.__wrapped__ = ragged_paged_attention_reference  # what the lab shows as the golden (inspect.unwrap)


def _mla_reference(call: Call):
    """The golden (`reference.mla_decode_reference`) with bad metadata's NaN rows."""
    return poison(mla_decode_reference(call), bad_batch_rows(call, "latent"))


_mla_reference.__wrapped__ = mla_decode_reference  # what the lab shows as the golden (inspect.unwrap)


# -- ops -------------------------------------------------------------------------------------
paged_attention_op = PAGED_BACKENDS.op(
    "paged_attention", _run_paged, check=check_paged, reference=_paged_reference, flops=paged_flops,
    bytes_accessed=paged_bytes, examples=examples.paged_examples, benchmarks=examples.paged_benchmarks)

ragged_paged_attention_op = RAGGED_BACKENDS.op(
    "ragged_paged_attention", _run_ragged, check=check_ragged, reference=_ragged_reference, flops=ragged_flops,
    bytes_accessed=ragged_bytes, examples=examples.ragged_examples, benchmarks=examples.ragged_benchmarks)

mla_decode_op = MLA_BACKENDS.op(
    "mla_decode", _run_mla, check=check_mla, reference=_mla_reference, flops=mla_flops, bytes_accessed=mla_bytes,
    examples=examples.mla_examples, benchmarks=examples.mla_benchmarks)


# -- public functions --------------------------------------------------------------------------
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
                    local_window_size=None, sinks=None, precision=None, implementation=None, config=None):
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
      precision: float32 contraction precision (None: 'highest' unless
        `jax.default_matmul_precision` is set); see docs/precision.md.
      implementation: ``None`` (best available, ending in ``"xla"``),
        ``"mosaic_tpu"``, ``"triton"``, ``"xla"`` or a sequence tried in order.
      config: a `TpuPagedConfig` for the Mosaic TPU kernel or a `PagedConfig`
        for the Triton kernels (the XLA path has none).

    Returns ``[B, (Q,) N, Hv]`` in ``q.dtype``.

    Data-dependent checks (docs/paged_attention.md): ``lengths[b]`` in ``[0,
    max_pages * page_size]`` and the live entries of ``block_tables[b]`` (the
    first ``ceil(lengths[b] / page_size)``) in ``[0, num_pages)``. Without
    checks, row ``b`` of a sequence that breaks them is NaN (every other row
    exact); in checked mode (`stellax.checked`) they are checkify checks naming
    the argument, index and value; `stellax.ops.paged_attention.validate`
    raises eagerly.
    """
    return paged_attention_op(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                              logits_soft_cap=logits_soft_cap, local_window_size=local_window_size, sinks=sinks,
                              precision=precision, implementation=implementation, config=config)


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
      implementation: ``None`` (best available, ending in ``"xla"``),
        ``"mosaic_tpu"``, ``"triton"``, ``"xla"`` or a sequence tried in order.
      config: a `TpuRaggedConfig` for the Mosaic TPU kernel or a `RaggedConfig`
        for the Triton kernels (the XLA path has none).
      precision: float32 contraction precision, as in `paged_attention` (docs/precision.md).

    Returns ``[total_q_tokens, N, Hv]`` in ``q.dtype``.

    Data-dependent checks (docs/paged_attention.md): ``0 <= num_seqs <= S``;
    ``cu_q_lens[0] == 0``, non-decreasing up to ``cu_q_lens[num_seqs] <=
    total_q_tokens``; for each live sequence ``kv_lens`` in ``[0, max_pages *
    page_size]``, ``q_len <= kv_len`` and live block-table entries in ``[0,
    num_pages)``. Without checks the tokens of a sequence that breaks them
    are NaN; the first bad offset ``cu_q_lens[j]`` makes every token from
    the start of sequence ``max(j - 1, 0)`` to the end NaN, a bad
    ``num_seqs`` every token; the other tokens are exact. In checked mode
    (`stellax.checked`) they are checkify checks naming the argument;
    `validate` raises eagerly.
    """
    return ragged_paged_attention_op(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
                                     scale=scale, logits_soft_cap=logits_soft_cap,
                                     local_window_size=local_window_size, sinks=sinks, precision=precision,
                                     implementation=implementation, config=config)


def mla_decode(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, *, scale, logits_soft_cap=None,
               local_window_size=None, implementation=None, config=None, precision=None):
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
      logits_soft_cap, local_window_size: as in `paged_attention`.
      implementation: ``None`` (best available, ending in ``"xla"``),
        ``"mosaic_tpu"``, ``"triton"``, ``"xla"`` or a sequence tried in order.
      config: a `TpuMlaConfig` for the Mosaic TPU kernel or an `MlaConfig`
        for the Triton kernels (the XLA path has none).
      precision: float32 contraction precision, as in `paged_attention` (docs/precision.md).

    Returns ``[B, (Q,) N, R]`` in ``q_nope.dtype`` (project with ``W_UV`` after).

    Data-dependent checks: as `paged_attention` (``lengths``, live
    ``block_tables`` entries): without checks a bad row is NaN; in checked
    mode (`stellax.checked`) they are checkify checks naming the argument.
    """
    return mla_decode_op(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, scale=scale,
                         logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                         precision=precision, implementation=implementation, config=config)


__all__ = [
    "KVClip", "KVQuant", "KVRotation", "MlaConfig", "PagedConfig", "QuantizedPages", "RaggedConfig", "TpuMlaConfig",
    "TpuPagedConfig", "TpuRaggedConfig", "calibrate_kv_clip", "calibrate_kv_rotation", "dequantize_pages",
    "hadamard", "init_kv_cache", "load_kv_rotation", "mla_decode", "mla_decode_op", "mla_inputs", "pack_codes",
    "paged_attention", "paged_attention_op", "paged_inputs", "quantize_pages", "ragged_inputs",
    "ragged_paged_attention", "ragged_paged_attention_op", "random_block_tables", "rotate", "rotation_signs",
    "save_kv_rotation", "unpack_codes", "unrotate", "update_kv_cache", "validate",
]
