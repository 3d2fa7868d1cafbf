"""The shared Pallas toolkit: launching kernels with named operands, and the
small helpers every kernel family needs.

Launching (`kernel_call`, `triton_kernel_call`):

* a kernel receives its operands **by name**: ``kernel(*, x, residual, y, ...)``;
  the launch takes ``inputs={"x": operand(x, spec), "residual": operand(r, spec)}``
  and ``outputs={"y": output(shape, dtype, spec)}``. An optional operand is
  ``None`` (``operand(None, spec)`` is ``None``): it gets no block spec, no
  buffer, and the kernel sees ``residual=None``. There is no positional
  bookkeeping to keep in step with parallel ``inputs`` / ``in_specs`` lists;
* the result is an `Outputs` mapping (attribute access too) with ``None`` for
  the outputs that were ``None``;
* Triton launches always pass Triton compiler params (``num_warps`` /
  ``num_stages``), so the call goes to Triton and not to Mosaic GPU (jax 0.10
  picks Mosaic GPU for a CUDA ``pallas_call`` without compiler params);
* in interpret mode (`stellax.interpret_mode`) every output starts as NaN (a
  NaN-filled buffer aliased into the output), so an element a kernel forgets to
  write fails the numerics checks instead of silently reading as zero;
* scalar-prefetch operands (Mosaic TPU: page tables, group metadata) are named
  too; Pallas passes them to the index maps positionally, in the order given;
* Mosaic TPU launches (`tpu_kernel_call`) always state each grid axis's
  semantics; interpreted, they run under ``pltpu.InterpretParams`` with race
  detection and NaN-filled uninitialized memory: a read of scratch no step
  wrote is NaN, and so is an output element the first grid step leaves
  unwritten. Later steps reuse the VMEM block buffers (as on a TPU), so an
  element a later step leaves unwritten holds the previous block's value:
  wrong against the golden, which is how the numerics checks catch it.

Helpers: `cdiv`, `pad_axis`, `padded_dim`, `nbytes`, `dot` / `dot_nt` / `dot_tn`
(explicit precision, float32 accumulation; `TF32X3` puts float32 dots on GPU
tensor cores at about float32 accuracy, emulated bit for bit in interpret
mode), `mxu_dot` / `mxu_dot_nt` / `mxu_dot_tn` (Mosaic TPU: float32 operands at
a resolved precision, `core.precision`), `triton_precision`, `iota`, `square_iota`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from .config import next_power_of_two
from .platform import interpret_enabled
from .precision import mxu_dot_general

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
#: Float32 dots as three TF32 tensor-core passes, ``a_hi·b_hi + a_hi·b_lo +
#: a_lo·b_hi`` (``hi`` = the value rounded to TF32's 10 mantissa bits, ``lo``
#: the remainder, truncated to TF32 by the tensor core): relative error about
#: 2⁻²⁰ instead of 2⁻²⁴, on tensor cores (an IEEE float32 `HIGHEST` dot is
#: scalar FMA on a GPU, ~15× slower on an H200). Triton kernels only: on a CPU
#: (interpret mode) the three passes are emulated with the same roundings.
TF32X3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


# -- sizes and padding ------------------------------------------------------------
def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` for Python ints (``pl.cdiv`` works on traced values too)."""
    return -(-int(a) // int(b))


def padded_dim(d: int, minimum: int = 16) -> int:
    """A head/feature size padded to a power of two ≥ ``minimum`` (16 is
    ``tl.dot``'s smallest operand dimension)."""
    return max(int(minimum), next_power_of_two(int(d)))


def pad_axis(x: jax.Array, axis: int, length: int, value=0) -> jax.Array:
    """``x`` padded at the end of ``axis`` to ``length`` with ``value`` (no-op
    when it is already at least that long)."""
    extra = int(length) - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def nbytes(x: Any) -> int:
    """Bytes of an array or `jax.ShapeDtypeStruct` (0 for ``None``)."""
    if x is None:
        return 0
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


# -- in-kernel math -----------------------------------------------------------------
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))


def _tf32_bits(x, round_to_nearest: bool):
    """``x`` (float32) with its 13 low mantissa bits cleared: rounded to the
    nearest TF32, ties away from zero (``cvt.rna.tf32.f32``), or truncated
    (what a tensor core does to a TF32 operand's extra bits)."""
    bits = jax.lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
    if round_to_nearest:
        bits = bits + jnp.uint32(0x1000)
    return jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFE000), F32)


