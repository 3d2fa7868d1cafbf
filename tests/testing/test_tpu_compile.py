"""The TPU compile tier's own machinery (`stellax.testing.tpu_compile`), on a
tiny copy kernel whose VMEM need is known: the real compiler (libtpu) must
accept what fits each generation's scoped VMEM and reject what does not."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from stellax.core import Call, Implementation, KernelConfig, Op
from stellax.core.pallas import operand, output, tpu_kernel_call
from stellax.core.tpu import TPU_GENERATIONS, tpu_generation
from stellax.testing.tpu_compile import compilable_space, compile_config, libtpu_available, vmem_estimate

LIBTPU, WHY_NOT = libtpu_available()
needs_libtpu = pytest.mark.skipif(not LIBTPU, reason=WHY_NOT)


@dataclasses.dataclass(frozen=True)
class RowsConfig(KernelConfig):
    block_rows: int = 8


def _double(call, config):
    x = call.arrays["x"]
    spec = pl.BlockSpec((config.block_rows, x.shape[1]), lambda i: (i, 0))

    def kernel(*, x, y):
        y[...] = x[...] * 2

    return tpu_kernel_call(kernel, grid=(x.shape[0] // config.block_rows,), inputs=dict(x=operand(x, spec)),
                           outputs=dict(y=output(x.shape, x.dtype, spec)), dimension_semantics=("parallel",),
                           name="double_rows").y


#: Blocks of 512 / 1536 rows of 1024 float32: 2 MiB / 6 MiB, double-buffered in and out: 8 / 24 MiB.
SPACE = [RowsConfig(512), RowsConfig(1536)]
DOUBLE = Op("double_rows_test_op", check=lambda x: Call({"x": x}, {}), reference=lambda call: call.arrays["x"] * 2,
            implementations=[Implementation("mosaic_tpu", _double, backend="mosaic_tpu", config_type=RowsConfig,
                                            heuristic=lambda call: SPACE[0], space=lambda call: SPACE),
                             Implementation("xla", lambda call, config: call.arrays["x"] * 2)])
X = jax.ShapeDtypeStruct((3072, 1024), jnp.float32)


def test_generations_are_recognised_from_device_kind():
    assert tpu_generation("TPU v5 lite").name == "v5e" and tpu_generation("TPU v6 lite").name == "v6e"
    assert tpu_generation("TPU v5").name == "v5p" and tpu_generation("TPU7x").name == "tpu7x"
    assert tpu_generation("NVIDIA H200") is None
    assert not TPU_GENERATIONS["v4"].kernels and all(TPU_GENERATIONS[g].kernels for g in ("v5e", "v6e"))


def test_vmem_estimate_counts_double_buffered_blocks():
    estimate = vmem_estimate(lambda x: _double(Call({"x": x}, {}), RowsConfig(512)), X)
    assert estimate == 4 * 512 * 1024 * 4


@needs_libtpu
def test_the_compiler_rejects_what_overflows_a_generations_scoped_vmem():
    fits = compile_config(DOUBLE, "mosaic_tpu", (X,), generation="v5e", config=SPACE[0])
    assert fits.ok and fits.vmem_bytes == 8 * 2**20, fits.describe()
    too_big = compile_config(DOUBLE, "mosaic_tpu", (X,), generation="v5e", config=SPACE[1])
    assert not too_big.ok and too_big.vmem_overflow, too_big.describe()
    # v6e's scoped default is 32 MiB: the same 24 MiB config compiles there.
    assert compile_config(DOUBLE, "mosaic_tpu", (X,), generation="v6e", config=SPACE[1]).ok


@needs_libtpu
def test_compilable_space_drops_configs_a_generation_cannot_compile():
    kept, rejected = compilable_space(DOUBLE, "mosaic_tpu", (X,), generation="v5e")
    assert kept == [SPACE[0]] and [r.config for r in rejected] == [SPACE[1]]
    kept, rejected = compilable_space(DOUBLE, "mosaic_tpu", (X,), generation="v6e")
    assert kept == SPACE and not rejected


def test_unknown_generation_is_a_clear_error():
    with pytest.raises(ValueError, match="generation: expected one of"):
        compile_config(DOUBLE, "mosaic_tpu", (X,), generation="v9")
