"""The verification tiers over the whole registry, generated at collection time:
every registered op × every kernel implementation (triton, mosaic_gpu,
mosaic_tpu) × its examples and its whole autotuning space.

* Tier 1 (numerics, interpret mode, vs the golden):
  - every example with the heuristic config, forward and gradients (for ops
    with ``differentiable``); for Mosaic TPU kernels the first example
    (the others under ``slow``: interpreted TPU kernels cost 10-60 s each,
    and their family tests cover the options);
  - the corner configs of the autotuning space (`corner_configs`: each
    varying field at its smallest and largest value) on the space's example
    (the first example with a non-empty space), forward; Mosaic TPU kernels'
    corners and every other config under ``slow``;
  - ``slow``: the full product, every example × every config, with gradients,
    and every example in bfloat16.
* Tier 2 (lowering for each platform the implementation targets: cuda for
  triton/mosaic_gpu, tpu for mosaic_tpu; the backend's custom call must be in
  the module):
  - every config of the space, forward;
  - every example with the heuristic config, forward and (differentiable ops)
    gradients;
  - ``slow``: every example × every config.
* Tier 3 (``ptx``, needs the cuda-check extra): every config of each Triton
  implementation compiles to PTX for sm_90 and fits its shared memory.
* Tier 3 for TPUs (needs the tpu-check extra, libtpu): each Mosaic TPU
  implementation's heuristic config compiles with the real compiler for v5e
  and v6e, forward and gradient, on its first example and its first TPU
  benchmark size (the transformer-sized call, where VMEM limits bite); ``tpu``: every config of each generation's space for v5e,
  v5p, v6e and TPU7x on every example and benchmark call.

Since 2026-12-03 the numerics, lowering and TPU compile tests of this module
are in the extended tier (`tests/extended_tier.txt`: CI runs it right after
the default tier; `pytest -m extended`), which keeps the default tier under
15 minutes.

Family test files keep only what is specific to an op (edge cases, options,
layouts, oracles); what is generic lives here.

Cost (measured 2026-12-01 on the shared 2-core CPU, loaded; CPU seconds):
collecting the module builds every op's float32 examples, 35 s warm (63 s
with a cold compilation cache). Default tier: 84 heuristic-config numerics
cases ~280 s, 199 every-config numerics cases ~240 s, 283 lowering cases
~60 s. The full product (696 example × config pairs with gradients, about
2.5 s each) would add over 25 min of CPU, hence ``slow``. Tier 3: 199 Triton
configs compile to PTX in ~400 s with the cuda-check wheels. With 26 Mosaic
TPU kernels (2026-12-02): their 26 interpreted first examples and 89 libtpu
compiles (v5e and v6e) took 422 s of wall time on 2 workers (5-31 s per
interpreted example, 2-21 s per compile, one 98 s outlier now deferred).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.core import interpret_mode
from stellax.testing import (assert_fits_smem, check_example, compile_triton_to_ptx, lower_config, platforms_of,
                             triton_compiler_available)
from stellax.testing.registry import config_cases, example_cases, kernel_implementations
from stellax.testing.tpu_compile import KERNEL_GENERATIONS, compile_cases, libtpu_available

KERNELS = kernel_implementations(stellax.registered_ops())


def _platform_cases(make, **kwargs):
    """``make(op, implementation, platform=p)`` for every kernel implementation and platform it targets."""
    return [case for op, impl in KERNELS for p in platforms_of(op.implementations[impl].backend)
            for case in make(op, impl, platform=p, **kwargs)]


def _params(cases, *marks):
    return [pytest.param(case, id=case.id, marks=marks) for case in cases]


#: Interpreted Mosaic TPU kernels cost 10-60 s of CPU per example with gradients
#: (race detection included): the default tier runs the first example of each
#: (over 25 TPU kernels), the others run under ``slow`` (the family tests cover
#: their options).
TPU_DEFAULT_EXAMPLES = 1
ALL_EXAMPLES = [c for op, impl in KERNELS for c in example_cases(op, impl)]


def _is_deferred(case) -> bool:
    if case.op.implementations[case.implementation].backend != "mosaic_tpu":
        return False
    same = [c for c in ALL_EXAMPLES if c.op is case.op and c.implementation == case.implementation]
    return same.index(case) >= TPU_DEFAULT_EXAMPLES


TIER1_EXAMPLES = [c for c in ALL_EXAMPLES if not _is_deferred(c)]
TIER1_DEFERRED = [c for c in ALL_EXAMPLES if _is_deferred(c)]
def _is_tpu(op, impl) -> bool:
    return op.implementations[impl].backend == "mosaic_tpu"


TIER1_CONFIGS = [c for op, impl in KERNELS if not _is_tpu(op, impl) for c in config_cases(op, impl, corners=True)]
_CORNER_IDS = {c.id for c in TIER1_CONFIGS}
TIER1_OTHER_CONFIGS = [c for op, impl in KERNELS for c in config_cases(op, impl) if c.id not in _CORNER_IDS]
TIER2_CONFIGS = _platform_cases(config_cases)
TIER2_EXAMPLES = _platform_cases(example_cases)
TRITON_CONFIGS = [c for c in TIER2_CONFIGS if c.op.implementations[c.implementation].backend == "triton"]


def _assert_numerics(case, *, gradients: bool):
    """Run the case interpreted and compare with the golden."""
    with interpret_mode(True):
        result = check_example(case.op, case.implementation, case.concrete_example(), jnp.dtype(case.dtype),
                               gradients=gradients, config=case.config)
    assert not result.skipped, f"{case.id}: generated for a call the implementation rejects: {result.skipped}"
    assert result.passed, f"{case.id} ({case.example.label}): {result.detail} worst {result.worst}"


# -- tier 1: interpret-mode numerics --------------------------------------------
@pytest.mark.parametrize("case", _params(TIER1_EXAMPLES))
def test_numerics_heuristic_config(case):
    _assert_numerics(case, gradients=bool(case.op.differentiable))


@pytest.mark.slow
@pytest.mark.parametrize("case", _params(TIER1_DEFERRED))
def test_numerics_heuristic_config_more_tpu_examples(case):
    _assert_numerics(case, gradients=bool(case.op.differentiable))


@pytest.mark.parametrize("case", _params(TIER1_CONFIGS))
def test_numerics_corner_configs(case):
    _assert_numerics(case, gradients=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", _params(TIER1_OTHER_CONFIGS))
def test_numerics_other_configs(case):
    _assert_numerics(case, gradients=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", _params([c for op, impl in KERNELS
                                          for c in config_cases(op, impl, every_example=True)]))
def test_numerics_every_example_and_config(case):
    _assert_numerics(case, gradients=bool(case.op.differentiable))


@pytest.mark.slow
@pytest.mark.parametrize("case", _params([c for op, impl in KERNELS
                                          for c in example_cases(op, impl, dtype=jnp.bfloat16)]))
def test_numerics_bfloat16(case):
    _assert_numerics(case, gradients=bool(case.op.differentiable))


# -- tier 2: lowering -------------------------------------------------------------
def _assert_lowers(case, *, grad: bool):
    ex = case.example
    lower_config(case.op, case.implementation, ex.args, ex.kwargs, config=case.config, platform=case.platform,
                 grad=grad)


@pytest.mark.parametrize("case", _params(TIER2_CONFIGS))
def test_lowering_every_config(case):
    _assert_lowers(case, grad=False)


@pytest.mark.parametrize("case", _params(TIER2_EXAMPLES))
def test_lowering_every_example(case):
    _assert_lowers(case, grad=bool(case.op.differentiable))


@pytest.mark.slow
@pytest.mark.parametrize("case", _params(_platform_cases(config_cases, every_example=True)))
def test_lowering_every_example_and_config(case):
    _assert_lowers(case, grad=False)


# -- tier 3: PTX and shared memory ------------------------------------------------
@pytest.mark.ptx
@pytest.mark.parametrize("case", _params(TRITON_CONFIGS))
def test_ptx_fits_shared_memory(case):
    available, reason = triton_compiler_available()
    if not available:
        pytest.skip(reason)
    ex = case.example
    (lowered,) = lower_config(case.op, case.implementation, ex.args, ex.kwargs, config=case.config,
                              platform="cuda")
    assert_fits_smem(compile_triton_to_ptx(lowered, "9.0"), "9.0")


# -- tier 3: the real Mosaic TPU compiler (libtpu, no TPU) --------------------------
#: Generations the default tier compiles each TPU kernel's heuristic config for
#: (the ``tpu`` marker compiles every config for all of `KERNEL_GENERATIONS`).
CI_GENERATIONS = ("v5e", "v6e")
TPU_KERNELS = [(op, impl) for op, impl in KERNELS if op.implementations[impl].backend == "mosaic_tpu"]


#: Benchmark calls per TPU kernel the default tier compiles (with gradients);
#: ``tpu`` compiles them all.
CI_BENCHMARKS = 1


#: Ops whose benchmark-size compile stays under ``tpu``: `moe_mlp`'s kernels are
#: `ragged_dot`'s (compiled at benchmark sizes by those ops), and the fused
#: layer's gradient at its benchmark size took 100-660 s of CPU to compile.
CI_EXAMPLE_ONLY = {"moe_mlp"}


def _tpu_compile_cases(generations, every_config: bool):
    def benchmarks(op):
        if every_config:
            return None
        return 0 if op.name in CI_EXAMPLE_ONLY else CI_BENCHMARKS

    return [case for op, impl in TPU_KERNELS for g in generations
            for case in compile_cases(op, impl, g, every_config=every_config, benchmarks=benchmarks(op))]


def _assert_compiles(case):
    available, reason = libtpu_available()
    if not available:
        pytest.skip(reason)
    result = case.compile()
    assert result.ok, result.describe()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in _tpu_compile_cases(CI_GENERATIONS, False)])
def test_tpu_compile_heuristic_config(case):
    """The heuristic's choice always compiles (forward and gradient), on the
    first example and at the first `CI_BENCHMARKS` benchmark sizes."""
    _assert_compiles(case)


@pytest.mark.tpu
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in _tpu_compile_cases(KERNEL_GENERATIONS, True)])
def test_tpu_compile_every_config_every_generation(case):
    """Every config of each generation's autotuning space compiles there (a
    config that cannot is excluded from that generation's space)."""
    _assert_compiles(case)


