"""Interpret mode never deadlocks a collective (issue 43): `interpret_collectives.py` runs ring and USP
context parallelism and expert parallelism interpreted on 4 simulated CPU devices, forward and
gradients, and checks that what jax's Mosaic TPU interpreter cannot run between collectives is
refused before it starts. A deadlock would abort or hang the process, so it runs in its own, under a
time limit."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("interpret_collectives.py")
SRC = pathlib.Path(__file__).resolve().parents[2] / "src"


def test_interpreted_collectives_run_to_the_end_or_are_refused():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=480, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"interpreted collectives hung past 480 s; printed: {e.stdout}") from None
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("ok"), (
        f"exit {done.returncode}; stdout: {done.stdout[-2000:]}; stderr: {done.stderr[-3000:]}")
