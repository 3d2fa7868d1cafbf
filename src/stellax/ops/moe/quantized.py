"""`ragged_dot` with quantized expert weights: ``rhs`` a `QArray` ``[G, K, N]``.

Convention (the one `quantized_matmul` uses for ``w [K, N]``, with the expert
axis in front): the weights are quantized along **axis 1, the contraction
axis K** — ``stellax.quantize(w, fmt, axis=1, block_size=...)`` on
``w [G, K, N]``. Blocks have size 1 along G; along K a block (per channel =
the whole K, or 16/32/64/128/... elements) and along N 1 (or the N side of a
2-D block such as fp8 ``(128, 128)`` or nvfp4 ``(16, 16)``). 4-bit codes are
packed two per byte along K. Formats: every weight format of
`quantized_matmul` (int8, int8_asym, int4, int4_asym, fp8_e4m3, fp8_e5m2,
mxfp8_e4m3, mxfp8_e5m2, mxfp4, nvfp4); activations float32/bfloat16/float16.

Golden: ``dequantize(rhs)`` in float32, then the float32 `ragged_dot` golden.

* ``triton``: the grouped-matmul tile schedule of `triton.py`; in the K loop
  each step loads the codes of ``rhs[g]`` (``[block_k, block_n]``, or
  ``[block_k/2, block_n]`` bytes for 4-bit), decodes them in registers to the
  activation dtype (minus zero points), and multiplies the float32 partial
  product by the step's scale row (blocked scales: ``block_k`` is capped at
  the K block so one step has one scale row) — or, per channel, the
  accumulator once in the epilogue; the NVFP4 tensor scale is applied in the
  epilogue, before the activation. No dequantized weight is ever written.
* ``xla``: the row-tile loop of `xla.py`; each tile dequantizes only its own
  expert ``rhs[g]`` (``[K, N]`` in the activation dtype) — never all experts
  at once. (The work is repeated per tile of a group: the XLA path is the
  portable fallback, not the fast one.)

Gradients: only w.r.t. ``lhs``. Quantized weights are frozen; the cotangents
of the QArray's arrays are zero (``None`` in the custom VJP).
``dlhs = dz @ dequantize(rhs[g])^T`` runs for **both** implementations in
the XLA per-tile-dequantize loop (transposed contraction); the Triton kernel
has no transposed-rhs decode yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ...core import Call, Example, Implementation, Op, checks, product_space, register
from ...core.pallas import triton_call
from ..quant import formats as QF
from ..quant.kernel import decode_codes, decode_packed_pairs, decode_scale, kernel_operands
from ..quant.qarray import QArray
from ..quant.reference import dequantize_reference
from .activations import activation_fn, activation_grad, check_activation, fusable_in_kernel, kernel_activation_fn
from .checks import (check_groups, check_out_dtype, check_precision,
                     kernel_precision)
from .configs import GroupedMatmulConfig, XlaGroupedMatmulConfig, _cap, _xla_block, xla_space
from .reference import ragged_dot_reference
from .schedule import group_bounds, tile_schedule
from .triton import OutputTile, _iota

FAMILY = "moe"
FORMATS = ("int8", "int8_asym", "int4", "int4_asym", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4",
           "nvfp4")
_ARRAYS = ("rhs_values", "rhs_scales", "rhs_zero_points", "rhs_tensor_scale")


# -- argument checks ------------------------------------------------------------------
def _check(lhs, rhs_values, rhs_scales, rhs_zero_points, rhs_tensor_scale, group_sizes, precision=None,
           preferred_element_type=None, group_offset=None, *, rhs_format, rhs_shape, rhs_block_shape, rhs_axis,
           rhs_rotation=None, activation=None) -> Call:
    lhs = checks.require_float("lhs", lhs)
    checks.require_ndim("lhs", lhs, 2)
    rhs = QArray(rhs_values, rhs_scales, rhs_zero_points, rhs_tensor_scale, format=rhs_format, shape=rhs_shape,
                 block_shape=rhs_block_shape, axis=rhs_axis, rotation=rhs_rotation)
    if rhs.format not in FORMATS:
        raise ValueError(f"rhs: unsupported QArray format {rhs.format!r} for ragged_dot; "
                         f"expected one of {list(FORMATS)}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs: expected a rank-3 QArray [G, K, N] (gated [G, K, 2, N] and transpose_rhs are not "
                         f"supported quantized), got shape {rhs.shape}")
    if rhs.axis != 1:
        raise ValueError(f"rhs: expected a QArray quantized along axis 1 (K, the contraction axis of [G, K, N]), got "
                         f"axis {rhs.axis}; quantize the weights with axis=1")
    if rhs.block_shape[0] != 1:
        raise ValueError(f"rhs: expected blocks of size 1 along the group axis, got block_shape {rhs.block_shape}")
    if rhs.rotation is not None:
        raise ValueError("rhs: QArray quantized with rotate=... is not supported by ragged_dot (lhs would need the "
                         "same Hadamard rotation); quantize without rotate")
    k = lhs.shape[1]
    if rhs.shape[1] != k:
        raise ValueError(f"rhs: expected shape [G, {k}, N] (K = lhs.shape[1]), got {rhs.shape}")
    num_local = rhs.shape[0]
    group_sizes, group_offset = check_groups(group_sizes, group_offset, num_local, lhs.shape[0], "lhs.shape[0]")
    activation = check_activation(activation)
    return Call(
        {"lhs": lhs, "rhs_values": rhs.values, "rhs_scales": rhs.scales, "rhs_zero_points": rhs.zero_points,
         "rhs_tensor_scale": rhs.tensor_scale, "group_sizes": group_sizes, "group_offset": group_offset},
        {"precision": check_precision(precision), "out_dtype": check_out_dtype(preferred_element_type, lhs.dtype),
         "activation": activation, "rhs_format": rhs.format, "rhs_shape": rhs.shape,
         "rhs_block_shape": rhs.block_shape, "rhs_axis": rhs.axis, "rhs_rotation": rhs.rotation},
    )


def rhs_of(call: Call) -> QArray:
    return QArray(*(call.arrays[n] for n in _ARRAYS), format=call.rhs_format, shape=call.rhs_shape,
                  block_shape=call.rhs_block_shape, axis=call.rhs_axis, rotation=call.rhs_rotation, _validate=False)


def _k_block(call: Call) -> int | None:
    """The K block of the scales, or None when per channel (one scale row)."""
    return None if rhs_of(call).scales.shape[1] == 1 else call.rhs_block_shape[1]


def flatten(lhs, rhs: QArray, group_sizes, precision, preferred_element_type, group_offset, activation):
    """``(args, kwargs)`` of `ragged_dot_quantized_op`."""
    args = (lhs, rhs.values, rhs.scales, rhs.zero_points, rhs.tensor_scale, group_sizes, precision,
            preferred_element_type, group_offset)
    kwargs = {"rhs_format": rhs.format, "rhs_shape": rhs.shape, "rhs_block_shape": rhs.block_shape,
              "rhs_axis": rhs.axis, "rhs_rotation": rhs.rotation, "activation": activation}
    return args, kwargs


# -- golden ----------------------------------------------------------------------------
def reference(call: Call):
    rhs = dequantize_reference(rhs_of(call), jnp.float32)
    return ragged_dot_reference(Call(
        {"lhs": call.lhs, "rhs": rhs, "group_sizes": call.group_sizes, "group_offset": call.group_offset},
        {"precision": call.precision, "out_dtype": call.out_dtype, "activation": call.activation,
         "transpose_rhs": False}))


# -- XLA: dequantize one expert per row tile -----------------------------------------------
def _expert(rhs: QArray, g, dtype):
    """``dequantize(rhs[g])`` ``[K, N]`` in ``dtype`` (``g`` traced)."""
    pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, g, 0, keepdims=False)  # noqa: E731
    one = QArray(pick(rhs.values), pick(rhs.scales), pick(rhs.zero_points), rhs.tensor_scale, format=rhs.format,
                 shape=rhs.shape[1:], block_shape=rhs.block_shape[1:], axis=0, _validate=False)
    return dequantize_reference(one, dtype)


def xla_gmm(lhs, rhs: QArray, group_sizes, group_offset, *, transpose: bool, precision, out_dtype, block_m: int):
    """Pre-activation ``z [M, N]`` (``transpose``: ``lhs [M, N] @ rhs[g]^T → [M, K]``)
    with zeros outside the local groups."""
    m = lhs.shape[0]
    num_local, k, n = rhs.shape
    precision = kernel_precision(precision, lhs.dtype)
    width = k if transpose else n
    contracting = ((1,), (1,)) if transpose else ((1,), (0,))
    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    sched = tile_schedule(bounds, m, block_m, fill=False)
    padded = jnp.pad(lhs, ((0, block_m), (0, 0)))

    def body(t, out):
        start = sched.start[t]
        tile = jax.lax.dynamic_slice_in_dim(padded, start, block_m, 0)
        weight = _expert(rhs, sched.group[t], lhs.dtype)
        z = jax.lax.dot_general(tile, weight, (contracting, ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out, z.astype(out.dtype), start, 0)

    out = jax.lax.fori_loop(0, sched.count, body, jnp.zeros((m + block_m, width), out_dtype))
    rows = jnp.arange(m)[:, None]
    return jnp.where((rows >= bounds.begin) & (rows < bounds.end), out[:m], 0).astype(out_dtype)


# -- Triton: decode in the K loop ------------------------------------------------------------
def _quantized_refs(refs, has_zp: bool, has_ts: bool):
    """``(group, start, rows, activations, codes, scales, zero points?, tensor scale?, out)``
    refs of the quantized kernels, in launch order (``None`` when absent)."""
    refs = list(refs)
    fixed, rest = refs[:6], refs[6:]
    zp_ref = rest.pop(0) if has_zp else None
    ts_ref = rest.pop(0) if has_ts else None
    return (*fixed, zp_ref, ts_ref, rest.pop(0))


def _gmm_q_kernel(*refs, bm, bn, bk, k_dim, n_dim, fmt, packed, in_loop, group_k, has_zp, has_ts, activation,
                  compute_dtype, precision):
    group_ref, start_ref, rows_ref, lhs_ref, v_ref, s_ref, zp_ref, ts_ref, out_ref = _quantized_refs(
        refs, has_zp, has_ts)
    group, rows, row_ok, col0, col_ok, out_mask, row_block, col_block = OutputTile.of(
        group_ref, start_ref, rows_ref, bm=bm, width=bn, n_cols=n_dim)
    kp = (k_dim + 1) // 2

    def scale_row(ref, kb):  # [1, bn] of the step's K block
        return pltriton.load(ref.at[group, pl.ds(kb, 1), col_block], mask=col_ok[None, :],
                             other=jnp.zeros((), ref.dtype))

    @pl.when((rows > 0) & (group >= 0))
    def _compute():
        def step(kb, acc):
            k0 = kb * bk
            k_ok = k0 + _iota(bk) < k_dim
            a = pltriton.load(lhs_ref.at[row_block, pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :],
                              other=0.0).astype(compute_dtype)
            sb = k0 // group_k if in_loop else 0
            zp = scale_row(zp_ref, sb).astype(jnp.float32) if has_zp else None
            if packed:  # bytes [bk/2, bn], two K codes per byte
                kb_ok = k0 // 2 + _iota(bk // 2) < kp
                codes = pltriton.load(v_ref.at[group, pl.ds(k0 // 2, bk // 2), col_block],
                                      mask=kb_ok[:, None] & col_ok[None, :], other=jnp.zeros((), v_ref.dtype))
                w = decode_packed_pairs(codes.T, fmt)  # [bn, bk], K in element order
                if zp is not None:
                    w = w - zp.T
                part = jax.lax.dot_general(a, w.astype(compute_dtype), (((1,), (1,)), ((), ())),
                                           precision=precision, preferred_element_type=jnp.float32)
            else:
                codes = pltriton.load(v_ref.at[group, pl.ds(k0, bk), col_block],
                                      mask=k_ok[:, None] & col_ok[None, :], other=jnp.zeros((), v_ref.dtype))
                w = decode_codes(codes, fmt)
                if zp is not None:
                    w = w - zp
                part = jax.lax.dot_general(a, w.astype(compute_dtype), (((1,), (0,)), ((), ())),
                                           precision=precision, preferred_element_type=jnp.float32)
            if in_loop:
                part = part * decode_scale(scale_row(s_ref, sb))
            return acc + part

        acc = jax.lax.fori_loop(0, pl.cdiv(k_dim, bk), step, jnp.zeros((bm, bn), jnp.float32))
        if not in_loop:
            acc = acc * decode_scale(scale_row(s_ref, 0))
        if has_ts:
            acc = acc * pltriton.load(ts_ref.at[pl.ds(0, 1)]).reshape(1, 1)
        y = kernel_activation_fn(activation)(acc)
        pltriton.store(out_ref.at[row_block, col_block], y.astype(out_ref.dtype), mask=out_mask)

    @pl.when((rows > 0) & (group < 0))
    def _zero_fill():
        pltriton.store(out_ref.at[row_block, col_block], jnp.zeros((bm, bn), out_ref.dtype), mask=out_mask)


def effective_block_k(config: GroupedMatmulConfig, k_block: int | None) -> int:
    """``block_k`` capped at the scales' K block, so a step reads one scale row."""
    return config.block_k if k_block is None else min(config.block_k, k_block)


