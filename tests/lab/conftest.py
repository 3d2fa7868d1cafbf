"""Shared fixtures of the lab tests: one evaluation child for the session, tiny
options, and tiny benchmark shapes for `hadamard_transform` (the cheapest op
with a benchmark: no gradients, four small examples)."""

import pytest

from stellax.lab.evaluate import Worker

HADAMARD_SHAPES = '''
import jax, jax.numpy as jnp
from stellax.core import Example

def BENCHMARKS(platform):
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 512), jnp.float32)
    return [Example("x=(64,512) block=128", (x, None), {"block": 128})]
'''


@pytest.fixture(scope="session")
def worker():
    with Worker(time_limit=240, memory_limit_mb=8192) as w:
        yield w


@pytest.fixture
def hadamard_shapes(tmp_path):
    path = tmp_path / "hadamard_shapes.py"
    path.write_text(HADAMARD_SHAPES)
    return str(path)
