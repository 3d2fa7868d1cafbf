"""Pallas Mosaic TPU kernel of `mla_decode` (weight-absorbed multi-head latent attention).

All ``N`` query heads (× the ``Q`` new tokens) share one latent cache
``[num_pages, page_size, R]`` (``R = 512`` in DeepSeek V2/V3) and one rope
cache ``[num_pages, page_size, P]`` (``P = 64``), so a grid step ``(b, 0)``
of grid ``(B, 1)`` takes every row ``r = i·N + n`` of batch row ``b`` at once
(``Q·N`` rows, 16 to 128 in practice: the matmuls are MXU-shaped without
any GQA packing), and each page is read once per sequence:

    s   = scale · (q_nope Cᵀ + q_pe PEᵀ)     [Q·N, T]  (C: latent, PE: rope block)
    m'  = max(m, rowmax s);  α = e^{m - m'};  p = e^{s - m'}
    l'  = α l + rowsum p;    acc' = α acc + p C          (the values are the latent)

The latent block is dequantized (when quantized) once and used twice: for
the logits and as the values. Both caches go through the double-buffered
page pipeline of `mosaic_tpu` (one async copy per page and array, the copy
of block ``i+1`` in flight while block ``i`` is computed); block tables,
lengths and key ranges come by scalar prefetch. The full-precision windows
(if any) are merged from `plan.window_partial`, as for the other ops.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import plan as plan_mod
from .mosaic_tpu import by_coverage, init_state, launch_rows, write_results
from .mosaic_tpu_pages import dequantize, folded_scales, program_pipeline, run_pipeline
from .plan import Problem
from .configs import TpuMlaConfig


def _mla_kernel(tables, seq, kv_lens, key_lo, key_hi, full_lo, full_hi, *, row_pos, q, q_pe, sinks, out, o_part,
                m_part, l_part, m_ref, l_ref, acc_ref, sems, next_slot, metas, sm, ppb: int, width: int,
                per_core: int, **refs):
    """Step ``(c, i)``: the online softmax of batch row ``b = c·per_core + i``'s
    ``Q·N`` rows over the blocks of its latent and rope pages."""
    b, pipe, bufs, sched = program_pipeline(refs, tables=tables, seq=seq, key_lo=key_lo, key_hi=key_hi, sems=sems,
                                            metas=metas, tokens=sm.tokens, ppb=ppb, width=width, per_core=per_core)
    kv_len = kv_lens[b]
    rp = row_pos[...]
    heads = sm.row_heads(rp)
    m, l, acc = m_ref.at[0], l_ref.at[0], acc_ref.at[0]
    init_state(m, l, acc)
    c_meta, pe_meta = metas["latent"], metas["pe"]
    qn = [q[0, i] for i in range(c_meta.per_byte)]
    qr = [q_pe[0, i] for i in range(pe_meta.per_byte)]

    def body(block, slot, masked):
        keys = (block, key_hi[b]) if masked else None
        fold = {n: folded_scales(bufs, n, meta, slot, 1, ppb, keys) if meta.fold else None
                for n, meta in (("latent", c_meta), ("pe", pe_meta))}
        c_parts = dequantize(bufs, "latent", c_meta, slot, 0, 1, ppb, sm.dtype, keys)
        pe_parts = dequantize(bufs, "pe", pe_meta, slot, 0, 1, ppb, sm.dtype, keys)
        s = sm.logits([(list(zip(qn, c_parts)), fold["latent"]), (list(zip(qr, pe_parts)), fold["pe"])], block, rp,
                      heads, kv_len, masked)
        sm.update(s, c_parts, block, key_hi[b], m, l, acc, masked, fold["latent"])

    run_pipeline(pipe, sched, next_slot, by_coverage(body, full_lo[b], full_hi[b], sm.tokens))
    write_results(1, m_ref, l_ref, acc_ref, sinks=sinks, out=out, o_part=o_part, m_part=m_part, l_part=l_part)


def mla_rows(problem: Problem, tables, *, pages_per_block: int):
    """Normalized float32 rows ``[B, 1, Q·N, R]`` of an `mla_decode` problem."""
    return launch_rows(_mla_kernel, problem, tables, sources={"latent": problem.k, "pe": problem.pe},
                       queries={"q": (problem.q, "latent"), "q_pe": (problem.q_pe, "pe")}, values="latent",
                       ppb=pages_per_block, name="stellax_mla_decode_tpu")


def run_mla(call, config: TpuMlaConfig):
    """`mla_decode` on the Mosaic TPU kernel."""
    problem, finish = plan_mod.mla_problem(call)
    tables = jnp.clip(call.block_tables.astype(jnp.int32), 0, problem.k.num_pages - 1)
    return finish(mla_rows(problem, tables, pages_per_block=config.pages_per_block))

