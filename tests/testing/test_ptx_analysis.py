"""The readings of the static GPU tier on compiler output written down here
(no compiler needed): dots of Triton IR, tensor-core instructions of PTX, a
ptxas report, occupancy, and the findings they turn into."""

import pytest

from stellax.testing.ptx_analysis import (Dot, KernelStatic, Occupancy, Ptxas, occupancy, parse_dots, parse_ptxas,
                                          tensor_core_instructions)

IR = """
    %283 = tt.dot %98, %281, %282, inputPrecision = tf32 : tensor<64x64xbf16> * tensor<64x32xbf16> -> tensor<64x32xf32>
    %9 = tt.dot %a, %b, %c, inputPrecision = ieee : tensor<16x32xf32> * tensor<32x16xf32> -> tensor<16x16xf32>
    %10 = tt.dot %a, %b, %c : tensor<128x64xf8E4M3FN> * tensor<64x128xf8E4M3FN> -> tensor<128x128xf32>
"""

PTX = """
    wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1}, {%r2}, {%f5};
    cp.async.cg.shared.global [ %r1 + 0 ], [ %rd4 + 0 ], 0x10, %r2;
"""

PTXAS = """ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas info    : Function properties for k
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
"""


def test_parse_dots_reads_shapes_dtypes_and_precision():
    dots = parse_dots(IR)
    assert dots[0] == Dot(64, 32, 64, "bf16", "bf16", "f32", "tf32")
    assert dots[1] == Dot(16, 16, 32, "f32", "f32", "f32", "ieee")
    assert (dots[2].lhs, dots[2].m, dots[2].n, dots[2].precision) == ("f8E4M3FN", 128, 128, "")
    assert [d.tc_dtype for d in dots] == ["bf16", None, "e4m3"]


def test_tensor_core_instructions_by_operand_dtype():
    wgmma, mma = tensor_core_instructions(PTX)
    assert wgmma == {"bf16": 2} and mma == {"bf16": 1}


def test_parse_ptxas_report():
    assert parse_ptxas(PTXAS) == Ptxas(168, 8, 4, 12, True)
    with pytest.raises(RuntimeError, match="unexpected ptxas report"):
        parse_ptxas("ptxas fatal: nothing")


def test_occupancy_limits():
    # 168 regs × 32 = 5376 → 5376 per warp (a multiple of 256): 12 warps by registers, 1 block of 8 warps.
    assert occupancy(168, 40 * 1024, 8, "9.0") == Occupancy(1, 8, "registers")
    # Few registers: shared memory limits (228 KiB / (100 KiB + 1 KiB) = 2 blocks).
    assert occupancy(32, 100 * 1024, 4, "9.0") == Occupancy(2, 8, "shared memory")
    # Tiny kernels: the 64 warps per SM.
    assert occupancy(16, 0, 8, "9.0") == Occupancy(8, 64, "warps")
    # Over the per-block limit: nothing fits.
    assert occupancy(32, 230 * 1024, 4, "9.0").blocks_per_sm == 0


def _kernel(**overrides):
    base = dict(name="k", arch="9.0", num_warps=4, num_stages=2, grid=(1, 1, 1), smem_bytes=1024,
                dots=(Dot(64, 64, 64, "bf16", "bf16", "f32", "tf32"),), wgmma={"bf16": 4}, mma_sync={},
                cp_async=8, tma=0, has_loop=True, local_ptx=0, ptxas=Ptxas(96, 0, 0, 0, False),
                occupancy=Occupancy(4, 16, "registers"))
    base.update(overrides)
    return KernelStatic(**base)


def test_a_healthy_kernel_has_no_findings():
    k = _kernel()
    assert k.uses_tensor_cores and k.pipelined and not k.spills
    assert k.failures() == [] and k.warnings() == []


def test_findings_fma_dot_spills_no_pipeline_smem():
    fma = _kernel(dots=(Dot(16, 16, 32, "f32", "f32", "f32", "ieee"),), wgmma={})
    assert not fma.uses_tensor_cores and "on FMA" in fma.failures()[0]
    # A bf16 dot without any bf16 tensor-core instruction in the PTX is on FMA too.
    assert "on FMA" in _kernel(wgmma={"f16": 2}).failures()[0]
    spill = _kernel(ptxas=Ptxas(255, 64, 64, 32, False))
    assert spill.spills and "register spills" in spill.failures()[0]
    assert _kernel(local_ptx=3, ptxas=None).spills
    unpipelined = _kernel(cp_async=0)
    assert "no cp.async/TMA" in unpipelined.failures()[0]
    assert _kernel(cp_async=0, tma=2).failures() == []
    big = _kernel(smem_bytes=300 * 1024)
    assert "shared memory" in big.failures()[0]


def test_warnings_do_not_fail():
    k = _kernel(wgmma={}, mma_sync={"bf16": 8}, ptxas=Ptxas(96, 0, 0, 0, True), has_loop=False)
    assert k.failures() == []
    warnings = " ".join(k.warnings())
    assert "mma.sync only" in warnings and "C7514" in warnings and "without a loop" in warnings


def test_loop_trip_counts_from_constant_bounds():
    from stellax.testing.ptx_analysis import has_pipelinable_loop, loop_trip_counts

    text = """
    %c0_i32 = arith.constant 0 : i32
    %c1_i32 = arith.constant 1 : i32
    %c4_i32 = arith.constant 4 : i32
    %0:2 = scf.for %arg8 = %c0_i32 to %c1_i32 step %c1_i32 iter_args(%a = %x) -> (f32) : i32 {
    %1:2 = scf.for %arg9 = %c0_i32 to %c4_i32 step %c1_i32 iter_args(%a = %x) -> (f32) : i32 {
    %2:2 = scf.for %arg10 = %125 to %c4_i32 step %c1_i32 iter_args(%a = %x) -> (f32) : i32 {
    %9 = arith.addi %c0_i32, %c1_i32 : i32
    %10 = arith.muli %9, %c4_i32 : i32
    %3:2 = scf.for %arg11 = %c0_i32 to %9 step %c1_i32 iter_args(%a = %x) -> (f32) : i32 {
    %4:2 = scf.for %arg12 = %c0_i32 to %10 step %c1_i32 iter_args(%a = %x) -> (f32) : i32 {
    """
    assert loop_trip_counts(text) == [1, 4, None, 1, 4]
    assert has_pipelinable_loop(text)
    assert not has_pipelinable_loop(text.split("%1:2")[0])
