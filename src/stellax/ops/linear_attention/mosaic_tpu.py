"""Pallas Mosaic TPU kernels of the chunked recurrence (forward): stages 1–6
fused in one kernel per chunk, the state carried in VMEM across chunks.

Grid ``(BH/hb, V/BV, NT)``: every (batch·head, block of ``BV`` value columns)
pair is independent (``"parallel"``) and walks its ``NT`` chunks in order
(``"arbitrary"``), holding ``S [K, BV]`` in a float32 VMEM scratch. A step
takes ``hb`` heads (``config.heads_per_step``; every block's leading axis)
through one chunk function batched over that axis: each head's chain of
dependent small products (the inverse's doubling steps, then ``W S`` and
``P Δ``) leaves the MXU idle while it waits for results (a product's weight
push, row issues and ~130 cycles before its first result: ~290 cycles per link
at chunk 128 on a v5e), and a batched product issues every head's product back
to back, on all four MXUs, so that the other heads' products fill that time
(`tpu_costs`; the grid steps fall ``hb``-fold). Written head after head, the
compiler kept each MXU's products in program order and the heads' chains ran
one after the other: the static schedule of the GDN forward at chunk 128 and 4
heads had a critical path of 17285 cycles (3.7 times one head's 4624), batched
8468 (`stellax.testing.llo_schedule`; v5e, libtpu 0.0.42). The value
columns of the delta rule are independent given the keys (``W`` and ``T``
depend on ``k, g, β`` only), so splitting ``V`` recomputes the chunk's solve
per value block and nothing else.

Per chunk of ``C`` tokens (notation of `wy`, `scan`, `output`; every
exponent a direct span sum ≤ 0, masked to −inf outside its span):

    scalar decays (GDN, SSD):                  per-channel decays (KDA):
    D_ij = Σ_{j<t≤i} g_t  (0/1-mask matmul)     P_x = scores.channel_scores (sub-blocks)
    P_x  = (X Kᵀ) ⊙ exp(D)   (x = q, k)
    A  = β ⊙ strictly_lower(P_k),   T = (I + A)⁻¹   (`solve.merge_inverse`: 2·log₂(C/2) MXU products)
    U  = T (β V),   W = T (β Γ K)                   (SSD: U = V, no W)
    Δ  = U − W S,   O = (Γ Q) S + P_q Δ,   S ← Γ_C S + K̃ᵀ Δ    (K̃_j = k_j exp(Σ_{t>j} g_t))

bfloat16 operands form ``Δ = (I + A)⁻¹ (β V − (β Γ K) S)`` instead (`refined_solve`: ``T`` at one
pass, then one refinement step with a three-pass residual; `mxu.Products.refine`).

Layout (`recurrence`; `forward` is the entry of the backend's row in
`base.BACKENDS`): heads-major, flattened, ``q, k [BH, Tp, Kp]``,
``v [BH, Tp, Vp]``, head sizes zero-padded to multiples of 128 lanes;
scalar decays and ``β`` come to both kernels as lane-dense rows ``[BH, NT, 1, C]``
(span sums over lanes stay exact; the columns the chunk functions also take are
formed in VMEM, `row_to_column`: a ``[BH, Tp, 1]`` operand pads its lane to 128,
moving 128 times its bytes — at T = 16384, HV = 32, 268 MB per column instead of 2
MB; the backward's ``dg``, ``dβ`` are rows too).
Packed batches use int32 ``first, seq, last [NT]`` by scalar prefetch (dense
batches get ``first = [c = 0]``, ``seq = 0``, ``last = [c = NT−1]``): the
state is reset to ``h0[seq·HV + head]`` at a sequence's first chunk and
written to ``final[seq·HV + head]`` at its last (the block index maps read
``seq``). Padding tokens are the identity step (``k = v = q = β = g = 0``).

Precision of the products (`mxu.Products`, `kernel_products`): float32 ``q, k, v``
run every product at the call's precision (the float32 contract). bfloat16
``q, k, v`` — what bfloat16 inputs get (`mxu.operand_dtype`; half the bytes to
read) — are upcast once in VMEM (`load_tile`) and run `mxu.BF16_PRODUCTS`:

* one bfloat16 pass, float32 accumulation: ``Q Kᵀ``, ``K Kᵀ`` (and KDA's gathers and
  sub-block scores), ``T (β V)``, ``T (β Γ K)``, ``W S``, ``(Γ⊙Q) S``, ``P Δ``,
  ``K̃ᵀ Δ`` — inputs and well-scaled factors (every decay factor ≤ 1), each rounded
  once to bfloat16 as the MXU takes it;
* exact (`mxu.EXACT`, three passes): the 0/1-mask matmuls that sum log decays
  (``D``, KDA's prefixes, tails, chunk totals and sub-block spans): the decays' digits
  set every ``exp``, and the sums' transposes carry ``dg``;
* one pass: the inverse's doubling products too, and ``Δ`` then solved by one step of
  iterative refinement (`refined_solve`) whose residual product ``A X₀`` takes three passes
  (``HIGH``): statically 1.4x fewer cycles per GDN forward step at chunk 128 and 4 heads than
  the inverse at three passes (`mxu.BF16_POLICIES` ``three_pass``, the default before), with
  smaller errors at T = 65536 (docs/linear_attention.md);
* float32 on the VPU: every ``exp`` and the state ``S``.

Batching the step's heads (above) changes no product: each head's products take the same
operands at the same precision as one head alone.

Against the float32 golden at T = 65536 the bfloat16 kernels stay within bfloat16's
tolerance (rel-L2 1e-2, gradients 2e-2); their output and gradient errors are one to
four times the XLA path's on the same inputs (docs/linear_attention.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import F32, HIGHEST, operand, output, square_iota, tpu_kernel_call
from .mxu import Products, chunk_products, mask_matmul, mxu_matmul
from .scores import channel_scores
from .solve import merge_inverse
from .configs import TRITON_CHUNK, TpuLinearAttentionConfig, tpu_vmem_limit

#: Every product at `HIGHEST` (float32 operands at the default precision).
UNIFORM_HIGHEST = Products.uniform(HIGHEST)


def dense_meta(chunks: int):
    """int32 ``(first, seq, last) [NT]`` of a dense row: one sequence over all chunks."""
    c = np.arange(chunks)
    return tuple(jnp.asarray(x, jnp.int32) for x in (c == 0, np.zeros(chunks), c == chunks - 1))


def _dot(a, b, precision):
    return mxu_matmul(a, b, "nn", precision)


def _dot_nt(a, b, precision):
    return mxu_matmul(a, b, "nt", precision)


def _dot_tn(a, b, precision):
    return mxu_matmul(a, b, "tn", precision)


def scalar_spans(g_col, g_row, chunk: int, precision=HIGHEST, pairs: bool = True):
    """Span sums of one chunk's scalar log decays, from ``g`` as a column
    ``[C, 1]`` and as a row ``[1, C]``: ``(D [C, C], G [C, 1], tail [C, 1],
    total [1, 1])`` with ``D_ij = Σ_{j<t≤i} g_t`` (a matmul with a 0/1 mask at
    ``precision``, `mxu.EXACT` or a resolved precision), ``G_i = Σ_{t≤i} g_t``,
    ``tail_j = Σ_{t>j} g_t`` (lane sums) and ``total = Σ_t g_t`` (without ``pairs``:
    ``D = 0``, no matmul; the ablation benchmark's seam). Tiles may carry a leading axis of heads."""
    rows, cols = square_iota(chunk)
    later = jnp.where(rows > cols, g_col, 0.0)  # [t, j]: g_t for t > j
    if pairs:
        spans = mask_matmul((rows >= cols).astype(F32), later, "nn", precision)
    else:
        spans = jnp.zeros_like(later)
    prefix = jnp.sum(jnp.where(cols <= rows, g_row, 0.0), axis=-1, keepdims=True)
    tail = jnp.sum(jnp.where(cols > rows, g_row, 0.0), axis=-1, keepdims=True)
    return spans, prefix, tail, jnp.sum(g_row, axis=-1, keepdims=True)


#: The stages a chunk function can leave out (`check_skip`; the ablation benchmark's seam,
#: benchmarks/linear_attention_ablation_tpu.py; the results are then wrong):
#: ``"spans"``: the decay spans ``D`` (and KDA's channel scores) taken as 0 (no mask matmuls,
#: still the masked ``exp``); ``"solve"``: ``T = I`` (no inverse products); ``"state"``: no
#: products with the chunk's initial state (``Δ = U``, ``O = P Δ``); ``"update"``: ``S' = Γ_C S``
#: (no ``K̃ᵀ Δ``).
STAGES = ("spans", "solve", "state", "update")


def check_skip(skip) -> frozenset:
    """``skip`` as a frozenset of `STAGES` names."""
    skip = frozenset(skip)
    if not skip <= set(STAGES):
        raise ValueError(f"skip: expected names among {STAGES}, got {sorted(skip)}")
    return skip


def _inverse(kk_scores, beta, chunk: int, products: Products, skip=frozenset()):
    """``(A, T)``: ``A = β ⊙ strictly_lower(S_k)`` and ``T = (I + A)⁻¹`` (`solve.merge_inverse`,
    its products at ``products.solve``; ``"solve"`` in ``skip``: ``T = I``)."""
    rows, cols = square_iota(chunk)
    a = jnp.where(rows > cols, kk_scores, 0.0) * beta
    if "solve" in skip:
        return a, jnp.broadcast_to((rows == cols).astype(F32), kk_scores.shape)
    return a, merge_inverse(a, rows, cols, chunk, precision=products.solve, mxu=True)


def _refine(a, t, rhs, products: Products, layout: str = "n"):
    """One step of iterative refinement of ``(I + A)⁻¹ R`` (``layout`` ``"n"``) or ``(I + A)⁻ᵀ R``
    (``"t"``) on the approximate inverse ``T̃``: ``X₀ = T̃ R``, ``X = X₀ + T̃ (R − X₀ − A X₀)``."""
    mm = _dot if layout == "n" else _dot_tn
    p = products.operands
    x0 = mm(t, rhs, p)
    return x0 + mm(t, rhs - x0 - mm(a, x0, products.refine), p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def refined_solve(a, rhs, chunk: int, products: Products):
    """``X = (I + A)⁻¹ R`` for strictly lower ``A [C, C]`` and ``R [C, N]`` (float32; tiles may carry a
    leading head axis): the approximate inverse ``T̃`` by `solve.merge_inverse` at ``products.solve``,
    then one step of iterative refinement,

        X₀ = T̃ R,   r = R − X₀ − A X₀,   X = X₀ + T̃ r

    (``T̃ R``, ``T̃ r`` at ``products.operands``, the residual's ``A X₀`` at ``products.refine``). With
    ``E = I − T̃ (I + A)`` the error of ``X₀`` is ``E X*`` and that of ``X`` is ``E² X*`` plus the
    roundings of the small ``r``: a one-pass ``T̃`` ends about as accurate as the residual.

    The gradient is that of the exact solve, not of these steps: ``λ = (I + A)⁻ᵀ X̄`` by the same
    refinement on ``T̃ᵀ``, ``R̄ = λ``, ``Ā = −λ Xᵀ`` (at ``products.refine``; the caller's mask keeps
    its strictly lower part). ``T̃`` takes no cotangent (a preconditioner), so the backward never
    differentiates the inverse's doubling products: to first order in ``E`` the autodiff of the
    refined steps would carry ``T̃``'s error into ``Ā`` (measured: ``dg`` 1.3× the three-pass
    kernel's at T = 4096)."""
    return _refined_fwd(a, rhs, chunk, products)[0]


def _refined_fwd(a, rhs, chunk, products):
    rows, cols = square_iota(chunk)
    t = merge_inverse(a, rows, cols, chunk, precision=products.solve, mxu=True)
    x = _refine(a, t, rhs, products)
    return x, (a, t, x)


def _refined_bwd(chunk, products, residuals, dx):
    a, t, x = residuals
    lam = _refine(a, t, dx, products, layout="t")
    return -_dot_nt(lam, x, products.refine), lam


refined_solve.defvjp(_refined_fwd, _refined_bwd)


def _delta(kk_scores, beta, v, k_gated, s, chunk: int, products: Products, skip=frozenset()):
    """The delta rule's pre-update residuals ``Δ [C, BV]`` of the chunk's initial state ``s``
    (``k_gated = β ⊙ Γ ⊙ K``; ``"state"`` in ``skip``: ``s`` taken as 0):

    * ``products.refine`` ``None``: ``U = T (β V)``, ``W = T k_gated``, ``Δ = U − W S``
      (``T`` by `_inverse`; the products at ``products.operands``);
    * else ``Δ = (I + A)⁻¹ (β V − k_gated S)`` by `refined_solve` on ``T``: ``k_gated S``
      does not wait for the inverse, and one product follows it on the chain instead of two."""
    p = products.operands
    if products.refine is None:
        _, t = _inverse(kk_scores, beta, chunk, products, skip)
        u = _dot(t, beta * v, p)
        return u if "state" in skip else u - _dot(_dot(t, k_gated, p), s, p)
    rhs = beta * v if "state" in skip else beta * v - _dot(k_gated, s, p)
    if "solve" in skip:
        return rhs
    rows, cols = square_iota(chunk)
    return refined_solve(jnp.where(rows > cols, kk_scores, 0.0) * beta, rhs, chunk, products)


def scalar_chunk(q, k, v, g_col, g_row, beta, s, *, chunk: int, products: Products = UNIFORM_HIGHEST,
                 skip=frozenset()):
    """One chunk of the scalar-decay recurrence, a pure function of its tiles
    (the forward kernel runs it, the backward kernel differentiates it):
    ``(O [C, BV], S' [K, BV])`` from float32 ``q, k [C, K]``, ``v [C, BV]``, the
    decays as ``g_col [C, 1]`` and ``g_row [1, C]`` (the same values), ``beta
    [C, 1]`` or ``None`` (SSD: ``Δ = V``) and the chunk's initial state ``s [K, BV]``.
    Products (`mxu.Products`): the decay spans at ``sums``, the inverse at
    ``solve``, the scores ``Q Kᵀ``, ``K Kᵀ``, ``T (β V)``, ``T (β Γ K)``, ``W S``,
    ``(Γ⊙Q) S``, ``P Δ`` and ``K̃ᵀ Δ`` at ``operands``; the exponentials float32.

    Every tile may carry a leading axis of heads (``[hb, C, K]``, ..., ``s [hb, K,
    BV]``): the products are batched over it (`mxu.mxu_matmul`), one issued per head
    back to back, so that the heads' chains of dependent products overlap on the MXUs.
    ``skip``: stages left out (`STAGES`; the ablation benchmark only)."""
    skip = check_skip(skip)
    spans, prefix, tail, total = scalar_spans(g_col, g_row, chunk, products.sums, pairs="spans" not in skip)
    rows, cols = square_iota(chunk)
    decay = jnp.exp(jnp.where(rows >= cols, spans, -jnp.inf))
    gate = jnp.exp(prefix)
    p = products.operands
    if beta is None:
        delta = v
    else:
        delta = _delta(_dot_nt(k, k, p) * decay, beta, v, beta * gate * k, s, chunk, products, skip)
    o = _dot(_dot_nt(q, k, p) * decay, delta, p)
    if "state" not in skip:
        o = _dot(q * gate, s, p) + o
    if "update" in skip:
        return o, jnp.exp(total) * s
    return o, jnp.exp(total) * s + _dot_tn(k * jnp.exp(tail), delta, p)


def channel_chunk(q, k, v, g, beta, s, *, chunk: int, products: Products = UNIFORM_HIGHEST, skip=frozenset()):
    """One chunk of the per-channel (KDA) recurrence, as `scalar_chunk` with
    ``g [C, K]`` (``beta [C, 1]``): the per-channel prefix, tail and chunk sums and
    the decay spans of `scores.channel_scores` at ``products.sums``, its gathers
    and sub-block scores at ``products.operands`` (``"spans"`` in ``skip``: plain
    causal scores ``Q Kᵀ``, ``K Kᵀ`` instead)."""
    skip = check_skip(skip)
    rows, cols = square_iota(chunk)
    sums, p = products.sums, products.operands
    prefix = mask_matmul((rows >= cols).astype(F32), g, "nn", sums)  # Σ_{t≤i} g_t per channel
    tail = mask_matmul((cols > rows).astype(F32), g, "nn", sums)     # Σ_{t>j} g_t per channel
    gate = jnp.exp(prefix)
    if "spans" in skip:
        pq, pk = (jnp.where(rows >= cols, _dot_nt(x, k, p), 0.0) for x in (q, k))
    else:
        pq, pk = channel_scores(q, k, g, chunk, unrolled=True, precision=p, sums=sums, mxu=True)
    delta = _delta(pk, beta, v, beta * gate * k, s, chunk, products, skip)
    o = _dot(pq, delta, p)
    if "state" not in skip:
        o = _dot(q * gate, s, p) + o
    # Γ_C per channel as a column [K, 1]: Σ_t g_tk by a matmul with ones (lanes all equal).
    gamma = jnp.exp(mask_matmul(g, jnp.ones((chunk, 128), F32), "tn", sums, mask="b")[..., :1])
    if "update" in skip:
        return o, gamma * s
    return o, gamma * s + _dot_tn(k * jnp.exp(tail), delta, p)


def load_tile(ref):
    """A tile as float32 (``None`` for an absent operand): bfloat16 ``q, k, v`` are
    upcast once here, so that the chunk's elementwise work, its transpose and
    the cotangents are float32 and only the products round to bfloat16."""
    return None if ref is None else ref[...].astype(F32)


def _forward_kernel(*, first, seq, last, q, k, v, g, g_row, beta, h0, o, final, states, state, chunk, per_channel,
                    products, skip=frozenset()):
    """One chunk of the step's heads (the blocks' leading axis; their chains are
    independent, batched so that the MXUs interleave them): reset the
    state at a sequence's first chunk, store the chunk-initial state (``states``,
    for the backward), run the chunk, write the final state at a sequence's last chunk."""
    del seq
    c = pl.program_id(2)

    @pl.when(first[c] != 0)
    def _():
        state[...] = h0[...].astype(F32)

    # The step's heads run as one batched chunk function (a leading head axis on every tile):
    # each product is issued for every head back to back, so the heads' independent chains
    # overlap on the MXUs (written head after head, each head's chain ran to its end first).
    # β and the scalar decays arrive as rows [hb, 1, C]; the chunk functions take them as columns too.
    initial = state[...]
    hb = initial.shape[0]
    b = None if beta is None else row_to_column(load_tile(beta), chunk)
    qt, kt = (expand_heads(load_tile(x), hb) for x in (q, k))
    if per_channel:
        out, new = channel_chunk(qt, kt, load_tile(v), load_tile(g), b, initial,
                                 chunk=chunk, products=products, skip=skip)
    else:
        rows = load_tile(g_row)
        out, new = scalar_chunk(qt, kt, load_tile(v), row_to_column(rows, chunk), rows, b,
                                initial, chunk=chunk, products=products, skip=skip)
    if states is not None:
        states[...] = initial
    if o is not None:
        o[...] = out.astype(o.dtype)
    state[...] = new

    @pl.when(last[c] != 0)
    def _():
        final[...] = new


def expand_heads(x, hb: int):
    """A grouped ``q`` / ``k`` tile ``[hb / r, C, K]`` (``r`` value heads per key head, `Specs.grouped`)
    as the step's ``[hb, C, K]``: each key head repeated for its ``r`` value heads (leading axis only)."""
    n = x.shape[0]
    if n == hb:
        return x
    return jnp.concatenate([jnp.broadcast_to(x[i:i + 1], (hb // n,) + x.shape[1:]) for i in range(n)], axis=0)


def groups_fit(group: int, hb: int) -> bool:
    """Whether the kernels read ``q, k`` with ``group`` value heads per key head at ``hb`` heads per
    step without expanding them first (`Specs.grouped`): one divides the other."""
    return hb % group == 0 or group % hb == 0


def config_groups_fit(config: TpuLinearAttentionConfig, group: int) -> bool:
    """`groups_fit` at ``config``'s heads per step (the backend row's ``kernels.grouped``)."""
    return groups_fit(group, config.heads_per_step)


class Specs:
    """Block specs of the operands on grid ``(BH/hb, V/BV, NT)``, ``hb`` heads per step
    (every block's leading axis; ``hb`` divides ``heads``), ``reverse``: the chunk axis
    runs from the last chunk back; index maps reading the prefetched ``(first, seq,
    last)``: ``tokens(width)`` ``[BH, Tp, width]``, ``cols`` ``[BH, Tp, Vp]``, ``state``
    ``[N·HV, Kp, Vp]`` by sequence, ``per_chunk`` ``[BH, NT, Kp, Vp]``, ``rows`` ``[BH,
    NT, 1, C]``; ``parts`` wraps a spec with a leading value-block axis (partial sums
    over ``V/BV``)."""

    def __init__(self, kp: int, bv: int, chunk: int, heads: int, chunks: int, reverse: bool = False, hb: int = 1):
        if heads % hb:
            raise ValueError(f"config.heads_per_step: expected a divisor of the heads {heads}, got {hb}")
        self.kp, self.bv, self.chunk, self.heads, self.hb = kp, bv, chunk, heads, hb
        self.at = (lambda c: chunks - 1 - c) if reverse else (lambda c: c)

    def tokens(self, width: int, parts: bool = False):
        if parts:
            return pl.BlockSpec((None, self.hb, self.chunk, width), lambda i, j, c, *_: (j, i, self.at(c), 0))
        return pl.BlockSpec((self.hb, self.chunk, width), lambda i, j, c, *_: (i, self.at(c), 0))

    @property
    def cols(self):
        return pl.BlockSpec((self.hb, self.chunk, self.bv), lambda i, j, c, *_: (i, self.at(c), j))

    @property
    def state(self):
        groups = self.heads // self.hb  # blocks of hb states per sequence
        return pl.BlockSpec((self.hb, self.kp, self.bv),
                            lambda i, j, c, first, seq, last: (seq[self.at(c)] * groups + i, 0, j))

    @property
    def per_chunk(self):
        return pl.BlockSpec((self.hb, None, self.kp, self.bv), lambda i, j, c, *_: (i, self.at(c), 0, j))

    def grouped(self, width: int, group: int):
        """``q, k [BH / group, Tp, width]`` with ``group`` value heads per key head (`groups_fit`):
        the step's ``hb`` value heads read ``max(hb / group, 1)`` key heads (`expand_heads`)."""
        if group == 1:
            return self.tokens(width)
        if self.hb % group == 0:
            return pl.BlockSpec((self.hb // group, self.chunk, width), lambda i, j, c, *_: (i, self.at(c), 0))
        per = group // self.hb  # steps per key head
        return pl.BlockSpec((1, self.chunk, width), lambda i, j, c, *_: (lax.div(i, per), self.at(c), 0))

    def rows(self, parts: bool = False):
        if parts:
            return pl.BlockSpec((None, self.hb, None, 1, self.chunk), lambda i, j, c, *_: (j, i, self.at(c), 0, 0))
        return pl.BlockSpec((self.hb, None, 1, self.chunk), lambda i, j, c, *_: (i, self.at(c), 0, 0))


def check_layout(k, v, chunk: int, bv: int) -> None:
    """The kernels' layout: head sizes padded to multiples of 128, ``Tp`` whole chunks, ``BV | Vp``."""
    for name, x in (("k", k), ("v", v)):
        if x.shape[-1] % 128:
            raise ValueError(f"{name}: expected a head size padded to a multiple of 128, got {x.shape[-1]}")
    if k.shape[1] % chunk:
        raise ValueError(f"k: expected a padded length that is a multiple of {chunk}, got {k.shape[1]}")
    if v.shape[-1] % bv:
        raise ValueError(f"config.block_v: expected a divisor of the padded value size {v.shape[-1]}, got {bv}")


def check_groups(q, k, v, hb: int) -> int:
    """The value heads per key head of grouped ``q, k [BH / r, Tp, Kp]`` against ``v [BH, Tp, Vp]``
    (``r``; 1 when ``q, k`` are expanded), one that the forward kernel reads as it is (`groups_fit`)."""
    if q.shape != k.shape or v.shape[0] % k.shape[0]:
        raise ValueError(f"q, k: expected equal shapes whose rows divide v's {v.shape[0]}, got {q.shape}, {k.shape}")
    group = v.shape[0] // k.shape[0]
    if not groups_fit(group, hb):
        raise ValueError(f"config.heads_per_step: expected a divisor or a multiple of the {group} value heads per "
                         f"key head, got {hb}")
    return group


def kernel_products(q, k, v, precision) -> Products:
    """The `mxu.Products` of kernels given ``q, k, v`` (all float32, or all bfloat16:
    `mxu.chunk_products`) and the call's resolved ``precision``."""
    dtypes = {jnp.dtype(x.dtype).name for x in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= {"float32", "bfloat16"}:
        raise TypeError(f"q, k, v: expected all float32 or all bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    return chunk_products(q.dtype, precision)


def decay_operands(g, specs: Specs, per_channel: bool, name: str = "g"):
    """The named decay operands: ``g [BH, Tp, Kp]`` per channel, else ``g`` as lane-dense
    rows ``[BH, NT, 1, C]`` only (``g_row``; the kernels form the column, `row_to_column`:
    a ``[BH, Tp, 1]`` operand pads its one lane to 128 in HBM, 128 times its bytes)."""
    if per_channel:
        return {name: operand(g, specs.tokens(specs.kp)), name + "_row": None}
    bh, tp = g.shape
    return {name: None, name + "_row": operand(g.reshape(bh, tp // specs.chunk, 1, specs.chunk), specs.rows())}


def row_to_column(row, chunk: int):
    """A chunk's per-token values from a lane-dense row ``[..., 1, C]`` to a column ``[..., C, 1]``,
    exactly (each row's sum holds one nonzero term: the diagonal of the row broadcast over ``C`` rows)."""
    rows, cols = square_iota(chunk)
    return jnp.sum(jnp.where(rows == cols, row, 0.0), axis=-1, keepdims=True)


def recurrence_forward(q, k, v, g, beta, h0, meta, *, heads: int, per_channel: bool,
                       config: TpuLinearAttentionConfig, with_states: bool = False, precision=HIGHEST,
                       out_dtype=F32, _skip=()):
    """The chunked recurrence on the kernels' layout (module docstring), float32.

    Args:
      q, k: ``[BH, Tp, Kp]`` (q scaled), or grouped ``[BH / r, Tp, Kp]``, each key head serving
        ``r`` consecutive value heads (`check_groups`: read as they are, no expanded copy in HBM);
        v: ``[BH, Tp, Vp]``; ``Kp, Vp``
        multiples of 128, ``Tp`` a multiple of ``config.chunk``; all float32, or
        all bfloat16 (the products of `mxu.BF16_PRODUCTS`: `kernel_products`).
      g: ``[BH, Tp]`` scalar or ``[BH, Tp, Kp]`` per-channel (``per_channel``) log decays.
      beta: ``[BH, Tp]`` or ``None`` (no delta rule; scalar decays only).
      h0: ``[N·HV, Kp, Vp]`` initial states; meta: ``None`` (dense) or int32
        ``(first, seq, last) [NT]`` of a packed row (``BH = HV``).
      heads: ``HV``.
      precision: a resolved `jax.lax.Precision` of every matmul of float32 ``q, k, v``
        (`stellax.core.precision`: ``DEFAULT`` one bfloat16 pass, ``HIGH`` three,
        ``HIGHEST`` float32); bfloat16 ones do not use it.
      with_states: return each chunk's initial state ``[BH, NT, Kp, Vp]`` instead
        of ``o`` (what the backward needs; ``o`` would take HBM for nothing).
      out_dtype: the dtype of ``o``, each element rounded once from the kernel's float32 (a
        bfloat16 ``o`` halves the bytes the kernel writes and XLA's layout pass after it reads).
      _skip: stages the chunks leave out (`STAGES`: wrong results; the ablation benchmark's seam).
    Returns ``(o [BH, Tp, Vp], final [N·HV, Kp, Vp])`` (``(states, final)``); the
    final state of a packed sequence with no chunk is left unwritten (the
    caller passes ``h0``).
    """
    (bh, tp, vp), kp = v.shape, k.shape[-1]
    chunk, bv = config.chunk, min(config.block_v, vp)
    check_layout(k, v, chunk, bv)
    group = check_groups(q, k, v, config.heads_per_step)
    if per_channel and beta is None:
        raise ValueError("beta: the per-channel recurrence is a delta rule (beta required), got None")
    products = kernel_products(q, k, v, precision)
    nt = tp // chunk
    first, seq, last = dense_meta(nt) if meta is None else meta
    hb = config.heads_per_step
    specs = Specs(kp, bv, chunk, heads, nt, hb=hb)
    # Scalar decays and β as lane-dense rows only (`row_to_column` in the kernel): a [BH, Tp, 1] column
    # operand would move 128 times its bytes (its lane padded to 128) and cost XLA a padded copy.
    beta_rows = None if beta is None else beta.reshape(bh, nt, 1, chunk)
    inputs = {"q": operand(q, specs.grouped(kp, group)), "k": operand(k, specs.grouped(kp, group)),
              "v": operand(v, specs.cols), "beta": operand(beta_rows, specs.rows()),
              "h0": operand(h0, specs.state), **decay_operands(g, specs, per_channel)}
    outs = tpu_kernel_call(
        functools.partial(_forward_kernel, chunk=chunk, per_channel=per_channel, products=products,
                          skip=check_skip(_skip)),
        grid=(bh // hb, vp // bv, nt),
        inputs=inputs,
        outputs={"o": None if with_states else output((bh, tp, vp), out_dtype, specs.cols),
                 "final": output(h0.shape, F32, specs.state),
                 "states": output((bh, nt, kp, vp), F32, specs.per_chunk) if with_states else None},
        scratch={"state": pltpu.VMEM((hb, kp, bv), F32)},
        scalar_prefetch={"first": first, "seq": seq, "last": last},
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=tpu_vmem_limit(kp, bv, chunk, per_channel, heads=hb),
        name="linear_attention_channel_forward" if per_channel else "linear_attention_scalar_forward",
    )
    return (outs.states, outs.final) if with_states else (outs.o, outs.final)


def layout_chunk(config: TpuLinearAttentionConfig) -> int:
    """Tokens per chunk of the layout: ``config.chunk``."""
    return config.chunk


def forward(q, k, v, g, beta, h0, meta, config: TpuLinearAttentionConfig, *, per_channel: bool, precision=HIGHEST,
            out_dtype=F32):
    """`recurrence_forward` on the heads-major layout ``[Bs, HV, Tp, ...]`` (head
    sizes padded to 128 lanes) with ``meta`` per chunk of `TRITON_CHUNK` (the
    backward ops' layout; regrouped for chunks of 128): ``(o [Bs, HV, Tp, Vp]`` in
    ``out_dtype``, ``final [N, HV, Kp, Vp]`` float32``)``."""
    heads = v.shape[1]
    if meta is not None and config.chunk != TRITON_CHUNK:
        step = config.chunk // TRITON_CHUNK
        first, seq, last = meta
        meta = (first[::step], seq[::step], last[step - 1::step])
    flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])
    o, final = recurrence_forward(flat(q), flat(k), flat(v), flat(g), flat(beta), flat(h0), meta, heads=heads,
                                  per_channel=per_channel, config=config, precision=precision, out_dtype=out_dtype)
    return o.reshape(v.shape), final.reshape(h0.shape)
