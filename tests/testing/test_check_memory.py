"""`stellax check`'s memory figures: an accelerator's memory mapped into the
process is told apart from host RAM, and the check starts the TPU runtime with a
small transfer buffer unless the user chose one."""

from __future__ import annotations

import gc
import os

import pytest

from stellax import cli
from stellax.testing import process_memory, report

SMAPS = """\
7f0000000000-7f0100000000 rw-s 00000000 00:0f 1234     anon_inode:[vfio-device]
Size:            4194304 kB
Rss:             4194304 kB
7f0100000000-7f0200000000 rw-p 00000000 00:00 0
Size:            4194304 kB
Rss:             1048576 kB
7f0200000000-7f0200001000 r-xp 00000000 08:01 42       /usr/lib/libtpu.so
Size:                  4 kB
Rss:                   4 kB
7f0300000000-7f0300100000 rw-s 00000000 00:05 7        /dev/accel0
Size:               1024 kB
Rss:                1024 kB
"""


def test_device_mappings_are_counted_apart(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert process_memory.device_mapped_bytes(str(smaps)) == (4194304 + 1024) * 1024
    assert process_memory.device_mapped_bytes(str(tmp_path / "absent")) is None


def test_memory_text_names_the_host_part():
    gb = 10 ** 9
    text = report._memory_text({"peak_rss": 18 * gb, "rss": 17 * gb, "device_mapped": 8 * gb, "peak_host": 10 * gb})
    assert "peak host RSS 18.0 GB" in text and "8.0 GB of it the accelerator's memory" in text
    assert "10.0 GB host memory at the peak" in text
    plain = report._memory_text({"peak_rss": 2 * gb, "rss": gb, "anonymous": gb // 2, "file": gb // 2,
                                 "device_mapped": 0})
    assert "0.5 allocated" in plain and "accelerator" not in plain
    measured = process_memory.host_memory()
    if measured:  # Linux
        assert measured["peak_host"] <= measured["peak_rss"] and measured["device_mapped"] >= 0


def test_check_sets_a_small_tpu_transfer_buffer_unless_one_is_set(monkeypatch):
    monkeypatch.delenv("TPU_PREMAPPED_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    cli._fast_compiles()
    assert os.environ["TPU_PREMAPPED_BUFFER_SIZE"] == str(256 << 20)
    monkeypatch.setenv("TPU_PREMAPPED_BUFFER_SIZE", "4294967296")
    cli._fast_compiles()
    assert os.environ["TPU_PREMAPPED_BUFFER_SIZE"] == "4294967296"


def test_threaded_check_releases_memory_per_op_and_records_rss(monkeypatch):
    """In threads (an accelerator's run), memory is released after every ``threads``
    examples built and after each op's last check, and each row records the RSS it ended at."""
    import stellax
    from stellax.testing import workers
    from stellax.testing.plan import plan_checks, select_ops

    releases = []
    monkeypatch.setattr(workers, "release_host_memory", lambda ceiling=None: releases.append(ceiling))
    jobs = plan_checks(select_ops(stellax.registered_ops(), ["rms_norm", "moe_route"]))
    names = {job.op.name for job in jobs}
    pairs = {(job.op.name, job.dtype) for job in jobs}
    run = report.run_quietly(jobs, platform="cpu", mode="quick", threads=2)
    assert len(run.rows) == len(jobs) and not run.failures
    assert len(releases) == -(-len(pairs) // 2) + len(names)  # every 2 examples built, then per op
    assert len(set(releases)) == 1  # one ceiling for the run, taken before its checks
    assert all(row["host_rss"] > 0 for row in run.rows)


def test_release_host_memory_drops_compiled_programs():
    import jax
    import jax.numpy as jnp

    from stellax.testing import workers

    f = jax.jit(lambda x: x * 3)
    f(jnp.ones(3))
    assert f._cache_size() == 1
    workers.release_host_memory()
    assert f._cache_size() == 0


def test_release_host_memory_keeps_programs_below_its_ceiling():
    """With a ceiling above what the process holds, a release only trims the heap: the compiled
    programs stay (no recompiles); above it, they are dropped."""
    import jax
    import jax.numpy as jnp

    from stellax.testing import workers

    now = process_memory.host_bytes_now()
    if now is None:
        pytest.skip("no /proc figures of this process's memory here (Linux only)")
    f = jax.jit(lambda x: x * 5)
    f(jnp.ones(3))
    assert workers.release_host_memory(ceiling=now * 4) is False and f._cache_size() == 1
    assert workers.release_host_memory(ceiling=0) is True and f._cache_size() == 0
    assert workers.program_ceiling() > 0


def _until_sampled(watch, label: str, at_least: int = 0, timeout: float = 30.0) -> None:
    """Wait until ``watch`` has taken a sample labelled ``label`` (of at least ``at_least`` bytes: one
    taken after an allocation was touched, not during it); a loaded machine may starve the sampling
    thread for longer than any fixed sleep. No wait where RSS cannot be read."""
    import time

    if process_memory.rss_now() is None:
        return
    deadline = time.monotonic() + timeout
    while watch.phase_peaks.get(label, -1) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)


def test_memory_watch_names_what_ran_at_the_peak():
    # Earlier tests' garbage is freed first and the collector held off, so the process's RSS moves
    # only with this test's block (a CI run saw an xdist worker's RSS fall by ~100 MiB, a collection
    # set off by the block's allocation, while the block went in).
    gc.collect()
    gc.disable()
    try:
        _watch_a_big_block()
    finally:
        gc.enable()


def _watch_a_big_block():
    state = {"now": "idle"}
    with report.MemoryWatch(lambda: state["now"], interval=0.01) as watch:
        _until_sampled(watch, "idle")
        state["now"] = "the big one"
        block = bytearray(200 << 20)  # 200 MiB, touched
        for i in range(0, len(block), 4096):
            block[i] = 1
        _until_sampled(watch, "the big one", at_least=process_memory.rss_now() or 0)
        del block
        state["now"] = "after"
        _until_sampled(watch, "after")
    summary = watch.summary()
    if summary:  # Linux
        assert summary["sampled_peak_during"] == "the big one"
        assert summary["sampled_peak"] >= 200 << 20
        phases = summary["sampled_phases"]
        assert set(phases) == {"idle", "the big one", "after"}
        assert phases["the big one"] == summary["sampled_peak"] >= phases["idle"] + (150 << 20)


def test_a_started_watch_names_its_phases_then_the_checks(monkeypatch):
    """`stellax check`'s watch runs from start-up (phases it names) through `_run`, which labels
    the samples by the checks in flight and stops it at the end."""
    import types

    monkeypatch.setattr(report, "_sequential", lambda jobs: iter([("start", jobs[0], None), ("cpu", None, 0.0)]))
    watch = report.MemoryWatch(interval=0.01).start()
    watch.phase = "starting the backend"
    block = bytearray(100 << 20)
    for i in range(0, len(block), 4096):
        block[i] = 1
    _until_sampled(watch, "starting the backend", at_least=process_memory.rss_now() or 0)
    del block
    job = types.SimpleNamespace(op=types.SimpleNamespace(name="op"), implementation="xla", dtype="float32")
    out = report._run([job], report.CheckReport("cpu", "quick"), watch=watch)
    assert not watch._thread.is_alive()  # stopped by _run
    trace = out.memory_trace
    if trace:  # Linux
        assert trace["sampled_peak_during"] == "starting the backend"
        assert "starting the backend" in trace["sampled_phases"]
        starts = trace["phase_starts"]
        assert list(starts) == ["start-up", "starting the backend", "building the examples"]
        assert 0 <= starts["starting the backend"] <= starts["building the examples"]


def test_threads_take_the_next_job_when_free(monkeypatch):
    """One slow job does not hold back the jobs dealt after it: the other thread runs them all."""
    import threading
    import time
    import types

    from stellax.testing import validation, workers

    monkeypatch.setattr(validation, "examples_of", lambda op, dtype: [])
    monkeypatch.setattr(workers, "release_host_memory", lambda ceiling=None: None)
    monkeypatch.setattr(workers, "row_of", lambda job, result, seconds: {"thread": result})

    class Op:  # hashable, as registered ops are
        name = "op"

    op = Op()

    def job(seconds):
        def run():
            time.sleep(seconds)
            return threading.current_thread().name
        return types.SimpleNamespace(op=op, dtype="float32", run=run)

    jobs = [job(0.6)] + [job(0.01) for _ in range(6)]
    rows = {id(j): row for kind, j, row in workers.threaded_events(jobs, 2) if kind == "done"}
    slow = rows[id(jobs[0])]["thread"]
    assert all(rows[id(j)]["thread"] != slow for j in jobs[1:])


def test_examples_are_built_by_one_compiled_program():
    """`validation.compiled_examples`: the random numbers of an op's examples are the eager
    builder's bits, and the builder runs once, traced (no op-by-op dispatch)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import stellax
    from stellax.core.op import Example
    from stellax.testing import validation

    op = stellax.registered_ops()["attention"]
    built = validation.compiled_examples(lambda: op.examples(jnp.dtype("float32")))
    eager = op.examples(jnp.dtype("float32"))
    assert [e.label for e in built] == [e.label for e in eager]
    for x, y in zip(validation._leaves(built), validation._leaves(eager)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    traced = []

    def make():
        x = jax.random.normal(jax.random.PRNGKey(0), (4, 8))
        traced.append(isinstance(x, jax.core.Tracer))
        return [Example("x", (x, jnp.tanh(x)), {"axis": 1})]

    (example,) = validation.compiled_examples(make)
    assert traced == [True] and example.kwargs == {"axis": 1}
    np.testing.assert_allclose(example.args[1], np.tanh(np.asarray(example.args[0])), rtol=1e-6)

    def concrete():  # a builder that reads its values back is built eagerly
        x = jax.random.normal(jax.random.PRNGKey(0), (3,))
        return [Example("x", (x, int(np.asarray(x).argmax())), {})]

    (example,) = validation.compiled_examples(concrete)
    assert isinstance(example.args[1], int)


def test_compiled_examples_computes_only_the_first_count():
    """With ``count``, the later examples' arrays are never computed: the second one here is
    64 GB of random numbers, which would fail the process if it were."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stellax.core.op import Example
    from stellax.testing import validation

    def make():
        key = jax.random.PRNGKey(1)
        return [Example("small", (jax.random.normal(key, (5,)),), {}),
                Example("huge", (jax.random.normal(key, (1 << 34,)),), {})]

    (example,) = validation.compiled_examples(make, count=1)
    assert example.label == "small"
    np.testing.assert_array_equal(np.asarray(example.args[0]),
                                  np.asarray(jax.random.normal(jax.random.PRNGKey(1), (5,))))
    assert isinstance(example.args[0], jax.Array) and example.args[0].dtype == jnp.float32

    def shared():  # a balanced and a skewed case of one weight tensor: computed and held once
        w = jax.random.normal(jax.random.PRNGKey(2), (6, 4))
        return [Example("balanced", (w, jnp.ones(3)), {}), Example("skewed", (w, jnp.zeros(3)), {})]

    first, second = validation.compiled_examples(shared)
    assert first.args[0] is second.args[0] and not np.array_equal(first.args[1], second.args[1])


def test_random_array_draws_large_arrays_in_pieces(monkeypatch):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stellax.testing import numerics

    key = jax.random.PRNGKey(3)
    small = numerics.random_array(key, (3, 7), jnp.bfloat16)
    monkeypatch.setattr(numerics, "RANDOM_PIECE", 8)
    pieced = numerics.random_array(key, (3, 7), jnp.bfloat16, scale=2.0)
    assert pieced.shape == (3, 7) and pieced.dtype == jnp.bfloat16
    flat = np.asarray(pieced.astype(jnp.float32)).ravel()
    assert np.all(flat != 0) and len(np.unique(flat)) == flat.size   # pieces are not repeats of one draw
    np.testing.assert_array_equal(flat[:8], 2.0 * np.asarray(jax.random.normal(jax.random.fold_in(key, 0), (8,)),
                                                              ).astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(np.asarray(numerics.random_array(key, (3, 7), jnp.bfloat16, scale=2.0)), pieced)
    assert not np.array_equal(np.asarray(small), np.asarray(pieced))
