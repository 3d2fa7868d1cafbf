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
``HIGHEST`` take 2.5e8 pass-FLOPs, bfloat16 operands with the inverse at three passes
(`mxu.BF16_POLICIES` ``three_pass``) 8.8e7, 2.9× fewer — 6.3e7 of them the inverse — and at the
default ``refined`` policy (the inverse at one pass, one refinement step) 5.2e7; KDA 7.9e8 and 2.8e8 (half
of it the exact decay sums of its sub-block scores); SSD (no inverse) 7.6e7 and
1.7e7, 4.5× fewer (`tests/ops/linear_attention/test_la_bf16_products.py` pins GDN's).

The time of a call (`kernel_seconds`) sums, over the grid steps (``heads_per_step``
heads of one block of value columns and one chunk each):

    STEP_SECONDS + heads · VPU_SECONDS_PER_TOKEN · C + max(chain · LATENCY_SECONDS, heads · pass-FLOPs / PEAK_FLOPS)

* ``STEP_SECONDS``: the fixed cost of a grid step (its DMA issue and wait, the pipeline's
  bookkeeping);
* the VPU/EUP work of each head (the ``exp`` of the decay spans, the masks, the bfloat16
  splits of the exact sums, the upcasts) and its tiles' DMA, taken as proportional to the
  chunk's tokens;
* the MXU: a head's products form a chain of `chain_length` dependent products (the
  inverse's doubling steps, then ``U``/``W``, ``W S``, ``P Δ``), each waiting for the one
  before it (``LATENCY_SECONDS``: a small ``[C, ·] × [·, 128]`` product fills and drains the
  systolic array before its result can feed the next). One head alone leaves the MXU idle
  most of that time; the independent chains of several heads in one step (`mosaic_tpu`
  batches them: each product issued for every head back to back) overlap, until the step is
  bound by its pass-FLOPs.

Calibration (v5e, 2026-12-06, bfloat16 inputs, the whole op, `benchmarks/linear_attention_tpu.py`,
one head per step): GDN T = 16384, HV = 32, chunk 128 / block_v 128 took 17.9 ms (4096 steps,
4.37 µs each; the model before this term said 5.5 ms) and SSD T = 16384, H = 32, chunk 128 took
6.58 ms (1.61 µs per step). With ``STEP_SECONDS`` = 0.35 µs, the two fix ``LATENCY_SECONDS``
(GDN's chain of 16 against SSD's of 2: 0.197 µs) and the per-token term (0.87 µs per head at
chunk 128). The model then says 17.9 and 6.58 ms on those; on KDA T = 4096, HV = 16, chunk 64
(measured 5.04 ms, 1024 steps, chain 17) it says 4.0 ms, 20 % low. More heads per step are
modelled only (overlap of the chains): GDN at 16384 × 32 with 4 heads per step 8.0 ms.
``benchmarks/linear_attention_stages_tpu.py`` prints this model beside each measured kernel.

What the chip then said, and why (v5e, the same GDN case): 13.9 ms at 4 heads per step against
15.1 at one — no overlap. The static schedule of the compiled kernels (`stellax.testing.llo_schedule`,
libtpu 0.0.42's LLO dumps, no TPU needed; `tpu_cases.kernel_case` builds the kernels) shows why, in
cycles per grid step of the forward at chunk 128 (bundles issued / critical path of dependences):

* one head: 2456 / 4624. The critical path is the chain itself: each link a weight push (32
  cycles), the row issues (8 × 16) and ~125 cycles until the first result pops: ~290 cycles
  (``LATENCY_SECONDS`` = 0.197 µs is that at ~1.5 GHz, the clock that 197 TFLOP/s over four
  128 × 128 MXUs implies), 16 links. The measured 3.7 µs per step is
  1.19 × the critical path at 1.5 GHz;
* four heads, written head after head: 9224 / 17285 — the compiler kept each MXU's products in
  program order, so the heads' chains ran one after the other (3.7 × one head's; 13.6 µs per step
  measured, 1.18 × the critical path);
* four heads, one batched chunk function (`mosaic_tpu`, this change): 8253 / 8468, all four MXUs in
  use. Its critical path is now the inverse's three-pass products (`mxu.BF16_SOLVE`: ~550 cycles a
  link, the four heads' passes filling the four MXUs) and its bundles are bound by stores (4493
  bundles of stores, 4009 of them register spills: four heads' ``[128, 128]`` float32 tiles do not
  fit 64 vector registers).

