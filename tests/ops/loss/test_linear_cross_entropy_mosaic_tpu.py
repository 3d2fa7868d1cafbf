"""linear_cross_entropy Mosaic TPU kernels: interpret-mode numerics against the golden (every
option, both weight layouts, T not a multiple of the token block, V not a multiple of 128,
ignored rows), the backward op alone, the float32 precision contract, determinism, configs per
TPU generation, and lowering for tpu over the whole config space.

The generic tiers (the op's examples with the heuristic config, interpreted, lowered and
compiled with libtpu) run in tests/test_registry_tiers.py; this file holds what is specific
to these kernels. Interpreted TPU kernels run with race detection and NaN-filled
uninitialized memory, so a column past V or a row past T that reaches a sum fails here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core.tpu import KERNEL_GENERATIONS, TPU_GENERATIONS
from stellax.ops.loss import LossTpuConfig, linear_cross_entropy_backward_op, linear_cross_entropy_op
from stellax.ops.loss.configs import loss_tpu_vmem_bytes
from stellax.ops.loss.examples import random_case
from stellax.ops.loss.reference import logits, token_stats
from stellax.testing import assert_close, lower_config

IMPL = "mosaic_tpu"
#: 16-token blocks over T=37 (a partial last block), 128-column tiles over V=300 (a partial last tile).
SMALL = LossTpuConfig(block_t=16, block_v=128)


def _configured(config):
    """``config`` for the forward and the backward op (the backward op, called by the forward's
    VJP rule, would otherwise take its own heuristic's tiles: whole dimensions at these sizes)."""
    return stellax.use_configs({("linear_cross_entropy", IMPL): config,
                                ("linear_cross_entropy_backward", IMPL): config})


def _run_and_grads(x, w, labels, opts, config=SMALL):
    """Outputs and the gradients of a random projection of them, one jitted program, interpreted."""
    def run(x, w):
        with _configured(config):
            return stellax.linear_cross_entropy(x, w, labels, implementation=IMPL, **opts)

    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)
    project = lambda f: lambda x, w: sum(jnp.sum(o * c) for o, c in zip(as_tuple(f(x, w)), cots))
    with stellax.interpret_mode(), _configured(config):
        out = jax.jit(run)(x, w)
        cots = [jax.random.normal(jax.random.PRNGKey(10 + k), o.shape) for k, o in enumerate(as_tuple(out))]
        grads = jax.jit(jax.grad(project(run), argnums=(0, 1)))(x, w)
    ref = lambda x, w: linear_cross_entropy_op.reference(x, w, labels, **opts)
    f32 = lambda a: a.astype(jnp.float32)
    ref_grads = jax.grad(project(ref), argnums=(0, 1))(f32(x), f32(w))
    return as_tuple(out), grads, as_tuple(ref(f32(x), f32(w))), ref_grads


