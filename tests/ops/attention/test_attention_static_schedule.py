"""stellax's Mosaic TPU attention kernels against jax's splash attention in the static schedule of
the real TPU compiler (libtpu for a v5e, no TPU; `stellax.testing.attention_schedule`): bundles of a
grid step that visits one ``1024 × 1024`` logits tile, MHA causal, bf16, D=128. Static cycles
(libtpu's schedule), not measured times: docs/attention.md has the numbers."""

from __future__ import annotations

import pytest

from stellax.testing.attention_schedule import compare, kernel_case, step_cycles
from stellax.testing.tpu_compile import libtpu_available

LIBTPU, WHY_NOT = libtpu_available()
needs_libtpu = pytest.mark.skipif(not LIBTPU, reason=WHY_NOT)
#: The per-step code does not depend on T or the head count; small ones compile faster.
CASE = dict(t=4096, n=4, k=4, block=1024)


@needs_libtpu
def test_forward_step_is_a_tenth_shorter_than_splash():
    """The forward's unmasked step at least 10 % fewer bundles than splash's step (which
    evaluates its mask on every block), its masked step no longer than splash's, and over the
    causal schedule (finishes included) at least 10 % fewer bundles per visited block."""
    r = compare(CASE)
    ours, theirs = r["stellax"], r["splash"]
    assert ours.full <= 0.9 * theirs.full, (ours, theirs)
    assert ours.partial <= theirs.partial, (ours, theirs)
    assert r["ratio"] <= 0.9, r


@needs_libtpu
def test_fused_backward_step_is_no_longer_than_splash():
    """The fused backward's step (5 matmuls, MXU-bound in both kernels; keys first, one
    transpose, as splash's) no longer than splash's fused step, masked or not, and its
    unmasked step at least 3 % shorter (rows first, with two transposes, it was 2.8 % longer)."""
    r = compare({**CASE, "backward": True})
    ours, theirs = r["stellax"], r["splash"]
    assert max(ours.full, ours.partial) <= theirs.full, (ours, theirs)
    assert ours.full <= 0.97 * theirs.full, (ours, theirs)


def test_kernel_case_checks_its_arguments():
    with pytest.raises(ValueError, match="impl"):
        kernel_case(impl="flash")
    with pytest.raises(ValueError, match="multiple of k"):
        kernel_case(n=6, k=4)


def test_step_cycles_needs_the_kernel(tmp_path):
    with pytest.raises(ValueError, match="kernel_prefix"):
        step_cycles(str(tmp_path), "stellax_splash_attention_forward")
