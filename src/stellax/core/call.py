"""`Call`: the canonical, checked arguments of one op invocation."""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Mapping

import jax
import jax.numpy as jnp
import numpy as np


def _abstract(value: Any) -> Hashable:
    if value is None:
        return None
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return (tuple(int(d) for d in shape), np.dtype(dtype).name)
    return repr(value)


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """Checked arguments of an op call.

    Attributes:
      arrays: named array operands (``None`` for an absent optional operand),
        in the op's positional order.
      options: named static options (Python scalars, strings, tuples).
    """

    arrays: Mapping[str, Any]
    options: Mapping[str, Any]

    def __post_init__(self):
        # NumPy operands behave like jnp ones: implementations index, gather and
        # trace them (a NumPy array indexed by a tracer fails deep inside).
        if any(isinstance(v, np.ndarray) for v in self.arrays.values()):
            arrays = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in self.arrays.items()}
            object.__setattr__(self, "arrays", arrays)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: expose operands and options.
        for table in ("arrays", "options"):
            values = self.__dict__.get(table, {})
            if name in values:
                return values[name]
        raise AttributeError(name)

    def signature(self) -> tuple:
        """Hashable abstract description (shapes, dtypes, options): the key
        autotuning caches and benchmark tables use."""
        arrays = tuple((k, _abstract(v)) for k, v in self.arrays.items())
        options = tuple(sorted((k, _hashable(v)) for k, v in self.options.items()))
        return arrays, options

    def describe(self) -> str:
        parts = []
        for name, value in self.arrays.items():
            if value is not None:
                shape = "x".join(str(d) for d in value.shape) or "scalar"
                parts.append(f"{name}={np.dtype(value.dtype).name}[{shape}]")
        for name, value in self.options.items():
            if value is not None and value is not False:
                parts.append(f"{name}={value}")
        return " ".join(parts)

    def abstract(self) -> "Call":
        """The same call with arrays replaced by `jax.ShapeDtypeStruct`s."""
        arrays = {
            k: None if v is None else jax.ShapeDtypeStruct(v.shape, v.dtype)
            for k, v in self.arrays.items()
        }
        return Call(arrays, dict(self.options))

    def replace_arrays(self, **arrays: Any) -> "Call":
        return Call({**self.arrays, **arrays}, self.options)


def _hashable(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return value


def signature_to_json(signature: Any) -> Any:
    """A `Call.signature()` as JSON-able nested lists (tuples → lists; values JSON cannot hold → their
    ``repr``): the canonical form autotuning cache keys and HLO annotations use."""
    if isinstance(signature, tuple):
        return [signature_to_json(v) for v in signature]
    if signature is None or isinstance(signature, (bool, int, float, str)):
        return signature
    return repr(signature)


def signature_from_json(data: Any) -> Any:
    """Inverse of `signature_to_json` (lists back to tuples; repr'd values stay strings)."""
    if isinstance(data, list):
        return tuple(signature_from_json(v) for v in data)
    return data
