"""The grouped-matmul ops and their public API, with the contract of
``jax.lax.ragged_dot``: `ragged_dot`, `ragged_dot_tgmm` and `ragged_dot_general`.

Three ops over the kernel modules of `base.BACKENDS` (``mosaic_tpu``,
``triton``, ``xla``), each differentiated through a `core.vjp` rule:

* ``ragged_dot``: ``lhs [M, K]`` (rows sorted by group) times one of
  ``rhs [G, K, N]`` per group (or ``[G, N, K]`` with ``transpose_rhs``, the
  dlhs layout), optional fused activation and fused gate/up
  (``rhs [G, K, 2, N]`` → ``act(gate) * up``)::

      out[rows of g] = act(lhs[rows of g] @ rhs[g])   (zeros outside the local groups)

  Its VJP saves the pre-activation and calls ``ragged_dot_backward``.
* ``ragged_dot_tgmm``: the ragged dimension contracted (the weight gradient),
  ``lhs [K, M]`` (or ``[M, K]`` with ``transpose_lhs``), ``rhs [M, N]`` →
  ``[G, K, N]`` over the ``num_local_groups`` groups from ``group_offset``::

      out[g] = lhs[:, rows of g] @ rhs[rows of g, :]   (zeros for an empty group)

  Its VJP is two ``ragged_dot`` calls: with ``A [M, K]`` (``lhs`` or ``lhsᵀ``)
  and ``B = rhs``, ``dA = B @ dout[g]ᵀ`` (transposed rhs), ``dB = A @ dout[g]``.
* ``ragged_dot_backward``: ``(dlhs, drhs)`` of ``ragged_dot``. With ``dz`` the
  cotangent of the pre-activation (the activation gradient in XLA, from the
  forward's saved pre-activation; ``dz = dy`` without one)::

      dlhs = dz @ rhs[g]ᵀ                          a ``ragged_dot`` with the transposed weights
      drhs[g] = lhs[rows of g]ᵀ @ dz[rows of g]     a ``ragged_dot_tgmm``

  each dispatched as an op with its own configs (``transpose_rhs``: the roles
  of ``lhs`` and ``dz`` swap for ``drhs``). A gated ``rhs [G, K, 2, N]`` is
  differentiated as ``[G, K, 2N]``.

A `QArray` rhs goes to the quantized ``ragged_dot`` (`quantized.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ...core import Call, backward_implementation, vjp
from ...core.backends import Backend
from ..quant.qarray import QArray
from .activations import activation_grad
from .base import BACKENDS, TGMM_BACKENDS, gmm_bytes, gmm_flops, tgmm_bytes, tgmm_flops
from .checks import check_backward, check_ragged_dot, check_tgmm
from .examples import (FORWARD_PEERS, TGMM_PEERS, backward_examples, forward_benchmarks, forward_examples,
                       tgmm_benchmarks, tgmm_examples)
from .quantized import ragged_dot_quantized
from .reference import ragged_dot_backward_reference, ragged_dot_reference, ragged_dot_tgmm_reference
from .schedule import poison_bad_offset


# -- ragged_dot ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _RaggedDot:
    """``ragged_dot`` by one backend (a `core.vjp` rule): operands ``(lhs, rhs, group_sizes,
    group_offset)``; differentiated, the forward also returns the pre-activation (gated or
    activated calls), which the backward op reads."""

    backend: Backend
    config: Any
    transpose_rhs: bool
    activation: Any
    precision: Any
    out_dtype: Any

    def _gmm(self, lhs, rhs, group_sizes, group_offset, save: bool):
        return self.backend.kernels.gmm(lhs, rhs, group_sizes, group_offset, transpose_rhs=self.transpose_rhs,
                                        activation=self.activation, precision=self.precision,
                                        out_dtype=self.out_dtype, save_preactivation=save, config=self.config)

    def primal(self, lhs, rhs, group_sizes, group_offset):
        return self._gmm(lhs, rhs, group_sizes, group_offset, False)[0]

    def forward(self, lhs, rhs, group_sizes, group_offset):
        save = rhs.ndim == 4 or self.activation is not None
        out, pre = self._gmm(lhs, rhs, group_sizes, group_offset, save)
        return out, (lhs, rhs, group_sizes, group_offset, pre)

    def backward(self, residuals, dy):
        lhs, rhs, group_sizes, group_offset, pre = residuals
        dlhs, drhs = ragged_dot_backward_op(
            dy, lhs, rhs, group_sizes, group_offset, pre, activation=self.activation,
            transpose_rhs=self.transpose_rhs, precision=self.precision,
            implementation=backward_implementation(ragged_dot_backward_op, self.backend.name))
        return dlhs, drhs, None, None


def _run_ragged_dot(backend: Backend, call: Call, config):
    rule = _RaggedDot(backend, config, call.transpose_rhs, call.activation, call.precision, call.out_dtype)
    out = vjp.apply(rule, call.lhs, call.rhs, call.group_sizes, call.group_offset)
    return poison_bad_offset(out, call.group_sizes, call.group_offset, call.rhs.shape[0])


ragged_dot_op = BACKENDS.op(
    "ragged_dot", _run_ragged_dot, check=check_ragged_dot, reference=ragged_dot_reference,
    flops=gmm_flops, bytes_accessed=gmm_bytes, examples=forward_examples, benchmarks=forward_benchmarks,
    peers=FORWARD_PEERS, differentiable=("lhs", "rhs"))


# -- ragged_dot_tgmm ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tgmm:
    """``ragged_dot_tgmm`` by one backend (a `core.vjp` rule): operands ``(lhs, rhs,
    group_sizes, group_offset)``; its backward is two ``ragged_dot`` calls (module doc)."""

    backend: Backend
    config: Any
    num_local: int
    transpose_lhs: bool
    precision: Any
    out_dtype: Any

    def forward(self, lhs, rhs, group_sizes, group_offset):
        out = self.backend.kernels.tgmm(lhs, rhs, group_sizes, group_offset, num_local=self.num_local,
                                        transpose_lhs=self.transpose_lhs, precision=self.precision,
                                        out_dtype=self.out_dtype, config=self.config)
        return out, (lhs, rhs, group_sizes, group_offset)

    def backward(self, residuals, dout):
        lhs, rhs, group_sizes, group_offset = residuals
        rows_lhs = lhs if self.transpose_lhs else lhs.T
        dout = dout.astype(lhs.dtype)
        impl = backward_implementation(ragged_dot_op, self.backend.name)
        da = ragged_dot_op(rhs, dout, group_sizes, self.precision, lhs.dtype, group_offset,
                           transpose_rhs=True, implementation=impl)
        db = ragged_dot_op(rows_lhs, dout, group_sizes, self.precision, rhs.dtype, group_offset,
                           implementation=impl)
        return (da if self.transpose_lhs else da.T), db, None, None


def _run_tgmm(backend: Backend, call: Call, config):
    rule = _Tgmm(backend, config, call.num_local_groups, call.transpose_lhs, call.precision, call.out_dtype)
    out = vjp.apply(rule, call.lhs, call.rhs, call.group_sizes, call.group_offset)
    return poison_bad_offset(out, call.group_sizes, call.group_offset, call.num_local_groups)


ragged_dot_tgmm_op = TGMM_BACKENDS.op(
    "ragged_dot_tgmm", _run_tgmm, check=check_tgmm, reference=ragged_dot_tgmm_reference,
    flops=tgmm_flops, bytes_accessed=tgmm_bytes, examples=tgmm_examples, benchmarks=tgmm_benchmarks,
    peers=TGMM_PEERS, differentiable=("lhs", "rhs"))


# -- ragged_dot_backward -------------------------------------------------------------------------
def _run_backward(backend: Backend, call: Call, config):
    """``(dlhs, drhs)`` by two ops of ``backend`` (module doc)."""
    del config
    lhs, rhs = call.lhs, call.rhs
    gated = rhs.ndim == 4
    m = lhs.shape[0]
    if call.preactivation is None:
        dz = call.dy
    else:
        dz = activation_grad(call.activation, call.dy, call.preactivation, gated).reshape(m, -1)
    dz = dz.astype(lhs.dtype)
    impl = (backend.name,)
    sizes, offset, precision = call.group_sizes, call.group_offset, call.precision
    num_local = rhs.shape[0]
    if call.transpose_rhs:  # y = x @ rhs[g]^T, rhs [G, N, K]
        dlhs = ragged_dot_op(dz, rhs, sizes, precision, lhs.dtype, offset, implementation=impl)
        drhs = ragged_dot_tgmm_op(dz, lhs, sizes, precision, rhs.dtype, offset, num_local_groups=num_local,
                                  transpose_lhs=True, implementation=impl)
        return dlhs, drhs
    weights = rhs.reshape(num_local, rhs.shape[1], -1)  # [G, K, N] (gate/up flattened to 2N)
    dlhs = ragged_dot_op(dz, weights, sizes, precision, lhs.dtype, offset, transpose_rhs=True, implementation=impl)
    drhs = ragged_dot_tgmm_op(lhs, dz, sizes, precision, rhs.dtype, offset, num_local_groups=num_local,
                              transpose_lhs=True, implementation=impl)
    return dlhs, drhs.reshape(rhs.shape)


ragged_dot_backward_op = BACKENDS.op(
    "ragged_dot_backward", _run_backward, backward=True, check=check_backward,
    reference=ragged_dot_backward_reference, flops=lambda call: 2 * gmm_flops(call),
    bytes_accessed=lambda call: 2 * gmm_bytes(call), examples=backward_examples)


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
        len(group_sizes) - G]`` raises; under ``jit`` it names no group and
        the whole result is NaN (never a plausible zero).
      activation: ``None``, ``"silu"``, ``"gelu"``, ``"gelu_tanh"``,
        ``"relu"``, ``"sigmoid"`` or a callable, applied to the product
        (to the gate half for a gated rhs). Callables are applied by XLA after
        the kernel, names are fused into it.
      implementation: ``None`` (the best available: Mosaic TPU on TPUs,
        Triton on GPUs, else XLA), ``"mosaic_tpu"``, ``"triton"``, ``"xla"``
        or a sequence tried in order.
      config: for ``"mosaic_tpu"`` a `TpuGroupedMatmulConfig`
        (`stellax.ops.moe.configs`), for ``"triton"`` a `GroupedMatmulConfig`,
        for ``"xla"`` an `XlaGroupedMatmulConfig`. The backward runs as the
        ``ragged_dot_backward`` op (its dlhs a ``ragged_dot``, its drhs a
        `ragged_dot_tgmm`, each with its own configs) on the same backend.

    Quantized weights: ``rhs`` may be a `stellax.QArray` ``[G, K, N]``
    quantized along axis 1 (K) in int8/int8_asym/int4/int4_asym/fp8_e4m3/
    fp8_e5m2/mxfp8_*/mxfp4/nvfp4 (no gated rhs); decoding is fused into the
    Mosaic TPU and Triton kernels' K loop (same implementations and config
    types), gradients flow to ``lhs`` only (the weights are frozen). See
    `stellax.ops.moe.quantized` and docs/moe.md.

    Returns:
      ``[M, N]`` in ``preferred_element_type``.

    Data-dependent checks (values under ``jit``; eagerly they raise `ValueError`): in checked mode
    (`stellax.checked`, ``STELLAX_CHECKS=1``) each is a ``checkify`` check naming the argument and
    the bad value; without checks, the result documented above:

    * ``group_sizes`` non-negative — else a negative size counts as 0;
    * ``sum(group_sizes) <= M`` — else the group running past row M is cut at M;
    * ``0 <= group_offset <= len(group_sizes) - G`` — else every element of the result is NaN.
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
    `stellax.core.precision`).

    Data-dependent checks, as for `ragged_dot` (checked mode: ``checkify`` checks naming the
    argument; without: the documented result): negative ``group_sizes`` count as 0, a group
    running past row M is cut at M, and a ``group_offset`` outside ``[0, len(group_sizes) -
    num_local_groups]`` makes the whole ``[G, K, N]`` result NaN.

    ``implementation``: ``None`` (the best available), ``"mosaic_tpu"``
    (config: `TpuGroupedMatmulConfig`), ``"triton"`` (`GroupedMatmulConfig`),
    ``"xla"`` (`XlaGroupedMatmulConfig`) or a sequence tried in order. The
    backward is two `ragged_dot` calls on the same backend."""
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

    ``implementation`` and ``config`` as for `ragged_dot` (forward layouts) and
    `ragged_dot_tgmm` (tgmm layouts): ``"mosaic_tpu"`` (`TpuGroupedMatmulConfig`),
    ``"triton"`` (`GroupedMatmulConfig`), ``"xla"`` (`XlaGroupedMatmulConfig`).
    Data-dependent checks (``group_sizes``, ``group_offset``) and their unchecked results: as for
    `ragged_dot`.
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
