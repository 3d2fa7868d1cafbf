"""The `mla_decode` op: DeepSeek-style multi-head latent attention decode
(weight-absorbed form) over paged latent and rope caches."""

from __future__ import annotations

import numpy as np

from ...core import Call, checks
from ...core.pallas import nbytes
from . import examples, mosaic_tpu_mla
from . import triton as triton_kernels
from . import xla as xla_kernels
from .base import check_pool, check_windows, common_options, int_array, live_tokens, pool_bytes_per_token, serving_op
from .cache import pool_entries
from .configs import MlaConfig, mla_heuristic, mla_requirements, mla_space
from .quant_cache import QuantizedPages
from .reference import mla_decode_reference


def check_mla(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
              local_window_size=None, precision=None) -> Call:
    """Checked `mla_decode_op` arguments (see `mla_decode`); ``scale`` is required."""
    q_nope = checks.require_float("q_nope", q_nope)
    checks.require_ndim("q_nope", q_nope, (3, 4))
    q_pe = checks.require_float("q_pe", q_pe)
    checks.require_same_dtype("q_pe", q_pe, "q_nope", q_nope)
    checks.require_shape("q_pe", q_pe, (*q_nope.shape[:-1], None), "q_nope's leading dims")
    b, r, p = q_nope.shape[0], q_nope.shape[-1], q_pe.shape[-1]
    check_pool("latent_pages", latent_pages, ranks=(3,))
    check_pool("pe_pages", pe_pages, ranks=(3,))
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
    int_array("lengths", lengths, (b,))
    if scale is None:
        raise TypeError("scale: mla_decode needs an explicit scale (1/sqrt(qk_nope_dim + qk_rope_dim) "
                        "of the un-absorbed model)")
    check_windows(latent_pages, pe_pages, b, "one per batch row")
    l_arrays, l_opts = pool_entries("latent", latent_pages)
    p_arrays, p_opts = pool_entries("pe", pe_pages)
    arrays = {"q_nope": q_nope, "q_pe": q_pe, **l_arrays, **p_arrays, "block_tables": block_tables,
              "lengths": lengths}
    return Call(arrays, {**common_options(scale, logits_soft_cap, local_window_size, r, precision), **l_opts, **p_opts})


def _mla_flops(call: Call) -> float:
    q = call.q_nope
    nq = 1 if q.ndim == 3 else q.shape[1]
    n, r, p = q.shape[-2], q.shape[-1], call.q_pe.shape[-1]
    return 2.0 * nq * n * (2 * r + p) * live_tokens(call, call.lengths, call.block_tables)


def _mla_bytes(call: Call) -> float:
    tokens = live_tokens(call, call.lengths, call.block_tables)
    kv = tokens * (pool_bytes_per_token(call, "latent") + pool_bytes_per_token(call, "pe"))
    return kv + 2 * nbytes(call.q_nope) + nbytes(call.q_pe) + nbytes(call.block_tables)


mla_decode_op = serving_op(
    "mla_decode", check=check_mla, reference=mla_decode_reference, triton=triton_kernels.run_mla,
    xla=xla_kernels.run_mla, config_type=MlaConfig, heuristic=mla_heuristic, space=mla_space,
    requirements=mla_requirements, flops=_mla_flops, bytes_accessed=_mla_bytes, examples=examples.mla_examples,
    benchmarks=examples.mla_benchmarks,
    mosaic_tpu=mosaic_tpu_mla.MLA_IMPLEMENTATION)


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
      precision: float32 contraction precision, as in `paged_attention` (docs/precision.md).

    Returns ``[B, (Q,) N, R]`` in ``q_nope.dtype`` (project with ``W_UV`` after).
    """
    return mla_decode_op(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, scale=scale,
                         logits_soft_cap=logits_soft_cap, local_window_size=local_window_size,
                         precision=precision, implementation=implementation, config=config)