OPTIONS = [
    {"reduction": "none", "return_lse": True, "return_z_loss": True, "z_loss": 1e-2},
    {"label_smoothing": 0.1, "logit_soft_cap": 4.0, "reduction": "sum", "transpose_w": True},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "logit_soft_cap": 2.5, "ignore_index": 3},
    {"transpose_w": True, "reduction": "none", "return_lse": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_every_option_against_the_golden_float32(options):
    """T=37 over 16-token blocks, V=300 over 128-column tiles, a quarter of the labels ignored:
    the outputs (loss, lse, z-loss) and both gradients within float32's 1e-5 / 2e-5."""
    transpose_w = options.get("transpose_w", False)
    x, w, labels = random_case(1, (37,), 40, 300, jnp.float32, transpose_w=transpose_w,
                               ignore_index=options.get("ignore_index", -100))
    out, grads, ref, ref_grads = _run_and_grads(x, w, labels, options)
    assert len(out) == len(ref)
    for k, (o, r) in enumerate(zip(out, ref)):
        assert o.shape == r.shape and o.dtype == jnp.float32
        assert_close(o, r, rel_l2_tolerance=1e-5, name=f"output {k}")
    for name, g, r in zip(("dx", "dw"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == jnp.float32
        assert_close(g, r, rel_l2_tolerance=2e-5, name=name)


@pytest.mark.parametrize("transpose_w", [False, True], ids=["w=[D,V]", "w=[V,D]"])
def test_bfloat16_leading_axes(transpose_w):
    """bfloat16 operands (MXU-native, float32 accumulation, dz rounded to bfloat16), leading axes
    (2, 19) = 38 tokens over 16-token blocks, V=260: bfloat16's tolerances."""
    x, w, labels = random_case(2, (2, 19), 64, 260, jnp.bfloat16, transpose_w=transpose_w)
    opts = {"transpose_w": transpose_w, "label_smoothing": 0.05, "z_loss": 1e-4}
    out, grads, ref, ref_grads = _run_and_grads(x, w, labels, opts)
    assert_close(out[0], ref[0], dtype=jnp.bfloat16, name="loss")
    for name, g, r in zip(("dx", "dw"), grads, ref_grads):
        assert g.dtype == jnp.bfloat16
        assert_close(g, r, dtype=jnp.bfloat16, gradient=True, name=name)


def test_backward_op_with_random_coefficients_and_determinism():
    """The backward op alone (arbitrary per-token a, b, e, a soft cap, [V, D] weights) against its
    golden; two runs bitwise equal."""
    tokens, d, v = 29, 24, 140
    x, w, labels = random_case(3, (tokens,), d, v, jnp.float32, transpose_w=True)
    lse, _, _ = token_stats(logits(x, w, transpose_w=True, logit_soft_cap=3.0), labels)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(4), 3)
    a = jax.random.uniform(k1, (tokens,), jnp.float32, 0.1, 1.0)
    b = -jax.random.uniform(k2, (tokens,), jnp.float32, 0.1, 1.0)
    e = -0.01 * jax.random.uniform(k3, (tokens,), jnp.float32)
    args = (x, w, labels, lse, a, b, e)
    kwargs = dict(transpose_w=True, logit_soft_cap=3.0)
    run = jax.jit(lambda *args: linear_cross_entropy_backward_op(*args, **kwargs, implementation=IMPL, config=SMALL))
    with stellax.interpret_mode():
        dx, dw = run(*args)
        dx2, dw2 = run(*args)
    rdx, rdw = linear_cross_entropy_backward_op.reference(*args, **kwargs)
    assert_close(dx, rdx, rel_l2_tolerance=2e-5, name="dx")
    assert_close(dw, rdw, rel_l2_tolerance=2e-5, name="dw")
    assert np.asarray(dx).tobytes() == np.asarray(dx2).tobytes()
    assert np.asarray(dw).tobytes() == np.asarray(dw2).tobytes()


def test_every_token_ignored_and_out_of_range_label():
    """No valid token: loss 0 and zero gradients; a label past V under jit: NaN at that token only."""
    x, w, _ = random_case(5, (20,), 16, 150, jnp.float32)
    none = jnp.full((20,), -100, jnp.int32)
    run = lambda x, w, y: stellax.linear_cross_entropy(x, w, y, implementation=IMPL)
    with stellax.interpret_mode(), _configured(SMALL):
        loss, (dx, dw) = jax.jit(jax.value_and_grad(run, argnums=(0, 1)))(x, w, none)
        bad = jnp.arange(20, dtype=jnp.int32).at[4].set(150)
        per = jax.jit(lambda x, w, y: stellax.linear_cross_entropy(x, w, y, reduction="none", implementation=IMPL,
                                                                   config=SMALL))(x, w, bad)
    assert float(loss) == 0.0 and not jnp.any(dx) and not jnp.any(dw)
    assert np.isnan(per[4]) and np.isfinite(np.delete(np.asarray(per), 4)).all()


def test_float32_precision_contract():
    """precision='default' is one bfloat16 pass in the kernels (a bfloat16-like error),
    'high' three (float32-like), 'highest' float32 (`stellax.core.precision`)."""
    x, w, labels = random_case(6, (24,), 256, 200, jnp.float32)
    ref = linear_cross_entropy_op.reference(x, w, labels, reduction="none")
    errors = {}
    for precision in ("default", "high", "highest"):
        with stellax.interpret_mode():
            out = stellax.linear_cross_entropy(x, w, labels, reduction="none", precision=precision,
                                               implementation=IMPL, config=SMALL)
        errors[precision] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert 1e-5 < errors["default"] < 3e-2, errors
    assert errors["high"] < 1e-5 and errors["highest"] < 1e-6, errors


# -- configs per generation -----------------------------------------------------------------
def _call(tokens, d, v, dtype=jnp.bfloat16, transpose_w=True):
    x = jax.ShapeDtypeStruct((tokens, d), dtype)
    w = jax.ShapeDtypeStruct((v, d) if transpose_w else (d, v), dtype)
    return linear_cross_entropy_op.check(x, w, jax.ShapeDtypeStruct((tokens,), jnp.int32), transpose_w=transpose_w)


@pytest.mark.parametrize("generation", KERNEL_GENERATIONS)
def test_heuristic_and_space_fit_the_vmem(generation):
    impl = linear_cross_entropy_op.implementations[IMPL]
    budget = TPU_GENERATIONS[generation].vmem_bytes * 3 // 4
    with stellax.lowering_target(generation):
        for tokens, d, v, dtype in ((8192, 4096, 131072, jnp.bfloat16), (32768, 8192, 262144, jnp.bfloat16),
                                    (13, 24, 50, jnp.float32), (4096, 4096, 32000, jnp.float32)):
            call = _call(tokens, d, v, dtype)
            config, space = impl.default_config(call), impl.config_space(call)
            size = np.dtype(dtype).itemsize
            assert impl.supported(call)
            assert loss_tpu_vmem_bytes(tokens, d, v, size, config) <= budget, (generation, config)
            assert space and all(loss_tpu_vmem_bytes(tokens, d, v, size, c) <= budget for c in space)
            if (tokens, d, v) == (8192, 4096, 131072):
                assert config == LossTpuConfig(block_t=512, block_v=512) and config in space
            if tokens == 13:
                assert len(space) == 1  # every tiling collapses to the whole dimensions


def test_requirements_name_what_cannot_run():
    impl = linear_cross_entropy_op.implementations[IMPL]
    with stellax.lowering_target("v6e"):
        support = impl.supported(_call(64, 128, 256, jnp.float16))
        assert not support and "float16" in support.reason and "v6e" in support.reason
        support = impl.supported(_call(256, 1 << 17, 256, jnp.float32))
        assert not support and "D=131072" in support.reason
        assert impl.supported(_call(64, 128, 256, jnp.bfloat16))


@pytest.mark.parametrize("field, value, match", [
    ("block_t", 24, "LossTpuConfig.block_t: expected a multiple of 16, got 24"),
    ("block_v", 200, "LossTpuConfig.block_v: expected a multiple of 128, got 200"),
    ("block_v", 0, "LossTpuConfig.block_v: expected a positive int, got 0"),
])
def test_config_validation_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        LossTpuConfig(**{field: value})


# -- lowering for tpu ---------------------------------------------------------------------
def _space_lowering_case():
    """A Llama-3-sized head (V not a multiple of the tile, T not a multiple of 1024) and the v5e
    space (9 tilings)."""
    tokens, d, v = 3000, 2048, 128256
    args = (jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16), jax.ShapeDtypeStruct((v, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((tokens,), jnp.int32))
    impl = linear_cross_entropy_op.implementations[IMPL]
    with stellax.lowering_target("v5e"):
        space = impl.config_space(linear_cross_entropy_op.check(*args, transpose_w=True))
    assert len(space) == 9
    return args, space


def test_lowers_for_tpu_every_config_of_the_space():
    """Every config of the space lowers to tpu_custom_calls: the forward kernel, and the gradient
    of the mean loss by the fused sweep (logits, dz/dx and dw kernels)."""
    args, space = _space_lowering_case()
    for config in space:
        forward, gradient = lower_config(linear_cross_entropy_op, IMPL, args, {"transpose_w": True}, config=config,
                                         grad=True, target="v5e")
        assert "stellax_linear_cross_entropy_forward_tpu" in forward.as_text()
        text = gradient.as_text()
        assert all(f"stellax_linear_cross_entropy_{k}_tpu" in text for k in ("logits", "dz_dx", "dw_chunk"))


def test_recompute_path_lowers_for_tpu_every_config_of_the_space():
    """Per-token losses (a per-token cotangent) take the recompute path for every config of the
    space: the forward, dx and dw kernels."""
    args, space = _space_lowering_case()
    for config in space:
        (gradient,) = lower_config(linear_cross_entropy_op, IMPL, args, {"transpose_w": True, "reduction": "none"},
                                   config=config, grad=True, target="v5e")[1:]
        text = gradient.as_text()
        assert all(f"stellax_linear_cross_entropy_{k}_tpu" in text for k in ("forward", "dx", "dw"))


def test_backward_op_lowers_for_tpu_with_d_by_v_weights():
    tokens, d, v = 300, 640, 1000
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    args = (f32(tokens, d), f32(d, v), jax.ShapeDtypeStruct((tokens,), jnp.int32), f32(tokens), f32(tokens),
            f32(tokens), f32(tokens))
    (module,) = lower_config(linear_cross_entropy_backward_op, IMPL, args, {"logit_soft_cap": 30.0}, target="v6e")
    assert module.as_text().count("tpu_custom_call") >= 2
