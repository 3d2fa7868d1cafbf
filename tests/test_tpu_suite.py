"""The TPU suite script runs end to end on the CPU (--dry-run: the Mosaic TPU
kernels interpreted, tiny shapes) so it is ready the day a TPU is lent: it
resumes across commands, writes the rows schema, plans for a v5e (--list),
and refuses a program that would not fit the device before running it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stellax

ROOT = Path(__file__).resolve().parents[1]
TPU_OPS = sorted(name for name, op in stellax.registered_ops().items() if "mosaic_tpu" in op.implementations)


def _run_suite(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "benchmarks/tpu_suite.py", *args, "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    return proc


@pytest.mark.skipif(not TPU_OPS, reason="no op has a mosaic_tpu implementation")
def test_tpu_suite_dry_run_resumes_and_writes_the_rows_schema(tmp_path):
    ops = "layer_norm"
    proc = _run_suite(tmp_path, "--dry-run", "--ops", ops, "--stages", "environment,check,autotune")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("stellax-tpu-suite-")]
    data = json.loads(path.read_text())
    assert data["format"] == "stellax-tpu-suite" and data["version"] == 2 and data["dry_run"]
    assert not data["errors"], data["errors"]
    assert data["check"]["passed"] >= 1 and data["check"]["failures"] == 0, data["check"]
    assert {r["op"] for r in data["check"]["records"] if r["result"] == "ok"} == set(ops.split(","))
    assert {e["op"] for e in data["autotune"]["entries"]} == {"layer_norm", "layer_norm_backward"}  # fwd and bwd
    assert (tmp_path / data["autotune"]["exported_to"]).exists()
    assert data["done"]["bench"] == [] and data["rows"] == []
    assert data["unit_seconds"]["check"]["layer_norm"] > 0, data["unit_seconds"]

    # A second command resumes: the bench stage runs, the check and autotune sections are kept.
    proc = _run_suite(tmp_path, "--dry-run", "--ops", ops, "--stages", "bench")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert len(data["commands"]) == 2 and data["check"]["passed"] >= 1 and data["autotune"]["entries"]
    rows = {row["contender"]: row for row in data["rows"]}
    assert {"stellax:mosaic_tpu", "stellax:xla"} <= set(rows), rows
    for row in rows.values():
        assert set(row) >= {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "gbps", "pct_peak",
                            "peak_hbm_bytes", "device", "date"}
        assert row["op"] == "layer_norm" and row["pass"] == "fwd" and row["ms"] > 0 and not row["peer"]
    assert rows["stellax:mosaic_tpu"]["default"] and not rows["stellax:xla"]["default"]

    # Done stages are skipped on a third command unless --redo.
    proc = _run_suite(tmp_path, "--dry-run", "--ops", ops, "--stages", "bench")
    assert "bench layer_norm" not in proc.stdout, proc.stdout

    # The plan estimates a unit that ran at the seconds its run took.
    ran = json.loads(path.read_text())["unit_seconds"]["bench"]["layer_norm"]
    proc = _run_suite(tmp_path, "--dry-run", "--list", "--ops", ops, "--stages", "bench")
    (line,) = [l for l in proc.stdout.splitlines() if l.startswith("bench") and " layer_norm " in l]
    assert float(line.split()[2]) == pytest.approx(ran, abs=0.6) and f"last run {ran:.0f} s" in line, line

    # Another day (another --out) carries on from the file given to --resume.
    later = tmp_path / "later"
    proc = _run_suite(later, "--dry-run", "--ops", ops, "--stages", "bench", "--resume", str(path))
    assert proc.returncode == 0 and "bench layer_norm" not in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    carried = json.loads((later / path.name).read_text())
    assert carried["rows"] == data["rows"] and len(carried["commands"]) == 4


def test_tpu_suite_list_plans_for_a_v5e_from_the_cpu(tmp_path):
    proc = _run_suite(tmp_path, "--list", "--ops", "layer_norm,ragged_dot", "--stages", "check,bench")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(l.startswith("check") and "layer_norm" in l and "to do" in l for l in lines), proc.stdout
    assert any(l.startswith("bench") and "ragged_dot" in l and "timings" in l for l in lines), proc.stdout
    assert "estimated on a v5e" in lines[-1] and "command(s)" in lines[-1]


def test_a_program_that_cannot_fit_the_device_is_refused_before_it_runs():
    from stellax.bench import measurement

    class Analysis:
        argument_size_in_bytes, output_size_in_bytes, temp_size_in_bytes = 1 << 30, 8 << 30, 24 << 30

    class Compiled:
        def memory_analysis(self):
            return Analysis()

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 16 << 30, "bytes_in_use": 1 << 30}

    with pytest.raises(measurement.DeviceMemoryError, match=r"needs 32\.00 GiB.*has 15\.00 GiB free"):
        measurement.require_device_memory(Compiled(), what="attention T=65536", device=Device())


def test_a_compile_time_out_of_memory_is_a_device_memory_error_and_other_errors_pass_through():
    from stellax.bench import measurement

    class Refused:
        def __init__(self, message):
            self.message = message

        def compile(self):
            raise RuntimeError(self.message)

    hbm = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
           "(16.44G) exceeds available HBM (15.75G).")
    with pytest.raises(measurement.DeviceMemoryError, match=r"the golden \(reference\) does not fit.*16\.44G"):
        measurement.compile_within_memory(Refused(hbm), what="the golden (reference)")
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT") as info:
        measurement.compile_within_memory(Refused("INVALID_ARGUMENT: bad shape"), what="x")
    assert not isinstance(info.value, measurement.DeviceMemoryError)


def test_splash_peer_matches_the_golden_in_interpret_mode():
    """The suite's jax_splash peer (jax's bundled kernel) computes the op's
    math, so its timings compare like with like."""
    import importlib.util

    import jax
    import jax.numpy as jnp
    import numpy as np

    suite = _peers_module()
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, 256, 2, 128), jnp.float32) for key in keys)
    with stellax.interpret_mode():
        out = suite.splash_peer(q, k, v, is_causal=True)
    ref = stellax.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-3, atol=2e-3)
    with pytest.raises(stellax.UnsupportedError, match="jax_splash peer"):
        suite.splash_peer(q, k[:, :, :1], v[:, :, :1])


def _peers_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tpu_peers", ROOT / "benchmarks" / "tpu_peers.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    return suite


def test_moe_peers_match_the_golden_in_interpret_mode():
    """The suite's grouped-matmul peers (jax.lax.ragged_dot, bundled megablox gmm and
    tgmm, interpreted) compute the ops' math: an empty group, group sizes summing to
    less than M (M not a multiple of megablox's row tile), an expert-parallel offset."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    suite = _peers_module()
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    lhs = jax.random.normal(keys[0], (200, 128), jnp.float32)
    rhs = jax.random.normal(keys[1], (3, 128, 128), jnp.float32) / 12
    sizes = jnp.asarray([60, 0, 110], jnp.int32)  # 170 of 200 rows
    ops = stellax.registered_ops()

    def close(a, b):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)

    golden = ops["ragged_dot"].reference(lhs, rhs, sizes)
    with stellax.interpret_mode():
        close(suite.megablox_gmm_peer(lhs, rhs, sizes), golden)
        close(suite.megablox_gmm_peer(lhs, rhs[1:], sizes, group_offset=jnp.int32(1)),
              ops["ragged_dot"].reference(lhs, rhs[1:], sizes, group_offset=jnp.int32(1)))
        close(suite.megablox_tgmm_peer(lhs.T, lhs[:, :64], sizes),
              ops["ragged_dot_tgmm"].reference(lhs.T, lhs[:, :64], sizes))
        close(suite.megablox_tgmm_peer(lhs, lhs[:, :64], sizes, group_offset=jnp.int32(1), num_local_groups=2,
                                       transpose_lhs=True),
              ops["ragged_dot_tgmm"].reference(lhs, lhs[:, :64], sizes, group_offset=jnp.int32(1),
                                               num_local_groups=2, transpose_lhs=True))
    close(suite.ragged_dot_peer(lhs, rhs, sizes), golden)
    with pytest.raises(stellax.UnsupportedError, match="megablox"):
        suite.megablox_gmm_peer(lhs, rhs, sizes, activation="silu")
    assert set(suite.MOE_PEERS) == {"ragged_dot", "ragged_dot_tgmm"}


