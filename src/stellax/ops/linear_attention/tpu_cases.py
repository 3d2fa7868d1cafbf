"""The Mosaic TPU chunked kernels alone, on abstract operands: what the static
schedule tool (`stellax.testing.llo_schedule`) compiles to say where a grid
step's cycles go, and what `tpu_costs` counts.

`kernel_case` builds ``(fn, args)`` for one kernel — the forward kernel
(`mosaic_tpu.recurrence_forward`) or the backward kernel after its states
pass (`mosaic_tpu_backward.backward_from_states`) — of GDN (scalar decays,
delta rule), KDA (per-channel decays) or SSD (scalar decays, no delta rule) on
the kernels' layout, bfloat16 ``q, k, v`` (`mxu.BF16_PRODUCTS`) unless
``dtype="float32"``:

    python -m stellax.testing.llo_schedule stellax.ops.linear_attention.tpu_cases:kernel_case \\
        kind='"gdn"' chunk=128 heads_per_step=4
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from ...core.pallas import F32
from .configs import TpuLinearAttentionConfig
from .mosaic_tpu import recurrence_forward
from .mxu import BF16_POLICIES, bf16_policy
from .mosaic_tpu_backward import backward_from_states

KINDS = ("gdn", "kda", "ssd")


def kernel_case(kind: str = "gdn", chunk: int = 64, heads_per_step: int = 1, block_v: int = 128,
                heads: int = 4, tokens: int = 512, head_size: int = 128, backward: bool = False,
                dtype: str = "bfloat16", skip: tuple = (), group: int = 1, out_dtype: str = "float32",
                policy: str | None = None):
    """``(fn, args)``: one kernel of ``kind`` (`KINDS`) with ``config = (chunk, block_v,
    heads_per_step)`` on ``heads`` rows of ``tokens`` tokens, ``K = V = head_size``;
    ``args`` are shape structs (``q, k, v [heads, tokens, head_size]`` of ``dtype``, the
    decays and ``β`` float32, ``h0 [heads, K, V]``; the backward also ``states``, ``do``,
    ``dfinal``); ``skip``: stages the forward kernel leaves out (`mosaic_tpu.STAGES`); ``group``: the
    forward's ``q, k`` grouped, ``heads / group`` rows each serving ``group`` value heads (as the ops
    pass grouped heads); ``out_dtype``: the forward's ``o`` (the ops write their output dtype); ``policy``: a
    name in `mxu.BF16_POLICIES` that bfloat16 ``q, k, v`` run instead of `mxu.BF16_PRODUCTS`."""
    if policy is not None and policy not in BF16_POLICIES:
        raise ValueError(f"policy: expected one of {sorted(BF16_POLICIES)}, got {policy!r}")
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if skip and backward:
        raise ValueError(f"skip: only the forward kernel leaves stages out, got {skip} with backward")
    if tokens % chunk:
        raise ValueError(f"tokens: expected a multiple of the chunk {chunk}, got {tokens}")
    per_channel, delta = kind == "kda", kind != "ssd"
    config = TpuLinearAttentionConfig(chunk=chunk, block_v=block_v, heads_per_step=heads_per_step)
    shape = lambda *s, dt=F32: jax.ShapeDtypeStruct(s, dt)
    if group > 1 and backward:
        raise ValueError(f"group: only the forward kernel reads grouped q, k, got {group} with backward")
    rows = (heads // group, heads // group, heads)
    qkv = [shape(n, tokens, head_size, dt=jnp.dtype(dtype)) for n in rows]
    g = shape(heads, tokens, head_size) if per_channel else shape(heads, tokens)
    beta = shape(heads, tokens) if delta else None
    h0 = shape(heads, head_size, head_size)
    common = dict(heads=heads, per_channel=per_channel, config=config)
    traced = (lambda: bf16_policy(policy)) if policy else contextlib.nullcontext
    if not backward:
        def forward(q, k, v, g, beta, h0):
            with traced():
                return recurrence_forward(q, k, v, g, beta, h0, None, **common, out_dtype=jnp.dtype(out_dtype),
                                          _skip=tuple(skip))
        return forward, (*qkv, g, beta, h0)
    states = shape(heads, tokens // chunk, head_size, head_size)
    do = shape(heads, tokens, head_size)

    def backward_kernel(q, k, v, g, beta, h0, states, do, dfinal):
        with traced():
            return backward_from_states(q, k, v, g, beta, h0, states, do, dfinal, None, **common)
    return backward_kernel, (*qkv, g, beta, h0, states, do, h0)

