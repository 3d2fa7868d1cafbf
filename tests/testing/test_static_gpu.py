"""The static GPU performance tier (`stellax.testing.static_gpu`).

Under the ``ptx`` marker (needs the cuda-check extra: the jax CUDA plugin's
Triton compiler; ptxas from ``nvidia-cuda-nvcc`` for registers and spills):

* every Triton implementation: each config its heuristic can choose (on the
  bf16 examples and H200 benchmark shapes) compiles at sm_90 with every dot on
  tensor cores, no register spills, and cp.async where it is pipelined;
  configs only in the autotuning space that fail are reported (flagged), not
  failed;
* the flash attention forward kernel, known ground: wgmma bf16 on sm_90,
  mma.sync on sm_80, cp.async with num_stages > 1, a ptxas register count.

The default tier checks the CLI's refusal when the compiler is missing and
the table format on results written down here.
"""

from __future__ import annotations

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
@pytest.mark.parametrize("op,implementation", [pytest.param(op, name, id=f"{op.name}-{name}")
                                               for op, name in IMPLEMENTATIONS])
def test_heuristic_configs_pass_the_static_tier(op, implementation):
    _require_compiler()
    units = [u for u in static_gpu.units(op, implementation) if u.heuristic]
    assert units, f"{op.name}/{implementation}: no call reaches the heuristic"
    results = [r for u in units for r in static_gpu.analyze_unit(u, ("9.0",))]
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


def test_cli_exits_2_without_the_compiler(monkeypatch, capsys):
    from stellax import cli
    from stellax.testing import lowering

    monkeypatch.setattr(lowering, "triton_compiler_available", lambda: (False, "no CUDA Triton compiler: install"))
    assert cli.main(["check", "--static-gpu", "norm"]) == 2
    assert "no CUDA Triton compiler" in capsys.readouterr().out


def test_abstract_examples_keep_integer_operands_concrete():
    op = stellax.registered_ops()["ragged_dot"]
    examples = static_gpu.abstract_examples(lambda: op.examples(jnp.bfloat16))
    lhs, rhs, sizes = examples[0].args
    assert not hasattr(lhs, "addressable_shards") and lhs.dtype == jnp.bfloat16
    assert sizes.tolist() == [13, 0, 20]
