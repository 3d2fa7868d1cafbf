"""Argument checks of the grouped-matmul ops: the shared pieces (groups,
precision, output dtype) and each op's ``check`` (`ragged_dot`,
`ragged_dot_tgmm`, `ragged_dot_backward`, the quantized `ragged_dot` with its
`QArray` flattened into named arrays)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.precision import resolve_precision
from ...core.runtime_checks import require
from ..quant.qarray import QArray
from .activations import check_activation
from .configs import gmm_dims

_OUT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


#: ``value`` as a numpy array when it is concrete (not traced), else None.
concrete = checks.concrete_values


def reject_expert_ids(expert_ids, num_experts: int, bound: str) -> None:
    """Concrete (eager) ``expert_ids [T, k]``: raise on the first id outside ``[0, num_experts)``;
    ``bound`` names where ``num_experts`` comes from. Traced ids are left to the op's documented
    result and its checked-mode `require`."""
    ids = checks.concrete_values(expert_ids)
    if ids is None:
        return
    bad = np.argwhere((ids < 0) | (ids >= num_experts))
    if bad.size:
        t, j = (int(i) for i in bad[0])
        raise ValueError(f"expert_ids[{t}, {j}]: expected an expert in [0, {num_experts}) ({bound}), "
                         f"got {int(ids[t, j])}")


def check_out_dtype(preferred_element_type, default):
    """``preferred_element_type`` (default ``default``) as a float32/bfloat16/float16 numpy dtype."""
    if preferred_element_type is None:
        return np.dtype(default)
    try:
        dtype = np.dtype(preferred_element_type)
    except TypeError as e:
        raise TypeError(f"preferred_element_type: expected a floating dtype, got {preferred_element_type!r}") from e
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"preferred_element_type: expected one of {[d.name for d in _OUT_DTYPES]}, got {dtype.name}")
    return dtype


def check_group_sizes(group_sizes, num_groups: int | None, *, at_least: int | None = None):
    """1-D integer ``group_sizes`` (int32), of length ``num_groups`` or ≥ ``at_least``."""
    group_sizes = checks.as_array("group_sizes", group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes: expected an integer dtype, got {np.dtype(group_sizes.dtype).name}")
    checks.require_ndim("group_sizes", group_sizes, 1)
    length = group_sizes.shape[0]
    if num_groups is not None and length != num_groups:
        raise ValueError(f"group_sizes: expected length {num_groups} (the number of groups of rhs), got {length}")
    if at_least is not None and length < at_least:
        raise ValueError(f"group_sizes: expected length >= {at_least} (the local groups of rhs), got {length}")
    if length == 0:
        raise ValueError("group_sizes: expected at least one group, got length 0")
    if isinstance(group_sizes, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(group_sizes.shape, jnp.int32)
    return group_sizes if group_sizes.dtype == jnp.int32 else jnp.asarray(group_sizes, jnp.int32)


def check_group_offset(group_offset):
    """``None``, an int or an integer array of shape ``()``/``(1,)`` → int32 scalar."""
    if group_offset is None:
        return None
    if isinstance(group_offset, (bool, np.bool_)):
        raise TypeError("group_offset: expected an int or an integer array, got bool")
    if isinstance(group_offset, (int, np.integer)):
        return jnp.asarray(group_offset, jnp.int32)
    group_offset = checks.as_array("group_offset", group_offset)
    if not jnp.issubdtype(group_offset.dtype, jnp.integer):
        raise TypeError(f"group_offset: expected an integer dtype, got {np.dtype(group_offset.dtype).name}")
    if tuple(group_offset.shape) not in ((), (1,)):
        raise ValueError(f"group_offset: expected shape () or (1,), got {tuple(group_offset.shape)}")
    if isinstance(group_offset, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((), jnp.int32)
    return jnp.asarray(group_offset, jnp.int32).reshape(())


def require_group_values(group_sizes, group_offset, num_local: int, rows: int, rows_name: str) -> None:
    """Checked mode (`stellax.checked`): the value checks of `check_group_values` as ``checkify``
    checks, for traced values (nothing is added to the program with checks off)."""
    sizes = group_sizes.astype(jnp.int32)
    first_negative = lambda: jnp.argmax(sizes < 0)
    require(lambda: jnp.all(sizes >= 0), "group_sizes: expected non-negative sizes, got {size} at index {index}",
            size=lambda: sizes[first_negative()], index=first_negative)
    require(lambda: jnp.sum(jnp.clip(sizes, 0, rows + 1)) <= rows,
            f"group_sizes: expected sum(group_sizes) <= {rows} ({rows_name}), got {{total}}",
            total=lambda: jnp.sum(jnp.maximum(sizes, 0)))
    if group_offset is not None:
        high = group_sizes.shape[0] - num_local
        offset = group_offset.astype(jnp.int32)
        require(lambda: (offset >= 0) & (offset <= high),
                f"group_offset: expected a value in [0, {high}] (len(group_sizes) - local groups), got {{offset}}",
                offset=lambda: offset)


def check_group_values(group_sizes, group_offset, num_local: int, rows: int, rows_name: str) -> None:
    """Eager value checks (raise `ValueError`); traced values are checked only in checked mode
    (`require_group_values`), else sizes are clamped (`schedule.group_bounds`) and an
    out-of-range offset gives NaN (`schedule.poison_bad_offset`)."""
    sizes = concrete(group_sizes)
    if sizes is not None:
        if (sizes < 0).any():
            raise ValueError(f"group_sizes: expected non-negative sizes, got {sizes.tolist()}")
        total = int(sizes.astype(np.int64).sum())
        if total > rows:
            raise ValueError(f"group_sizes: expected sum(group_sizes) <= {rows} ({rows_name}), got {total}")
    offset = concrete(group_offset)
    if offset is not None and group_sizes is not None:
        length = group_sizes.shape[0]
        if not 0 <= int(offset) <= length - num_local:
            raise ValueError(f"group_offset: expected a value in [0, {length - num_local}] "
                             f"(len(group_sizes) - local groups), got {int(offset)}")
    if not isinstance(group_sizes, jax.ShapeDtypeStruct) and not isinstance(group_offset, jax.ShapeDtypeStruct):
        require_group_values(group_sizes, group_offset, num_local, rows, rows_name)


def check_groups(group_sizes, group_offset, num_local: int, rows: int, rows_name: str):
    """The groups of a grouped matmul over ``num_local`` local groups:
    ``(group_sizes int32, group_offset int32 scalar or None)``. Without an
    offset there is one size per local group; with one, ``group_sizes``
    covers every group (at least ``num_local``) and the local ones start at
    ``group_offset``. Sizes are checked against the ``rows`` (``rows_name``)."""
    group_offset = check_group_offset(group_offset)
    if group_offset is None:
        group_sizes = check_group_sizes(group_sizes, num_local)
    else:
        group_sizes = check_group_sizes(group_sizes, None, at_least=num_local)
    check_group_values(group_sizes, group_offset, num_local, rows, rows_name)
    return group_sizes, group_offset


# -- ragged_dot, ragged_dot_tgmm, ragged_dot_backward ------------------------------------
def _check_rhs(lhs, rhs, transpose_rhs: bool):
    checks.require_same_dtype("rhs", rhs, "lhs", lhs)
    k = lhs.shape[1]
    if transpose_rhs:
        checks.require_ndim("rhs", rhs, 3)
        checks.require_shape("rhs", rhs, (None, None, k), "G, N, lhs.shape[1] (transpose_rhs)")
    else:
        checks.require_ndim("rhs", rhs, (3, 4))
        if rhs.ndim == 3:
            checks.require_shape("rhs", rhs, (None, k, None), "G, lhs.shape[1], N")
        else:
            checks.require_shape("rhs", rhs, (None, k, 2, None), "G, lhs.shape[1], 2, N (gated)")


def check_ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                     activation=None, transpose_rhs=False) -> Call:
    """`ragged_dot`: ``lhs [M, K]``, ``rhs [G, K, N]`` / ``[G, K, 2, N]`` (gated) /
    ``[G, N, K]`` (``transpose_rhs``), same float dtype; the groups of `check_groups`."""
    lhs = checks.require_float("lhs", lhs)
    checks.require_ndim("lhs", lhs, 2)
    rhs = checks.require_float("rhs", rhs)
    if not isinstance(transpose_rhs, bool):
        raise TypeError(f"transpose_rhs: expected a bool, got {type(transpose_rhs).__name__}")
    _check_rhs(lhs, rhs, transpose_rhs)
    num_local = rhs.shape[0]
    group_sizes, group_offset = check_groups(group_sizes, group_offset, num_local, lhs.shape[0], "lhs.shape[0]")
    return Call(
        {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes, "group_offset": group_offset},
        {"precision": resolve_precision(precision),
         "out_dtype": check_out_dtype(preferred_element_type, lhs.dtype),
         "activation": check_activation(activation), "transpose_rhs": transpose_rhs},
    )


def _check_num_local_groups(num_local_groups, group_sizes, group_offset) -> int:
    if num_local_groups is None:
        if group_offset is not None:
            raise ValueError("num_local_groups: required with group_offset (the number of groups this shard holds)")
        num_local_groups = group_sizes.shape[0]
    if isinstance(num_local_groups, bool) or not isinstance(num_local_groups, (int, np.integer)):
        raise TypeError(f"num_local_groups: expected an int, got {type(num_local_groups).__name__}")
    if not 1 <= num_local_groups <= group_sizes.shape[0]:
        raise ValueError(f"num_local_groups: expected a value in [1, {group_sizes.shape[0]}] (len(group_sizes)), "
                         f"got {num_local_groups}")
    if group_offset is None and num_local_groups != group_sizes.shape[0]:
        raise ValueError(f"num_local_groups: expected len(group_sizes) = {group_sizes.shape[0]} without "
                         f"group_offset, got {num_local_groups}")
    return int(num_local_groups)


def check_tgmm(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
               num_local_groups=None, transpose_lhs=False) -> Call:
    """`ragged_dot_tgmm`: ``lhs [K, M]`` (``[M, K]`` with ``transpose_lhs``), ``rhs [M, N]``,
    same float dtype; ``num_local_groups`` groups from ``group_offset``."""
    lhs = checks.require_float("lhs", lhs)
    checks.require_ndim("lhs", lhs, 2)
    rhs = checks.require_float("rhs", rhs)
    checks.require_ndim("rhs", rhs, 2)
    checks.require_same_dtype("rhs", rhs, "lhs", lhs)
    if not isinstance(transpose_lhs, bool):
        raise TypeError(f"transpose_lhs: expected a bool, got {type(transpose_lhs).__name__}")
    m = lhs.shape[0] if transpose_lhs else lhs.shape[1]
    what = "lhs.shape[0] (transpose_lhs)" if transpose_lhs else "lhs.shape[1]"
    checks.require_shape("rhs", rhs, (m, None), f"{what}, N")
    group_offset = check_group_offset(group_offset)
    group_sizes = check_group_sizes(group_sizes, None)
    num_local_groups = _check_num_local_groups(num_local_groups, group_sizes, group_offset)
    check_group_values(group_sizes, group_offset, num_local_groups, m, what)
    return Call(
        {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes, "group_offset": group_offset},
        {"precision": resolve_precision(precision), "out_dtype": check_out_dtype(preferred_element_type, lhs.dtype),
         "num_local_groups": num_local_groups, "transpose_lhs": transpose_lhs},
    )


def check_backward(dy, lhs, rhs, group_sizes, group_offset=None, preactivation=None, *, activation=None,
                   transpose_rhs=False, precision=None) -> Call:
    """`ragged_dot_backward`: the `ragged_dot` arguments, ``dy [M, N]`` and the
    forward's pre-activation (``[M, N]``, ``[M, 2, N]`` gated; required with an
    activation or a gated rhs)."""
    call = check_ragged_dot(lhs, rhs, group_sizes, precision, None, group_offset, activation=activation,
                            transpose_rhs=transpose_rhs)
    m, _, n_total, _, gated = gmm_dims(call)
    n_out = n_total // 2 if gated else n_total
    dy = checks.require_float("dy", dy)
    checks.require_shape("dy", dy, (m, n_out), "lhs.shape[0], N")
    needs_pre = gated or activation is not None
    if needs_pre:
        if preactivation is None:
            raise ValueError("preactivation: required with an activation or gated rhs (the forward's saved "
                             "pre-activation)")
        checks.require_shape("preactivation", preactivation, (m, 2, n_out) if gated else (m, n_out))
    return Call({**call.arrays, "dy": dy, "preactivation": preactivation if needs_pre else None},
                dict(call.options))


# -- quantized ragged_dot ----------------------------------------------------------------------
QUANTIZED_FORMATS = ("int8", "int8_asym", "int4", "int4_asym", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2",
                     "mxfp4", "nvfp4")
#: The QArray's arrays as the quantized op's named arrays.
QUANTIZED_ARRAYS = ("rhs_values", "rhs_scales", "rhs_zero_points", "rhs_tensor_scale")


def _check_quantized_rhs(rhs: QArray, k: int) -> None:
    if rhs.format not in QUANTIZED_FORMATS:
        raise ValueError(f"rhs: unsupported QArray format {rhs.format!r} for ragged_dot; "
                         f"expected one of {list(QUANTIZED_FORMATS)}")
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
    if rhs.shape[1] != k:
        raise ValueError(f"rhs: expected shape [G, {k}, N] (K = lhs.shape[1]), got {rhs.shape}")


def check_ragged_dot_quantized(lhs, rhs_values, rhs_scales, rhs_zero_points, rhs_tensor_scale, group_sizes,
                               precision=None, preferred_element_type=None, group_offset=None, *, rhs_format,
                               rhs_shape, rhs_block_shape, rhs_axis, rhs_rotation=None, activation=None) -> Call:
    """The quantized `ragged_dot`: ``lhs [M, K]`` float and a `QArray` ``rhs [G, K, N]``
    (given flattened, see `flatten_quantized`) quantized along axis 1 in a
    `QUANTIZED_FORMATS` format, blocks of 1 along G, no rotation."""
    lhs = checks.require_float("lhs", lhs)
    checks.require_ndim("lhs", lhs, 2)
    rhs = QArray(rhs_values, rhs_scales, rhs_zero_points, rhs_tensor_scale, format=rhs_format, shape=rhs_shape,
                 block_shape=rhs_block_shape, axis=rhs_axis, rotation=rhs_rotation)
    _check_quantized_rhs(rhs, lhs.shape[1])
    group_sizes, group_offset = check_groups(group_sizes, group_offset, rhs.shape[0], lhs.shape[0], "lhs.shape[0]")
    return Call(
        {"lhs": lhs, "rhs_values": rhs.values, "rhs_scales": rhs.scales, "rhs_zero_points": rhs.zero_points,
         "rhs_tensor_scale": rhs.tensor_scale, "group_sizes": group_sizes, "group_offset": group_offset},
        {"precision": resolve_precision(precision), "out_dtype": check_out_dtype(preferred_element_type, lhs.dtype),
         "activation": check_activation(activation), "rhs_format": rhs.format, "rhs_shape": rhs.shape,
         "rhs_block_shape": rhs.block_shape, "rhs_axis": rhs.axis, "rhs_rotation": rhs.rotation},
    )


def quantized_rhs(call: Call) -> QArray:
    """The `QArray` ``rhs`` of a checked quantized call."""
    return QArray(*(call.arrays[n] for n in QUANTIZED_ARRAYS), format=call.rhs_format, shape=call.rhs_shape,
                  block_shape=call.rhs_block_shape, axis=call.rhs_axis, rotation=call.rhs_rotation, _validate=False)


def flatten_quantized(lhs, rhs: QArray, group_sizes, precision, preferred_element_type, group_offset, activation):
    """``(args, kwargs)`` of the quantized op: the `QArray` as named arrays and options."""
    args = (lhs, rhs.values, rhs.scales, rhs.zero_points, rhs.tensor_scale, group_sizes)
    kwargs = {"precision": precision, "preferred_element_type": preferred_element_type, "group_offset": group_offset,
              "rhs_format": rhs.format, "rhs_shape": rhs.shape, "rhs_block_shape": rhs.block_shape,
              "rhs_axis": rhs.axis, "rhs_rotation": rhs.rotation, "activation": activation}
    return args, kwargs
