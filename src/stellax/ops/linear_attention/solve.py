"""Stage 3 of the chunked pipeline: the triangular solve of the delta rule.

Inside a chunk the delta rule's writes interact through the strictly lower
``A [C, C]``, ``A_ij = β_i (k_i·k_j)_decayed`` for ``j < i`` (stage 2), and
the chunk's UT/WY form needs ``T = (I + A)⁻¹`` applied to its right-hand
sides (stage 4). ``A`` is nilpotent (``A^C = 0``), so

    (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)…        (log₂ C factors, exact)

Three forms: `solve_unit_lower` (XLA) is a blocked forward substitution over
sub-blocks of 16 rows, each diagonal block inverted by the product above;
`unit_lower_inverse` (inside the Triton kernels) forms the whole ``[C, C]``
inverse by the product; `block_unit_lower_inverse` (inside the Triton kernels
below sm_90) forms the inverse's blocks of 32 rows by the same forward
substitution, so that no matmul takes a ``[C, C]`` operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.pallas import F32, HIGHEST, dot, square_iota

#: Sub-block size of the XLA triangular solve.
SUB_BLOCK = 16


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=HIGHEST, preferred_element_type=F32)


def sub_block(c: int, size: int = SUB_BLOCK) -> int:
    """``size`` when it divides the chunk ``c``, else ``c`` (one block)."""
    return size if c % size == 0 else c


def solve_unit_lower(A, R):
    """``X = (I + A)⁻¹ R`` for strictly lower ``A [..., C, C]`` and ``R [..., C, N]`` (float32).

    Blocked forward substitution over sub-blocks of 16 rows; each diagonal
    block is inverted exactly by the nilpotent product
    ``(I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)`` (A is 16×16 strictly lower).
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
        power = _einsum("...ij,...jk->...ik", power, power)
        inv = inv + _einsum("...ij,...jk->...ik", inv, power)
        span *= 2
    xs = []
    for a in range(nb):
        rows = R[..., a * s:(a + 1) * s, :]
        if a:
            done = jnp.concatenate(xs, axis=-2)
            rows = rows - _einsum("...ij,...jn->...in", A[..., a * s:(a + 1) * s, :a * s], done)
        xs.append(_einsum("...ij,...jn->...in", inv[..., a, :, :], rows))
    return jnp.concatenate(xs, axis=-2)


def unit_lower_inverse(a, rows, cols, chunk: int, *, precision=HIGHEST, serial: bool = False):
    """``T = (I + A)⁻¹ [C, C]`` of a strictly lower ``A [C, C]`` on one tile
    (``rows, cols`` its `square_iota`): ``(I − A)(I + A²)(I + A⁴)…`` — exact,
    as ``A^C = 0``. ``precision`` of its ``2·log2(C/2)`` matmuls.

    ``serial`` makes each squaring wait for the previous product's update (an
    added ``0·T``, exact for finite ``T``): the two matmuls of a step are
    otherwise independent and, on sm_90 (wgmma), ptxas overlaps them — at C = 64
    on 4 warps the GDN WY kernel spilled 44–84 B there, none serialized. Below
    sm_90 (mma.sync, operands in registers) the serialized chain spilled more.
    """
    inv = (rows == cols).astype(F32) - a
    power = a
    span = 2
    while span < chunk:
        lhs = power + 0.0 * inv if serial and span > 2 else power
        power = dot(lhs, power, precision=precision)
        inv = inv + dot(inv, power, precision=precision)
        span *= 2
    return inv


def block_unit_lower_inverse(a_blocks, *, precision=HIGHEST, serial: bool = False):
    """The blocks of ``T = (I + A)⁻¹`` from those of a strictly lower ``A`` cut into
    ``nb × nb`` blocks of ``s`` rows (``s`` a power of two ≥ 16, inside a Triton kernel).

    ``a_blocks[a][c]`` is ``A``'s ``[s, s]`` float32 block ``(a, c)`` for ``c ≤ a`` (the
    diagonal ones strictly lower); returns ``t[a][c]`` likewise (``T`` is lower triangular).
    Forward substitution down the block rows of ``(I + A) T = I``:

        T_aa = (I + A_aa)⁻¹                       (`unit_lower_inverse` on ``[s, s]``)
        T_ac = −T_aa Σ_{c≤b<a} A_ab T_bc          (c < a)

    — ``nb·2·log2(s/2)`` matmuls for the diagonal blocks and ``Σ_{c<a} (a − c + 1)``
    for the others, each ``[s, s]·[s, s]``; ``serial`` as in `unit_lower_inverse`, for the
    diagonal blocks. Below sm_90 (mma.sync) every warp holds its share of a matmul's
    operands in registers, and the ``[64, 64]`` operands of `unit_lower_inverse` (hi and
    lo halves under `TF32X3`) spill; ``[32, 32]`` tiles do not.
    """
    s = a_blocks[0][0].shape[0]
    rows, cols = square_iota(s)
    t = []
    for a, row in enumerate(a_blocks):
        diag = unit_lower_inverse(row[a], rows, cols, s, precision=precision, serial=serial)
        below = []
        for c in range(a):
            acc = dot(row[c], t[c][c], precision=precision)
            for b in range(c + 1, a):
                acc = acc + dot(row[b], t[b][c], precision=precision)
            below.append(-dot(diag, acc, precision=precision))
        t.append(below + [diag])
    return t
