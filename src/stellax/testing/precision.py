"""Checking the float32 contract (`stellax.core.precision`) without a TPU.

On a CPU every precision computes in float32, so numerics alone cannot show
that a ``precision`` reached every contraction. `contractions` traces a
function and lists every ``dot_general`` in its program — inside ``jit``,
``custom_vjp``, ``scan``/``while``/``cond`` bodies and the kernels of
``pallas_call`` — with its operand dtypes and precision;
`assert_precision_honoured` fails when a float32 contraction runs at another
precision than the one asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.extend  # noqa: F401  (jax.extend.core below; not loaded by `import jax`)
import numpy as np

from ..core.pallas import TF32X3
from ..core.precision import DEFAULT, HIGH, HIGHEST, resolve_precision


@dataclasses.dataclass(frozen=True)
class Contraction:
    """One ``dot_general`` in a traced program."""

    lhs_dtype: str
    rhs_dtype: str
    precision: Any          # None, a (lhs, rhs) pair of jax.lax.Precision, or a DotAlgorithmPreset
    in_kernel: bool         # inside a pallas_call kernel

    @property
    def float32(self) -> bool:
        return "float32" in (self.lhs_dtype, self.rhs_dtype)

    def level(self):
        """The precision this contraction runs a float32 operand at, or None when unset."""
        p = self.precision
        if p is None:
            return None
        if p == TF32X3:
            return "tf32x3"
        if isinstance(p, (tuple, list)):
            p = p[0]
        return p


def _subjaxprs(params: dict) -> Iterator:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item
            elif hasattr(item, "jaxpr") and isinstance(getattr(item, "jaxpr"), jax.extend.core.Jaxpr):
                yield item.jaxpr  # e.g. pallas_call's kernel, custom_vjp's fun_jaxpr wrappers


def _walk(jaxpr, in_kernel: bool) -> Iterator[Contraction]:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars[:2])
            yield Contraction(np.dtype(lhs.dtype).name, np.dtype(rhs.dtype).name, eqn.params.get("precision"),
                              in_kernel)
        kernel = in_kernel or name == "pallas_call"
        for sub in _subjaxprs(eqn.params):
            yield from _walk(sub, kernel)


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def contractions(fn: Callable, *args, **kwargs) -> list[Contraction]:
    """Every ``dot_general`` in ``fn(*args, **kwargs)``'s program. Array
    arguments (positional or keyword, in pytrees too) may be arrays or
    `jax.ShapeDtypeStruct`s and are traced; the other leaves stay static.
    Trace ``jax.grad`` of a loss to see the backward's contractions too."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: x is None)
    traced = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def flat_fn(*arrays):
        full = list(leaves)
        for i, a in zip(traced, arrays):
            full[i] = a
        a, kw = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **kw)

    closed = jax.make_jaxpr(flat_fn)(*[leaves[i] for i in traced])
    return list(_walk(closed.jaxpr, False))


def violations(found: list[Contraction], precision: Any) -> list[Contraction]:
    """The float32 contractions in ``found`` that do not run at ``precision``
    (resolved). ``DEFAULT`` also accepts an unset precision (XLA's default);
    Triton's three TF32 passes (`TF32X3`) count as ``HIGH`` and ``HIGHEST``,
    its one-pass ``DEFAULT`` as ``DEFAULT``. A Mosaic TPU kernel writes
    ``DEFAULT`` and ``HIGH`` as bfloat16 passes, so its float32 contractions
    only appear at ``HIGHEST``."""
    want = resolve_precision(precision)
    accepted = {DEFAULT: (DEFAULT, None), HIGH: (HIGH, "tf32x3"), HIGHEST: (HIGHEST, "tf32x3")}[want]
    # Interpret mode emulates a Triton kernel's three TF32 passes with HIGHEST dots on rounded
    # operands (`core.pallas._dot_general`): inside a kernel, HIGHEST also meets "high".
    in_kernel = (HIGHEST,) if want == HIGH else ()
    return [c for c in found if c.float32 and c.level() not in accepted
            and not (c.in_kernel and c.level() in in_kernel)]


def assert_precision_honoured(fn: Callable, *args, precision: Any, **kwargs) -> list[Contraction]:
    """Raise ``AssertionError`` listing every float32 contraction of ``fn`` that
    runs at another precision than ``precision``; return all contractions found
    (so a caller can also assert there were some)."""
    found = contractions(fn, *args, **kwargs)
    bad = violations(found, precision)
    if bad:
        shown = "; ".join(f"{c.lhs_dtype}x{c.rhs_dtype} at {c.precision} ({'kernel' if c.in_kernel else 'XLA'})"
                          for c in bad[:8])
        raise AssertionError(f"{len(bad)} of {len(found)} contractions ignore precision={precision!r}: {shown}")
    return found