def triton_gmm(lhs, rhs: QArray, group_sizes, group_offset, *, activation, precision, out_dtype, k_block,
               config: GroupedMatmulConfig):
    """``act(lhs @ dequantize(rhs[g]))`` per group, zeros outside the local groups;
    ``activation`` must be None or fusable."""
    m, k = lhs.shape
    num_local, _, n = rhs.shape
    ops = kernel_operands(rhs)
    bm, bn = config.block_m, config.block_n
    bk = effective_block_k(config, k_block)
    compute_dtype = lhs.dtype
    precision = kernel_precision(precision, lhs.dtype)
    sched = tile_schedule(group_bounds(group_sizes, group_offset, num_local, m), m, bm, fill=True)
    inputs = [sched.group, sched.start, sched.rows, lhs, ops.values, ops.scales]
    inputs += [a for a in (ops.zero_points, ops.tensor_scale) if a is not None]
    kernel = functools.partial(
        _gmm_q_kernel, bm=bm, bn=bn, bk=bk, k_dim=k, n_dim=n, fmt=rhs.format, packed=ops.packed,
        in_loop=k_block is not None, group_k=k_block or k, has_zp=ops.zero_points is not None,
        has_ts=ops.tensor_scale is not None, activation=activation, compute_dtype=compute_dtype,
        precision=precision)
    full = pl.BlockSpec()
    return triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(sched.max_tiles, pl.cdiv(n, bn)),
        in_specs=[full] * len(inputs), out_specs=full, num_warps=config.num_warps, num_stages=config.num_stages,
        name="stellax_ragged_dot_quantized",
    )(*inputs)


