"""The `hadamard_transform` op: the normalized (randomized) fast Walsh–Hadamard
transform over blocks of the last axis (math in `hadamard`)."""

from __future__ import annotations

import math

import jax
import numpy as np

from ...core import Call, Implementation, Op, checks, register
from ...core.config import is_power_of_two
from ...core.precision import resolve_precision
from . import examples
from . import hadamard as H
from . import mosaic_tpu as tpu_kernels
from . import triton as kernels
from .configs import HadamardConfig, hadamard_heuristic, hadamard_space
from .tpu_configs import HadamardTpuConfig, hadamard_tpu_heuristic, hadamard_tpu_space


def check_hadamard(x, signs=None, *, block=None, inverse=False, precision=None) -> Call:
    """Checked `hadamard_op` arguments: ``x [..., n]`` float, ``block`` a power
    of two dividing ``n`` (default ``n``), ``signs`` ``[block]`` or ``None``."""
    x = checks.require_float("x", x)
    if x.ndim < 1:
        raise ValueError("x: expected rank >= 1, got rank 0")
    n = x.shape[-1]
    block = n if block is None else block
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"block_size: expected an int, got {type(block).__name__}")
    block = int(block)
    if not is_power_of_two(block):
        raise ValueError(f"block_size: the Walsh–Hadamard transform needs a power-of-two size, got {block}"
                         + (" (the last axis; pass block_size=a power of two dividing it)" if block == n else ""))
    if n % block:
        raise ValueError(f"block_size: {block} must divide the last axis (size {n})")
    if signs is not None:
        checks.require_shape("random signs", signs, (block,), "block_size")
    return Call({"x": x, "signs": signs},
                {"block": block, "inverse": bool(inverse), "precision": resolve_precision(precision)})


_xla_jit = jax.jit(H.hadamard_xla, static_argnames=("block", "inverse"))


def _xla(call: Call, config=None):
    del config  # butterflies of float32 adds: exact at every precision, no contraction
    return _xla_jit(call.x, block=call.block, signs=call.signs, inverse=call.inverse)


def _reference(call: Call):
    return H.hadamard_reference(call.x, block=call.block, signs=call.signs, inverse=call.inverse)


def _triton(call: Call, config: HadamardConfig):
    return kernels.hadamard(call.x, call.signs, block=call.block, inverse=call.inverse, config=config,
                            precision=call.precision)


def _triton_requirements(call: Call):
    if not 16 <= call.block <= 256:
        return f"the Triton Hadamard kernel takes blocks of 16–256, got {call.block}"
    return None


hadamard_op = register(Op(
    "hadamard_transform",
    family="quant",
    check=check_hadamard,
    reference=_reference,
    implementations=[
        Implementation("mosaic_tpu", tpu_kernels.hadamard_run, backend="mosaic_tpu", config_type=HadamardTpuConfig,
                       heuristic=hadamard_tpu_heuristic, space=hadamard_tpu_space,
                       requirements=tpu_kernels.hadamard_requirements),
        Implementation("triton", _triton, backend="triton", config_type=HadamardConfig,
                       heuristic=hadamard_heuristic, space=hadamard_space, requirements=_triton_requirements),
        Implementation("xla", _xla),
    ],
    flops=lambda call: float(np.prod(call.x.shape)) * math.log2(call.block),
    bytes_accessed=lambda call: 2.0 * float(np.prod(call.x.shape)) * np.dtype(call.x.dtype).itemsize,
    examples=examples.hadamard_examples,
    benchmarks=examples.hadamard_benchmarks,
))


def hadamard_transform(x, *, block_size=None, random_signs_key=None, inverse=False, precision=None,
                       implementation=None, config=None):
    """Normalized fast Walsh–Hadamard transform over the last axis.

    Args:
      x: ``[..., n]`` float32/bfloat16/float16.
      block_size: ``None`` (the whole last axis) or a power of two dividing
        ``n``: the transform is applied to each consecutive block. The Triton
        kernel takes 16–256; other sizes run in XLA. Non-powers of two raise
        ``ValueError``.
      random_signs_key: a PRNG key for random ±1 signs ``d`` (randomized
        Hadamard: ``v → H(d ⊙ v)/√b``); the same key gives the same signs.
      inverse: apply the inverse (``w → d ⊙ (H w)/√b``; without signs the
        transform is its own inverse).
      precision: of the float32 product with the ±1 matrix in the Mosaic TPU and
        Triton kernels (``None``: float32-accurate unless
        `jax.default_matmul_precision` is set; ``"default"`` rounds ``x`` to
        bfloat16 / TF32 once); see `stellax.core.precision`. The XLA butterfly
        adds in float32 and is exact at every setting.
      implementation, config: ``None`` / ``"mosaic_tpu"`` / ``"triton"`` / ``"xla"``; a
        `HadamardTpuConfig` / `HadamardConfig`.

    Returns:
      An array like ``x`` (float32 math inside).
    """
    x = checks.require_float("x", x)
    block = x.shape[-1] if block_size is None else block_size
    signs = None
    if random_signs_key is not None:
        if isinstance(block, (int, np.integer)) and not isinstance(block, bool) and block > 0:
            signs = H.random_signs(random_signs_key, int(block))
    return hadamard_op(x, signs, block=block, inverse=inverse, precision=precision, implementation=implementation,
                       config=config)
