"""Numerics harness: random inputs, golden comparison, tolerances, determinism.

The policy (DESIGN.md): the golden runs in float32 at ``Precision.HIGHEST``;
errors are reported as max-abs, relative L2 (‖out−ref‖/‖ref‖) and the fraction
of elements within an elementwise tolerance; a result passes when its relative
L2 error is within the dtype's tolerance (2× for gradients) and it holds no
NaN where the reference has none.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..core.vjp import vjp_at

#: Relative L2 tolerance per dtype for forward results.
REL_L2_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3, "float64": 1e-12}
#: Elementwise tolerance (|out−ref| ≤ atol + rtol·|ref|) used for "% within".
ELEMENT_TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (2e-2, 2e-2), "float16": (2e-3, 2e-3),
                     "float64": (1e-12, 1e-12)}


def tolerance(dtype, *, gradient: bool = False) -> float:
    """The relative-L2 tolerance for results computed in ``dtype``."""
    name = np.dtype(dtype).name
    tol = REL_L2_TOLERANCE.get(name, 1e-2)
    return 2 * tol if gradient else tol


#: Relative-L2 tolerance of a float32 result computed at a reduced contraction precision
#: (`stellax.core.precision`): ``"high"`` (three bfloat16 / TF32 passes, ~1e-5 per product) and
#: ``"default"`` (one bfloat16 pass on a TPU, ~2e-3 per product: bfloat16's tolerance).
REDUCED_PRECISION_TOLERANCE = {"high": 1e-4, "default": 1e-2}


def contract_tolerance(dtype, precision=None, *, gradient: bool = False) -> float:
    """The relative-L2 tolerance for results in ``dtype`` computed at contraction
    ``precision`` (None / ``"highest"``: the dtype's own, `tolerance`). A reduced
    precision loosens only float32 (narrower dtypes contract natively), never below
    the dtype's own tolerance."""
    own = tolerance(dtype, gradient=gradient)
    if precision is None or np.dtype(dtype).name != "float32":
        return own
    from ..core.precision import resolve_precision

    name = resolve_precision(precision).name.lower()
    reduced = REDUCED_PRECISION_TOLERANCE.get(name)
    if reduced is None:
        return own
    return max(own, 2 * reduced if gradient else reduced)


#: Arrays larger than this many values are drawn in pieces of it (`random_array`).
RANDOM_PIECE = 1 << 26


def random_array(key, shape, dtype=jnp.float32, *, scale: float = 1.0, offset: float = 0.0):
    """Normal random values cast to ``dtype``; exact zeros are nudged away so
    a kernel that writes zeros can never pass by accident.

    An array of more than `RANDOM_PIECE` values is drawn piece by piece (key
    ``fold_in(key, i)`` for piece ``i``) and joined: drawn at once, a benchmark's
    expert weights (1.9G bfloat16 values) take their random bits and float32
    normals as well, 17.5 GB of temporaries on a 16 GiB TPU."""
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if size <= RANDOM_PIECE:
        return _random_piece(key, shape, dtype, scale, offset)
    pieces = [_random_piece(jax.random.fold_in(key, i), (min(RANDOM_PIECE, size - start),), dtype, scale, offset)
              for i, start in enumerate(range(0, size, RANDOM_PIECE))]
    return jnp.concatenate(pieces).reshape(shape)


def _random_piece(key, shape, dtype, scale, offset):
    x = offset + scale * jax.random.normal(key, shape, jnp.float32)
    x = jnp.where(x == 0, jnp.float32(scale * 1e-3 + 1e-3), x)
    return x.astype(dtype)


def random_inputs(key, shapes: Sequence[Sequence[int]], dtype=jnp.float32, **kwargs) -> list[jax.Array]:
    keys = jax.random.split(key, len(shapes))
    return [random_array(k, s, dtype, **kwargs) for k, s in zip(keys, shapes)]


def upcast(tree):
    """Floating leaves to float32 (for the golden)."""
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(x, jnp.float32)
        return x
    return jax.tree_util.tree_map(cast, tree)


def golden(fn: Callable[..., Any], *args, **kwargs):
    """``fn`` on float32-upcast arguments at the highest matmul precision, on the host CPU.

    On an accelerator the golden still runs on the CPU: a TPU's own float32
    transcendental functions are approximations (measured on a v5e: ``log`` 6.5e-6
    rms, ``tanh`` up to 8e-5, ``softplus`` 2.6e-4; docs/precision.md), so a golden
    computed there with them cannot hold an implementation to float32's 1e-5. The
    CPU's float32 functions are correct to an ulp or two; the examples are small."""
    args, kwargs = upcast(args), upcast(kwargs)
    with jax.default_matmul_precision("highest"):
        if jax.default_backend() == "cpu":
            return fn(*args, **kwargs)
        cpu = jax.devices("cpu")[0]
        to_cpu = lambda x: jax.device_put(x, cpu) if isinstance(x, (jax.Array, np.ndarray)) else x
        args, kwargs = jax.tree_util.tree_map(to_cpu, (args, kwargs))
        with jax.default_device(cpu):
            return fn(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class ErrorSummary:
    """Error of one array against its reference."""

    max_abs: float
    rel_l2: float
    fraction_within: float
    has_nan: bool
    reference_has_nan: bool
    tolerance: float
    shape: tuple

    @property
    def passed(self) -> bool:
        if self.has_nan and not self.reference_has_nan:
            return False
        return self.rel_l2 <= self.tolerance

    def __str__(self) -> str:
        status = "ok" if self.passed else "FAIL"
        return (f"{status}: rel_l2={self.rel_l2:.2e} (tol {self.tolerance:.1e}) max_abs={self.max_abs:.2e} "
                f"within={100 * self.fraction_within:.2f}% nan={self.has_nan} shape={self.shape}")


def compare(out, ref, *, dtype=None, gradient: bool = False, rel_l2_tolerance: float | None = None) -> ErrorSummary:
    """Summarize ``out`` against ``ref`` (computed in float64 on the host).

    ``dtype`` selects the tolerance (default: ``out``'s dtype)."""
    out_np = np.asarray(jnp.asarray(out).astype(jnp.float32), dtype=np.float64)
    ref_np = np.asarray(jnp.asarray(ref).astype(jnp.float32), dtype=np.float64)
    if out_np.shape != ref_np.shape:
        raise AssertionError(f"shape mismatch: out {out_np.shape} vs reference {ref_np.shape}")
    dtype_name = np.dtype(dtype if dtype is not None else jnp.asarray(out).dtype).name
    tol = rel_l2_tolerance if rel_l2_tolerance is not None else tolerance(dtype_name, gradient=gradient)
    has_nan = bool(np.isnan(out_np).any())
    ref_nan = bool(np.isnan(ref_np).any())
    both_finite = np.isfinite(out_np) & np.isfinite(ref_np)
    same_nonfinite = (np.isnan(out_np) & np.isnan(ref_np)) | (np.isinf(out_np) & (out_np == ref_np))
    with np.errstate(invalid="ignore"):  # inf - inf where both are non-finite is masked below
        diff = np.where(both_finite, np.abs(out_np - ref_np), np.where(same_nonfinite, 0.0, np.inf))
    ref_norm = np.sqrt(np.sum(np.where(np.isfinite(ref_np), ref_np, 0.0) ** 2))
    err_norm = np.sqrt(np.sum(diff**2)) if np.isfinite(diff).all() else np.inf
    rel = float(err_norm / ref_norm) if ref_norm > 0 else float(err_norm)
    atol, rtol = ELEMENT_TOLERANCE.get(dtype_name, (1e-2, 1e-2))
    within = diff <= atol + rtol * np.abs(np.where(np.isfinite(ref_np), ref_np, 0.0))
    return ErrorSummary(
        max_abs=float(diff.max()) if diff.size else 0.0,
        rel_l2=rel,
        fraction_within=float(within.mean()) if within.size else 1.0,
        has_nan=has_nan,
        reference_has_nan=ref_nan,
        tolerance=tol,
        shape=out_np.shape,
    )


@jax.jit
def _device_errors(out, ref, atol, rtol):
    """`compare`'s statistics in float32 on the device: ``(max_abs, ‖ref‖, ‖out − ref‖ (inf where
    out and ref are not finite alike), fraction within atol + rtol·|ref|, out has NaN, ref has
    NaN)``. The norms are taken of the values over their largest magnitude, so no square overflows."""
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    ref_finite = jnp.isfinite(ref)
    both = jnp.isfinite(out) & ref_finite
    same_nonfinite = (jnp.isnan(out) & jnp.isnan(ref)) | (jnp.isinf(out) & (out == ref))
    diff = jnp.where(both, jnp.abs(out - ref), jnp.where(same_nonfinite, 0.0, jnp.inf))
    out_nan, ref_nan = jnp.any(jnp.isnan(out)), jnp.any(jnp.isnan(ref))
    ref = jnp.where(ref_finite, ref, 0.0)
    finite_diff = jnp.where(jnp.isfinite(diff), diff, 0.0)

    def norm(x):
        scale = jnp.maximum(jnp.max(jnp.abs(x)), jnp.finfo(jnp.float32).tiny)
        return jnp.sqrt(jnp.sum(jnp.square(x / scale))) * scale

    err = jnp.where(jnp.all(jnp.isfinite(diff)), norm(finite_diff), jnp.inf)
    within = jnp.mean((diff <= atol + rtol * jnp.abs(ref)).astype(jnp.float32))
    return jnp.max(diff), norm(ref), err, within, out_nan, ref_nan


def compare_on_device(out, ref, *, dtype=None, gradient: bool = False,
                      rel_l2_tolerance: float | None = None) -> ErrorSummary:
    """`compare` computed on the device in float32 rather than on the host in float64: for
    outputs too large to bring to the host (a 64-expert weight gradient holds 940M values, 7.5 GB
    per float64 copy). The float32 sums agree with `compare`'s to about 1e-6 relative."""
    if jnp.shape(out) != jnp.shape(ref):
        raise AssertionError(f"shape mismatch: out {jnp.shape(out)} vs reference {jnp.shape(ref)}")
    if not np.prod(jnp.shape(out)):
        return compare(out, ref, dtype=dtype, gradient=gradient, rel_l2_tolerance=rel_l2_tolerance)
    dtype_name = np.dtype(dtype if dtype is not None else jnp.asarray(out).dtype).name
    tol = rel_l2_tolerance if rel_l2_tolerance is not None else tolerance(dtype_name, gradient=gradient)
    atol, rtol = ELEMENT_TOLERANCE.get(dtype_name, (1e-2, 1e-2))
    max_abs, ref_norm, err_norm, within, has_nan, ref_nan = (
        np.asarray(v).item() for v in _device_errors(out, ref, np.float32(atol), np.float32(rtol)))
    return ErrorSummary(max_abs=float(max_abs), rel_l2=float(err_norm / ref_norm) if ref_norm > 0 else float(err_norm),
                        fraction_within=float(within), has_nan=bool(has_nan), reference_has_nan=bool(ref_nan),
                        tolerance=tol, shape=tuple(jnp.shape(out)))


def assert_close(out, ref, *, dtype=None, gradient: bool = False, rel_l2_tolerance: float | None = None,
                 name: str = "output") -> ErrorSummary:
    """Raise ``AssertionError`` (with the error summary) unless ``out`` matches ``ref``."""
    summary = compare(out, ref, dtype=dtype, gradient=gradient, rel_l2_tolerance=rel_l2_tolerance)
    if not summary.passed:
        raise AssertionError(f"{name}: {summary}")
    return summary


def assert_trees_close(out, ref, *, dtype=None, gradient: bool = False, name: str = "output",
                       rel_l2_tolerance: float | None = None) -> list[ErrorSummary]:
    """`assert_close` leaf by leaf (``None`` leaves must match)."""
    out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=lambda x: x is None)
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref, is_leaf=lambda x: x is None)
    if out_tree != ref_tree:
        raise AssertionError(f"{name}: structure {out_tree} differs from reference {ref_tree}")
    summaries = []
    for i, (o, r) in enumerate(zip(out_leaves, ref_leaves)):
        if o is None or r is None:
            if (o is None) != (r is None):
                raise AssertionError(f"{name}[{i}]: one of output/reference is None")
            continue
        summaries.append(assert_close(o, r, dtype=dtype, gradient=gradient, name=f"{name}[{i}]",
                                      rel_l2_tolerance=rel_l2_tolerance))
    return summaries


