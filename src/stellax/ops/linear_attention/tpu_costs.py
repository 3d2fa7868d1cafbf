"""The MXU work of the Mosaic TPU chunked kernels, counted in bfloat16 passes, and
the time model their heuristic ranks configs by (`configs.linear_attention_tpu_heuristic`).

`chunk_inventory` lists the products of one chunk step (one head, one block of
``BV`` value columns; `mosaic_tpu.scalar_chunk` / `channel_chunk`) with the kind
that sets their precision (`mxu.Products`: ``sums``, ``solve``, ``operands``) and
the operands whose cotangents the backward forms. A product ``[m, k] × [k, n]``
costs ``2·m·k̂·n̂`` FLOPs per pass, ``k̂, n̂`` rounded up to the MXU's tile (the
weight tile is ``mxu × mxu``; a ``[64, 64]`` operand fills a quarter of a v5e's),
times its passes (`PASSES`: ``DEFAULT`` one bfloat16 pass, ``HIGH`` three,
``HIGHEST`` six, `mxu.EXACT` three). The backward kernel runs the forward chunk
twice (the states pass, then ``jax.vjp``'s recomputation) and each needed
transpose at its product's passes.

At chunk 64, K = V = 128, per chunk step (forward): GDN's float32 operands at
``HIGHEST`` take 2.5e8 pass-FLOPs, bfloat16 operands (`mxu.BF16_PRODUCTS`) 8.8e7,
2.9× fewer — 6.3e7 of them the inverse's three passes; KDA 7.9e8 and 2.8e8 (half
of it the exact decay sums of its sub-block scores); SSD (no inverse) 7.6e7 and
1.7e7, 4.5× fewer (`tests/ops/linear_attention/test_la_bf16_products.py` pins GDN's).

The time of a call is ``steps · STEP_SECONDS + pass-FLOPs / PEAK_FLOPS`` (a v5e's
bfloat16 peak; only the ratio steers the choice). The VPU's work (the ``exp`` of
the decays, the masks) is not counted.
"""

from __future__ import annotations

import math

from ...core.precision import DEFAULT, HIGH, HIGHEST
from .mxu import EXACT, Products

#: bfloat16 MXU passes of one product at each precision.
PASSES = {DEFAULT: 1, HIGH: 3, HIGHEST: 6, EXACT: 3}
#: A v5e's bfloat16 MXU peak (FLOP/s) and the fixed cost of one grid step (seconds).
PEAK_FLOPS = 197e12
STEP_SECONDS = 0.35e-6


def _mm(kind: str, m: int, k: int, n: int, grads: str = "ab"):
    """One product ``[m, k] × [k, n]`` of ``kind``; ``grads``: the operands with a cotangent."""
    return (kind, m, k, n, grads)


def _delta_products(c: int, kp: int, bv: int) -> list:
    """The delta rule's products after the scores: the inverse, ``U``, ``T (βΓK)``, ``W S``."""
    solve = [_mm("solve", c, c, c)] * (2 * (int(math.log2(c)) - 1))
    return solve + [_mm("operands", c, c, bv), _mm("operands", c, c, kp), _mm("operands", c, kp, bv)]


def _channel_score_products(c: int, kp: int, sub: int = 16) -> list:
    """`scores.channel_scores`: a span sum for the rows' factor, per earlier sub-block a span
    sum and two score products, per diagonal offset a gather and a span sum."""
    blocks = c // sub if c % sub == 0 else 1
    sub = c // blocks
    out = [_mm("sums", c, c, kp, "b")]
    out += [_mm("sums", c, c, kp, "b"), _mm("operands", c, kp, c), _mm("operands", c, kp, c)] * (blocks - 1)
    out += [_mm("operands", c, c, kp, "b"), _mm("sums", c, c, kp, "b")] * sub
    return out


def chunk_inventory(c: int, kp: int, bv: int, *, per_channel: bool, delta: bool) -> list:
    """The products of one chunk step: ``(kind, m, k, n, grads)`` each (module docstring)."""
    state = [_mm("operands", c, kp, bv), _mm("operands", c, c, bv), _mm("operands", kp, c, bv)]  # QS, PΔ, K̃ᵀΔ
    if per_channel:
        sums = [_mm("sums", c, c, kp, "b"), _mm("sums", c, c, kp, "b"), _mm("sums", kp, c, 128, "a")]
        return sums + _channel_score_products(c, kp) + _delta_products(c, kp, bv) + state
    out = [_mm("sums", c, c, c, "b"), _mm("operands", c, kp, c)]  # the spans D, Q Kᵀ
    if delta:
        out += [_mm("operands", c, kp, c)] + _delta_products(c, kp, bv)  # K Kᵀ, ...
    return out + state


def _padded(x: int, mxu: int) -> int:
    return -(-x // mxu) * mxu


def _pass_flops(m: int, k: int, n: int, mxu: int) -> int:
    return 2 * m * _padded(k, mxu) * _padded(n, mxu)


def chunk_pass_flops(c: int, kp: int, bv: int, *, per_channel: bool, delta: bool, products: Products,
                     backward: bool = False, mxu: int = 128) -> int:
    """bfloat16-pass FLOPs of one chunk step (forward, or ``backward``: two forward
    evaluations and the transposes), each product at ``products``' precision of its kind."""
    total = 0
    for kind, m, k, n, grads in chunk_inventory(c, kp, bv, per_channel=per_channel, delta=delta):
        passes = PASSES[getattr(products, kind)]
        total += passes * _pass_flops(m, k, n, mxu) * (2 if backward else 1)
        if backward:  # c = a b: da = dc bᵀ ([m, n] × [n, k]), db = aᵀ dc ([k, m] × [m, n])
            total += passes * (("a" in grads) * _pass_flops(m, n, k, mxu) + ("b" in grads) * _pass_flops(k, m, n, mxu))
    return total


def kernel_seconds(rows: int, tokens: int, kp: int, vp: int, chunk: int, block_v: int, *, per_channel: bool,
                   delta: bool, products: Products, backward: bool = False, mxu: int = 128) -> float:
    """Modelled seconds of the forward (or ``backward``) kernel over ``rows`` (batch·heads)
    of ``tokens`` each: grid steps at `STEP_SECONDS` plus the pass-FLOPs at `PEAK_FLOPS`."""
    bv = min(block_v, vp)
    steps = rows * (vp // bv) * -(-tokens // chunk)
    flops = chunk_pass_flops(chunk, kp, bv, per_channel=per_channel, delta=delta, products=products,
                             backward=backward, mxu=mxu)
    return steps * (STEP_SECONDS * (2 if backward else 1) + flops / PEAK_FLOPS)
