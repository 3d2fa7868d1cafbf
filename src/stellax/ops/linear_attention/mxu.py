"""In-kernel matmuls of the linear-attention kernels at a resolved precision
(`stellax.core.precision`).

`mxu_matmul` is `core.precision.mxu_dot_general` (the Mosaic TPU kernels'
float32 contract: ``DEFAULT`` one bfloat16 pass, ``HIGH`` three, ``HIGHEST``
float32) with a ``jax.custom_vjp`` whose transposed products go through the
same helper at the same precision: the backward kernel differentiates the
forward chunk with ``jax.vjp`` while it is traced, and without the rule the
transposes of the bfloat16 passes would be float32 × bfloat16 products at no
stated precision. `tile_dot` lets the tile helpers shared with the Triton
kernels (`solve`, `decay`, `scores`) take either form: ``mxu=False`` is
`core.pallas.dot` (Triton: ``precision`` from `core.pallas.triton_precision`).
"""

from __future__ import annotations

import functools

import jax

from ...core import pallas
from ...core.precision import mxu_dot_general

_DIMS = {"nn": (((1,), (0,)), ((), ())), "nt": (((1,), (1,)), ((), ())), "tn": (((0,), (0,)), ((), ()))}


def _product(a, b, layout, precision):
    return mxu_dot_general(a, b, _DIMS[layout], precision)


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
    return da.astype(a.dtype), db.astype(b.dtype)


mxu_matmul.defvjp(_matmul_fwd, _matmul_bwd)

_PALLAS = {"nn": pallas.dot, "nt": pallas.dot_nt, "tn": pallas.dot_tn}


def tile_dot(a, b, layout: str = "nn", *, precision, mxu: bool = False):
    """`mxu_matmul` inside a Mosaic TPU kernel (``mxu``), else `core.pallas.dot`
    / ``dot_nt`` / ``dot_tn`` at ``precision`` (a Triton kernel's, or XLA's)."""
    if mxu:
        return mxu_matmul(a, b, layout, precision)
    return _PALLAS[layout](a, b, precision=precision)
