"""The static schedule of the Mosaic TPU paged decode kernel compiled by libtpu for a v5e (no
TPU; `stellax.ops.paged_attention.tpu_cases`, `stellax.testing.llo_schedule`): a block's update
stays well under the HBM time of the block's pages, so the decode is bound by its bytes."""

from __future__ import annotations

import pytest

from stellax.ops.paged_attention.tpu_cases import (
    Segment,
    block_compute,
    block_dma_cycles,
    decode_case,
    dump_kernel,
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
    libtpu 0.0.42: int8 1293, fp8 1275; fp8 was 2408 before its codes were read as
    e4m3b11fnuz)."""
    case = {"batch": 8, "context": 16384, "page_size": 64, "pages_per_block": 8, "cache": cache}
    path = dump_kernel(case, str(tmp_path), "stellax_paged_attention_tpu")
    dma = block_dma_cycles(512, 8, 128, 1) + block_dma_cycles(512, 8, 1, 4)   # codes + scales
    unmasked, masked = block_compute(path)
    assert unmasked < 0.80 * dma, (cache, unmasked, dma)
    assert masked < 1.5 * dma, (cache, masked, dma)
