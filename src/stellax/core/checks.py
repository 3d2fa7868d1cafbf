"""Argument checks shared by every op. Each raises ``TypeError`` (wrong kind
or dtype) or ``ValueError`` (wrong rank, shape or value) naming the argument,
the expected and the actual value."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def as_array(name: str, value: Any):
    """Accept jax/numpy arrays (and tracers); anything else is a TypeError."""
    if isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "aval"):
        return value
    if isinstance(value, jax.ShapeDtypeStruct):
        return value
    raise TypeError(f"{name}: expected an array, got {type(value).__name__}")


def require_float(name: str, value: Any, dtypes: Sequence = FLOAT_DTYPES):
    value = as_array(name, value)
    allowed = tuple(np.dtype(d) for d in dtypes)
    if np.dtype(value.dtype) not in allowed:
        raise TypeError(
            f"{name}: expected a floating dtype in {[_dtype_name(d) for d in allowed]}, "
            f"got {_dtype_name(value.dtype)}"
        )
    return value


def require_int(name: str, value: Any):
    value = as_array(name, value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {_dtype_name(value.dtype)}")
    return value


def require_ndim(name: str, value: Any, ndim: int | Sequence[int]):
    allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if value.ndim not in allowed:
        expected = allowed[0] if len(allowed) == 1 else f"one of {allowed}"
        raise ValueError(f"{name}: expected rank {expected}, got rank {value.ndim} (shape {tuple(value.shape)})")
    return value


def require_shape(name: str, value: Any, shape: Sequence[int | None], what: str = ""):
    """``None`` in ``shape`` matches any size."""
    actual = tuple(value.shape)
    ok = len(actual) == len(shape) and all(e is None or e == a for e, a in zip(shape, actual))
    if not ok:
        shown = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ("," if len(shape) == 1 else "") + ")"
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name}: expected shape {shown}{extra}, got {actual}")
    return value


def require_same_dtype(name: str, value: Any, other_name: str, other: Any):
    if np.dtype(value.dtype) != np.dtype(other.dtype):
        raise TypeError(
            f"{name}: expected dtype {_dtype_name(other.dtype)} (the dtype of {other_name}), "
            f"got {_dtype_name(value.dtype)}"
        )
    return value


def normalize_axis(name: str, axis: Any, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{name}: expected an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: expected an axis in [{-ndim}, {ndim}) for a rank-{ndim} input, got {axis}")
    return int(axis) % ndim


def require_positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name}: expected a positive float, got {value}")
    return float(value)


def require_choice(name: str, value: Any, choices: Sequence[Any]):
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value


def require_count(name: str, value: Any, *, minimum: int = 1) -> int:
    """A Python (or NumPy) integer size ``>= minimum``; bools and floats are a TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


#: Largest array `require_extent` accepts (bytes): 16 TiB, far past any device memory,
#: far below the int64 element-count overflow that aborts XLA.
MAX_ARRAY_BYTES = 2**44


def require_extent(name: str, shape: Sequence[int], itemsize: int = 1) -> tuple:
    """Check an array's size before building it: the element-count product of
    huge dims overflows int64 inside XLA, which aborts the process."""
    total = 1
    for d in shape:
        total *= int(d)
    if total * itemsize > MAX_ARRAY_BYTES:
        raise ValueError(f"{name}: expected an array of at most 2**44 bytes, got shape {tuple(shape)} "
                         f"({total * itemsize} bytes)")
    return tuple(shape)


def concrete_values(value: Any):
    """The host (NumPy) values of a concrete array, or ``None`` under a trace
    (values are then checked by the documented clamping instead)."""
    if value is None or isinstance(value, jax.ShapeDtypeStruct):
        return None
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
