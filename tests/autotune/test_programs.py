"""Every stellax call is visible in the compiled program: annotations, `--from-hlo`, `--from-trace`,
and the profiler timer."""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.autotune import cli as autotune_cli
from stellax.autotune import keys as keys_lib
from stellax.autotune import programs
from stellax.bench import timing
from stellax.bench import trace as trace_lib
from stellax.core import Call, metadata

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def _block(params, x):
    """A tiny transformer block: RMSNorm → causal attention → SwiGLU → MoE layer."""
    t, d = x.shape
    h = stellax.rms_norm(x, params["norm"])
    q = (h @ params["wq"]).reshape(1, t, 2, d // 2)
    a = stellax.dot_product_attention(q, q, q, is_causal=True).reshape(t, d)
    y = stellax.gated_linear_unit(a + x, params["glu"], activation="silu")
    logits = y @ params["router"]
    m = stellax.moe_mlp(y, logits, params["w_gate_up"], params["w_down"], top_k=2)
    return jnp.mean((m + y) ** 2)


def _params(d=32, f=32, experts=4):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    return {"norm": jnp.ones((d,)), "wq": jax.random.normal(k[0], (d, d)) * 0.2,
            "glu": jax.random.normal(k[1], (d, 2, d)) * 0.2, "router": jax.random.normal(k[2], (d, experts)),
            "w_gate_up": jax.random.normal(k[3], (experts, d, 2, f)) * 0.2,
            "w_down": jax.random.normal(k[4], (experts, f, d)) * 0.2}


@pytest.fixture(scope="module")
def block():
    params, x = _params(), jax.random.normal(jax.random.PRNGKey(1), (16, 32))
    step = jax.value_and_grad(_block)
    traced = sorted({keys_lib.key_to_string(c.key) for c in stellax.autotune.find_calls(step, params, x)})
    return step, params, x, traced


def _tunable_keys(records):
    calls, _ = programs.observed_calls(records)
    return sorted({keys_lib.key_to_string(c.key) for c in calls})


def test_annotation_round_trip_keeps_the_call():
    call = Call({"x": jnp.zeros((4, 8), jnp.bfloat16), "absent": None},
                {"axis": -1, "window": (None, 3), "dtype": np.dtype("float16"), "eps": 1e-6, "name": "a\"b",
                 "precision": jax.lax.Precision.HIGHEST})
    value = metadata.encode_call("layer_norm", "triton", None, call)
    assert value.startswith("v1.") and '"' not in value
    record = metadata.decode_call(value)
    assert (record.op, record.implementation, record.config) == ("layer_norm", "triton", None)
    assert record.signature == keys_lib.make_key("x", "y", call.signature())[2]
    assert record.arrays["x"] == jax.ShapeDtypeStruct((4, 8), jnp.bfloat16) and record.arrays["absent"] is None
    assert record.options["window"] == (None, 3) and record.rebuildable is None
    assert record.options["precision"] is jax.lax.Precision.HIGHEST
    opaque = metadata.decode_call(metadata.encode_call("g", "xla", None, Call({}, {"activation": jnp.tanh})))
    assert "activation" in opaque.rebuildable


def test_bad_annotations_are_clear_errors():
    with pytest.raises(metadata.MetadataError, match="version"):
        metadata.decode_call("v9.abc")
    with pytest.raises(metadata.MetadataError, match="corrupt"):
        metadata.decode_call("v1.bm90IGpzb24=")


def test_calls_from_hlo_equal_the_traced_calls(block, tmp_path):
    step, params, x, traced = block
    lowered = jax.jit(step).lower(params, x)
    for name, text in (("lowered.mlir", lowered.as_text()), ("compiled.txt", lowered.compile().as_text())):
        path = tmp_path / name
        path.write_text(text)
        records = programs.calls_from_hlo(path)
        assert _tunable_keys(records) == traced, name
        ops = {r.op for r in records}
        assert {"layer_norm", "layer_norm_backward", "attention", "attention_backward", "gated_linear_unit",
                "ragged_dot", "ragged_dot_tgmm", "moe_mlp"} <= ops


def test_calls_from_an_xla_dump_directory(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(
        "import jax, jax.numpy as jnp, stellax\n"
        "q = jnp.ones((1, 8, 2, 16))\n"
        "jax.jit(lambda q: stellax.dot_product_attention(q, q, q, is_causal=True)).lower(q).compile()\n")
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={tmp_path / 'dump'}", "PYTHONPATH": SRC,
           "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, str(script)], check=True, env=env, capture_output=True, timeout=300)
    records = programs.calls_from_hlo(tmp_path / "dump")
    assert [(r.op, r.implementation) for r in records] == [("attention", "xla_chunked")]
    assert records[0].arrays["query"].shape == (1, 8, 2, 16)


def test_calls_from_trace_equal_the_traced_calls_with_times(block, tmp_path):
    step, params, x, traced = block
    fn = jax.jit(step)
    jax.block_until_ready(fn(params, x))
    jax.profiler.start_trace(str(tmp_path / "trace"))
    try:
        for _ in range(2):
            jax.block_until_ready(fn(params, x))
    finally:
        jax.profiler.stop_trace()
    found = programs.calls_from_trace(tmp_path / "trace")
    assert _tunable_keys([t.record for t in found]) == traced
    times = [t.time_ms for t in found]
    assert all(t > 0 for t in times) and times == sorted(times, reverse=True)
    assert all(t.executions == 2 for t in found)


def test_no_stellax_calls_are_clear_errors(tmp_path):
    text = jax.jit(lambda a: jnp.sin(a) * 2).lower(jnp.ones(4)).as_text()
    (tmp_path / "plain.txt").write_text(text)
    with pytest.raises(programs.ProgramError, match="no stellax call"):
        programs.calls_from_hlo(tmp_path / "plain.txt")
    with pytest.raises(programs.ProgramError, match="does not exist"):
        programs.calls_from_hlo(tmp_path / "missing.txt")
    f = jax.jit(lambda a: jnp.cos(a) + 1)
    jax.block_until_ready(f(jnp.ones(8)))
    jax.profiler.start_trace(str(tmp_path / "other"))
    try:
        jax.block_until_ready(f(jnp.ones(8)))
    finally:
        jax.profiler.stop_trace()
    with pytest.raises(programs.ProgramError, match="no stellax call"):
        programs.calls_from_trace(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no \\*.xplane.pb"):
        programs.calls_from_trace(tmp_path / "empty")


def test_autotune_cli_tunes_a_program_from_its_hlo(block, tmp_path, capsys):
    step, params, x, traced = block
    path = tmp_path / "block.mlir"
    path.write_text(jax.jit(step).lower(params, x).as_text())
    out = tmp_path / "result.json"
    status = autotune_cli.main(["--from-hlo", str(path), "--no-cache", "--max-configs", "2", "--quiet",
                                "--out", str(out)])
    assert status == 0
    tuned = sorted({keys_lib.key_to_string(keys_lib.make_key(e.entry.op, e.entry.implementation,
                                                              e.entry.signature))
                    for e in stellax.autotune.AutotuneResult.load(str(out)).entries})
    assert tuned == traced
    assert autotune_cli.main(["--from-hlo", str(tmp_path / "nothing.txt")]) == 2


def test_profiler_timer_agrees_with_the_wall_clock_on_a_long_op(tmp_path):
    """The profiler's per-call device time against the wall clock of the same calls (a shared machine's
    load changes between separate measurements, so both clocks read the same executions)."""
    x = jax.random.normal(jax.random.PRNGKey(0), (768, 768))
    f = jax.jit(lambda a: jnp.sort(jnp.tanh(a @ a), axis=0)).lower(x).compile()
    jax.block_until_ready(f(x))
    wall = []
    jax.profiler.start_trace(str(tmp_path))
    try:
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            wall.append((time.perf_counter() - t0) * 1e3)
    finally:
        jax.profiler.stop_trace()
    events = [e for p in trace_lib.xplane_files(tmp_path) for e in trace_lib.op_events(p.read_bytes())]
    device = timing.per_iteration_ms(events, 5)
    ratio = float(np.median(np.asarray(device) / np.asarray(wall)))
    assert 0.8 <= ratio <= 1.2, (device, wall)
    profiler = timing.make_timer("profiler", min_iterations=3, max_iterations=3)
    times = profiler.time(f, [(x,)])
    assert len(times) == 3 and all(t > 0 for t in times)
    filtered = timing.make_timer("profiler", op_filter="^no-such-op$", min_iterations=2, max_iterations=2)
    with pytest.raises(RuntimeError, match="no XLA op events"):
        filtered.time(f, [(x,)])
