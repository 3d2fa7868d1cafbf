"""The hardware tier's bad-data cases (issue 43): every case of `tpu_bad_data_cases` natively on a
TPU through the ``mosaic_tpu`` implementations — invalid lengths, block tables, ragged offsets,
``cu_seqlens``, group offsets and positive linear-attention decays give NaN in exactly the affected
rows (the other rows bitwise what the kernel gives on valid data, and close to ``xla``), a repeated
cache slot keeps its last write, and checked mode (`stellax.checked`) reports each condition through
``checkify`` naming the argument and the bad value.

``pytest -m tpu_hardware -p no:xdist tests/tpu_hardware`` on a TPU host (one process holds the chip).
Without a TPU every case is skipped, saying so; the same cases run interpreted on the CPU in
`test_tpu_hardware_bad_data_interpreted.py`.
"""

from __future__ import annotations

import pytest

import stellax
from stellax.core import current_platform

from tpu_bad_data_cases import CASES

pytestmark = pytest.mark.tpu_hardware

PLATFORM = current_platform()
ON_TPU = PLATFORM.backend == "tpu" and PLATFORM.tpu is not None and PLATFORM.tpu.kernels
NO_TPU = f"needs a TPU v5e or newer (this device is {PLATFORM.describe()}): run it on a TPU host"


@pytest.mark.skipif(not ON_TPU, reason=NO_TPU)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_on_the_chip(case):
    with stellax.interpret_mode(False):  # natively, whatever STELLAX_INTERPRET says
        CASES[case]("mosaic_tpu")
