"""The fuzz harness: one generated call, judged against a NumPy reference or
the documented contract.

A `Case` is a call (``fn()``) with either an expected argument name (the call
is bad: it must raise ``ValueError``/``TypeError`` whose message names that
argument before its first ``:``) or an expected value (a NumPy array, or a
predicate for contracts such as "finite and within this error"). Anything
else is a failure: another exception type (``AttributeError``,
``ZeroDivisionError``, ``TracerArrayConversionError``, ...), an error naming
another argument, a bad call that succeeds, or a wrong value.

`run_family` drives one family's hypothesis strategy for ``examples``
examples and returns the counts; `main` prints them as one JSON line (the
tests run each family in its own subprocess, so a process-killing call is a
failure of that family, not of the test session).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import traceback
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass
class Case:
    label: str
    fn: Callable[[], Any]
    bad: str | None = None          # the argument an error must name (None: a good call)
    expect: Any = None              # NumPy value, or a callable(result) -> str | None (problem)
    rtol: float = 2e-5
    atol: float = 2e-5


@dataclasses.dataclass
class Counts:
    calls: int = 0
    bad_calls: int = 0
    named_errors: int = 0
    good_calls: int = 0
    correct_values: int = 0
    failures: list = dataclasses.field(default_factory=list)


def _names_argument(message: str, name: str) -> bool:
    head = message.split(":", 1)[0]
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", head) is not None


def _as_numpy(x):
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def judge(case: Case, counts: Counts) -> None:
    counts.calls += 1
    if case.bad is not None:
        counts.bad_calls += 1
    else:
        counts.good_calls += 1
    try:
        result = case.fn()
        if hasattr(result, "block_until_ready"):
            result.block_until_ready()
    except (ValueError, TypeError) as e:
        msg = str(e)
        if case.bad is None:
            counts.failures.append(f"{case.label}: a good call raised {type(e).__name__}: {msg[:300]}")
        elif not _names_argument(msg, case.bad):
            counts.failures.append(f"{case.label}: the error does not name {case.bad!r}: "
                                   f"{type(e).__name__}: {msg[:300]}")
        else:
            counts.named_errors += 1
        return
    except Exception as e:  # noqa: BLE001 - the point: any other exception is a finding
        counts.failures.append(f"{case.label}: {type(e).__name__} from inside: {str(e)[:300]} | "
                               + "".join(traceback.format_exception(e)[-3:])[-600:])
        return
    if case.bad is not None:
        counts.failures.append(f"{case.label}: a bad call (argument {case.bad!r}) succeeded")
        return
    if callable(case.expect):
        problem = case.expect(result)
    else:
        problem = compare(result, case.expect, case.rtol, case.atol)
    if problem:
        counts.failures.append(f"{case.label}: wrong value: {problem}")
    else:
        counts.correct_values += 1


def compare(result, expected, rtol, atol) -> str | None:
    got = _as_numpy(result).astype(np.float64)
    want = np.asarray(expected, np.float64)
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if not np.isfinite(got).all():
        return "non-finite values"
    if not np.allclose(got, want, rtol=rtol, atol=atol):
        err = np.abs(got - want).max()
        return f"max abs error {err:.3g} (rtol {rtol}, atol {atol})"
    return None


def run_family(name: str, examples: int, seed: int = 0) -> Counts:
    from hypothesis import HealthCheck, given, seed as hseed, settings

    from . import families

    strategy = families.FAMILIES[name]
    counts = Counts()

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy())
    def run(case):
        judge(case, counts)

    run()
    return counts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name, examples = argv[0], int(argv[1])
    seed = int(argv[2]) if len(argv) > 2 else 0
    counts = run_family(name, examples, seed)
    print("FUZZ-RESULT " + json.dumps(dataclasses.asdict(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
