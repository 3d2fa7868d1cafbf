"""Argument checks shared by the grouped-matmul ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import checks

_PRECISIONS = (None, jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST)
_OUT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def concrete(value):
    """``value`` as a numpy array when it is concrete (not traced), else None."""
    if value is None or isinstance(value, jax.ShapeDtypeStruct):
        return None
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_precision(precision):
    if isinstance(precision, str):
        try:
            precision = jax.lax.Precision(precision)
        except ValueError as e:
            raise ValueError(f"precision: expected None or a jax.lax.Precision, got {precision!r}") from e
    if isinstance(precision, tuple) and len(precision) == 2 and precision[0] == precision[1]:
        precision = precision[0]
    if precision not in _PRECISIONS:
        raise ValueError(f"precision: expected None or a jax.lax.Precision, got {precision!r}")
    return precision


def check_out_dtype(preferred_element_type, default):
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


def check_group_values(group_sizes, group_offset, num_local: int, rows: int, rows_name: str) -> None:
    """Eager value checks (skipped for traced values; under ``jit`` sizes are
    clamped instead, see `schedule.group_bounds`)."""
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


def kernel_precision(precision, dtype):
    """float32 operands default to full float32 dots (the numerics policy's
    1e-5 tolerance; GPUs would otherwise use TF32); callers may ask for less."""
    if precision is None and np.dtype(dtype) == np.dtype(jnp.float32):
        return jax.lax.Precision.HIGHEST
    return precision


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