#: Kernel implementations no example reaches yet (their family tests cover them).
#: The test below fails when one gains an example, so the entry is dropped.
NOT_YET_REACHED: set[tuple[str, str]] = set()


def test_every_kernel_implementation_is_covered():
    """Each kernel implementation has at least one example it runs and one it
    lowers (an implementation no example reaches is verified by nothing here)."""
    numerics = {(c.op.name, c.implementation) for c in ALL_EXAMPLES}
    lowering = {(c.op.name, c.implementation) for c in TIER2_EXAMPLES}
    every = {(op.name, impl) for op, impl in KERNELS}
    assert every - numerics == NOT_YET_REACHED, f"kernel implementations without an interpretable example: " \
                                                f"{every - numerics} (known: {NOT_YET_REACHED})"
    assert every - lowering == NOT_YET_REACHED, f"kernel implementations without a lowerable example: " \
                                                f"{every - lowering} (known: {NOT_YET_REACHED})"


# -- the generic lowering function on the platform the next backend targets ------------------
def _doubling_op():
    """A tiny op whose kernel implementation is a Mosaic TPU Pallas kernel."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from stellax.core import Call, Implementation, Op

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def run_kernel(call, config):
        x = call.arrays["x"]
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=pltpu.CompilerParams())(x)

    return Op("doubling_test_op", check=lambda x: Call({"x": x}, {}), reference=lambda call: call.arrays["x"] * 2,
              implementations=[Implementation("mosaic_tpu", run_kernel, backend="mosaic_tpu"),
                               Implementation("xla", lambda call, config: call.arrays["x"] * 2)])


def test_lower_config_lowers_mosaic_tpu_kernels_for_tpu():
    op = _doubling_op()
    assert platforms_of("mosaic_tpu") == ("tpu",) and platforms_of("triton") == ("cuda",)
    (lowered,) = lower_config(op, "mosaic_tpu", (jax.ShapeDtypeStruct((8, 128), jnp.float32),))
    assert "tpu_custom_call" in lowered.as_text()
    with pytest.raises(ValueError, match="platform: expected one of"):
        lower_config(op, "mosaic_tpu", (jnp.ones((8, 128)),), platform="rocm")
    with pytest.raises(ValueError, match="implementation: doubling_test_op/xla has backend 'xla'"):
        lower_config(op, "xla", (jnp.ones((8, 128)),))
