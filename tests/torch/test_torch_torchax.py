"""Runs `torchax_cases.py` (stellax.torch on torchax tensors) in a process of
its own: importing torchax registers it as torch's ``privateuse1`` accelerator
for the whole process, after which ``torch.compile`` in that process fails
("PyTorch is not linked with support for jax devices" when dynamo asks the
current accelerator for its stream). The other torch tests must not share a
process with it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("torchax_cases.py")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchax") is None or
                                importlib.util.find_spec("torch") is None,
                                reason="torchax is not installed: pip install 'stellax[torchax]' (torchax==0.0.13)")


def _run_cases(marker: str):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "-m", marker, str(CASES)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


def test_torchax_cases_in_their_own_process():
    _run_cases("not slow")


@pytest.mark.slow
def test_torchax_slow_cases_in_their_own_process():
    _run_cases("slow")
