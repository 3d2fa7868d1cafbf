"""The CPU twin of `test_tpu_hardware_bad_data.py` (default tier, no TPU needed): the same cases of
`tpu_bad_data_cases` through the same ``mosaic_tpu`` code path, with the kernels interpreted
(`stellax.interpret_mode`). The cheaper cases run in the default tier, the ones that interpret
longer kernels (10 s and more each on the 2-core development machine) under ``-m slow``."""

from __future__ import annotations

import pytest

import stellax

from tpu_bad_data_cases import CASES

DEFAULT_TIER = ("ragged_dot_bad_group_offset", "quantized_ragged_dot_bad_group_offset",
                "chunk_gated_delta_rule_bad_cu_seqlens", "varlen_attention_bad_cu_seqlens",
                "update_kv_cache_repeated_slots")


@pytest.mark.parametrize("case", [c if c in DEFAULT_TIER else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_bad_data_interpreted(case):
    with stellax.interpret_mode():
        CASES[case]("mosaic_tpu")
