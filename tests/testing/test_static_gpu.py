"""The static GPU performance tier (`stellax.testing.static_gpu`).

Under the ``ptx`` marker (needs the cuda-check extra: the jax CUDA plugin's
Triton compiler; ptxas from ``nvidia-cuda-nvcc`` for registers and spills):

* every Triton implementation: each config its heuristic can choose (on the
  bf16 examples and H200 benchmark shapes) compiles at sm_90 and sm_80 (each
  arch with its own dispatch: an A100's heuristic and refusals) with every dot on
  tensor cores, no register spills, and cp.async where it is pipelined;
  configs only in the autotuning space that fail are reported (flagged), not
  failed;
* the flash attention forward kernel, known ground: wgmma bf16 on sm_90,
  mma.sync on sm_80, cp.async with num_stages > 1, a ptxas register count.

The default tier checks the CLI's refusal when the compiler is missing, the
table format on results written down here, and that each arch's units are
what that arch's dispatch picks (no compile).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

import stellax
from stellax.testing import static_gpu
from stellax.testing.lowering import triton_compiler_available
from stellax.testing.ptx_analysis import Dot, KernelStatic, Occupancy, Ptxas, ptxas_path

IMPLEMENTATIONS = static_gpu.triton_implementations(stellax.registered_ops())


def _require_compiler():
    available, reason = triton_compiler_available()
    if not available:
        pytest.skip(reason)


@pytest.mark.ptx
@pytest.mark.parametrize("arch", static_gpu.ARCHS)
@pytest.mark.parametrize("op,implementation", [pytest.param(op, name, id=f"{op.name}-{name}")
                                               for op, name in IMPLEMENTATIONS])
def test_heuristic_configs_pass_the_static_tier(op, implementation, arch):
    _require_compiler()
    units = [u for u in static_gpu.units(op, implementation, arch) if u.heuristic]
    if not units and arch != "9.0":  # nothing to compile there only if dispatch refuses every call
        sm90 = [u for u in static_gpu.units(op, implementation) if u.heuristic]
        assert sm90 and not any(static_gpu.supported_at(u, arch) for u in sm90), \
            f"{op.name}/{implementation}: no heuristic call on sm_{arch.replace('.', '')}, and dispatch does not refuse"
        return
    assert units, f"{op.name}/{implementation}: no call reaches the heuristic"
    results = [r for u in units for r in static_gpu.analyze_unit(u)]
    failing = {f"{r.label} ({r.config})": r.failures for r in results if not r.ok}
    assert not failing, f"{op.name}/{implementation}: heuristic configs fail the static tier: {failing}"


@pytest.mark.ptx
def test_flash_attention_forward_reads_as_expected():
    _require_compiler()
    op = stellax.registered_ops()["attention"]
    unit = next(u for u in static_gpu.units(op, "triton") if u.heuristic and u.label.startswith("bench"))
    sm90, sm80 = static_gpu.analyze_unit(unit, ("9.0", "8.0"))
    (k90,), (k80,) = sm90.kernels, sm80.kernels
    assert k90.dots and all(d.lhs == "bf16" for d in k90.dots)
    assert set(k90.wgmma) == {"bf16"} and not k90.fma_dots
    assert set(k80.mma_sync) == {"bf16"} and not k80.wgmma
    assert unit.config.num_stages > 1 and k90.cp_async > 0 and k90.has_loop
    if ptxas_path() is not None:
        assert 0 < k90.ptxas.registers <= 255 and k90.occupancy.warps_per_sm >= unit.config.num_warps
    lines = static_gpu.format_findings(sm90)
    assert lines[0].startswith("attention/triton sm_90") and "[heuristic]" in lines[0]
    assert "wgmma bf16x" in lines[1]


def _result(op, family, heuristic, **kernel):
    base = dict(name="k", arch="9.0", num_warps=4, num_stages=2, grid=(1, 1, 1), smem_bytes=1024,
                dots=(Dot(64, 64, 64, "bf16", "bf16", "f32", "tf32"),), wgmma={"bf16": 4}, mma_sync={},
                cp_async=8, tma=0, has_loop=True, local_ptx=0, ptxas=Ptxas(96, 0, 0, 0, False),
                occupancy=Occupancy(4, 16, "registers"))
    base.update(kernel)
    return static_gpu.StaticConfig(op, "triton", family, "ex0", "w4,s2", 0, heuristic, "9.0",
                                   kernels=(KernelStatic(**base),))


def test_summary_rows_and_choosable_failures():
    results = [_result("a", "fam", True), _result("a", "fam", False, ptxas=Ptxas(255, 8, 8, 8, False)),
               _result("b", "fam", True, cp_async=0),
               _result("c", "other", False, dots=(), wgmma={})]
    (fam, other) = static_gpu.summary_rows(results)
    assert fam["configs"] == 3 and fam["tensor_cores"] == 3 and fam["spill"] == 1 and fam["pipelined"] == 2
    assert fam["failing"] == 2 and fam["failing_heuristic"] == 1 and fam["max_registers"] == 255
    assert other["with_dots"] == 0 and other["tensor_cores"] == 0
    assert [r.op for r in static_gpu.choosable_failures(results)] == ["b"]
    table = static_gpu.markdown_table(results)
    assert table.splitlines()[2].startswith("| fam | 2 | 3 | 3 | 3 | 1 | 2 | 2 (1) | 255 |")
    assert static_gpu.format_findings(results[2])[0].endswith("FAIL")
    assert static_gpu.format_findings(results[1])[0].endswith("flagged")


def test_json_readings_round_trip_and_merge(tmp_path):
    a = _result("a", "fam", False, ptxas=Ptxas(255, 8, 8, 8, False))
    b = _result("b", "fam", True, occupancy=None, ptxas=None, ptxas_error="ptxas timed out after 900 s")
    static_gpu.write_json([a, b], tmp_path / "run.json")
    assert static_gpu.read_json([tmp_path / "run.json"]) == [a, b]
    # JSON lines, as a run's progress appends them: a later reading of the same config replaces the first
    a_fixed = _result("a", "fam", False)
    lines = tmp_path / "a@9.0.jsonl"
    lines.write_text("".join(json.dumps(r.to_json()) + "\n" for r in (a, a_fixed)))
    merged = static_gpu.read_json([tmp_path / "run.json", lines])
    assert merged == [a_fixed, b] and merged[0].ok and not a.ok


def test_cli_exits_2_without_the_compiler(monkeypatch, capsys):
    from stellax import cli
    from stellax.testing import lowering

    monkeypatch.setattr(lowering, "triton_compiler_available", lambda: (False, "no CUDA Triton compiler: install"))
    assert cli.main(["check", "--static-gpu", "norm"]) == 2
    assert "no CUDA Triton compiler" in capsys.readouterr().out


def test_units_are_generated_at_each_archs_dispatch_target():
    # mla_decode at R = 512: two pipeline stages on sm_90, one below (two need 176 KB of shared
    # memory, over an A100's 163 KB): the sm_80 units must be what an A100's dispatch picks.
    op = stellax.registered_ops()["mla_decode"]
    sm90, sm80 = static_gpu.units(op, "triton", "9.0"), static_gpu.units(op, "triton", "8.0")
    assert {u.arch for u in sm90} == {"9.0"} and {u.arch for u in sm80} == {"8.0"}
    r512 = lambda us: [u for u in us if u.heuristic and "R=512" in u.label]  # noqa: E731
    assert r512(sm90) and r512(sm80)
    assert {u.config.num_stages for u in r512(sm90)} == {2}
    assert {u.config.num_stages for u in r512(sm80)} == {1}
    # the sm_80 space adds 1-stage configs; the sm_90 space has none
    assert {u.config.num_stages for u in sm80 if u.config_index is not None} == {1, 2}
    assert {u.config.num_stages for u in sm90 if u.config_index is not None} == {2}
    with pytest.raises(ValueError, match="arch: expected one of"):
        static_gpu.units(op, "triton", "7.5")


def _heuristic_configs(name, arch):
    op = stellax.registered_ops()[name]
    return {u.label: u.config for u in static_gpu.units(op, "triton", arch) if u.heuristic}


def test_sm80_heuristics_avoid_the_configs_the_tier_found_spilling():
    # Readings of the static tier (ptxas, sm_80, bf16): the sm_90 choices spill there.
    fwd80, fwd90 = _heuristic_configs("attention", "8.0"), _heuristic_configs("attention", "9.0")
    assert (fwd80["ex0"].block_q, fwd80["ex0"].num_warps) == (64, 4)  # 128x64 on 4 warps: 40 B spilled
    assert (fwd90["ex0"].block_q, fwd90["ex0"].num_warps) == (128, 4)
    bwd80 = _heuristic_configs("attention_backward", "8.0")["ex0"]
    assert (bwd80.block_q, bwd80.block_k) == (32, 64)  # dk/dv at 64x64: 36 B spilled
    ragged80 = _heuristic_configs("ragged_paged_attention", "8.0")
    ragged90 = _heuristic_configs("ragged_paged_attention", "9.0")
    mixed = next(label for label in ragged80 if "mixed" in label)
    assert ragged80[mixed].block_rows == 64 and ragged80[mixed].num_warps == 8  # 4 warps: 52 B spilled
    assert ragged90[mixed].num_warps == 4
    with stellax.lowering_target("a100"):
        op = stellax.registered_ops()["attention"]
        example = op.examples(jnp.bfloat16)[0]
        space = op.implementations["triton"].config_space(op.check(*example.args, **example.kwargs))
    assert space and not [c for c in space if c.block_q == 128 and c.num_warps == 4]


def test_the_cost_model_ranks_the_spilling_configs_of_the_stored_space_run_last():
    # The complete space run (sm_90) flagged ragged_dot's 4-warp 128x256 tiles: 2.0-2.5 KB of spills
    # a thread. They were the model's fastest configs at the headline shape; stored, they rank last.
    import jax

    from stellax.bench import cost_model
    from stellax.testing.registry import config_id

    op = stellax.registered_ops()["ragged_dot"]
    flagged = cost_model.flagged_configs("ragged_dot", "triton")
    assert {"w4,s3,bm128,bn256,bk32", "w4,s3,bm128,bn256,bk64"} <= set(flagged)
    lhs = jax.ShapeDtypeStruct((16384, 7168), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((64, 7168, 2048), jnp.bfloat16)
    with stellax.lowering_target("h200"):
        call = op.check(lhs, rhs, jnp.full((64,), 256, jnp.int32))
        space = op.implementations["triton"].config_space(call)
    ranked = [config_id(c) for c in cost_model.rank_space(op, "triton", call, space)]
    marks = [cid in flagged for cid in ranked]
    assert any(marks) and marks == sorted(marks)  # every flagged config after every other one


def test_abstract_examples_keep_integer_operands_concrete():
    op = stellax.registered_ops()["ragged_dot"]
    examples = static_gpu.abstract_examples(lambda: op.examples(jnp.bfloat16))
    lhs, rhs, sizes = examples[0].args
    assert not hasattr(lhs, "addressable_shards") and lhs.dtype == jnp.bfloat16
    assert sizes.tolist() == [13, 0, 20]
