"""Public quantization API: `quantize`, `dequantize`, `hadamard_transform` and
`quantized_matmul`, their ops, and the family's backend table.

Every op has the same implementations, in dispatch order: ``mosaic_tpu`` (Pallas Mosaic
TPU), ``triton`` (Pallas Triton, SM80+) and ``xla``. A row of `BACKENDS` names a backend's
kernel module, which provides one entry point per op, ``<op>_run(call, config)``, and the
``<op>_requirements(call)`` of its kernels; `quantized_matmul`'s kernels are in
``<backend>_matmul.py``. The configs, heuristics and spaces are in `configs`; the argument
checks in `base`. `quantized_linear` (the training GEMMs, not an op) is in `training`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.backends import Backend, BackendTable, Tuning
from . import examples
from . import formats as F
from . import hadamard as H
from . import mosaic_tpu, mosaic_tpu_matmul, triton, triton_matmul, xla
from .base import (array_bytes, check_dequantize, check_hadamard, check_quantize, check_quantized_matmul,
                   flatten_operands, matmul_operands, require_quantizable, resolve_block_shape)
from .configs import (DequantConfig, HadamardConfig, HadamardTpuConfig, QMatmulConfig, QMatmulTpuConfig,
                      QuantizeConfig, QuantTpuConfig, dequant_heuristic, dequant_space, dequantize_tpu_heuristic,
                      dequantize_tpu_space, hadamard_heuristic, hadamard_space, hadamard_tpu_heuristic,
                      hadamard_tpu_space, qmatmul_heuristic, qmatmul_space, qmatmul_tpu_heuristic,
                      qmatmul_tpu_space, quantize_heuristic, quantize_space, quantize_tpu_heuristic,
                      quantize_tpu_space)
from .qarray import QArray, qarray_fields, scale_shape
from .reference import dequantize_reference

# -- backends ------------------------------------------------------------------------------
BACKENDS = BackendTable("quant", [
    Backend("mosaic_tpu", mosaic_tpu, "mosaic_tpu"),
    Backend("triton", triton, "triton"),
    Backend("xla", xla),
])

#: `quantized_matmul`'s kernel module per backend (where it is not the row's).
MATMUL_KERNELS = {"mosaic_tpu": mosaic_tpu_matmul, "triton": triton_matmul}


def _run_quantize(row: Backend, call: Call, config) -> QArray:
    return row.kernels.quantize_run(call, config)


def _run_dequantize(row: Backend, call: Call, config):
    return row.kernels.dequantize_run(call, config)


def _run_hadamard(row: Backend, call: Call, config):
    return row.kernels.hadamard_run(call, config)


def _run_quantized_matmul(row: Backend, call: Call, config):
    return row.kernels.quantized_matmul_run(call, config)


# -- cost models ---------------------------------------------------------------------------
def _quantize_bytes(call: Call) -> float:
    """Read ``x``, write the codes and float32 scales."""
    fmt = F.get_format(call.format)
    n = float(np.prod(call.x.shape))
    scales = float(np.prod(scale_shape(call.x.shape, call.block_shape)))
    return n * np.dtype(call.x.dtype).itemsize + n * fmt.element.bits / 8 + scales * 4


def _dequantize_bytes(call: Call) -> float:
    """Read every field, write the values."""
    return array_bytes(call) + float(np.prod(call.shape)) * np.dtype(call.dtype).itemsize


def _matmul_bytes(call: Call) -> float:
    """Read every operand field, write the output."""
    return array_bytes(call) + call.m * call.n * np.dtype(call.preferred_element_type).itemsize


def _bf16_peer(x_values, *args, **kwargs):
    """bf16 matmul of the same shape (the speed baseline)."""
    w_shape = kwargs["w_shape"]
    x = x_values.astype(jnp.bfloat16) if x_values.ndim == 2 else x_values
    w = jnp.ones(w_shape, jnp.bfloat16)
    return jnp.matmul(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


# -- goldens (quantize / dequantize: the XLA path is the golden formula) ---------------------
def _hadamard_reference(call: Call):
    return H.hadamard_reference(call.x, block=call.block, signs=call.signs, inverse=call.inverse)


def _quantized_matmul_reference(call: Call):
    x, w = matmul_operands(call)
    xd = x.astype(jnp.float32) if not isinstance(x, QArray) else dequantize_reference(x)
    y = jnp.matmul(xd, dequantize_reference(w), precision=jax.lax.Precision.HIGHEST)
    return y.astype(call.preferred_element_type)


# -- ops -----------------------------------------------------------------------------------
def _op(name: str, run, tpu: Tuning, gpu: Tuning, *, writes_float8=None, kernels=None, **fields):
    """Register the quant op ``name`` over the family's rows (`BACKENDS`), its ``mosaic_tpu`` row
    tuned by ``tpu`` and its ``triton`` row by ``gpu``; ``kernels`` / ``writes_float8`` as in
    `BackendTable.retuned`, ``fields`` the rest of the `Op`."""
    table = BACKENDS.retuned({"mosaic_tpu": tpu, "triton": gpu}, kernels=kernels, writes_float8=writes_float8)
    return table.op(name, run, **fields)


quantize_op = _op(
    "quantize", _run_quantize,
    Tuning(QuantTpuConfig, quantize_tpu_heuristic, quantize_tpu_space, mosaic_tpu.quantize_requirements),
    Tuning(QuantizeConfig, quantize_heuristic, quantize_space, triton.quantize_requirements),
    writes_float8={"triton": triton.quantize_writes_float8}, check=check_quantize, reference=xla.quantize_run,
    flops=lambda call: float(np.prod(call.x.shape)) * 6, bytes_accessed=_quantize_bytes,
    examples=examples.quantize_examples, benchmarks=examples.quantize_benchmarks)

dequantize_op = _op(
    "dequantize", _run_dequantize,
    Tuning(QuantTpuConfig, dequantize_tpu_heuristic, dequantize_tpu_space, mosaic_tpu.dequantize_requirements),
    Tuning(DequantConfig, dequant_heuristic, dequant_space, triton.dequantize_requirements),
    check=check_dequantize, reference=xla.dequantize_run, flops=lambda call: float(np.prod(call.shape)) * 3,
    bytes_accessed=_dequantize_bytes, examples=examples.dequantize_examples,
    benchmarks=examples.dequantize_benchmarks)

hadamard_op = _op(
    "hadamard_transform", _run_hadamard,
    Tuning(HadamardTpuConfig, hadamard_tpu_heuristic, hadamard_tpu_space, mosaic_tpu.hadamard_requirements),
    Tuning(HadamardConfig, hadamard_heuristic, hadamard_space, triton.hadamard_requirements),
    check=check_hadamard, reference=_hadamard_reference,
    flops=lambda call: float(np.prod(call.x.shape)) * math.log2(call.block),
    bytes_accessed=lambda call: 2.0 * float(np.prod(call.x.shape)) * np.dtype(call.x.dtype).itemsize,
    examples=examples.hadamard_examples, benchmarks=examples.hadamard_benchmarks)

quantized_matmul_op = _op(
    "quantized_matmul", _run_quantized_matmul,
    Tuning(QMatmulTpuConfig, qmatmul_tpu_heuristic, qmatmul_tpu_space, mosaic_tpu_matmul.quantized_matmul_requirements),
    Tuning(QMatmulConfig, qmatmul_heuristic, qmatmul_space, triton_matmul.quantized_matmul_requirements),
    kernels=MATMUL_KERNELS, check=check_quantized_matmul, reference=_quantized_matmul_reference,
    flops=lambda call: 2.0 * call.m * call.n * call.k, bytes_accessed=_matmul_bytes,
    examples=examples.matmul_examples, benchmarks=examples.matmul_benchmarks, peers={"bf16_matmul": _bf16_peer})


# -- public functions ----------------------------------------------------------------------
def _rotate(x, axis: int, rotate):
    """``x`` Hadamard-rotated along ``axis`` and the rotation block (``None``: no rotation)."""
    if rotate is None or rotate is False:
        return x, None
    block, key = rotate, None
    if isinstance(rotate, tuple):
        if len(rotate) != 2:
            raise ValueError(f"rotate: expected True, an int or (block_size, key), got {rotate!r}")
        block, key = rotate
    if block is True:
        block = x.shape[axis]
    moved = jnp.moveaxis(x, axis, -1)
    # Always float32-accurate (not the caller's matmul precision): the rotation is part of the
    # quantization recipe, and a bf16 pass would add its rounding to every rotated value.
    moved = hadamard_transform(moved, block_size=block, random_signs_key=key, precision="highest")
    return jnp.moveaxis(moved, -1, axis), int(block)


def quantize(x, format, *, axis=-1, block_size=None, scale_dtype=None, stochastic_rounding_key=None,
             rotate=None, implementation=None):
    """Quantize ``x`` into a `QArray`.

    Args:
      x: float32/bfloat16/float16 array.
      format: ``"int8"``, ``"int8_asym"``, ``"int4"``, ``"int4_asym"``,
        ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"mxfp8_e4m3"`` (alias ``"mxfp8"``),
        ``"mxfp8_e5m2"``, ``"mxfp4"`` or ``"nvfp4"``.
      axis: the quantized axis (the contraction axis of a matmul operand:
        -1 for activations ``[M, K]``, 0 for weights ``[K, N]``). 4-bit codes
        are packed along it and 1-D blocks lie along it.
      block_size: ``None`` (the format's default: per channel for int8/fp8,
        128 for int4, 32 for MX, 16 for NVFP4), ``"tensor"``, ``"channel"``
        (one scale per slice along ``axis``), an int (blocks of that many
        along ``axis``; a trailing partial block is treated as zero-padded), or
        a pair ``(rows, cols)`` of 2-D blocks over the last two dimensions
        (``(128, 128)`` DeepSeek-V3 fp8 weights, ``(16, 16)`` NVFP4 weights).
        MX formats take only 32, NVFP4 only 16 or (16, 16).
      scale_dtype: float32 (default), bfloat16, float16 or float8_e8m0fnu
        (power-of-two scales rounded up) for int/fp8 formats; MX (E8M0) and
        NVFP4 (E4M3) scales are fixed.
      stochastic_rounding_key: a JAX PRNG key: round elements stochastically
        (unbiased) instead of to nearest-even; scales are unchanged.
      rotate: apply a normalized Hadamard transform along ``axis`` before
        quantizing: ``True`` (the whole axis), an int block size (16–256 for
        the Triton kernel), or ``(block_size, random_signs_key)``. The
        rotation is recorded in ``QArray.rotation``; `dequantize` returns the
        rotated values (undo with ``hadamard_transform(..., inverse=True)``).
        Rotate both matmul operands with the same block and key: ``(x Rᵀ)(R w) = x w``.
      implementation: ``None`` (the best available, ending in XLA), ``"mosaic_tpu"``
        (Pallas Mosaic TPU, 1-D blocks along the last axis, nearest-even, float32 scales;
        config `QuantTpuConfig`), ``"triton"`` (Pallas Triton: 1-D blocks of 32–256 along the
        last axis for int8/int4/fp8, MX formats; config `QuantizeConfig`) or ``"xla"`` (every
        format and block; no config). The config is the heuristic's (``quantize`` takes no
        ``config``; autotuning and `use_configs` can set one).

    Returns:
      A `QArray` (see `stellax.ops.quant.qarray` for the layout).
    """
    x, fmt, axis = require_quantizable(x, format, axis)
    x, rotation = _rotate(x, axis, rotate)
    block_shape = resolve_block_shape(fmt, x.shape, axis, block_size)
    return quantize_op(x, stochastic_rounding_key, format=fmt.name, axis=axis, block_shape=block_shape,
                       scale_dtype=scale_dtype, rotation=rotation, implementation=implementation)


def dequantize(qx: QArray, dtype=jnp.float32, *, implementation=None, config=None):
    """Values of a `QArray`: ``(code - zero_point) * scale * tensor_scale``
    computed in float32, returned in ``dtype`` (float32/bfloat16/float16).

    ``implementation``: ``None`` (the best available, ending in XLA), ``"mosaic_tpu"`` (Pallas
    Mosaic TPU, 1-D blocks along the last axis; config `QuantTpuConfig`), ``"triton"`` (Pallas
    Triton, 1-D blocks along the last axis; config `DequantConfig`) or ``"xla"`` (any `QArray`;
    no config); ``config``: the chosen implementation's config (``None``: the heuristic's)."""
    if not isinstance(qx, QArray):
        raise TypeError(f"qx: expected a QArray, got {type(qx).__name__}")
    arrays, options = qarray_fields(qx)
    return dequantize_op(*arrays.values(), **options, dtype=np.dtype(dtype).name, implementation=implementation,
                         config=config)


def hadamard_transform(x, *, block_size=None, random_signs_key=None, inverse=False, precision=None,
                       implementation=None, config=None):
    """Normalized fast Walsh–Hadamard transform over the last axis.

    Args:
      x: ``[..., n]`` float32/bfloat16/float16.
      block_size: ``None`` (the whole last axis) or a power of two dividing
        ``n``: the transform is applied to each consecutive block. The Mosaic TPU and
        Triton kernels take 16–256; other sizes run in XLA. Non-powers of two raise
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
      implementation: ``None`` (the best available, ending in XLA), ``"mosaic_tpu"`` (Pallas
        Mosaic TPU; config `HadamardTpuConfig`), ``"triton"`` (Pallas Triton; config
        `HadamardConfig`) or ``"xla"`` (the butterfly; no config).
      config: the chosen implementation's config (``None``: the heuristic's).

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


