"""`stellax.benchmark`: records, modes, input rotation, timers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.bench import inputs, timing
from stellax.bench.measurement import BenchmarkRecord
from stellax.testing import random_array


def test_record_fields_and_json_round_trip():
    x = random_array(jax.random.PRNGKey(0), (128, 256))
    r = stellax.benchmark(stellax.rms_norm, x, x[0], iterations=7, input_sets=3)
    assert r.iterations == 7 and len(r.times_ms) == 7 and r.input_sets == 3
    assert 0 < r.min_ms <= r.median_ms and r.iqr_ms >= 0 and r.compile_time_s > 0
    assert r.peak_memory_bytes and r.peak_memory_bytes >= 2 * x.nbytes
    assert r.timer == "wall" and r.device_kind == "cpu" and r.dtype == "float32"
    assert r.roofline["gbps"] > 0
    again = BenchmarkRecord.from_json(r.to_json())
    assert again.to_json() == r.to_json() and again.key == r.key
    assert "median" in str(r)


def test_modes_time_different_programs():
    x = random_array(jax.random.PRNGKey(1), (64, 64))
    w = random_array(jax.random.PRNGKey(2), (64, 64))
    f = lambda a, b: jnp.tanh(a @ b)  # noqa: E731
    fwd = stellax.benchmark(f, x, w, iterations=3)
    both = stellax.benchmark(f, x, w, mode="forward_backward", iterations=3)
    back = stellax.benchmark(f, x, w, mode="backward", iterations=3, argnums=1)
    # XLA's own counts: forward is one matmul, the backward (w.r.t. both) two more.
    assert fwd.flops == pytest.approx(2 * 64**3, rel=0.05)
    assert both.flops > 2.5 * fwd.flops
    assert back.flops < both.flops
    with pytest.raises(ValueError, match="mode"):
        stellax.benchmark(f, x, w, mode="sideways")
    with pytest.raises(ValueError, match="differentiable"):
        stellax.benchmark(lambda i: i * 2, jnp.arange(4), mode="forward_backward")


def test_inputs_are_random_rotated_and_never_zero():
    zeros = {"a": jnp.zeros((32, 32)), "ids": jnp.arange(5), "flag": True}
    sets = inputs.input_sets(zeros, 3, seed=0)
    assert len(sets) == 3
    for s in sets:
        assert not np.any(np.asarray(s["a"]) == 0)
        assert np.array_equal(s["ids"], zeros["ids"]) and s["flag"] is True
    assert not np.array_equal(sets[0]["a"], sets[1]["a"])
    seen = []

    def spy(a):
        jax.debug.callback(lambda v: seen.append(float(np.abs(v).min())), a)
        return a * 2

    stellax.benchmark(spy, jnp.zeros((16,)), iterations=4, input_sets=2)
    assert seen and min(seen) > 0  # the timed function never saw a zero


def test_stats_and_timers():
    s = timing.summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median, s.min, s.p25, s.p75, s.iqr) == (3.0, 1.0, 2.0, 4.0, 2.0)
    assert timing.default_timer_name() == "wall"  # CPU
    with pytest.raises(ValueError, match="timer"):
        timing.make_timer("sundial")
    fn = jax.jit(lambda a: a + 1).lower(jnp.ones(8)).compile()
    for name in ("wall", "batched"):
        times = timing.make_timer(name).time(fn, [(jnp.ones(8),), (jnp.ones(8) * 2,)], iterations=5)
        assert len(times) == 5 and all(t > 0 for t in times)
    ok, reason = timing.cupti_available()
    assert not ok and "NVIDIA" in reason


def test_shape_dtype_struct_operands_are_materialized():
    """Benchmark examples may give operands by shape and dtype only."""
    codes = jax.ShapeDtypeStruct((64, 32), jnp.int8)
    scales = jax.ShapeDtypeStruct((64, 1), jnp.float32)
    seen = {}

    def dequant(q, s):
        seen["types"] = (q.dtype, s.dtype)
        return q.astype(jnp.float32) * s

    r = stellax.benchmark(dequant, codes, scales, iterations=3)
    assert r.ok and seen["types"] == (jnp.int8, jnp.float32)
    q, s = inputs.input_sets((codes, scales), 1)[0]
    assert np.unique(np.asarray(q)).size > 100 and np.all(np.asarray(s) != 0)  # random codes, no zeros


def test_inputs_kept_in_the_builders_domain_are_shifted_not_redrawn():
    """``randomize=False`` (op benchmarks): set 0 is the given values, the others the same values
    at other positions, so a log-decay stays below zero (random normal values would not)."""
    decay = -jnp.exp(jax.random.normal(jax.random.PRNGKey(0), (4, 33)))
    tree = ({"g": decay, "ids": jnp.arange(3)}, jax.ShapeDtypeStruct((8,), jnp.float32))
    sets = inputs.input_sets(tree, 3, randomize=False)
    np.testing.assert_array_equal(sets[0][0]["g"], decay)
    for s in sets[1:]:
        g = np.asarray(s[0]["g"])
        assert g.shape == decay.shape and np.all(g < 0) and not np.array_equal(g, decay)
        np.testing.assert_array_equal(np.sort(g.ravel()), np.sort(np.asarray(decay).ravel()))
        np.testing.assert_array_equal(s[0]["ids"], jnp.arange(3))
    assert not np.array_equal(sets[1][0]["g"], sets[2][0]["g"])
    assert all(np.all(np.asarray(s[1]) != 0) for s in sets)   # structs are materialized


def test_input_sets_that_do_not_fit_the_device_are_fewer(monkeypatch):
    """A benchmark whose operands are large keeps only the input sets that fit half the free
    device memory (the MoE layer's 5.6 GB of weights thrice did not fit a v5e); the record says
    how many it rotated among."""
    tree = (jax.ShapeDtypeStruct((1024, 1024), jnp.float32), jnp.zeros((1024,), jnp.bfloat16))
    size = 4 * 1024 * 1024 + 2 * 1024
    assert inputs.tree_bytes(tree) == size
    assert inputs.sets_that_fit(tree, 3, None) == 3  # a CPU: no device memory figure
    assert inputs.sets_that_fit(tree, 3, 10 * size) == 3
    assert inputs.sets_that_fit(tree, 3, 3 * size) == 1  # half of it holds one new set
    assert inputs.sets_that_fit(tree, 3, 3 * size, randomize=False) == 2  # the first set is the tree itself
    assert inputs.sets_that_fit(tree, 3, size) == 1 and inputs.sets_that_fit(tree, 0, size) == 1
    from stellax.bench import measurement

    monkeypatch.setattr(measurement, "device_memory_free", lambda device=None: 3 * 4 * 64 * 64)
    r = stellax.benchmark(stellax.rms_norm, jnp.ones((64, 64)), jnp.ones((64,)), iterations=2, input_sets=3)
    assert r.input_sets == 1
