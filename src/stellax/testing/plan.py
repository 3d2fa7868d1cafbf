"""What `stellax check` runs: a list of check jobs, planned before anything runs
(so a progress bar knows the total), then run one at a time.

A `CheckJob` is one (op, implementation, dtype, example) with or without
gradients. `plan_checks` builds the list:

* the full sweep (``full=True``, `stellax check --all`): every example of every
  selected op and implementation in every requested dtype (default float32 and
  bfloat16), gradients for differentiable ops;
* the quick default: every registered op against its golden on its first
  example in float32, with gradients for the ops that have them, through every
  XLA implementation and every kernel implementation whose interpreted run is
  cheap on a CPU. Kernels listed in `SLOW_INTERPRETED` are left to ``--all``
  (and to the registry tests, which check every kernel and config) unless
  named explicitly with ``implementations``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import jax.numpy as jnp
import numpy as np

from ..core import Example, Op, current_platform, interpret_enabled, interpret_mode
from .validation import CheckResult, safe_check_example

#: (op, implementation) pairs whose interpreted run on a CPU costs several
#: seconds of compile and interpretation for one example; the quick default
#: leaves them to ``--all`` (measured on a 2-core CPU, see docs/testing notes
#: in the registry tests).
SLOW_INTERPRETED: frozenset[tuple[str, str]] = frozenset()

QUICK_DTYPES = ("float32",)
FULL_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class CheckJob:
    """One check: ``op`` with ``implementation`` on ``example`` (built in ``dtype``)."""

    op: Op
    implementation: str
    dtype: str
    example: Example
    gradients: bool

    def run(self) -> CheckResult:
        """Check against the golden; kernels run interpreted on a CPU."""
        kernel = self.op.implementations[self.implementation].is_kernel
        interpret = interpret_enabled() or (current_platform().backend == "cpu" and kernel)
        with interpret_mode(interpret):
            return safe_check_example(self.op, self.implementation, self.example, jnp.dtype(self.dtype),
                                      gradients=self.gradients)


def select_ops(ops: Mapping[str, Op], names: Iterable[str]) -> dict[str, Op]:
    """The ops named in ``names`` by op name or family (all when empty)."""
    names = list(names)
    if not names:
        return dict(ops)
    return {n: op for n, op in ops.items() if n in names or op.family in names}


def plan_checks(ops: Mapping[str, Op], *, full: bool = False, dtypes: Iterable[str] | None = None,
                implementations: Iterable[str] | None = None, gradients: bool = True) -> list[CheckJob]:
    """The jobs of one `stellax check` run, in order (sorted by op name).

    ``dtypes``: dtype names (default float32, plus bfloat16 with ``full``);
    ``implementations``: names to keep (others are dropped per op; an op with
    none of them gets no job)."""
    dtype_names = list(dtypes) if dtypes else list(FULL_DTYPES if full else QUICK_DTYPES)
    for name in dtype_names:
        try:
            np.dtype(jnp.dtype(name))
        except TypeError:
            raise ValueError(f"dtypes: expected dtype names such as float32,bfloat16, got {name!r}") from None
    wanted = list(implementations) if implementations else None
    jobs = []
    for name, op in sorted(ops.items()):
        chosen = [i for i in op.implementations if wanted is None or i in wanted]
        if not full and wanted is None:
            chosen = [i for i in chosen if (name, i) not in SLOW_INTERPRETED]
        grads = gradients and bool(op.differentiable)
        examples = {d: op.examples(jnp.dtype(d)) for d in dtype_names} if chosen else {}
        for impl in chosen:
            for dtype in dtype_names:
                selected = examples[dtype] if full else examples[dtype][:1]
                jobs += [CheckJob(op, impl, dtype, example, grads) for example in selected]
    return jobs
