"""What `stellax check` runs: a list of check jobs, planned before anything runs
(so a progress bar knows the total), then run one at a time.

A `CheckJob` is one (op, implementation, dtype, example index) with or
without gradients; its example is built when it runs (`examples_of`, once per
op and dtype), so the first row appears after one op's examples, not all.
`plan_checks` builds the list:

* the full sweep (``full=True``, `stellax check --all`): every example of every
  selected op and implementation in every requested dtype (default float32 and
  bfloat16), gradients for differentiable ops;
* the quick default: every registered op against its golden on its first
  example in float32 (for a kernel, the first example it supports), with gradients for the ops that have them, through every
  implementation except the kernels in `SLOW_INTERPRETED` and, off a TPU, the
  Mosaic TPU kernels (interpreting them on a CPU costs several seconds each;
  ``--all``, an explicit ``--implementations`` and the registry tests check them).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import jax.numpy as jnp

from .._op_names import OP_ALIASES
from ..core import Op, current_platform, interpret_enabled, interpret_mode
from .validation import CheckResult, examples_of, safe_check_example

#: (op, implementation) pairs the quick default leaves out: interpreting them
#: on a CPU costs the most (measured on a 2-core machine under load, first
#: example with gradients: 4-7 s of CPU each at XLA's default optimization,
#: against under 2 s for the other kernels). Their ops stay in the quick run
#: through their XLA implementations; ``--all``, ``--implementations triton``
#: and tests/test_registry_tiers.py check these kernels.
SLOW_INTERPRETED: frozenset[tuple[str, str]] = frozenset({
    ("attention", "triton"),
    ("attention_backward", "triton"),
    ("chunk_gated_delta_rule", "triton"),
    ("chunk_kda", "triton"),
    ("gated_recurrence_backward", "triton"),
    ("kda_recurrence_backward", "triton"),
    ("moe_mlp", "triton"),
    ("ssd", "triton"),
})

def _interpreted_tpu(op: Op, implementation: str) -> bool:
    """Mosaic TPU kernels off a TPU: interpreted with race detection they cost
    15-60 s of CPU per example, so the quick run leaves them to ``--all``,
    ``--implementations mosaic_tpu`` and the test tiers (on a TPU they run natively)."""
    return op.implementations[implementation].backend == "mosaic_tpu" and current_platform().backend != "tpu"


QUICK_DTYPES = ("float32",)
FULL_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class CheckJob:
    """One check: ``op`` with ``implementation`` on example number ``example``
    of ``op.examples(dtype)`` (``None``: the first the implementation supports)."""

    op: Op
    implementation: str
    dtype: str
    example: int | None
    gradients: bool
    precision: str | None = "highest"

    @property
    def description(self) -> str:
        return f"{self.op.name} · {self.implementation} · {self.dtype}"

    def run(self) -> CheckResult:
        """Check against the golden; kernels run interpreted on a CPU. An op
        without examples gives a skipped result saying so."""
        examples = examples_of(self.op, self.dtype)
        if not examples:
            return CheckResult(self.op.name, self.implementation, self.dtype, "-", True, None,
                               skipped=f"{self.op.name} has no examples")
        impl = self.op.implementations[self.implementation]
        interpret = interpret_enabled() or (current_platform().backend == "cpu" and impl.is_kernel)
        with interpret_mode(interpret):
            index = self.example if self.example is not None else self._first_supported(impl, examples)
            return safe_check_example(self.op, self.implementation, examples[index], jnp.dtype(self.dtype),
                                      gradients=self.gradients, precision=self.precision)

    def _first_supported(self, impl, examples) -> int:
        """The first example ``impl`` supports here (0 when none does: its row says why)."""
        for index, example in enumerate(examples):
            if impl.supported(self.op.check(*example.args, **example.kwargs)):
                return index
        return 0


def select_ops(ops: Mapping[str, Op], names: Iterable[str]) -> dict[str, Op]:
    """The ops named in ``names`` by op name (the registry's or the public
    function's: ``rms_norm`` selects ``layer_norm``) or family (all when empty)."""
    names = list(names)
    if not names:
        return dict(ops)
    op_names = {OP_ALIASES.get(n, n) for n in names}
    return {n: op for n, op in ops.items() if n in op_names or op.family in names}


def _dtype_names(dtypes: Iterable[str] | None, full: bool) -> list[str]:
    names = list(dtypes) if dtypes else list(FULL_DTYPES if full else QUICK_DTYPES)
    for name in names:
        try:
            jnp.dtype(name)
        except TypeError:
            raise ValueError(f"dtypes: expected dtype names such as float32,bfloat16, got {name!r}") from None
    return [jnp.dtype(n).name for n in names]


def plan_checks(ops: Mapping[str, Op], *, full: bool = False, dtypes: Iterable[str] | None = None,
                implementations: Iterable[str] | None = None, gradients: bool = True,
                precision: str | None = "highest") -> list[CheckJob]:
    """The jobs of one `stellax check` run, in order (by op name, then
    implementation, dtype and example).

    ``dtypes``: dtype names (default float32, plus bfloat16 with ``full``);
    ``implementations``: names to keep (an op with none of them gets no job).
    ``precision``: the contraction precision every op that takes one is run
    at, and its float32 tolerance (`validation.check_example`).
    Only ``full`` builds examples here (to count them)."""
    if precision is not None:
        from ..core.precision import check_precision

        precision = check_precision(precision, "--precision").name.lower()
    dtype_names = _dtype_names(dtypes, full)
    wanted = list(implementations) if implementations else None
    jobs = []
    for name, op in sorted(ops.items()):
        chosen = [i for i in op.implementations if wanted is None or i in wanted]
        if not full and wanted is None:
            chosen = [i for i in chosen if (name, i) not in SLOW_INTERPRETED and not _interpreted_tpu(op, i)]
        grads = gradients and bool(op.differentiable)
        for impl in chosen:
            for dtype in dtype_names:
                indices = range(max(1, len(examples_of(op, dtype)))) if full else [None]
                jobs += [CheckJob(op, impl, dtype, i, grads, precision) for i in indices]
    return jobs


def row_of(job: CheckJob, result: CheckResult, seconds: float, cpu_seconds: float = 0.0) -> dict:
    """The report row of one finished check."""
    w = result.worst
    outcome = "skip" if result.skipped else ("ok" if result.passed else "fail")
    return {
        "op": result.op, "implementation": result.implementation, "dtype": result.dtype,
        "example": result.example, "gradients": job.gradients, "result": outcome,
        "rel_l2": None if w is None else w.rel_l2, "tolerance": None if w is None else w.tolerance,
        "max_abs": None if w is None else w.max_abs,
        "fraction_within": None if w is None else w.fraction_within,
        "detail": result.skipped or result.detail, "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu_seconds, 3),
    }
