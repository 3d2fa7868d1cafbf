"""Front-end arguments as custom-op options (schema-typed values) and back.

Custom-op options are ``int``, ``float``, ``bool``, ``str``, ``int[]`` or
``float[]`` (each optionally ``None``); these helpers turn the arguments
users pass (torch dtypes, precisions, windows with open sides) into such
values, with errors that name the argument, and decode them in the JAX
functions.
"""

from __future__ import annotations

import numpy as np
import torch

from . import bridge

__all__ = ["check_group_sizes", "concrete", "decode_window", "dtype_name", "encode_window", "int32", "left_window", "opt_float", "opt_int",
           "precision_name", "registered_name", "strict_int"]


def opt_float(value) -> float | None:
    """``None`` or a float."""
    return None if value is None else float(value)


def opt_int(value) -> int | None:
    """``None`` or ``int(value)``."""
    return None if value is None else int(value)


def strict_int(name: str, value) -> int | None:
    """``None`` or an int (``TypeError`` naming ``name`` for anything else, bools included)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    return int(value)


def int32(t: torch.Tensor | None, name: str = "tensor") -> torch.Tensor | None:
    """An integer tensor as int32 (JAX runs with 32-bit integers); None stays None.
    A float (or bool, complex) tensor is a ``TypeError`` naming ``name``: casting
    lengths or indices silently would truncate them."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected an integer torch.Tensor, got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name}: expected an integer tensor, got {t.dtype}")
    return t.to(torch.int32)


def concrete(t: torch.Tensor | None) -> bool:
    """Whether ``t`` holds real values (not a meta / fake tensor under ``torch.compile``,
    not a torchax tensor wrapping a traced JAX value under torchax's jit)."""
    if t is None:
        return False
    from .torchax import is_torchax_tensor

    if is_torchax_tensor(t):
        import jax

        return not isinstance(t.jax(), jax.core.Tracer)
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return False  # under torch.compile the values are symbolic (and `is_fake` is not traceable)
    try:
        from torch._subclasses.fake_tensor import is_fake
        return not is_fake(t)
    except ImportError:  # pragma: no cover - older torch
        return True


def host_values(t: torch.Tensor) -> torch.Tensor:
    """A concrete tensor's values on the CPU (a torchax tensor's through its JAX array)."""
    from .torchax import is_torchax_tensor

    if is_torchax_tensor(t):
        import numpy as np

        return torch.from_numpy(np.array(t.jax()))
    return t.detach().to("cpu")


def check_group_sizes(group_sizes: torch.Tensor, rows: int, rows_name: str, *, offset: int = 0,
                      count: int | None = None) -> None:
    """Concrete ``group_sizes``: non-negative and summing to at most ``rows`` (as the JAX front
    end checks eagerly; the JAX function runs jitted, where the values are traced)."""
    if not concrete(group_sizes):
        return
    sizes = host_values(group_sizes).to(torch.int64)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes: expected non-negative sizes, got {sizes.tolist()}")
    total = int(sizes.sum())
    if total > rows:
        raise ValueError(f"group_sizes: expected sum(group_sizes) <= {rows} ({rows_name}), got {total}")


def dtype_name(name: str, dtype) -> str | None:
    """A torch dtype as its numpy/JAX name (``torch.bfloat16`` -> ``"bfloat16"``); None stays None."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}: expected a torch.dtype or None, got {dtype!r}")
    return np.dtype(bridge.jax_dtype(dtype)).name


def registered_name(name: str, value, registered, name_of, unknown: str) -> str:
    """An argument given as an object or as the string it is registered under (strings are what
    `torch.compile`d code passes): a string must be a key of ``registered``, anything else becomes
    ``name_of(value)``. An unknown string raises ``ValueError`` ``"{name}: " + unknown``, with
    ``{value}`` and ``{registered}`` (the sorted keys) filled in."""
    if isinstance(value, str):
        if value not in registered:
            raise ValueError(f"{name}: " + unknown.format(value=value, registered=sorted(registered)))
        return value
    return name_of(value)


def precision_name(precision) -> str | None:
    """``None``, a `jax.lax.Precision` or its name -> the lower-case name."""
    if precision is None or isinstance(precision, str):
        return precision
    name = getattr(precision, "name", None)
    if name is None:
        raise TypeError(f"precision: expected None, a string or a jax.lax.Precision, got {precision!r}")
    return name.lower()


def encode_window(value, *, int_means: str = "both", name: str = "local_window_size") -> list[int] | None:
    """A sliding window as the ``int[]?`` option ``[left, right]``, ``-1`` for an open side.

    ``value``: ``None`` (no window), a ``(left, right)`` pair (``None`` for an
    unbounded side) or an int ``w``: ``(w, w)`` with ``int_means="both"`` (the
    `jax.nn.dot_product_attention` convention) or ``(w, 0)`` with
    ``int_means="left"`` (a causal window of ``w`` past keys)."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected an int or a (left, right) pair, got {value!r}")
        return [-1 if v is None else int(v) for v in value]
    w = int(value)
    return [w, w] if int_means == "both" else [w, 0]


def decode_window(encoded) -> tuple | None:
    """Inverse of `encode_window`: ``[left, right]`` -> ``(left or None, right or None)``."""
    if encoded is None:
        return None
    left, right = encoded
    return None if left < 0 else int(left), None if right < 0 else int(right)


def left_window(value, *, name: str = "local_window_size") -> int | None:
    """The left extent of a window for the paged (decode) ops, which take
    ``left`` only: an int, or the first item of a ``(left, right)`` pair."""
    if value is None:
        return None
    left = encode_window(value, int_means="left", name=name)[0]
    if left < 0:
        raise TypeError(f"{name}: paged attention needs a bounded left window, got {value!r}")
    return left