def _gmm_qt_kernel(*refs, bm, bo, bc, k_dim, n_dim, fmt, packed, group_k, has_zp, has_ts, compute_dtype,
                   precision):
    """dlhs: ``out[rows, K-block] = dz[rows, :] @ W[g][K-block, :]^T`` with ``W`` decoded
    in registers. The output K block (``bo`` ≤ the scales' K block) has one
    scale row, which varies along the contraction (N), so the scales multiply
    the decoded weight tile before the dot."""
    group_ref, start_ref, rows_ref, dz_ref, v_ref, s_ref, zp_ref, ts_ref, out_ref = _quantized_refs(
        refs, has_zp, has_ts)
    # The output tile spans ``bo`` columns of K.
    group, rows, row_ok, k0, ko_ok, out_mask, row_block, ko_block = OutputTile.of(
        group_ref, start_ref, rows_ref, bm=bm, width=bo, n_cols=k_dim)
    sb = k0 // group_k
    kp = (k_dim + 1) // 2

    @pl.when((rows > 0) & (group >= 0))
    def _compute():
        def step(cb, acc):
            c0 = cb * bc
            c_ok = c0 + _iota(bc) < n_dim
            a = pltriton.load(dz_ref.at[row_block, pl.ds(c0, bc)], mask=row_ok[:, None] & c_ok[None, :],
                              other=0.0).astype(compute_dtype)
            s = decode_scale(pltriton.load(s_ref.at[group, pl.ds(sb, 1), pl.ds(c0, bc)], mask=c_ok[None, :],
                                           other=jnp.zeros((), s_ref.dtype)))  # [1, bc]
            zp = None
            if has_zp:
                zp = pltriton.load(zp_ref.at[group, pl.ds(sb, 1), pl.ds(c0, bc)], mask=c_ok[None, :],
                                   other=jnp.zeros((), zp_ref.dtype)).astype(jnp.float32)
            if packed:  # bytes [bo/2, bc] → [bc, bo]
                kb_ok = k0 // 2 + _iota(bo // 2) < kp
                codes = pltriton.load(v_ref.at[group, pl.ds(k0 // 2, bo // 2), pl.ds(c0, bc)],
                                      mask=kb_ok[:, None] & c_ok[None, :], other=jnp.zeros((), v_ref.dtype))
                w = decode_packed_pairs(codes.T, fmt)
                if zp is not None:
                    w = w - zp.T
                w = w * s.T  # [bc, bo]
                dims = (((1,), (0,)), ((), ()))
            else:
                codes = pltriton.load(v_ref.at[group, ko_block, pl.ds(c0, bc)],
                                      mask=ko_ok[:, None] & c_ok[None, :], other=jnp.zeros((), v_ref.dtype))
                w = decode_codes(codes, fmt)
                if zp is not None:
                    w = w - zp
                w = w * s  # [bo, bc]
                dims = (((1,), (1,)), ((), ()))
            return acc + jax.lax.dot_general(a, w.astype(compute_dtype), dims, precision=precision,
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, pl.cdiv(n_dim, bc), step, jnp.zeros((bm, bo), jnp.float32))
        if has_ts:
            acc = acc * pltriton.load(ts_ref.at[pl.ds(0, 1)]).reshape(1, 1)
        pltriton.store(out_ref.at[row_block, ko_block], acc.astype(out_ref.dtype), mask=out_mask)

    @pl.when((rows > 0) & (group < 0))
    def _zero_fill():
        pltriton.store(out_ref.at[row_block, ko_block], jnp.zeros((bm, bo), out_ref.dtype), mask=out_mask)


def triton_gmm_transposed(dz, rhs: QArray, group_sizes, group_offset, *, precision, out_dtype, k_block,
                          config: GroupedMatmulConfig):
    """``dlhs [M, K]``: ``dz [M, N] @ dequantize(rhs[g])^T`` per group (zeros outside).
    Output K blocks of ``min(block_n, K block)``, contraction steps of ``block_k``."""
    m, n = dz.shape
    num_local, k, _ = rhs.shape
    ops = kernel_operands(rhs)
    bm, bc = config.block_m, config.block_k
    bo = config.block_n if k_block is None else min(config.block_n, k_block)
    precision = kernel_precision(precision, dz.dtype)
    sched = tile_schedule(group_bounds(group_sizes, group_offset, num_local, m), m, bm, fill=True)
    inputs = [sched.group, sched.start, sched.rows, dz, ops.values, ops.scales]
    inputs += [a for a in (ops.zero_points, ops.tensor_scale) if a is not None]
    kernel = functools.partial(
        _gmm_qt_kernel, bm=bm, bo=bo, bc=bc, k_dim=k, n_dim=n, fmt=rhs.format, packed=ops.packed,
        group_k=k_block or k, has_zp=ops.zero_points is not None, has_ts=ops.tensor_scale is not None,
        compute_dtype=dz.dtype, precision=precision)
    full = pl.BlockSpec()
    return triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, k), out_dtype), grid=(sched.max_tiles, pl.cdiv(k, bo)),
        in_specs=[full] * len(inputs), out_specs=full, num_warps=config.num_warps, num_stages=config.num_stages,
        name="stellax_ragged_dot_quantized_dlhs",
    )(*inputs)


