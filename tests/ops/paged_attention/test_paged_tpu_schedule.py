"""The static schedule of the Mosaic TPU paged decode kernel compiled by libtpu for a v5e (no
TPU; `stellax.ops.paged_attention.tpu_cases`, `stellax.testing.llo_schedule`): a block's update
stays well under the HBM time of the block's pages, so the decode is bound by its bytes."""

from __future__ import annotations

import pytest

from stellax.ops.paged_attention.tpu_cases import (
    V5E_CLOCK_HZ,
    V5E_HBM_BYTES_PER_S,
    Segment,
    block_compute,
    block_dma_cycles,
    decode_case,
    dma_sizes,
    dump_kernel,
    mla_case,
    segments,
)
from stellax.testing.tpu_compile import libtpu_available

LIBTPU, WHY_NOT = libtpu_available()
needs_libtpu = pytest.mark.skipif(not LIBTPU, reason=WHY_NOT)

#: The benchmark's first case: B=64 ctx 4k, pages of 64, 32q/8kv, H=128, bf16, 8 pages a block.
CASE = {"batch": 64, "context": 4096, "page_size": 64, "pages_per_block": 8}


@needs_libtpu
def test_decode_block_update_is_under_the_blocks_dma_time(tmp_path):
    """bf16 pages, 512 keys × 8 kv heads a block (2 MiB, ~3840 cycles at 819 GB/s and 1.5 GHz):
    the unmasked block update (static bundles, 908 on libtpu 0.0.42) under 40 % of that, the
    masked last block's (1795) under 75 %, and the pipeline's issue of the next block's 16 page
    copies (236) under 10 %."""
    path = dump_kernel(CASE, str(tmp_path), "stellax_paged_attention_tpu")
    dma = block_dma_cycles(512, 8, 128, 2)
    unmasked, masked = block_compute(path)
    assert unmasked < 0.40 * dma, (unmasked, dma)
    assert masked < 0.75 * dma, (masked, dma)
    issue = [s for s in segments(path) if s.depth == 2 and s.dmas and not s.matmuls and s.bundles > 50]
    assert issue and min(s.bundles for s in issue) < 0.10 * dma, (issue, dma)


def test_segments_split_at_labels_and_branches(tmp_path):
    """A hand-written dump: a loop body label opens a segment, a branch closes one."""
    dump = tmp_path / "1-k-72-final_bundles.txt"
    dump.write_text(
        "   0x0   :  { %1 = sst [smem:[#allocation1_spill]] %s0 }\n"
        "   0x1 LB: > { %2 = vmatmul.bf16 %v1 ;; %3 = vpow2 %v2 }\n"
        "   0x2   : > { %4 = dma.hbm_to_vmem %s1 ;; %5 = sbr.rel (%p1) target = $region7 }\n"
        "   0x3   : > { %6 = vmatmul.bf16 %v3 }\n")
    assert segments(str(dump)) == [Segment(0, 1, 0, 0, 0, 1, 0), Segment(1, 2, 1, 1, 1, 0, 1),
                                   Segment(3, 1, 1, 1, 0, 0, 0)]
    assert block_compute(str(dump)) == (1, 2)


def test_decode_case_checks_its_shape():
    with pytest.raises(ValueError, match="pages_per_block"):
        decode_case(batch=2, context=256, page_size=64, pages_per_block=3)
    with pytest.raises(ValueError, match="cache"):
        decode_case(batch=2, context=256, page_size=64, pages_per_block=4, cache="int8", peer=True)


@needs_libtpu
@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_quantized_block_update_is_under_the_blocks_dma_time(tmp_path, cache):
    """B=8 ctx 16k, 512 keys × 8 kv heads a block of 8-bit codes (1 MiB + 32 KiB of float32
    scales, ~1984 cycles): the unmasked block update under 80 % of that (static bundles on
    libtpu 0.0.42: int8 1293, fp8 1332; fp8 was 2408 before its codes were read as
    e4m3b11fnuz, 1275 while that bitcast was XLA's, a copy of the pool per call)."""
    case = {"batch": 8, "context": 16384, "page_size": 64, "pages_per_block": 8, "cache": cache}
    path = dump_kernel(case, str(tmp_path), "stellax_paged_attention_tpu")
    dma = block_dma_cycles(512, 8, 128, 1) + block_dma_cycles(512, 8, 1, 4)   # codes + scales
    unmasked, masked = block_compute(path)
    assert unmasked < 0.80 * dma, (cache, unmasked, dma)
    assert masked < 1.5 * dma, (cache, masked, dma)