def test_an_op_whose_every_config_failed_is_not_marked_tuned(tmp_path, monkeypatch):
    """A tuning where every config failed (e.g. all out of HBM) raises, so the stage
    records an error and a later command tries the op again instead of skipping it."""
    import importlib.util
    import types

    import stellax.autotune

    spec = importlib.util.spec_from_file_location("tpu_suite_under_test", ROOT / "benchmarks" / "tpu_suite.py")
    suite_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_module)
    failure = {"op": "layer_norm", "implementation": "mosaic_tpu", "error": "RESOURCE_EXHAUSTED: out of HBM"}
    monkeypatch.setattr(stellax.autotune, "autotune",
                        lambda *a, **k: types.SimpleNamespace(entries=[], failures=[failure]))
    args = suite_module.parse_args(["--dry-run", "--out", str(tmp_path)])
    from stellax.core import current_platform, interpret_mode

    suite = suite_module.Suite(args, current_platform())
    suite.results = suite_module.Results(tmp_path / "r.json", fresh=True, dry_run=True)
    with interpret_mode(True), pytest.raises(suite_module.NothingTuned, match="no config of layer_norm ran.*out of HBM"):
        suite_module.autotune_op(suite, stellax.registered_ops()["layer_norm"])


def _suite_module_and_cpu_suite(tmp_path):
    """The suite module and a `Suite` on this CPU acting as a real run (not a dry run): the
    benchmark shapes are the CPU's."""
    import importlib.util

    from stellax.core import current_platform

    spec = importlib.util.spec_from_file_location("tpu_suite_under_test", ROOT / "benchmarks" / "tpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    suite = module.Suite(module.parse_args(["--dry-run", "--out", str(tmp_path)]), current_platform())
    suite.args.dry_run = False
    return module, suite


def test_benchmark_shape_inputs_are_the_builders_values_and_supported(tmp_path):
    """The check stage's benchmark call carries the op's own values (SSD's A < 0: random normal
    values sent the state to inf on the chip) and is one the kernel runs on the device (no fp8
    weights on a v5e)."""
    import jax
    import jax.numpy as jnp

    module, suite = _suite_module_and_cpu_suite(tmp_path)
    ops = stellax.registered_ops()
    (example,) = module.concrete_cases(suite, ops["ssd"], 1)
    assert float(jnp.max(example.args[2])) < 0, "A must be negative"
    assert bool(jnp.all(jnp.isfinite(example.args[0])))
    labels = [e.label for e in module.abstract_cases(suite, ops["ragged_dot_quantized"], None)]
    assert labels[0].startswith("fp8")
    with stellax.lowering_target("v5e"):
        picked = module.first_supported_case(suite, ops["ragged_dot_quantized"])
    assert picked is not None and not picked.label.startswith("fp8") and picked.label in labels
    # The builder gives the quantized weights as shapes only: the check gets values for them (the
    # chip's check failed on a `jax.ShapeDtypeStruct` operand).
    leaves = jax.tree_util.tree_leaves((picked.args, picked.kwargs))
    assert not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    codes = [x for x in leaves if hasattr(x, "dtype") and jnp.dtype(x.dtype).itemsize == 1
             and jnp.issubdtype(x.dtype, jnp.integer)]
    assert codes and any(bool(jnp.any(c != 0)) for c in codes)


def test_check_at_scale_fails_when_the_golden_is_not_finite(tmp_path):
    """NaN against NaN compares equal, so a benchmark-shape check whose golden is not finite is
    a failure, not a pass."""
    import dataclasses

    import jax.numpy as jnp

    module, _ = _suite_module_and_cpu_suite(tmp_path)
    op = stellax.registered_ops()["layer_norm"]
    example = op.examples(jnp.float32)[0]
    with stellax.interpret_mode():
        good = module.check_at_scale(op, example)
        bad_x = example.args[0].at[(0,) * example.args[0].ndim].set(jnp.inf)
        bad = module.check_at_scale(op, dataclasses.replace(example, args=(bad_x, *example.args[1:])))
    assert good["result"] == "ok", good
    assert bad["result"] == "fail" and "non-finite" in bad["detail"], bad


def test_check_at_scale_falls_back_to_a_same_dtype_golden_when_float32_copies_do_not_fit(tmp_path, monkeypatch):
    """Where no float32 golden fits the device (a 64-expert layer's weights), the XLA path on the
    operands as given, at 'highest', is the golden, and the record names it; with none fitting the
    check is skipped with the reasons."""
    import jax.numpy as jnp

    from stellax.bench import measurement

    module, _ = _suite_module_and_cpu_suite(tmp_path)
    op = stellax.registered_ops()["layer_norm"]
    example = op.examples(jnp.bfloat16)[1]
    real = measurement.compile_within_memory
    refused = []

    def compile_float32_refused(lowered, *, what="the program", device=None):
        if "golden" in what and ("float32" in what or "reference" in what):
            refused.append(what)
            raise measurement.DeviceMemoryError(f"{what} does not fit (planted)")
        return real(lowered, what=what, device=device)

    monkeypatch.setattr(measurement, "compile_within_memory", compile_float32_refused)
    with stellax.interpret_mode():
        record = module.check_at_scale(op, example)
    assert record["result"] == "ok" and record["golden"] == "xla (bfloat16 operands, highest)", record
    assert len(refused) == 2   # the reference and the XLA path in float32

    def every_golden_refused(lowered, *, what="the program", device=None):
        if "golden" in what:
            raise measurement.DeviceMemoryError(f"{what} does not fit (planted)")
        return real(lowered, what=what, device=device)

    monkeypatch.setattr(measurement, "compile_within_memory", every_golden_refused)
    with stellax.interpret_mode():
        skipped = module.check_at_scale(op, example)
    assert skipped["result"] == "skip" and "no golden fits" in skipped["detail"], skipped


def test_attention_stage_runs_issue_37s_cases_and_resumes(tmp_path):
    """The attention stage: a case of `attention_tpu.CASES` per unit, stellax's default against
    splash's searched block sizes in both passes, rows with ``config`` and ``vs_splash`` (so a
    splash row per block size, none replacing another); a done case is not run again."""
    args = ("--dry-run", "--stages", "attention", "--attention-cases", "0", "--attention-configs", "none")
    proc = _run_suite(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("stellax-tpu-suite-")]
    data = json.loads(path.read_text())
    assert data["done"]["attention"] == ["MHA causal T=8192 D=128"] and not data["errors"], data["errors"]
    rows = data["rows"]
    assert {(r["pass"], r["contender"], r["config"]) for r in rows if r["contender"] == "jax:splash"} == {
        (p, "jax:splash", f"blocks {b}") for p in ("fwd", "fwd+bwd") for b in ("512", "1024")}
    ours = [r for r in rows if r["contender"] == "stellax:mosaic_tpu"]
    assert len(ours) == 2 and all(r["default"] and r["ms"] > 0 and r["vs_splash"] > 0 for r in ours), ours
    assert all(r["rel_l2"] < 1e-2 for r in rows), [r["rel_l2"] for r in rows]
    again = _run_suite(tmp_path, *args)
    assert again.returncode == 0 and "attention MHA causal" not in again.stdout, again.stdout[-3000:]
    assert all(r["vs_xla"] is None for r in json.loads(path.read_text())["rows"])
    # The attention_xla stage adds the XLA paths to the case's rows, and every row its vs_xla.
    proc = _run_suite(tmp_path, *args[:2], "attention_xla", *args[3:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["done"]["attention_xla"] == ["MHA causal T=8192 D=128"] and len(data["rows"]) == len(rows) + 4
    xla = {(r["pass"], r["contender"]) for r in data["rows"] if r["contender"] not in ("jax:splash", "stellax:mosaic_tpu")}
    assert xla == {(p, c) for p in ("fwd", "fwd+bwd")
                   for c in ("stellax:xla_chunked", "jax.nn.dot_product_attention[xla]")}, xla
    assert all(r["vs_xla"] > 0 and r["vs_splash"] > 0 for r in data["rows"]), data["rows"]
    listed = _run_suite(tmp_path / "plan", "--list", "--stages", "attention,attention_xla")
    assert listed.returncode == 0, listed.stderr[-3000:]
    lines = listed.stdout.splitlines()
    assert sum(l.startswith("attention ") for l in lines) == sum(l.startswith("attention_xla") for l in lines) == 18


def test_row_key_tells_configs_apart_but_not_the_defaults_picks(tmp_path):
    module, _ = _suite_module_and_cpu_suite(tmp_path)
    row = {"op": "attention", "case": "MHA causal T=8192 D=128", "pass": "fwd", "contender": "jax:splash"}
    assert module.row_key({**row, "config": "blocks 512"}) != module.row_key({**row, "config": "blocks 1024"})
    ours = {**row, "contender": "stellax:mosaic_tpu"}
    assert module.row_key({**ours, "config": "default(attention=mosaic_tpu:512x512)"}) == \
        module.row_key({**ours, "config": "default(attention=mosaic_tpu:1024x1024)"})
    assert module.row_key(row) == module.row_key({**row, "config": None})   # bench-stage rows have no config


def test_an_op_checked_again_replaces_all_its_records(tmp_path, monkeypatch):
    """A re-check whose benchmark call changed (the chip's fp8 call became the int4 one) leaves
    no stale failure of the old call in the results; other ops' records stay."""
    module, suite = _suite_module_and_cpu_suite(tmp_path)
    suite.results = module.Results(tmp_path / "r.json", fresh=True, dry_run=True)
    old = [{"op": "ragged_dot_quantized", "implementation": "mosaic_tpu", "dtype": "bfloat16",
            "example": "fp8_e4m3 (channel) (benchmark shape)", "result": "fail"},
           {"op": "ssd", "implementation": "mosaic_tpu", "dtype": "bfloat16", "example": "x", "result": "ok"}]
    suite.results.data["check"]["records"][:] = old
    new = [{"op": "ragged_dot_quantized", "implementation": "mosaic_tpu", "dtype": "bfloat16",
            "example": "int4 (128) (benchmark shape)", "result": "ok"}]
    monkeypatch.setattr(module, "check_op", lambda suite, op: list(new))
    op = stellax.registered_ops()["ragged_dot_quantized"]
    suite.args.budget = 1e6
    assert module.run_stage(suite, "check", [op], {("check", op.name): 1.0}) is None
    records = suite.results.data["check"]["records"]
    assert [r["example"] for r in records] == ["x", "int4 (128) (benchmark shape)"]
    assert suite.results.data["check"]["failures"] == 0 and suite.results.done("check", op.name)


def test_a_stage_runs_the_later_ops_that_fit_the_time_left(tmp_path, monkeypatch):
    """An op whose estimate is over the time left is left for the next command, named first in
    what is left; the smaller ops after it still run, and their seconds are recorded."""
    from types import SimpleNamespace

    module, suite = _suite_module_and_cpu_suite(tmp_path)
    suite.results = module.Results(tmp_path / "suite.json", fresh=True, dry_run=False)
    monkeypatch.setattr(suite, "remaining", lambda: 100.0)
    ran = []
    monkeypatch.setattr(module, "bench_op", lambda suite, op: ran.append(op.name) or [])
    ops = [SimpleNamespace(name=n) for n in ("small", "large", "later", "larger")]
    estimates = {("bench", "small"): 10.0, ("bench", "large"): 300.0, ("bench", "later"): 50.0,
                 ("bench", "larger"): 400.0}
    assert module.run_stage(suite, "bench", ops, estimates) == "large"
    assert ran == ["small", "later"] and suite.results.data["done"]["bench"] == ["small", "later"]
    assert set(suite.results.data["unit_seconds"]["bench"]) == {"small", "later"}
