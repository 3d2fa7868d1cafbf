"""In-kernel matmuls of the linear-attention kernels, and which precision each
kind of product of the Mosaic TPU chunked kernels runs at.

`mxu_matmul` is `core.precision.mxu_dot_general` (the Mosaic TPU kernels'
float32 contract: ``DEFAULT`` one bfloat16 pass, ``HIGH`` three, ``HIGHEST``
float32) with a ``jax.custom_vjp`` whose transposed products go through the
same helper at the same precision: the backward kernel differentiates the
forward chunk with ``jax.vjp`` while it is traced, and without the rule the
transposes of the bfloat16 passes would be float32 × bfloat16 products at no
stated precision. `exact_matmul` is a product with a constant 0/1 mask (the
sums of log decays over spans): the other operand split into three bfloat16
pieces, three passes whose every product is exact. `tile_dot` lets the tile
helpers shared with the Triton kernels (`solve`, `decay`, `scores`) take
either form: ``mxu=False`` is `core.pallas.dot` (Triton: ``precision`` from
`core.pallas.triton_precision`).

`Products` names the precision of each kind of product of the chunked
kernels (`mosaic_tpu.scalar_chunk`, `mosaic_tpu.channel_chunk`) and
`chunk_products` picks it from the kernels' operand dtype:

* float32 operands: the call's ``precision`` for every product (the float32
  contract of `stellax.core.precision`, unchanged);
* bfloat16 operands (bfloat16 inputs, `operand_dtype`): the products of
  input-like, well-scaled operands — the scores ``Q Kᵀ`` and ``K Kᵀ``, the
  state products ``W S``, ``(Γ⊙Q) S``, ``K̃ᵀ Δ``, ``T (β V)``, ``T (β Γ K)`` and
  ``P Δ`` — take bfloat16 operands with float32 accumulation (one MXU pass;
  the float32 factors are rounded to bfloat16 as the MXU takes them); the
  sums of log decays over spans stay exact (`EXACT`: the decays' digits set
  every ``exp``, and a bfloat16 log decay of −20 is off by 0.06); the
  unit-lower inverse at one pass too, and the delta rule's residuals ``Δ``
  by one step of iterative refinement on it whose residual product ``A X₀``
  takes three passes (``HIGH``; `Products.refine`, `mosaic_tpu.refined_solve`).
  The exponentials and the state stay float32. docs/linear_attention.md gives
  the errors measured per choice (`BF16_POLICIES`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import pallas
from ...core.precision import DEFAULT, HIGH, Precision, mxu_dot_general

_DIMS = {"nn": (((1,), (0,)), ((), ())), "nt": (((1,), (1,)), ((), ())), "tn": (((0,), (0,)), ((), ()))}
#: The same layouts on tiles with a leading batch axis (the heads of a grid step).
_BATCHED_DIMS = {"nn": (((2,), (1,)), ((0,), (0,))), "nt": (((2,), (2,)), ((0,), (0,))),
                 "tn": (((1,), (1,)), ((0,), (0,)))}
_BF16 = jnp.bfloat16

#: The "precision" of a sum over a 0/1 mask that is exact (`exact_matmul`).
EXACT = "exact"


def _batched(a, b):
    """``(a, b, dims)``: two 2-D tiles as they are; with a leading batch axis on either
    (``[hb, m, n]``), the other broadcast to it (a 2-D tile shared by the batch, e.g.
    a constant mask) and the batched layouts (one product per batch entry, which the
    Mosaic compiler issues back to back: independent chains overlap on the MXUs)."""
    if a.ndim == b.ndim == 2:
        return a, b, _DIMS
    if max(a.ndim, b.ndim) != 3 or min(a.ndim, b.ndim) < 2:
        raise ValueError(f"a, b: expected 2-D tiles or [batch, m, n] tiles, got shapes {a.shape} and {b.shape}")
    batch = a.shape[0] if a.ndim == 3 else b.shape[0]
    a = a if a.ndim == 3 else jnp.broadcast_to(a, (batch,) + a.shape)
    b = b if b.ndim == 3 else jnp.broadcast_to(b, (batch,) + b.shape)
    return a, b, _BATCHED_DIMS


def _product(a, b, layout, precision):
    a, b, dims = _batched(a, b)
    return mxu_dot_general(a, b, dims[layout], precision)


def _unbroadcast(grad, like):
    """The cotangent of an operand that `_batched` broadcast: summed over the batch."""
    return grad.sum(axis=0) if grad.ndim > like.ndim else grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def mxu_matmul(a, b, layout: str, precision):
    """``a·b`` (``layout`` ``"nn"``), ``a·bᵀ`` (``"nt"``) or ``aᵀ·b`` (``"tn"``) of two
    tiles in a Mosaic TPU kernel at a resolved ``precision``, float32 accumulation."""
    return _product(a, b, layout, precision)


def _matmul_fwd(a, b, layout, precision):
    return _product(a, b, layout, precision), (a, b)


def _matmul_bwd(layout, precision, residuals, dc):
    a, b = residuals
    if layout == "nn":    # c = a b
        da, db = _product(dc, b, "nt", precision), _product(a, dc, "tn", precision)
    elif layout == "nt":  # c = a bᵀ
        da, db = _product(dc, b, "nn", precision), _product(dc, a, "tn", precision)
    else:                 # c = aᵀ b
        da, db = _product(b, dc, "nt", precision), _product(a, dc, "nn", precision)
    return _unbroadcast(da, a).astype(a.dtype), _unbroadcast(db, b).astype(b.dtype)


mxu_matmul.defvjp(_matmul_fwd, _matmul_bwd)


# -- exact sums over 0/1 masks ------------------------------------------------------------
def bf16_pieces(x):
    """float32 ``x`` as three bfloat16 pieces whose sum is ``x`` exactly (24 significant
    bits in three of 8: each remainder is exact in float32 and the last fits bfloat16)."""
    x = x.astype(jnp.float32)
    hi = x.astype(_BF16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(_BF16)
    return hi, mid, (rest - mid.astype(jnp.float32)).astype(_BF16)


def _exact(a, b, layout, mask):
    """The three passes of `exact_matmul` (``mask``: which operand is the 0/1 mask)."""
    if mask == "a":
        m, pieces = a.astype(_BF16), bf16_pieces(b)
        parts = [_product(m, p, layout, DEFAULT) for p in pieces]
    else:
        m, pieces = b.astype(_BF16), bf16_pieces(a)
        parts = [_product(p, m, layout, DEFAULT) for p in pieces]
    return parts[2] + parts[1] + parts[0]  # smallest first


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def exact_matmul(a, b, layout: str, mask: str = "a"):
    """``a·b`` / ``a·bᵀ`` / ``aᵀ·b`` (``layout`` as `mxu_matmul`) where operand ``mask``
    (``"a"`` or ``"b"``) is a constant 0/1 matrix and the other float32: that one
    split into three bfloat16 pieces (`bf16_pieces`), three MXU passes whose every
    product is exact, accumulated in float32 — a sum of float32 terms over each
    mask row, as a float32 loop would add them (half of ``HIGHEST``'s six passes).
    The transposes are exact the same way; the mask gets no cotangent (it is
    built from iotas, not from the inputs)."""
    return _exact(a, b, layout, mask)


def _exact_fwd(a, b, layout, mask):
    return _exact(a, b, layout, mask), (a, b)


def _exact_bwd(layout, mask, residuals, dc):
    a, b = residuals
    if mask == "a":  # the cotangent of b only
        db = {"nn": lambda: _exact(a, dc, "tn", "a"), "nt": lambda: _exact(dc, a, "tn", "b"),
              "tn": lambda: _exact(a, dc, "nn", "a")}[layout]()
        return jnp.zeros_like(a), _unbroadcast(db, b).astype(b.dtype)
    da = {"nn": lambda: _exact(dc, b, "nt", "b"), "nt": lambda: _exact(dc, b, "nn", "b"),
          "tn": lambda: _exact(b, dc, "nt", "a")}[layout]()
    return _unbroadcast(da, a).astype(a.dtype), jnp.zeros_like(b)


exact_matmul.defvjp(_exact_fwd, _exact_bwd)


def mask_matmul(a, b, layout: str, precision, mask: str = "a"):
    """A product with a constant 0/1 ``mask`` operand in a Mosaic TPU kernel:
    `exact_matmul` at `EXACT`, else `mxu_matmul` at ``precision``."""
    if precision == EXACT:
        return exact_matmul(a, b, layout, mask)
    return mxu_matmul(a, b, layout, precision)


_PALLAS = {"nn": pallas.dot, "nt": pallas.dot_nt, "tn": pallas.dot_tn}


def tile_dot(a, b, layout: str = "nn", *, precision, mxu: bool = False):
    """`mxu_matmul` inside a Mosaic TPU kernel (``mxu``; `EXACT`: `exact_matmul`,
    ``a`` the mask), else `core.pallas.dot` / ``dot_nt`` / ``dot_tn`` at ``precision``
    (a Triton kernel's, or XLA's)."""
    if mxu:
        return mask_matmul(a, b, layout, precision)
    return _PALLAS[layout](a, b, precision=precision)


# -- the precision of each kind of product ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Products:
    """The precision of each kind of product of the Mosaic TPU chunked kernels
    (module docstring).

    Attributes:
      operands: the scores, the state products, ``T (β V)``, ``T (β Γ K)`` and ``P Δ``.
      solve: the doubling products of the unit-lower inverse (`solve.merge_inverse`).
      sums: the 0/1-mask matmuls that sum log decays over spans (`EXACT` or a precision).
      refine: ``None``: the delta rule's ``U = T (β V)``, ``W = T (β Γ K)``, ``Δ = U − W S``
        (the inverse ``T`` as accurate as ``solve`` makes it). A precision: ``Δ`` solved at once
        from ``R = β V − (β Γ K) S`` with one step of iterative refinement on the approximate
        ``T̃`` (`mosaic_tpu.refined_solve`): ``X₀ = T̃ R``, ``r = R − X₀ − A X₀`` (``A X₀`` at
        ``refine``), ``Δ = X₀ + T̃ r``, so that ``solve`` may be one pass.
    """

    operands: Precision
    solve: Precision
    sums: Precision | str
    refine: Precision | None = None

    @classmethod
    def uniform(cls, precision: Precision) -> Products:
        """Every product at ``precision`` (float32 operands)."""
        return cls(precision, precision, precision)


#: The inverse's precision for bfloat16 operands (measured: docs/linear_attention.md).
BF16_SOLVE = HIGH
#: The policies for bfloat16 operands compared in docs/linear_attention.md (issue 39):
#: ``three_pass`` the inverse at three passes and ``U``/``W`` from it (the default before);
#: ``one_pass`` the same at one pass (less accurate); ``refined`` the inverse at one pass and
#: ``Δ`` by one refinement step at three passes (`Products.refine`).
BF16_POLICIES = {
    "three_pass": Products(operands=DEFAULT, solve=BF16_SOLVE, sums=EXACT),
    "one_pass": Products(operands=DEFAULT, solve=DEFAULT, sums=EXACT),
    "refined": Products(operands=DEFAULT, solve=DEFAULT, sums=EXACT, refine=HIGH),
}
#: The products of bfloat16 operands (module docstring): ``refined`` (issue 39: against ``three_pass``
#: 1.4x fewer cycles per GDN forward step and 2.2x per backward step, statically, and smaller errors at
#: T = 65536; docs/linear_attention.md).
BF16_PRODUCTS = BF16_POLICIES["refined"]


@contextlib.contextmanager
def bf16_policy(name: str):
    """Kernels traced inside run `BF16_POLICIES` [``name``] for bfloat16 operands
    (`chunk_products` reads `BF16_PRODUCTS` at trace time; the benchmarks' and the
    static-schedule cases' seam)."""
    global BF16_PRODUCTS
    if name not in BF16_POLICIES:
        raise ValueError(f"name: expected one of {sorted(BF16_POLICIES)}, got {name!r}")
    saved, BF16_PRODUCTS = BF16_PRODUCTS, BF16_POLICIES[name]
    try:
        yield
    finally:
        BF16_PRODUCTS = saved


def operand_dtype(dtype) -> np.dtype:
    """The dtype the Mosaic TPU chunked kernels take ``q, k, v`` in for inputs of
    ``dtype``: bfloat16 for bfloat16 inputs (their products run `BF16_PRODUCTS`),
    else float32."""
    return np.dtype(_BF16) if np.dtype(dtype) == np.dtype(_BF16) else np.dtype(jnp.float32)


def chunk_products(dtype, precision: Precision) -> Products:
    """The `Products` of kernels whose ``q, k, v`` are of ``dtype``: `BF16_PRODUCTS`
    for bfloat16, else every product at ``precision`` (a resolved `jax.lax.Precision`)."""
    if np.dtype(dtype) == np.dtype(_BF16):
        return BF16_PRODUCTS
    return Products.uniform(precision)