# -- implementations ------------------------------------------------------------------------
def _runner(name: str):
    def run(call: Call, config):
        rhs0 = rhs_of(call)
        m = call.lhs.shape[0]
        act_name = call.activation
        k_block = _k_block(call)
        options = dict(precision=call.precision, out_dtype=call.out_dtype)

        def pre(lhs, rhs):  # pre-activation (no activation applied)
            if name == "xla":
                return xla_gmm(lhs, rhs, call.group_sizes, call.group_offset, transpose=False,
                               block_m=config.block_m, **options)
            return triton_gmm(lhs, rhs, call.group_sizes, call.group_offset, activation=None, k_block=k_block,
                              config=config, **options)

        def finish(z):  # XLA activation of the pre-activation, zero outside the groups
            if act_name is None:
                return z
            bounds = group_bounds(call.group_sizes, call.group_offset, rhs0.shape[0], m)
            rows = jnp.arange(m)[:, None]
            y = activation_fn(act_name)(z.astype(jnp.float32))
            return jnp.where((rows >= bounds.begin) & (rows < bounds.end), y, 0.0).astype(call.out_dtype)

        @jax.custom_vjp
        def grouped(lhs, rhs):
            if name == "triton" and (act_name is None or fusable_in_kernel(act_name)):
                return triton_gmm(lhs, rhs, call.group_sizes, call.group_offset, activation=act_name,
                                  k_block=k_block, config=config, **options)
            return finish(pre(lhs, rhs))

        def forward(lhs, rhs):
            z = pre(lhs, rhs)
            return finish(z), (rhs, z if act_name is not None else None)

        def backward(residuals, dy):
            rhs, z = residuals
            dz = dy if z is None else activation_grad(act_name, dy, z, False)
            dz = dz.astype(call.lhs.dtype)
            if name == "triton":
                dlhs = triton_gmm_transposed(dz, rhs, call.group_sizes, call.group_offset, precision=call.precision,
                                             out_dtype=call.lhs.dtype, k_block=k_block, config=config)
            else:
                dlhs = xla_gmm(dz, rhs, call.group_sizes, call.group_offset, transpose=True,
                               precision=call.precision, out_dtype=call.lhs.dtype, block_m=config.block_m)
            return dlhs, None  # frozen quantized weights: zero cotangents

        grouped.defvjp(forward, backward)
        return grouped(call.lhs, rhs0)
    return run


