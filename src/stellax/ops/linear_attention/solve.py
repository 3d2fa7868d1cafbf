"""Stage 3 of the chunked pipeline: the triangular solve of the delta rule.

Inside a chunk the delta rule's writes interact through the strictly lower
``A [C, C]``, ``A_ij = β_i (k_i·k_j)_decayed`` for ``j < i`` (stage 2), and
the chunk's UT/WY form needs ``T = (I + A)⁻¹`` applied to its right-hand
sides (stage 4). ``A`` is nilpotent (``A^C = 0``), so

    (I + A)⁻¹ = (I − A)(I + A²)(I + A⁴)(I + A⁸)…        (log₂ C factors, exact)

Two forms: `solve_unit_lower` (XLA) is a blocked forward substitution over
sub-blocks of 16 rows, each diagonal block inverted by the product above;
`unit_lower_inverse` (inside the Triton kernels) forms the whole ``[C, C]``
inverse by the product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.pallas import F32, HIGHEST, dot

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