def assert_deterministic(fn: Callable[..., Any], *args, runs: int = 2, **kwargs):
    """Run ``fn`` ``runs`` times; every output leaf must be bitwise equal."""
    first = jax.tree_util.tree_leaves(fn(*args, **kwargs))
    for _ in range(runs - 1):
        again = jax.tree_util.tree_leaves(fn(*args, **kwargs))
        for i, (a, b) in enumerate(zip(first, again)):
            a_np, b_np = np.asarray(a), np.asarray(b)
            if a_np.tobytes() != b_np.tobytes():
                raise AssertionError(f"output leaf {i} differs between runs (non-deterministic)")
    return first


def vjp_with_cotangent(fn: Callable[..., Any], args: Sequence[Any], cotangent_key, argnums: Sequence[int]):
    """Gradients of ``fn`` w.r.t. ``args[argnums]`` for a random cotangent
    (fixed by ``cotangent_key``), the output and the cotangent used."""
    out, vjp = vjp_at(fn, args, argnums)
    leaves, tree = jax.tree_util.tree_flatten(out)
    keys = jax.random.split(cotangent_key, len(leaves))
    cot = [random_array(k, l.shape, l.dtype) for k, l in zip(keys, leaves)]
    cot = jax.tree_util.tree_unflatten(tree, cot)
    return out, vjp(cot), cot