def _triton_requirements(call: Call) -> str | None:
    if np.dtype(call.lhs.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"the Triton kernel needs float32/bfloat16/float16 lhs, got {np.dtype(call.lhs.dtype).name}"
    kb = _k_block(call)
    if kb is not None and (kb < 16 or kb & (kb - 1)):
        return (f"the Triton kernel needs per-channel scales or K blocks that are powers of two >= 16 "
                f"(block_k is capped at the K block); rhs has K blocks of {kb}")
    return None


def _dims(call: Call):
    g, k, n = call.rhs_shape
    return call.lhs.shape[0], k, n, g


def heuristic(call: Call) -> GroupedMatmulConfig:
    m, k, n, g = _dims(call)
    rows_per_group = max(1, m // max(g, 1))
    bm = _cap(16 if rows_per_group <= 16 else 32 if rows_per_group <= 32 else 64, m)
    bn = _cap(128, n)
    bk = _cap(64, k)
    return GroupedMatmulConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4 if bm * bn < 64 * 128 else 8,
                               num_stages=3)


def space(call: Call) -> list[GroupedMatmulConfig]:
    """A modest space: the effective block_k is capped at the K block, so
    configs that collapse to the same kernel are dropped."""
    m, k, n, _ = _dims(call)
    kb = _k_block(call)
    out, seen = [], set()
    for c in product_space(GroupedMatmulConfig, block_m=(16, 64), block_n=(64, 128), block_k=(32, 64),
                           num_warps=(4,), num_stages=(3,)):
        if c.block_m > _cap(64, m) or c.block_n > _cap(128, n) or c.block_k > _cap(64, k):
            continue
        key = (c.block_m, c.block_n, effective_block_k(c, kb))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out or [heuristic(call)]


def xla_heuristic(call: Call) -> XlaGroupedMatmulConfig:
    m, _, _, g = _dims(call)
    return _xla_block(m, g)


def _flops(call: Call) -> float:
    m, k, n, _ = _dims(call)
    return 2.0 * m * k * n


def _bytes(call: Call) -> float:
    m, k, n, _ = _dims(call)
    weights = sum(float(np.prod(call.arrays[a].shape)) * np.dtype(call.arrays[a].dtype).itemsize
                  for a in _ARRAYS if call.arrays[a] is not None)
    return float(m * k * np.dtype(call.lhs.dtype).itemsize + weights + m * n * np.dtype(call.out_dtype).itemsize)


EXAMPLE_FORMATS = (("int8", "channel"), ("int8", 32), ("int8_asym", 64), ("int4", 32), ("int4_asym", 64),
                   ("fp8_e4m3", "channel"), ("fp8_e4m3", 128), ("fp8_e5m2", 32), ("mxfp8_e4m3", 32),
                   ("mxfp4", 32), ("nvfp4", 16))


def example_weights(key, g, k, n, fmt, block):
    from ..quant.quantize import quantize
    w = jax.random.normal(key, (g, k, n), jnp.float32) / np.sqrt(k)
    return quantize(w, fmt, axis=1, block_size=block)


def _examples(dtype):
    out = []
    for i, (fmt, block) in enumerate(EXAMPLE_FORMATS[::3] + (("nvfp4", 16),)):
        keys = jax.random.split(jax.random.PRNGKey(300 + i), 2)
        lhs = jax.random.normal(keys[0], (40, 160), jnp.float32).astype(dtype)
        rhs = example_weights(keys[1], 3, 160, 40, fmt, block)
        args, kwargs = flatten(lhs, rhs, jnp.asarray([13, 0, 20], jnp.int32), None, None, None, None)
        out.append(Example(f"{fmt} ({block}) M=40 K=160 N=40 G=3", args, kwargs))
    return out


def _benchmarks(platform):
    from ..quant.base import resolve_block_shape
    from ..quant.quantize import quantize_op
    cpu = platform.backend == "cpu"
    m, k, n, g = (2048, 512, 512, 8) if cpu else (16384, 7168, 2048, 64)
    dtype = jnp.float32 if cpu else jnp.bfloat16
    out = []
    for fmt, block in (("fp8_e4m3", "channel"), ("fp8_e4m3", 128), ("int4", 128), ("nvfp4", 16)):
        f = QF.get_format(fmt)
        bs = resolve_block_shape(f, (g, k, n), 1, block)
        q = jax.eval_shape(lambda a: quantize_op(a, format=fmt, axis=1, block_shape=bs),
                           jax.ShapeDtypeStruct((g, k, n), jnp.float32))
        sizes = np.full(g, m // g)
        args, kwargs = flatten(jax.ShapeDtypeStruct((m, k), dtype), q, jnp.asarray(sizes, jnp.int32), None, None,
                               None, None)
        out.append(Example(f"{fmt} ({block}) M={m} K={k} N={n} G={g}", args, kwargs))
    return out


def _peer_bf16(lhs, rhs_values, *args, rhs_shape, **kwargs):
    """Unquantized ``jax.lax.ragged_dot`` of the same shape (the speed baseline)."""
    sizes = args[3]
    return jax.lax.ragged_dot(lhs, jnp.ones(rhs_shape, lhs.dtype), sizes)


ragged_dot_quantized_op = register(Op(
    "ragged_dot_quantized", family=FAMILY, check=_check, reference=reference,
    implementations=[
        Implementation("triton", _runner("triton"), backend="triton", config_type=GroupedMatmulConfig,
                       heuristic=heuristic, space=space, requirements=_triton_requirements),
        Implementation("xla", _runner("xla"), config_type=XlaGroupedMatmulConfig, heuristic=xla_heuristic,
                       space=xla_space),
    ],
    flops=_flops, bytes_accessed=_bytes, examples=_examples, benchmarks=_benchmarks,
    peers={"jax.lax.ragged_dot (unquantized)": _peer_bf16}, differentiable=("lhs",),
))


def ragged_dot_quantized(lhs, rhs: QArray, group_sizes, precision=None, preferred_element_type=None,
                         group_offset=None, *, activation=None, implementation=None, config=None):
    """`ragged_dot` with a `QArray` ``rhs [G, K, N]`` quantized along axis 1 (see the module doc)."""
    args, kwargs = flatten(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset, activation)
    return ragged_dot_quantized_op(*args, **kwargs, implementation=implementation, config=config)
