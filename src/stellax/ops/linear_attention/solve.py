"""Stage 3 of the chunked pipeline: the triangular solve of the delta rule.

Inside a chunk the delta rule's writes interact through the strictly lower
``A [C, C]``, ``A_ij = β_i (k_i·k_j)_decayed`` for ``j < i`` (stage 2), and
the chunk's UT/WY form needs ``T = (I + A)⁻¹`` applied to its right-hand
sides (stage 4). ``A`` is nilpotent (``A^C = 0``), so

    (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)…        (log₂ C factors, exact)

Three forms: `solve_unit_lower` (XLA) is a blocked forward substitution over
sub-blocks of 16 rows, each diagonal block inverted by the product above;
`merge_inverse` (inside the Mosaic TPU kernels, and the Triton kernels on
sm_90) forms the whole ``[C, C]`` inverse with ``2·log₂(C/2)`` matmuls by
merging diagonal blocks of doubling size, which stays accurate where the
product over a whole chunk cancels (keys correlated at cosine 0.5 or more: its
powers ``A^2^j`` grow like binomial coefficients; the Triton kernels used that
product until issue 39's follow-up, docs/linear_attention.md);
`lazy_block_inverse` (inside the Triton kernels below sm_90) forms the
inverse's blocks of 32 rows by forward substitution, so that no matmul takes a
``[C, C]`` operand, with the diagonal blocks inverted row by row without
matmuls (`substitution_inverse`) and ``A``'s blocks formed on demand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.pallas import F32, HIGHEST, dot, square_iota
from .mxu import tile_dot

#: Sub-block size of the XLA triangular solve.
SUB_BLOCK = 16


def _einsum(spec, *operands, precision=HIGHEST):
    return jnp.einsum(spec, *operands, precision=precision, preferred_element_type=F32)


def sub_block(c: int, size: int = SUB_BLOCK) -> int:
    """``size`` when it divides the chunk ``c``, else ``c`` (one block)."""
    return size if c % size == 0 else c


def solve_unit_lower(A, R, precision=HIGHEST):
    """``X = (I + A)⁻¹ R`` for strictly lower ``A [..., C, C]`` and ``R [..., C, N]`` (float32).

    Blocked forward substitution over sub-blocks of 16 rows; each diagonal
    block is inverted exactly by the nilpotent product
    ``(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)`` (A is 16×16 strictly lower);
    ``precision`` of its matmuls.
    """
    c = A.shape[-1]
    s = sub_block(c)
    nb = c // s
    eye = jnp.eye(s, dtype=F32)
    blocks = jnp.stack([A[..., a * s:(a + 1) * s, a * s:(a + 1) * s] for a in range(nb)], axis=-3)
    inv = eye - blocks
    power = blocks
    span = 2
    while span < s:
        power = _einsum("...ij,...jk->...ik", power, power, precision=precision)
        inv = inv + _einsum("...ij,...jk->...ik", inv, power, precision=precision)
        span *= 2
    xs = []
    for a in range(nb):
        rows = R[..., a * s:(a + 1) * s, :]
        if a:
            done = jnp.concatenate(xs, axis=-2)
            rows = rows - _einsum("...ij,...jn->...in", A[..., a * s:(a + 1) * s, :a * s], done, precision=precision)
        xs.append(_einsum("...ij,...jn->...in", inv[..., a, :, :], rows, precision=precision))
    return jnp.concatenate(xs, axis=-2)


def _merge_mask(rows, cols, size: int):
    """The lower-left ``size × size`` block of every diagonal block of ``2·size``
    (``size`` a power of two; bitwise, no vector division)."""
    same = (rows & -(2 * size)) == (cols & -(2 * size))
    return same & ((rows & size) != 0) & ((cols & size) == 0)


def merge_inverse(a, rows, cols, chunk: int, *, precision=HIGHEST, mxu: bool = False):
    """``T = (I + A)⁻¹ [C, C]`` of a strictly lower ``A [C, C]`` on one tile (``rows,
    cols`` its `square_iota`, ``C`` a power of two) by merging diagonal blocks of
    doubling size: with ``T_b`` the inverse of ``A``'s diagonal blocks of ``b`` rows
    and ``X`` the lower-left ``b × b`` blocks of its diagonal blocks of ``2b``,

        T_2b = T_b − T_b X T_b                (T_1 = I; the same 2·log2(C/2) matmuls)

    — the 2 × 2 block inverse ``[[T₁, 0], [−T₂ X T₁, T₂]]`` of every pair at once.
    Each product is of accurate sub-inverses, bounded where ``T`` is; the nilpotent
    product ``(I − A)(I + A²)(I + A⁴)…`` (removed) forms the powers ``A^2^j`` instead, whose entries
    reach binomial coefficients times ``|A|^2^j`` and cancel: with keys at cosine 0.5 it
    lost four digits at float32 (``HIGHEST``), with cosine 0.8 every digit
    (docs/linear_attention.md). Each step's two matmuls depend on each other, so ptxas
    cannot overlap them on sm_90 (the product's independent pair spilled there unless
    serialized). ``precision`` of the matmuls (``mxu``: inside a Mosaic TPU kernel,
    `mxu.tile_dot`; inside a Triton kernel, `tile_dot` is the Triton `dot`)."""
    inv = (rows == cols).astype(F32) - jnp.where(_merge_mask(rows, cols, 1), a, 0.0)
    size = 2
    while size < chunk:
        x = jnp.where(_merge_mask(rows, cols, size), a, 0.0)
        inv = inv - tile_dot(inv, tile_dot(x, inv, precision=precision, mxu=mxu), precision=precision, mxu=mxu)
        size *= 2
    return inv


def substitution_inverse(a, rows, cols):
    """``T = (I + A)⁻¹ [s, s]`` of a strictly lower ``A [s, s]`` on one tile (``rows, cols``
    its `square_iota`) by forward substitution, one row per step and no matmul:

        T_0 = e_0,   T_i = e_i − Σ_{j<i} A_ij T_j        (i = 1 … s − 1)

    each step picks row ``i`` of ``A`` by a masked sum and adds ``s²`` products: ``s − 1``
    dependent steps of elementwise work and two reductions (fla's ``solve_tril`` inverts its
    16×16 diagonal blocks so). Below sm_90 it takes far fewer registers than the nilpotent
    product's TF32X3 matmuls, whose mma.sync operands (hi and lo halves) live in registers.
    Works inside a Triton kernel and on plain arrays."""
    eye = (rows == cols).astype(F32)

    def step(i, t):
        a_i = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # row i of A, indexed by j
        return jnp.where(rows == i, eye - jnp.sum(a_i[:, None] * t, axis=0)[None, :], t)

    return jax.lax.fori_loop(1, a.shape[0], step, eye)


def lazy_block_inverse(a_block, nb: int, size: int, *, precision=HIGHEST):
    """The blocks of ``T = (I + A)⁻¹`` for a strictly lower ``A`` cut into ``nb × nb``
    blocks of ``size`` rows, inside a Triton kernel below sm_90, with ``A``'s float32
    blocks formed on demand: ``a_block(a, c)`` returns block ``(a, c)``, ``c ≤ a`` (the
    diagonal ones strictly lower) and is called once per block. Returns ``t[a][c]``
    (``T`` is lower triangular), by forward substitution down the block rows:

        T_aa = (I + A_aa)⁻¹                       (`substitution_inverse`, every a first)
        T_ac = −T_aa Σ_{c≤b<a} A_ab T_bc          (c < a; ``precision`` matmuls)

    Inverting every diagonal block before the first off-diagonal block of ``A`` exists keeps
    those out of registers during the substitution. The GDN WY kernel on sm_80 at 4 warps,
    K = 32, spill stores per thread: the diagonal blocks by the nilpotent product and every
block formed up front (the kernel's earlier form) 52 B,
    the substitution on blocks formed up front 16 B, the nilpotent product on blocks formed on
    demand 396 B, this form none.
    """
    rows, cols = square_iota(size)
    t = [[None] * a + [substitution_inverse(a_block(a, a), rows, cols)] for a in range(nb)]
    formed = {}

    def block(a, b):
        if (a, b) not in formed:
            formed[a, b] = a_block(a, b)
        return formed[a, b]

    for a in range(1, nb):
        for c in range(a):
            acc = dot(block(a, c), t[c][c], precision=precision)
            for b in range(c + 1, a):
                acc = acc + dot(block(a, b), t[b][c], precision=precision)
            t[a][c] = -dot(t[a][a], acc, precision=precision)
    return t
