"""Public grouped-matmul API with the contract of ``jax.lax.ragged_dot``:
`ragged_dot`, `ragged_dot_tgmm` and `ragged_dot_general`.

Each picks its op — ``ragged_dot`` (`ragged_dot.py`), ``ragged_dot_tgmm``
(`tgmm.py`), the quantized ``ragged_dot`` for a `QArray` rhs
(`quantized.py`); the backward op is in `backward.py`.
"""

from __future__ import annotations

import jax
import numpy as np

from ..quant.qarray import QArray
from .quantized import ragged_dot_quantized
from .ragged_dot import ragged_dot_op
from .tgmm import ragged_dot_tgmm_op


# -- public functions ------------------------------------------------------------------------
def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
               activation=None, implementation=None, config=None):
    """Grouped matmul with the contract of ``jax.lax.ragged_dot``.

    Args:
      lhs: ``[M, K]`` float32/bfloat16/float16, rows sorted by group.
      rhs: ``[G, K, N]`` (one matrix per group), or ``[G, K, 2, N]`` for the
        fused gate/up projection: the result is ``act(lhs @ gate) * (lhs @ up)``.
      group_sizes: ``[G_total]`` integers; group ``g`` owns the next
        ``group_sizes[g]`` rows. Rows past ``sum(group_sizes)`` give zeros.
        Eagerly, negative sizes or ``sum > M`` raise; under ``jit`` sizes are
        clamped (negative → 0, a group running past row M is cut at M; the
        running sum saturates at M, so sizes near 2³¹ do not wrap around).
      precision: as for ``jax.lax.dot`` (``None``/``"default"``/``"high"``/
        ``"highest"``/a `jax.lax.Precision`), for the float32 products forward
        and backward; ``None`` is float32-accurate unless
        `jax.default_matmul_precision` is set. See `stellax.core.precision`.
      preferred_element_type: output dtype (default: ``lhs.dtype``);
        accumulation is always float32.
      group_offset: an int (or int array of shape ``()``/``(1,)``) for
        expert-sharded weights: ``rhs`` holds groups ``[offset, offset + G)``
        of ``group_sizes`` (``G = rhs.shape[0]``, the local group count);
        rows of the other groups give zeros. Eagerly an offset outside ``[0,
        len(group_sizes) - G]`` raises; under ``jit`` it selects no group (all
        rows zero).
      activation: ``None``, ``"silu"``, ``"gelu"``, ``"gelu_tanh"``,
        ``"relu"``, ``"sigmoid"`` or a callable, applied to the product
        (to the gate half for a gated rhs). Callables are applied by XLA after
        the Triton kernel, names are fused into it.
      implementation: ``None`` (Triton on GPUs, else XLA), ``"triton"``,
        ``"xla"`` or a sequence tried in order.
      config: a `GroupedMatmulConfig` (Triton) or `XlaGroupedMatmulConfig`.

    Quantized weights: ``rhs`` may be a `stellax.QArray` ``[G, K, N]``
    quantized along axis 1 (K) in int8/int8_asym/int4/int4_asym/fp8_e4m3/
    fp8_e5m2/mxfp8_*/mxfp4/nvfp4 (no gated rhs); decoding is fused into the
    Triton kernel's K loop, gradients flow to ``lhs`` only (the weights are
    frozen). See `stellax.ops.moe.quantized` and docs/moe.md.

    Returns:
      ``[M, N]`` in ``preferred_element_type``.
    """
    if isinstance(rhs, QArray):
        return ragged_dot_quantized(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                    activation=activation, implementation=implementation, config=config)
    return ragged_dot_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                         activation=activation, implementation=implementation, config=config)


def ragged_dot_tgmm(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                    num_local_groups=None, transpose_lhs=False, implementation=None, config=None):
    """``out[g] = lhs[:, rows of g] @ rhs[rows of g, :]`` → ``[G, K, N]``.

    ``lhs [K, M]`` (or ``[M, K]`` with ``transpose_lhs``), ``rhs [M, N]``; the
    weight gradient of `ragged_dot`. With ``group_offset`` only groups
    ``[offset, offset + num_local_groups)`` are computed. An empty group gives
    zeros. ``precision``: of the float32 products, as for `ragged_dot` (see
    `stellax.core.precision`)."""
    return ragged_dot_tgmm_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                              num_local_groups=num_local_groups, transpose_lhs=transpose_lhs,
                              implementation=implementation, config=config)


_LAYOUTS = {
    # (lhs contracting, rhs contracting, lhs ragged, rhs group) -> layout
    ((1,), (1,), (0,), (0,)): "forward",
    ((1,), (2,), (0,), (0,)): "transpose_rhs",
    ((1,), (0,), (1,), ()): "tgmm",
    ((0,), (0,), (0,), ()): "tgmm_transpose_lhs",
}


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, *, num_local_groups=None,
                       implementation=None, config=None):
    """``jax.lax.ragged_dot_general`` for the layouts training needs.

    Supported ``ragged_dot_dimension_numbers`` (``jax.lax.RaggedDotDimensionNumbers``,
    no batch dimensions):

    * forward: ``lhs [M, K]``, ``rhs [G, K, N]`` → ``[M, N]``
      (contracting ``([1], [1])``, lhs ragged ``[0]``, rhs group ``[0]``);
    * transposed rhs (dlhs): ``rhs [G, N, K]`` (contracting ``([1], [2])``);
    * ragged contraction (tgmm, drhs): ``lhs [K, M]``, ``rhs [M, N]`` →
      ``[G, K, N]`` (contracting ``([1], [0])``, lhs ragged ``[1]``, no rhs
      group), or ``lhs [M, K]`` (contracting ``([0], [0])``, lhs ragged ``[0]``).
    """
    dims = ragged_dot_dimension_numbers
    if not isinstance(dims, jax.lax.RaggedDotDimensionNumbers):
        raise TypeError(f"ragged_dot_dimension_numbers: expected a jax.lax.RaggedDotDimensionNumbers, "
                        f"got {type(dims).__name__} {dims!r}")
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    key = (tuple(lc), tuple(rc), tuple(dims.lhs_ragged_dimensions), tuple(dims.rhs_group_dimensions))
    layout = _LAYOUTS.get(key) if not lb and not rb and np.ndim(lhs) == 2 else None
    if layout is None:
        raise ValueError(
            f"ragged_dot_dimension_numbers: expected one of the layouts forward (([1],[1]) ragged [0] group [0]), "
            f"transposed rhs (([1],[2]) ragged [0] group [0]) or tgmm (([1],[0]) ragged [1] / ([0],[0]) ragged [0], "
            f"no group) without batch dimensions, got {dims}")
    if isinstance(rhs, QArray):
        if layout != "forward":
            raise ValueError(f"rhs: a QArray rhs supports only the forward layout (([1],[1]) ragged [0] group [0]), "
                             f"got the {layout} layout")
        return ragged_dot_quantized(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                    implementation=implementation, config=config)
    if layout in ("forward", "transpose_rhs"):
        if num_local_groups is not None and np.ndim(rhs) >= 1 and num_local_groups != rhs.shape[0]:
            raise ValueError(f"num_local_groups: expected rhs.shape[0] = {rhs.shape[0]}, got {num_local_groups}")
        return ragged_dot_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                             transpose_rhs=layout == "transpose_rhs", implementation=implementation, config=config)
    return ragged_dot_tgmm_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                              num_local_groups=num_local_groups, transpose_lhs=layout == "tgmm_transpose_lhs",
                              implementation=implementation, config=config)
