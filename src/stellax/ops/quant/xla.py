"""The XLA implementations of the quant ops (the ``"xla"`` row of `api.BACKENDS`): plain
jnp over the golden formulas of `reference` and `hadamard`, jitted.

* `quantize_run`: `reference.quantize_reference` (also the op's golden, and the examples' builder
  `quantize_xla`);
* `dequantize_run`: `reference.dequantize_reference` (also the op's golden);
* `hadamard_run`: the butterfly `hadamard.hadamard_xla` (float32 adds, exact at every precision);
* `quantized_matmul_run`: dequantize, then one ``dot`` at the call's precision (int8 × int8 with
  per-channel scales: an int32 ``dot``, scaled after).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core import Call
from . import hadamard as H
from .base import matmul_operands
from .qarray import QArray, qarray_from_call
from .reference import dequantize_reference, expand_blocks, quantize_reference


@functools.partial(jax.jit, static_argnames=("fmt", "block_shape", "axis", "scale_dtype", "rotation"))
def quantize_xla(x, key, *, fmt: str, block_shape, axis: int, scale_dtype: str | None, rotation: int | None):
    """``x`` (float, any shape) → `QArray` by the golden formulas (`reference.quantize_reference`).

    ``key``: a PRNG key for stochastic rounding (uniform ``[0, 1)`` noise of
    ``x``'s shape) or ``None`` (round to nearest even); ``scale_dtype``: a dtype
    name or ``None`` (the format's); ``rotation`` is only recorded.
    """
    noise = None if key is None else jax.random.uniform(key, x.shape, jnp.float32)
    sd = None if scale_dtype is None else jnp.dtype(scale_dtype)
    return quantize_reference(x, fmt, block_shape, axis, scale_dtype=sd, noise=noise, rotation=rotation)


def quantize_run(call: Call, config=None) -> QArray:
    del config
    return quantize_xla(call.x, call.key, fmt=call.format, block_shape=call.block_shape, axis=call.axis,
                        scale_dtype=call.scale_dtype, rotation=call.rotation)


_dequantize_jit = jax.jit(dequantize_reference, static_argnums=(1,))


def dequantize_run(call: Call, config=None):
    del config
    return _dequantize_jit(qarray_from_call(call), jnp.dtype(call.dtype))


_hadamard_jit = jax.jit(H.hadamard_xla, static_argnames=("block", "inverse"))


def hadamard_run(call: Call, config=None):
    del config  # butterflies of float32 adds: exact at every precision, no contraction
    return _hadamard_jit(call.x, block=call.block, signs=call.signs, inverse=call.inverse)


@functools.partial(jax.jit, static_argnames=("out", "precision"))
def _matmul_jit(x, w, *, out, precision):
    if not isinstance(x, QArray):
        wd = dequantize_reference(w, x.dtype)
        return jnp.matmul(x, wd, precision=precision, preferred_element_type=jnp.float32).astype(out)
    per_row = x.scales.shape[1] == 1 and w.scales.shape[0] == 1
    if per_row and x.format == "int8":
        acc = jnp.matmul(x.values, w.values, preferred_element_type=jnp.int32).astype(jnp.float32)
        sx = expand_blocks(x.scales.astype(jnp.float32), x.block_shape, x.shape)[:, :1]
        sw = expand_blocks(w.scales.astype(jnp.float32), w.block_shape, w.shape)[:1, :]
        return (acc * sx * sw).astype(out)
    xd = dequantize_reference(x)
    wd = dequantize_reference(w)
    return jnp.matmul(xd, wd, precision=precision).astype(out)


def quantized_matmul_run(call: Call, config=None):
    del config
    x, w = matmul_operands(call)
    return _matmul_jit(x, w, out=jnp.dtype(call.preferred_element_type), precision=call.precision)