So the model's overlap term holds only for the batched form; at chunk 128 and 4 heads it says 8.0
ms where the static bound (1.19 × the larger of bundles and critical path at 1.5 GHz) says 6.9 ms;
at chunk 64 and 4 heads 9.9 and 7.8; KDA at chunk 64, 4 heads 2.0 and 2.3. SSD is the exception:
its 1.61 µs per step measured at one head is 3.4 × its static bound (702 cycles): the step's DMAs,
not its code, set SSD's time (the per-token term).
"""

from __future__ import annotations

import math

from ...core.precision import DEFAULT, HIGH, HIGHEST
from .mxu import EXACT, Products

#: bfloat16 MXU passes of one product at each precision (``None``: a product that does not run).
PASSES = {DEFAULT: 1, HIGH: 3, HIGHEST: 6, EXACT: 3, None: 0}
#: A v5e's bfloat16 MXU peak (FLOP/s) and the fixed cost of one grid step (seconds).
PEAK_FLOPS = 197e12
STEP_SECONDS = 0.35e-6
#: Latency of one dependent product in a head's chain (seconds; calibrated, module docstring).
LATENCY_SECONDS = 0.197e-6
#: VPU/EUP work and DMA of one head per token of its chunk (seconds; calibrated, module docstring).
VPU_SECONDS_PER_TOKEN = 0.87e-6 / 128


def _mm(kind: str, m: int, k: int, n: int, grads: str = "ab"):
    """One product ``[m, k] × [k, n]`` of ``kind``; ``grads``: the operands with a cotangent."""
    return (kind, m, k, n, grads)


def _delta_products(c: int, kp: int, bv: int, refined: bool = False) -> list:
    """The delta rule's products after the scores: the inverse, then ``U``, ``T (βΓK)``, ``W S``;
    ``refined`` (`mxu.Products.refine`): the inverse (no cotangents: `mosaic_tpu.refined_solve`'s
    gradient does not differentiate it), ``(βΓK) S``, ``X₀ = T̃ R``, ``A X₀`` and ``T̃ r`` (whose
    custom gradient takes one product of each kind more: ``A X₀``'s two cotangent products)."""
    solve = [_mm("solve", c, c, c, "" if refined else "ab")] * (2 * (int(math.log2(c)) - 1))
    if refined:
        return solve + [_mm("operands", c, kp, bv), _mm("operands", c, c, bv, "b"), _mm("refine", c, c, bv),
                        _mm("operands", c, c, bv, "b")]
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


def chunk_inventory(c: int, kp: int, bv: int, *, per_channel: bool, delta: bool, refined: bool = False) -> list:
    """The products of one chunk step: ``(kind, m, k, n, grads)`` each (module docstring);
    ``refined``: the delta rule solved by `mosaic_tpu.refined_solve` (`_delta_products`)."""
    state = [_mm("operands", c, kp, bv), _mm("operands", c, c, bv), _mm("operands", kp, c, bv)]  # QS, PΔ, K̃ᵀΔ
    if per_channel:
        sums = [_mm("sums", c, c, kp, "b"), _mm("sums", c, c, kp, "b"), _mm("sums", kp, c, 128, "a")]
        return sums + _channel_score_products(c, kp) + _delta_products(c, kp, bv, refined) + state
    out = [_mm("sums", c, c, c, "b"), _mm("operands", c, kp, c)]  # the spans D, Q Kᵀ
    if delta:
        out += [_mm("operands", c, kp, c)] + _delta_products(c, kp, bv, refined)  # K Kᵀ, ...
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
    refined = products.refine is not None
    for kind, m, k, n, grads in chunk_inventory(c, kp, bv, per_channel=per_channel, delta=delta, refined=refined):
        passes = PASSES[getattr(products, kind)]
        total += passes * _pass_flops(m, k, n, mxu) * (2 if backward else 1)
        if backward:  # c = a b: da = dc bᵀ ([m, n] × [n, k]), db = aᵀ dc ([k, m] × [m, n])
            total += passes * (("a" in grads) * _pass_flops(m, n, k, mxu) + ("b" in grads) * _pass_flops(k, m, n, mxu))
    return total


def chunk_matmul_issues(c: int, kp: int, bv: int, *, per_channel: bool, delta: bool, products: Products,
                        rows_per_issue: int = 16, mxu: int = 128) -> int:
    """MXU row issues (``vmatmul`` instructions) of one chunk step's forward: per product
    ``[m, k] × [k, n]`` and pass, ``⌈m / rows_per_issue⌉·⌈k / mxu⌉·⌈n / mxu⌉`` (a v5e issues 16
    bfloat16 rows, one packed vector register, per instruction). What the static schedule of the
    compiled kernel counts (`stellax.testing.llo_schedule`; tests/testing/test_llo_schedule.py)."""
    total = 0
    refined = products.refine is not None
    for kind, m, k, n, _ in chunk_inventory(c, kp, bv, per_channel=per_channel, delta=delta, refined=refined):
        passes = PASSES[getattr(products, kind)]
        total += passes * -(-m // rows_per_issue) * -(-k // mxu) * -(-n // mxu)
    return total


def chain_length(c: int, *, per_channel: bool, delta: bool, refined: bool = False) -> int:
    """Dependent products on the longest path of one head's chunk step: the decay spans
    (per channel also the scores' sub-block sums), then for the delta rule the inverse's
    ``2·log2(C/2)`` doubling products, ``U``/``W``, ``W S``, and last ``P Δ`` (``K̃ᵀ Δ``
    and ``(Γ⊙Q) S`` beside it); ``refined``: ``X₀``, ``A X₀``, ``T̃ r`` after the inverse
    (``(βΓK) S`` beside it)."""
    if not delta:
        return 2
    return (3 if per_channel else 1) + 2 * (int(math.log2(c)) - 1) + (4 if refined else 3)


def kernel_seconds(rows: int, tokens: int, kp: int, vp: int, chunk: int, block_v: int, *, per_channel: bool,
                   delta: bool, products: Products, backward: bool = False, mxu: int = 128,
                   heads_per_step: int = 1) -> float:
    """Modelled seconds of the forward (or ``backward``: twice the chain, the VPU work and
    the step cost) kernel over ``rows`` (batch·heads) of ``tokens`` each, ``heads_per_step``
    rows per grid step (module docstring)."""
    bv = min(block_v, vp)
    hb = heads_per_step
    steps = -(-rows // hb) * (vp // bv) * -(-tokens // chunk)
    flops = chunk_pass_flops(chunk, kp, bv, per_channel=per_channel, delta=delta, products=products,
                             backward=backward, mxu=mxu)
    twice = 2 if backward else 1
    refined = products.refine is not None
    chain = twice * chain_length(chunk, per_channel=per_channel, delta=delta, refined=refined) * LATENCY_SECONDS
    vpu = twice * hb * VPU_SECONDS_PER_TOKEN * chunk
    return steps * (STEP_SECONDS * twice + vpu + max(chain, hb * flops / PEAK_FLOPS))
