"""Parameter helpers shared by the `stellax.nn` layers: flax initializers and
logical sharding annotations (``nnx.with_partitioning``)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax.numpy as jnp
from flax import nnx

Initializer = Callable[..., Any]


def check_sharding(module: str, sharding: Mapping[str, Sequence[str | None]] | None, names: Sequence[str]) -> dict:
    """``sharding`` (parameter name -> logical axis names, one per dimension)
    checked against the module's parameter names; ``{}`` for None."""
    if sharding is None:
        return {}
    unknown = sorted(set(sharding) - set(names))
    if unknown:
        raise ValueError(f"{module}: sharding names unknown parameters {unknown}; its parameters are {sorted(names)}")
    return {k: tuple(v) for k, v in sharding.items()}


def param(module: str, rngs: nnx.Rngs, name: str, init: Initializer, shape: Sequence[int], dtype,
          sharding: Mapping[str, tuple]) -> nnx.Param:
    """``nnx.Param(init(key, shape, dtype))``, annotated with ``sharding[name]``
    (logical axes, as ``nnx.with_partitioning`` records them) when given."""
    shape = tuple(int(s) for s in shape)
    axes = sharding.get(name)
    if axes is not None:
        if len(axes) != len(shape):
            raise ValueError(f"{module}: sharding[{name!r}] has {len(axes)} axes {axes}, the parameter has shape "
                             f"{shape}")
        init = nnx.with_partitioning(init, axes)
    return nnx.Param(init(rngs.params(), shape, dtype))


def positive(module: str, **values: int) -> None:
    """Each value a positive int, else a ValueError naming the module and the argument."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{module}: {name} must be a positive int, got {value!r}")


def dense(x, kernel, dtype=None):
    """``x[..., D] @ kernel[D, *rest] -> [..., *rest]`` (HIGHEST precision for float32)."""
    k = jnp.asarray(kernel)
    out = jnp.tensordot(x, k.astype(x.dtype), axes=1, precision="highest")
    return out if dtype is None else out.astype(dtype)


def zeros(key, shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def ones(key, shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)