def quantized_matmul(x, w, *, preferred_element_type=jnp.bfloat16, precision=None, implementation=None,
                     config=None):
    """``x @ w`` with quantized operands, dequantization fused into the kernel.

    Supported pairs (anything else raises ``ValueError`` naming the pair): weight-only
    (``x`` float, ``w`` in any format: int8, int8_asym, int4, int4_asym, fp8_e4m3,
    fp8_e5m2, mxfp8_*, mxfp4, nvfp4) and activation × weight (fp8_* × fp8_*, int8 × int8,
    mxfp8_* × mxfp8_*). The golden is ``dequantize(x) @ dequantize(w)`` in float32 at
    highest precision. The kernels apply the scales per K block inside the K loop or once
    in the epilogue (per-channel / per-tensor) and never write the dequantized weights to
    memory; the XLA path dequantizes and calls ``dot``.

    Args:
      x: float32/bfloat16/float16 ``[..., K]`` (weight-only), or a `QArray`
        ``[M, K]`` quantized along axis 1 (activation × weight).
      w: a `QArray` ``[K, N]`` quantized along axis 0.
      preferred_element_type: the output dtype (float32/bfloat16/float16).
      precision: of the float32 products (a float32 ``x``, or the dequantized
        operands of the XLA path): ``None`` (float32-accurate unless
        `jax.default_matmul_precision` is set), ``"default"``, ``"high"``,
        ``"highest"`` or a `jax.lax.Precision`; see `stellax.core.precision`.
        Narrower operands contract natively.
      implementation: ``None`` (the best available, ending in XLA), ``"mosaic_tpu"`` (Pallas
        Mosaic TPU, weight-only and int8 × int8; config `QMatmulTpuConfig`), ``"triton"``
        (Pallas Triton, every pair; config `QMatmulConfig`) or ``"xla"`` (no config).
      config: the chosen implementation's config (``None``: the heuristic's).

    Returns:
      ``[..., N]``: ``dequantize(x) @ dequantize(w)`` accumulated in float32
      (int32 for int8 × int8 with per-channel scales).

    Raises:
      ValueError for unsupported format pairs, mismatched K, weights not
      quantized along axis 0, or mismatched rotations.
    """
    args, kwargs = flatten_operands(x, w)
    return quantized_matmul_op(*args, **kwargs, preferred_element_type=np.dtype(preferred_element_type).name,
                               precision=precision, implementation=implementation, config=config)
