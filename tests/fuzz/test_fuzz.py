"""Property-based fuzzing of every family's public ops and the torch front end
(`families`): bad and edge-case calls, each judged against a NumPy reference
or the documented contract (`harness.judge`). Each family runs in its own
subprocess, so a call that takes the process down (an abort, a segfault) fails
that family instead of the session. Default tier: a few examples per family;
``-m slow``: many more, with other seeds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .families import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
#: Examples per family in the default tier (bounded: the suite's budget) and under slow.
DEFAULT_EXAMPLES = 4
SLOW_EXAMPLES = 150


def run_family(family: str, examples: int, seed: int = 0, timeout: float = 1500) -> dict:
    if family == "torch":
        pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tests.fuzz.harness", family, str(examples), str(seed)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{family}: the fuzz process died (rc {done.returncode}):\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("FUZZ-RESULT ")]
    assert line, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(line[-1].split(" ", 1)[1])


def _check(counts: dict, family: str) -> None:
    summary = {k: v for k, v in counts.items() if k != "failures"}
    print(f"fuzz {family}: {summary}")
    assert not counts["failures"], f"{family} {summary}:\n" + "\n".join(counts["failures"][:20])
    assert counts["calls"] > 0
    assert counts["named_errors"] == counts["bad_calls"]
    assert counts["correct_values"] == counts["good_calls"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fuzz_family(family):
    _check(run_family(family, DEFAULT_EXAMPLES), family)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fuzz_family_long(family, seed):
    _check(run_family(family, SLOW_EXAMPLES, seed, timeout=3600), family)


def test_the_harness_catches_what_it_claims():
    """The judge fails a bad call that succeeds, an error naming another
    argument, an internal exception, and a wrong value."""
    import numpy as np

    from .harness import Case, Counts, judge

    def boom():
        raise AttributeError("x")

    def wrong_name():
        raise ValueError("y: bad")

    counts = Counts()
    for case in (Case("ok", lambda: 1, bad="x"), Case("other", wrong_name, bad="x"), Case("attr", boom),
                 Case("value", lambda: np.ones(3), expect=np.zeros(3)),
                 Case("nan", lambda: np.full(3, np.nan), expect=np.zeros(3))):
        judge(case, counts)
    assert len(counts.failures) == 5 and counts.named_errors == 0 and counts.correct_values == 0
    good = Counts()
    judge(Case("named", wrong_name, bad="y"), good)
    judge(Case("right", lambda: np.ones(3), expect=np.ones(3)), good)
    assert not good.failures and good.named_errors == 1 and good.correct_values == 1
