"""Local block attention and the exact log-sum-exp merge of partial results.

`LocalAttention` is the per-device attention every strategy runs: one call
of `stellax.ops.attention.attention_op` (the op behind
`stellax.dot_product_attention`) with explicit per-token positions, so a
block of queries from one shard and a block of keys from another see exactly
the mask they would see in the unsharded sequence:

    query i sees key j  iff  causal: kp_j <= qp_i,  window: qp_i - left <= kp_j <= qp_i + right,
                             chunk: qp_i // C == kp_j // C,  segments: qs_i == ks_j

with ``qp``/``kp`` the tokens' original positions (`layout.shard_positions`).

Merging two partial attentions over disjoint key sets (``out_a, lse_a`` and
``out_b, lse_b``, float32) is exact:

    lse = log(exp(lse_a) + exp(lse_b)),   out = exp(lse_a − lse)·out_a + exp(lse_b − lse)·out_b

with ``lse = −inf`` (and ``out = 0``) for a row that sees no key yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from ..ops.attention import MaskSpec, attention_op, classify_blocks
from ..ops.attention.masks import EMPTY

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class LocalAttention:
    """Static description of the per-device attention (hashable)."""

    is_causal: bool = False
    window: tuple | None = None  # (left | None, right | None)
    chunk_size: int | None = None
    scale: float | None = None
    logits_soft_cap: float | None = None
    precision: Any = None
    implementation: Any = None  # None | str | tuple of str
    segments: bool = False

    @property
    def spec(self) -> MaskSpec:
        return MaskSpec(
            causal=self.is_causal or self.chunk_size is not None,
            window_left=None if self.window is None else self.window[0],
            window_right=None if self.window is None else self.window[1],
            chunk_size=self.chunk_size,
            segments=self.segments,
        )

    def __call__(self, q, k, v, q_pos, kv_pos, q_seg=None, kv_seg=None, sinks=None):
        """``q [B, Tq, N, H]``, ``k/v [B, Tk, K, H|Hv]``, positions ``[B|1, Tq|Tk]`` int32,
        segments ``[B, Tq|Tk]`` or ``None``. Returns ``(out [B, Tq, N, Hv] q.dtype, lse [B, N, Tq] f32)``."""
        b = q.shape[0]
        q_pos = jnp.broadcast_to(q_pos, (b, q.shape[1])).astype(jnp.int32)
        kv_pos = jnp.broadcast_to(kv_pos, (b, k.shape[1])).astype(jnp.int32)
        return attention_op(
            q, k, v, None, None, scale=self.scale, is_causal=self.is_causal, local_window_size=self.window,
            chunk_size=self.chunk_size, q_segment_ids=q_seg if self.segments else None,
            kv_segment_ids=kv_seg if self.segments else None, logits_soft_cap=self.logits_soft_cap,
            sinks=sinks, precision=self.precision, return_residuals=True, q_positions=q_pos,
            kv_positions=kv_pos, implementation=self.implementation)

    def any_visible(self, q_pos, kv_pos, q_seg=None, kv_seg=None):
        """A traced bool: does any query of the block see any key? ``None``
        when the mask hides nothing (always visible)."""
        spec = self.spec
        if spec.is_trivial:
            return None
        classes = classify_blocks(spec, q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32),
                                  q_seg if self.segments else None, kv_seg if self.segments else None,
                                  block_q=q_pos.shape[-1], block_k=kv_pos.shape[-1])
        return jnp.any(classes != EMPTY)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Exact merge of two float32 partial attentions (see the module docstring).

    ``out [B, T, N, Hv]``, ``lse [B, N, T]``; rows with ``lse = −inf`` on both
    sides stay ``(0, −inf)``."""
    m = jnp.maximum(lse_a, lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.exp(lse_a - m)
    wb = jnp.exp(lse_b - m)
    total = wa + wb
    safe = jnp.where(total > 0, total, 1.0)
    lse = jnp.where(total > 0, m + jnp.log(safe), -jnp.inf)
    wa_t = jnp.swapaxes(wa / safe, 1, 2)[..., None]
    wb_t = jnp.swapaxes(wb / safe, 1, 2)[..., None]
    return wa_t * out_a + wb_t * out_b, lse


def add_sinks(out, lse, sinks):
    """Join per-head sink logits ``sinks [N]`` to a merged attention's
    denominator (plain jnp: differentiable in all three)."""
    sink = sinks.astype(F32)[None, :, None]
    total = jnp.logaddexp(lse, sink)
    scale = jnp.swapaxes(jnp.exp(lse - total), 1, 2)[..., None]
    return out * scale, total