@needs_libtpu
def test_int4_page_copies_move_half_of_int8s_bytes(tmp_path):
    """int4 codes are uint4 (two per byte, lane-dense in XLA:TPU's ``T(8,128)(8,1)`` layout): the
    decode kernel's page copies (the largest DMAs of its v5e dump) move 32 KiB per page of 64
    tokens × 8 heads × 128 channels, half of int8's 64 KiB. The packed uint8 ``[.., H/2]`` rows
    before were padded to 128 lanes: int8's 64 KiB (2048 granules). (Pools of a few MiB are
    placed in VMEM by XLA before the kernel, which then copies no page: B=8 ctx 16k keeps them
    in HBM.)"""
    case = dict(batch=8, context=16384, page_size=64, pages_per_block=8)
    page = {}
    for cache in ("int8", "int4"):
        path = dump_kernel({**case, "cache": cache}, str(tmp_path / cache), "stellax_paged_attention_tpu")
        page[cache] = max(dma_sizes(path))
    assert page["int8"] == 64 * 8 * 128, page
    assert page["int4"] == 64 * 8 * 128 // 2, page


@needs_libtpu
def test_int4_block_update_against_its_dma_time(tmp_path):
    """B=8 ctx 16k, 512 keys × 8 kv heads a block of uint4 codes (512 KiB) with their float32
    scales and zero points (64 KiB, head pairs: `mosaic_tpu_pages.source_arrays`), ~1080 cycles
    at 819 GB/s. The word path (`mosaic_tpu_pages.word_codes`: int32 words, two kv heads'
    bfloat16 codes from three VPU ops a word vreg, logits per head pair, the four pairs' logits
    matmuls issued before their softmax updates) keeps the unmasked block update under 0.9x of
    that, the masked one and the kernel's longest dependency chain (`critical_path`, which a
    step takes at least) under 1.0x (static on libtpu 0.0.42: 889 / 902 bundles, critical path
    860 cycles; 2195 / 3238 bundles when Mosaic unpacked the uint4 block through s4 → s8 → s32,
    a mask, a sublane permute and the float conversion; 1043 / 1085 bundles but a 2011-cycle
    chain when each pair's softmax followed its own logits on one MXU)."""
    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import word_codes
    from stellax.testing.llo_schedule import parse_dump

    case = {"batch": 8, "context": 16384, "page_size": 64, "pages_per_block": 8, "cache": "int4"}
    assert word_codes(as_source(decode_case(**case)[1][1]))
    path = dump_kernel(case, str(tmp_path), "stellax_paged_attention_tpu")
    dma = block_dma_cycles(512, 8, 128, 0.5) + block_dma_cycles(512, 8, 2, 4)   # codes + scale and zero
    unmasked, masked = block_compute(path)
    assert unmasked < 0.9 * dma, (unmasked, dma)
    assert masked < 1.0 * dma, (masked, dma)
    kernel = [s for name, s in parse_dump(str(tmp_path)).items() if name.startswith("stellax_paged_attention_tpu")]
    assert kernel and kernel[0].critical_path < 1.0 * dma, (kernel, dma)


@needs_libtpu
def test_mla_block_update_is_near_its_dma_time(tmp_path):
    """DeepSeek-V3 MLA decode (128 heads, latent 512 + rope 64, bf16), B=64 ctx 4k, 16 pages of 64
    a block (1.1 MiB, 2160 cycles at 819 GB/s): the FLOPs of a block (2·128·(576 + 512) per key)
    take the same 2160 cycles at the MXU's 197 TFLOP/s (the shape sits on the v5e's ridge), so the
    update cannot drop under its DMA time; it stays within 1.3x of it (static bundles on libtpu
    0.0.42: 2488, the MXU ~87 % busy)."""
    case = {"batch": 64, "context": 4096, "page_size": 64, "pages_per_block": 16}
    path = dump_kernel(case, str(tmp_path), "stellax_mla_decode_tpu", builder="mla_case")
    dma = 16 * 64 * (512 + 64) * 2 / V5E_HBM_BYTES_PER_S * V5E_CLOCK_HZ
    unmasked, _ = block_compute(path)
    assert unmasked < 1.3 * dma, (unmasked, dma)


def test_mla_case_checks_its_shape():
    with pytest.raises(ValueError, match="context"):
        mla_case(batch=2, context=1000, page_size=64, pages_per_block=4)
