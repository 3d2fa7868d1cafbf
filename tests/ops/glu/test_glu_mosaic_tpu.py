"""gated_linear_unit Mosaic TPU kernels: interpret-mode numerics against the golden (both
weight forms, every activation, tiles that do not divide the shapes), determinism, configs
per TPU generation, and lowering for tpu.

The generic tiers (every example and config, interpreted and lowered) run in
tests/test_registry_tiers.py; this file holds what is specific to the TPU kernels.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core.tpu import KERNEL_GENERATIONS, TPU_GENERATIONS
from stellax.ops.glu import ACTIVATIONS, GluTpuConfig, gated_linear_unit_backward_op, gated_linear_unit_op
from stellax.ops.glu.configs import exact_k_tile, glu_tpu_vmem_bytes
from stellax.testing import assert_close, lower_config, random_array
from stellax.testing.numerics import compare, golden

IMPL = "mosaic_tpu"
SMALL = GluTpuConfig(block_m=128, block_n=128, block_k=128)


def _case(m, k, n, dtype, stacked, seed=0):
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = random_array(kx, (m, k), dtype)
    w = (jax.random.normal(kw, (k, 2, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    weights = w if stacked else (w[:, 0], w[:, 1])
    cot = random_array(kd, (m, n), jnp.float32)
    return x, weights, cot


def _f32(tree):
    return jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), tree)


def _check_against_golden(m, k, n, dtype, *, stacked, activation="silu", config=SMALL, precision=None,
                          deterministic=False, seed=0):
    """Output and the gradients of x and the weights against the golden, from one compiled program;
    with ``deterministic`` a second run must be bitwise equal."""
    x, weights, cot = _case(m, k, n, dtype, stacked, seed)

    def run(x, weights):
        with stellax.use_configs({("gated_linear_unit", IMPL): config, ("gated_linear_unit_backward", IMPL): config}):
            return stellax.gated_linear_unit(x, weights, activation=activation, precision=precision,
                                             implementation=IMPL)

    def loss_and_output(x, weights):
        y = run(x, weights)
        return jnp.sum(y.astype(jnp.float32) * cot), y

    with stellax.interpret_mode():
        both = jax.jit(jax.grad(loss_and_output, argnums=(0, 1), has_aux=True))
        grads, y = both(x, weights)
        if deterministic:
            again = both(x, weights)
    ref = lambda x, w: gated_linear_unit_op.reference(x, w, activation=activation)
    expected = ref(*_f32((x, weights)))
    ref_grads = jax.grad(lambda x, w: jnp.sum(ref(x, w) * cot), argnums=(0, 1))(*_f32((x, weights)))
    assert y.dtype == x.dtype and y.shape == (m, n)
    assert_close(y, expected, dtype=dtype, name="y")
    for name, g, r in zip(("dx", "dw_gate", "dw_up"), jax.tree_util.tree_leaves(grads),
                          jax.tree_util.tree_leaves(ref_grads)):
        assert g.dtype == dtype and g.shape == r.shape
        assert_close(g, r, dtype=dtype, gradient=True, name=name)
    if deterministic:
        for a, b in zip(jax.tree_util.tree_leaves((grads, y)), jax.tree_util.tree_leaves(again)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), "two runs differ"


def test_stacked_weights_tiles_not_dividing_shapes_and_determinism():
    """Stacked [K, 2, N] weights as one panel (N=256: two 128-column tiles, the up tiles at an
    offset), M=136 and K=130 not multiples of 128 (masked contraction tails in the forward, dx and
    dW kernels); forward and backward bitwise deterministic."""
    _check_against_golden(136, 130, 256, jnp.float32, stacked=True, deterministic=True)


def test_k_tile_not_a_power_of_two():
    """block_k = 384 = 3 x 128 (as 1792 = 14 x 128 at K=7168): two whole K steps in the forward,
    K tiles of 384 columns in the dx kernel and of 384 rows in the dW kernel, M and N tiles
    that leave partial last tiles (M=136, N=384 over 256)."""
    config = GluTpuConfig(block_m=128, block_n=256, block_k=384)
    _check_against_golden(136, 768, 384, jnp.float32, stacked=True, config=config, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "pair"])
def test_partial_n_tiles(dtype, stacked):
    """N=136: a partial last N tile (stacked weights are split, the panel offset needs N % 128 == 0)."""
    _check_against_golden(20, 200, 136, dtype, stacked=stacked, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation(activation):
    _check_against_golden(16, 48, 40, jnp.float32, stacked=False, activation=activation, seed=2)


@pytest.mark.slow
def test_callable_activation():
    _check_against_golden(16, 48, 40, jnp.float32, stacked=True, activation=lambda g: g * jnp.tanh(g), seed=3)


def test_float32_precision_contract_numerics():
    """precision='default' is one bfloat16 pass in the kernel (interpret mode reproduces it: a
    bf16-like error), 'high' three (float32-like); `stellax.core.precision`."""
    x, weights, _ = _case(32, 256, 128, jnp.float32, stacked=True, seed=4)
    expected = golden(lambda x, w: gated_linear_unit_op.reference(x, w, activation="silu"), x, weights)
    errors = {}
    for precision in ("default", "high"):
        with stellax.interpret_mode():
            y = stellax.gated_linear_unit(x, weights, precision=precision, implementation=IMPL)
        errors[precision] = compare(y, expected).rel_l2
    assert 1e-4 < errors["default"] < 3e-2, errors
    assert errors["high"] < 1e-4, errors


# -- configs per generation -------------------------------------------------------------
def _call(m, k, n, dtype=jnp.bfloat16):
    return gated_linear_unit_op.check(jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, 2, n), dtype))


@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_heuristic_takes_wide_k_steps_and_fits_its_vmem_budget(generation):
    impl = gated_linear_unit_op.implementations[IMPL]
    tpu = TPU_GENERATIONS[generation]
    with stellax.lowering_target(generation):
        for m, k, n, dtype in ((4096, 4096, 14336, jnp.bfloat16), (8, 8192, 28672, jnp.float32), (3, 17, 33, jnp.float32)):
            call = _call(m, k, n, dtype)
            config, space = impl.default_config(call), impl.config_space(call)
            budget = max(tpu.scoped_vmem_bytes, min(2 * tpu.scoped_vmem_bytes, tpu.vmem_bytes // 4))
            assert glu_tpu_vmem_bytes(m, k, n, np.dtype(dtype).itemsize, config) <= budget
            assert all(getattr(c, f) % tpu.mxu == 0 for c in space for f in ("block_n", "block_k"))
            if (m, k, n) == (4096, 4096, 14336):
                assert config in space and config.block_n >= 2 * tpu.mxu and config.block_k >= 1024, (generation, config)
            if (m, k, n) == (3, 17, 33):
                assert len(space) == 1  # every tiling collapses to whole dimensions


def test_exact_k_tile_is_the_longest_dividing_step():
    assert exact_k_tile(7168, 128) == 1792 and exact_k_tile(7168, 256) == 1792  # 7168 = 4 x 1792
    assert exact_k_tile(5120, 128) == 1280 and exact_k_tile(5120, 256) == 1280
    assert exact_k_tile(4608, 128) == 1536  # 4608 = 3 x 1536 = 2.25 x 2048
    assert exact_k_tile(128 * 33, 128) == 1408 and exact_k_tile(128 * 33, 256) is None  # 1408 = 5.5 x 256
    assert exact_k_tile(4096, 128) is None and exact_k_tile(14336, 128) is None  # 2048 divides them
    assert exact_k_tile(2048, 128) is None and exact_k_tile(1536, 128) is None  # one step holds K
    assert exact_k_tile(7000, 128) is None  # not a multiple of the MXU width: its tail is masked
    assert exact_k_tile(128 * 67, 128) is None  # 67 is prime: no step of 512 or more divides K


@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_heuristic_takes_a_k_step_that_divides_k(generation):
    """At K=7168 (issue 40's N=18432 case) a 2048 K step leaves half a tile (four steps for 3.5 of
    work): the space holds K's exact 1792 step beside 2048 and the heuristic takes it; at K=4096 it
    keeps 2048, and at K=5120 takes 1280 (four steps of 1280 cost less than three of 2048 with a
    masked half)."""
    impl = gated_linear_unit_op.implementations[IMPL]
    with stellax.lowering_target(generation):
        for (m, k, n), step in (((8192, 7168, 18432), 1792), ((8192, 4096, 14336), 2048), ((4096, 5120, 13824), 1280)):
            call = _call(m, k, n)
            config, space = impl.default_config(call), impl.config_space(call)
            assert config in space and config.block_k == step, (generation, (m, k, n), config)
            if step != 2048:
                assert any(c.block_k == 2048 for c in space)  # still there for the autotuner
                assert 512 in {c.block_n for c in space if c.block_k == step}, generation  # wide N tiles too


def test_requirements_reject_float16_operands():
    impl = gated_linear_unit_op.implementations[IMPL]
    with stellax.lowering_target("v6e"):
        support = impl.supported(_call(64, 128, 128, jnp.float16))
        assert not support and "float16" in support.reason and "v6e" in support.reason
        assert impl.supported(_call(64, 128, 128, jnp.bfloat16))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="GluTpuConfig.block_k: expected a multiple of 128, got 64"):
        GluTpuConfig(block_m=128, block_n=128, block_k=64)


# -- lowering for tpu ---------------------------------------------------------------------
def _vmem_limits(module) -> list[int]:
    """The scoped-VMEM sizes the module's Mosaic calls ask for (none: the generation's default)."""
    return [int(size) for size in re.findall(r"scoped_memory_configs\\22: \[\{[^]]*?size\\22: (\d+)", module.as_text())]


def test_lowers_for_tpu_every_config():
    """Every config of the v5e space lowers to a tpu_custom_call; the heuristic's gradient lowers
    to the forward (keeping gate/up), dx and dW kernels, with no recompute of gate/up; a tiling
    above the scoped VMEM asks for more."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    w = jax.ShapeDtypeStruct((1024, 2, 2048), jnp.float32)
    impl = gated_linear_unit_op.implementations[IMPL]
    with stellax.lowering_target("v5e"):
        space = impl.config_space(gated_linear_unit_op.check(x, w))
    assert len(space) == 27  # 4 row tiles x 9 (N, K) tiles, minus the ones K = 1024 collapses or VMEM rejects
    scoped = TPU_GENERATIONS["v5e"].scoped_vmem_bytes
    for config in space:
        (module,) = lower_config(gated_linear_unit_op, IMPL, (x, w), config=config, target="v5e")
        assert bool(_vmem_limits(module)) == (glu_tpu_vmem_bytes(1024, 1024, 2048, 4, config) > scoped * 3 // 4)
    forward, gradient = lower_config(gated_linear_unit_op, IMPL, (x, w), grad=True, target="v5e")
    assert "stellax_glu_forward_tpu" in forward.as_text()
    for kernel in ("stellax_glu_forward_tpu", "stellax_glu_dx_tpu", "stellax_glu_dw_tpu"):
        assert kernel in gradient.as_text()
    assert "stellax_glu_act_grad_tpu" not in gradient.as_text()
    big = GluTpuConfig(block_m=1024, block_n=1024, block_k=512)
    (module,) = lower_config(gated_linear_unit_op, IMPL, (x, w), config=big, target="v5e")
    assert _vmem_limits(module) and _vmem_limits(module)[0] > TPU_GENERATIONS["v5e"].scoped_vmem_bytes


def test_backward_op_lowers_for_tpu_with_a_weight_pair():
    dy = jax.ShapeDtypeStruct((300, 500), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((300, 700), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((700, 500), jnp.bfloat16)
    (module,) = lower_config(gated_linear_unit_backward_op, IMPL, (dy, x, w, w), {"activation": "gelu"})
    assert module.as_text().count("tpu_custom_call") >= 3 and "stellax_glu_act_grad_tpu" in module.as_text()


# -- the real compiler (libtpu, -m tpu) -----------------------------------------------------
def _require_libtpu():
    from stellax.testing.tpu_compile import libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)


@pytest.mark.tpu
@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_exact_k_step_configs_compile(generation):
    """At K=7168 N=18432 bf16 (stacked): the heuristic's config (its 1792 K step) compiles forward
    and backward, and every config of the space with that K step compiles forward."""
    from stellax.testing.tpu_compile import compile_config

    _require_libtpu()
    x = jax.ShapeDtypeStruct((8192, 7168), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((7168, 2, 18432), jnp.bfloat16)
    impl = gated_linear_unit_op.implementations[IMPL]
    with stellax.lowering_target(generation):
        call = gated_linear_unit_op.check(x, w)
        heuristic, space = impl.default_config(call), impl.config_space(call)
    assert heuristic.block_k == 1792
    result = compile_config(gated_linear_unit_op, IMPL, (x, w), generation=generation, grad=True)
    assert result.ok, result.describe()
    for config in (c for c in space if c.block_k == 1792 and c != heuristic):
        result = compile_config(gated_linear_unit_op, IMPL, (x, w), generation=generation, config=config)
        assert result.ok, (config, result.describe())


@pytest.mark.tpu
def test_static_schedule_of_the_exact_k_step():
    """libtpu's v5e schedule of the forward kernel at K=7168 N=18432 (`stellax.ops.glu.tpu_cases`):
    at the heuristic's (512, 512, 1792) a step is within 5 % of its MXU time and the whole kernel
    takes at most 0.9x the cycles of (512, 512, 2048), whose fourth K step is half masked
    (statically 33.4M against 38.1M cycles, docs/norm_glu.md)."""
    from stellax.ops.glu.tpu_cases import forward_schedule, forward_step_figures
    from stellax.testing.llo_schedule import kernel_schedules

    _require_libtpu()
    shape = dict(m=8192, k=7168, n=18432)
    with stellax.lowering_target("v5e"):
        x = jax.ShapeDtypeStruct((shape["m"], shape["k"]), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((shape["k"], 2, shape["n"]), jnp.bfloat16)
        config = gated_linear_unit_op.implementations[IMPL].default_config(gated_linear_unit_op.check(x, w))
    figures = {}
    for tiles in ((config.block_m, config.block_n, config.block_k), (512, 512, 2048)):
        tile_args = dict(zip(("block_m", "block_n", "block_k"), tiles))
        schedules = kernel_schedules("stellax.ops.glu.tpu_cases:forward_case", "v5e", **shape, **tile_args)
        figures[tiles] = forward_step_figures(forward_schedule(schedules), **shape, **tile_args)
    exact, padded = figures.values()
    assert exact["tiles"][2] == 1792 and exact["step_over_mxu"] < 1.05, exact
    assert exact["kernel_cycles"] <= 0.9 * padded["kernel_cycles"], (exact, padded)
    assert padded["kernel_over_mxu"] > 1.1, padded  # the masked half step, counted