def _dot_general(a, b, dims, precision, out_dtype):
    if precision == TF32X3 and interpret_enabled():
        a_hi, b_hi = _tf32_bits(a, True), _tf32_bits(b, True)
        a_lo = _tf32_bits(a.astype(F32) - a_hi, False)
        b_lo = _tf32_bits(b.astype(F32) - b_hi, False)
        exact = lambda x, y: jax.lax.dot_general(x, y, dims, precision=HIGHEST, preferred_element_type=F32)
        return (exact(a_lo, b_hi) + exact(a_hi, b_lo) + exact(a_hi, b_hi)).astype(out_dtype)
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)


def dot(a, b, *, precision=HIGHEST, out_dtype=F32):
    """``a [M, K] · b [K, N]`` accumulated in ``out_dtype``."""
    return _dot_general(a, b, _NN, precision, out_dtype)


def dot_nt(a, b, *, precision=HIGHEST, out_dtype=F32):
    """``a [M, K] · b [N, K]ᵀ`` accumulated in ``out_dtype``."""
    return _dot_general(a, b, _NT, precision, out_dtype)


def dot_tn(a, b, *, precision=HIGHEST, out_dtype=F32):
    """``a [K, M]ᵀ · b [K, N]`` accumulated in ``out_dtype``."""
    return _dot_general(a, b, _TN, precision, out_dtype)


def triton_precision(precision):
    """A resolved float32 precision (`core.precision.resolve_precision`) as Triton
    kernels run it: ``DEFAULT`` one TF32 pass; ``HIGH`` and ``HIGHEST`` three
    (`TF32X3`, ~1e-6 relative, on tensor cores: an IEEE float32 dot would be
    scalar FMA)."""
    return jax.lax.Precision.DEFAULT if precision == jax.lax.Precision.DEFAULT else TF32X3


def mxu_dot(a, b, precision, out_dtype=F32):
    """``a [M, K] · b [K, N]`` in a Mosaic TPU kernel at a resolved ``precision``
    (`core.precision.mxu_dot_general`)."""
    return mxu_dot_general(a, b, _NN, precision, out_dtype)


def mxu_dot_nt(a, b, precision, out_dtype=F32):
    """``a [M, K] · b [N, K]ᵀ`` in a Mosaic TPU kernel (`mxu_dot`)."""
    return mxu_dot_general(a, b, _NT, precision, out_dtype)


def mxu_dot_tn(a, b, precision, out_dtype=F32):
    """``a [K, M]ᵀ · b [K, N]`` in a Mosaic TPU kernel (`mxu_dot`)."""
    return mxu_dot_general(a, b, _TN, precision, out_dtype)


def online_softmax_step(s, m_ref, l_ref):
    """One online-softmax step over logits ``s [R, C]`` (float32, ``-inf`` where
    masked) with the running max ``m_ref`` and sum ``l_ref`` (``[R, W]`` refs,
    every column equal): updates both and returns ``(p [R, C], alpha [R, W])``,
    the block's probabilities against the new max and the factor that rescales
    the previous accumulator (``acc ← alpha · acc + p · V``). A row with no
    visible logit yet keeps ``m = -inf`` and gets ``p = 0``, ``alpha = 1``."""
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, :1])
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    m_ref[...] = m_new
    return p, alpha


def iota(n: int, dtype=jnp.int32) -> jax.Array:
    """``[0, 1, ..., n-1]`` inside a kernel."""
    return jax.lax.broadcasted_iota(dtype, (int(n),), 0)


def square_iota(n: int) -> tuple[jax.Array, jax.Array]:
    """``(rows, cols)`` index grids of an ``[n, n]`` tile."""
    rows = jax.lax.broadcasted_iota(jnp.int32, (int(n), int(n)), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (int(n), int(n)), 1)
    return rows, cols


# -- named operands -------------------------------------------------------------------
class Operand(NamedTuple):
    """An input array and its block spec (``None`` spec: the whole array)."""

    array: Any
    spec: Any = None


class Output(NamedTuple):
    """An output's shape/dtype and its block spec."""

    shape: jax.ShapeDtypeStruct
    spec: Any = None


def operand(array, spec=None) -> Operand | None:
    """An input operand, or ``None`` when ``array`` is ``None`` (optional operand)."""
    return None if array is None else Operand(array, spec)


def output(shape, dtype, spec=None) -> Output:
    """An output operand of ``shape`` and ``dtype``."""
    return Output(jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)), spec)


