"""XLA paths of the paged ops (the CPU default): a loop over blocks of pages
with an online softmax, memory-linear in the context.

For every block of ``n`` pages (all programs at once) the pages named by
the block tables are gathered (and dequantized when the pool is quantized:
only one block at a time, never the whole cache), scored against every
program's query rows, masked (`plan.visible`) and folded into the running
``(o, m, l)``:

    m' = max(m, max_t s_t),  α = e^{m - m'},  p_t = e^{s_t - m'}
    l' = α l + Σ_t p_t,      o' = α o + Σ_t p_t v_t

The loop runs only over the blocks some program can see. The
full-precision windows (if any) add one more partial, and `plan.merge`
normalizes with the attention sinks. Math is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.pallas import cdiv
from . import plan as plan_mod
from .plan import Problem, gather_block, key_range, merge, scores, visible, window_partial

#: Tokens gathered per loop step (rounded to whole pages).
BLOCK_TOKENS = 256


def attention_rows(problem: Problem, *, block_tokens: int = BLOCK_TOKENS):
    """Normalized float32 output rows ``[Bp, K, Rt, Hv]`` of a problem."""
    ps = problem.page_size
    ppb = max(1, block_tokens // ps)
    tables = problem.tables
    num_blocks = cdiv(tables.shape[1], ppb)
    tables = jnp.pad(tables, ((0, 0), (0, num_blocks * ppb - tables.shape[1])))
    tokens = ppb * ps
    lo, hi = key_range(problem.row_pos, problem.kv_len, window_left=problem.window_left,
                       sink_tokens=problem.sink_tokens, recent_tokens=problem.recent_tokens)
    lo = jnp.maximum(lo, 0)
    live = hi > lo
    first = jnp.min(jnp.where(live, lo // tokens, num_blocks))
    last = jnp.max(jnp.where(live, (hi + tokens - 1) // tokens, 0))
    first = jnp.minimum(first, last)

    bp, kv_heads, rt, _ = problem.q.shape
    hv = problem.value_dim
    row_pos = problem.row_pos[:, None, :, None]                                  # [Bp, 1, Rt, 1]
    kv_len = problem.kv_len[:, None, None, None]

    def body(j, carry):
        o, m, l = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, j * ppb, ppb, axis=1)
        pos = j * tokens + jnp.arange(tokens, dtype=jnp.int32)
        kx = gather_block(problem.k, ids)
        pex = None if problem.pe is None else gather_block(problem.pe, ids)
        vx = kx if problem.v is None else gather_block(problem.v, ids)
        s = scores(problem, kx, pex)
        mask = visible(pos[None, None, None, :], row_pos, kv_len, window_left=problem.window_left,
                       sink_tokens=problem.sink_tokens, recent_tokens=problem.recent_tokens)
        s = jnp.where(mask, s, -jnp.inf)
        vx = plan_mod.exclude_keys(vx, mask)   # garbage past the length must not reach p·v (0·NaN = NaN)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = alpha * l + jnp.sum(p, axis=-1)
        o = alpha[..., None] * o + plan_mod.pv(p, vx, precision=problem.precision)
        return o, m_new, l

    init = (jnp.zeros((bp, kv_heads, rt, hv), jnp.float32),
            jnp.full((bp, kv_heads, rt), -jnp.inf, jnp.float32),
            jnp.zeros((bp, kv_heads, rt), jnp.float32))
    partials = [jax.lax.fori_loop(first, last, body, init)]
    extra = window_partial(problem)
    if extra is not None:
        partials.append(extra)
    sinks = None if problem.sinks is None else problem.sinks[None]
    return merge(partials, sinks)


def run_paged(call, config=None):
    problem, finish = plan_mod.paged_problem(call)
    return finish(attention_rows(problem))


def run_ragged(call, config=None):
    problem, finish = plan_mod.ragged_problem(call, block_q=_ragged_block_q(call))
    return finish(attention_rows(problem))


def run_mla(call, config=None):
    problem, finish = plan_mod.mla_problem(call)
    return finish(attention_rows(problem))


def _ragged_block_q(call) -> int:
    """Query tokens per program in the XLA ragged path: a small power of two."""
    total = call.q.shape[0]
    return max(1, min(16, 1 << max(0, (total - 1).bit_length())))
