"""`stellax.testing.validation.GOLDENS`: the golden of an example is computed
once and shared by every implementation checked on it, and a cached golden
never hides a wrong implementation nor answers for a changed example."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from stellax.core import Call, Example, Implementation, Op
from stellax.testing import validation


def _probe_op(calls: list):
    """tanh(x) @ w: a reference that records its calls, a correct and a wrong implementation."""
    def reference(call):
        calls.append(call.arrays["x"].shape)
        return jnp.tanh(call.arrays["x"]) @ call.arrays["w"]

    def right(call, config):
        return jnp.tanh(call.arrays["x"]) @ call.arrays["w"]

    def wrong(call, config):
        return jnp.tanh(call.arrays["x"]) @ call.arrays["w"] * 1.001

    return Op("golden_cache_probe", check=lambda x, w: Call({"x": x, "w": w}, {}), reference=reference,
              implementations=[Implementation("xla", right), Implementation("wrong", wrong)],
              differentiable=("x", "w"))


def _example(seed: int, label: str = "8x16x4") -> Example:
    rng = np.random.default_rng(seed)
    return Example(label, (jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
                           jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)))


def test_the_golden_is_computed_once_per_example_and_dtype(monkeypatch):
    monkeypatch.setattr(validation, "GOLDENS", validation.GoldenCache())
    calls: list = []
    op = _probe_op(calls)
    first = validation.check_example(op, "xla", _example(0), jnp.float32)
    traced = len(calls)  # the reference, traced for the forward golden and for its gradient
    assert first.passed and traced > 0 and validation.GOLDENS.misses == 2
    again = validation.check_example(op, "wrong", _example(0), jnp.float32)  # same example, rebuilt
    assert len(calls) == traced and validation.GOLDENS.hits == 2
    # The cached golden still holds the wrong implementation to the tolerance.
    assert not again.passed and again.worst.rel_l2 > 1e-4
    assert validation.check_example(op, "xla", _example(0), jnp.float32).passed


def test_a_changed_example_is_a_miss(monkeypatch):
    monkeypatch.setattr(validation, "GOLDENS", validation.GoldenCache())
    op = _probe_op([])
    assert validation.check_example(op, "xla", _example(0), jnp.float32).passed
    # Same label, other values: a fresh golden (a stale one would fail this check).
    assert validation.check_example(op, "xla", _example(1), jnp.float32).passed
    assert validation.GOLDENS.hits == 0 and validation.GOLDENS.misses == 4
    # Another dtype of the same values is another golden too.
    assert validation.check_example(op, "xla", _example(0), jnp.bfloat16).passed
    assert validation.GOLDENS.hits == 0


def test_large_examples_are_not_kept():
    cache = validation.GoldenCache(entries=2, max_bytes=1024)
    assert cache.key("forward", np.zeros(512, np.float32)) is None
    computed = []
    for _ in range(2):
        cache.get(None, lambda: computed.append(1))
    assert len(computed) == 2 and cache.misses == 0
    for i in range(3):  # least recently used first out
        cache.get(cache.key(i), lambda i=i: np.float32(i))
    assert cache.get(cache.key(0), lambda: np.float32(-1)) == -1