class Outputs(dict):
    """A kernel's outputs by name (``None`` for absent ones); ``outs.y`` or ``outs["y"]``."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _present(table: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (table or {}).items() if v is not None}


def _poison(shape_dtype: jax.ShapeDtypeStruct) -> jax.Array:
    dtype = jnp.dtype(shape_dtype.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        fill = jnp.nan
    elif jnp.issubdtype(dtype, jnp.integer):
        fill = jnp.iinfo(dtype).min
    else:
        fill = False
    return jnp.full(shape_dtype.shape, fill, dtype)


@dataclasses.dataclass(frozen=True)
class _Binding:
    """Which names the flat ``*refs`` of a ``pallas_call`` kernel carry, in order."""

    prefetch: tuple[str, ...]
    inputs: tuple[str, ...]
    poison: int
    outputs: tuple[str, ...]
    scratch: tuple[str, ...]
    absent: tuple[str, ...]

    def kernel(self, kernel: Callable[..., None]) -> Callable[..., None]:
        groups = (self.prefetch, self.inputs, (None,) * self.poison, self.outputs, self.scratch)
        order = [name for group in groups for name in group]

        def flat_kernel(*refs):
            named = {name: ref for name, ref in zip(order, refs, strict=True) if name is not None}
            named.update(dict.fromkeys(self.absent))
            kernel(**named)

        return flat_kernel


def _block_aligned(array, spec) -> bool:
    """Whether ``array``'s shape is a whole number of ``spec``'s blocks (no padded edge block)."""
    block = getattr(spec, "block_shape", None)
    if block is None:
        return True
    return all(b is None or not isinstance(b, int) or size % b == 0 for size, b in zip(array.shape, block))


def _alias_indices(name: str, aliases: Mapping[str, str] | None, ins: Mapping, outs: Mapping, *,
                   interpreted: bool) -> dict[int, int]:
    """``aliases`` (input name → output name, both present) as positions among the inputs and
    outputs. Interpreted, an input with a partial edge block is not aliased: jax 0.10.2's TPU
    interpreter pads such an input and would return the padded buffer as the output (a shape
    mismatch); the output then starts uninitialized (NaN), which is the same for a kernel that
    writes all of it, and fails the numerics checks for one that relies on the alias."""
    in_names, out_names = list(ins), list(outs)
    found = {}
    for source, target in (aliases or {}).items():
        if source not in ins or target not in outs:
            raise ValueError(f"kernel_call({name}): aliases: expected an input and an output, got "
                             f"{source!r} -> {target!r}")
        array, shape = ins[source].array, outs[target].shape
        if tuple(array.shape) != tuple(shape.shape) or jnp.dtype(array.dtype) != jnp.dtype(shape.dtype):
            raise ValueError(f"kernel_call({name}): aliases: {source!r} {array.shape} {array.dtype} cannot hold "
                             f"{target!r} {shape.shape} {shape.dtype}")
        if not interpreted or _block_aligned(array, ins[source].spec):
            found[in_names.index(source)] = out_names.index(target)
    return found


def kernel_call(
    kernel: Callable[..., None],
    *,
    grid: tuple[int, ...],
    inputs: Mapping[str, Operand | None],
    outputs: Mapping[str, Output | None],
    scratch: Mapping[str, Any] | None = None,
    scalar_prefetch: Mapping[str, Any] | None = None,
    compiler_params: Any = None,
    interpret: Any = None,
    poison_outputs: bool = False,
    aliases: Mapping[str, str] | None = None,
    name: str,
    **pallas_kwargs,
) -> Outputs:
    """Launch ``kernel`` with named operands on any Pallas backend.

    Args:
      kernel: called as ``kernel(**refs)`` once per grid step, every name of
        ``scalar_prefetch``, ``inputs``, ``outputs`` and ``scratch`` a keyword
        (``None`` for an absent optional operand).
      grid: the launch grid.
      inputs / outputs: name → `Operand` / `Output`, or ``None`` (absent).
      scratch: name → scratch shape (``pltpu.VMEM(...)``, ...).
      scalar_prefetch: name → int32 array prefetched to scalar memory (Mosaic
        TPU); the index maps receive them after the grid indices, in this order.
      compiler_params: the backend's compiler params.
      interpret: ``None``/``False`` to compile, ``True`` or backend interpret
        params to interpret.
      poison_outputs: start every output as NaN (``iinfo.min`` for integers),
        except those ``aliases`` gives an input's buffer.
      aliases: input name → output name: the output is written into the
        input's buffer (``input_output_aliases``; same shape and dtype): an
        in-place update, or a loop carry XLA need not copy.
      name: the kernel's name in HLO and profiles.
      pallas_kwargs: passed to ``pl.pallas_call`` (``cost_estimate``, ...).

    Returns:
      `Outputs`: every name of ``outputs``, ``None`` where the output was ``None``.
    """
    ins, outs = _present(inputs), _present(outputs)
    given_scratch, scratch, prefetch = scratch, _present(scratch), _present(scalar_prefetch)
    if not outs:
        raise ValueError(f"kernel_call({name}): outputs: expected at least one output, got none")
    absent = tuple(k for k in (*(inputs or {}), *(outputs or {}), *(given_scratch or {}))
                   if k not in {**ins, **outs, **scratch})
    in_place = _alias_indices(name, aliases, ins, outs, interpreted=bool(interpret))
    poisoned = [i for i in range(len(outs)) if i not in in_place.values()] if poison_outputs else []
    binding = _Binding(tuple(prefetch), tuple(ins), len(poisoned), tuple(outs), tuple(scratch), absent)
    in_specs = [op.spec for op in ins.values()]
    out_specs = [o.spec for o in outs.values()]
    out_shapes = [o.shape for o in outs.values()]
    arrays = [op.array for op in ins.values()]
    aliases = {len(prefetch) + i: o for i, o in in_place.items()}
    if poisoned:
        offset = len(prefetch) + len(arrays)
        aliases.update({offset + k: i for k, i in enumerate(poisoned)})
        in_specs = in_specs + [out_specs[i] for i in poisoned]
        arrays = arrays + [_poison(out_shapes[i]) for i in poisoned]
    if prefetch:
        launch_grid = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=list(scratch.values()))
        call = pl.pallas_call(binding.kernel(kernel), out_shape=out_shapes, grid_spec=launch_grid,
                              compiler_params=compiler_params, input_output_aliases=aliases,
                              interpret=interpret or False, name=name, **pallas_kwargs)
        results = call(*prefetch.values(), *arrays)
    else:
        call = pl.pallas_call(binding.kernel(kernel), out_shape=out_shapes, grid=grid, in_specs=in_specs,
                              out_specs=out_specs, scratch_shapes=list(scratch.values()),
                              compiler_params=compiler_params, input_output_aliases=aliases,
                              interpret=interpret or False, name=name, **pallas_kwargs)
        results = call(*arrays)
    by_name = dict(zip(outs, results, strict=True))
    return Outputs({k: by_name.get(k) for k in (outputs or {})})


def triton_kernel_call(
    kernel: Callable[..., None],
    *,
    grid: tuple[int, ...],
    inputs: Mapping[str, Operand | None],
    outputs: Mapping[str, Output | None],
    num_warps: int,
    num_stages: int,
    name: str,
    scratch: Mapping[str, Any] | None = None,
) -> Outputs:
    """`kernel_call` for a Pallas Triton kernel: Triton compiler params always
    passed; interpreted with NaN-poisoned outputs in interpret mode."""
    interpret = interpret_enabled()
    return kernel_call(
        kernel, grid=grid, inputs=inputs, outputs=outputs, scratch=scratch,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, poison_outputs=interpret, name=name,
    )



def tpu_interpret_params():
    """How TPU kernels are interpreted on a CPU: races between grid steps
    detected, uninitialized VMEM and scratch NaN."""
    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def tpu_kernel_call(
    kernel: Callable[..., None],
    *,
    grid: tuple[int, ...],
    inputs: Mapping[str, Operand | None],
    outputs: Mapping[str, Output | None],
    dimension_semantics: tuple[str, ...],
    name: str,
    scratch: Mapping[str, Any] | None = None,
    scalar_prefetch: Mapping[str, Any] | None = None,
    vmem_limit_bytes: int | None = None,
    cost_estimate: Any = None,
    aliases: Mapping[str, str] | None = None,
) -> Outputs:
    """`kernel_call` for a Pallas Mosaic TPU kernel.

    ``dimension_semantics`` gives each grid axis as ``"parallel"`` (steps are
    independent: split across megacore TensorCores) or ``"arbitrary"``
    (sequential: an accumulator or a recurrent state carried in scratch).
    ``vmem_limit_bytes`` raises the scoped-VMEM limit above the generation's
    default (`stellax.core.tpu`). ``aliases`` (input name → output name)
    writes an output into an input's buffer (`kernel_call`). In interpret mode
    the kernel runs with `tpu_interpret_params`.
    """
    if len(dimension_semantics) != len(grid):
        raise ValueError(f"tpu_kernel_call({name}): dimension_semantics: expected {len(grid)} entries "
                         f"(one per grid axis), got {dimension_semantics!r}")
    interpret = tpu_interpret_params() if interpret_enabled() else None
    params = pltpu.CompilerParams(dimension_semantics=tuple(dimension_semantics),
                                  vmem_limit_bytes=vmem_limit_bytes)
    extra = {} if cost_estimate is None else {"cost_estimate": cost_estimate}
    return kernel_call(kernel, grid=grid, inputs=inputs, outputs=outputs, scratch=scratch,
                       scalar_prefetch=scalar_prefetch, compiler_params=params,
                       interpret=interpret, aliases=aliases, name=name, **extra)
