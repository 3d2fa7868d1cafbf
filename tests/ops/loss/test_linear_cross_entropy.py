"""linear_cross_entropy: XLA paths (naive, chunked) vs the golden, optax and the naive formula;
options, gradients, memory and bad inputs. The Triton kernels' numerics and lowering over
their configs come from the registry tiers (tests/test_registry_tiers.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.loss import ChunkedConfig, LinearCrossEntropyConfig, linear_cross_entropy_op
from stellax.ops.loss.examples import random_case
from stellax.testing import assert_close, assert_deterministic

#: Chunks smaller than the shapes below, V not a multiple of block_vocab (an overlapping last chunk),
#: T not a multiple of block_tokens (padded rows).
SMALL = ChunkedConfig(block_tokens=4, block_vocab=16)


def _naive(x, w, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_soft_cap=None,
           reduction="mean", transpose_w=False):
    """The textbook formula in float64 numpy-free jnp: log_softmax of the full logits."""
    z = jnp.matmul(x.astype(jnp.float32), (w.T if transpose_w else w).astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if logit_soft_cap is not None:
        z = logit_soft_cap * jnp.tanh(z / logit_soft_cap)
    logp = jax.nn.log_softmax(z, axis=-1)
    valid = labels != ignore_index
    nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    smooth = -jnp.mean(logp, axis=-1)
    lse = jax.nn.logsumexp(z, axis=-1)
    per = jnp.where(valid, (1 - label_smoothing) * nll + label_smoothing * smooth + z_loss * lse**2, 0.0)
    if reduction == "none":
        return per
    if reduction == "sum":
        return jnp.sum(per)
    return jnp.sum(per) / jnp.maximum(jnp.sum(valid), 1)


OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2, "reduction": "sum"},
    {"logit_soft_cap": 2.5, "reduction": "none"},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "logit_soft_cap": 4.0, "transpose_w": True},
    {"ignore_index": 3, "reduction": "sum", "transpose_w": True},
]


CASES = [("xla_chunked", o) for o in OPTIONS] + [("xla", OPTIONS[0]), ("xla", OPTIONS[4])]


@pytest.mark.parametrize("implementation, options", CASES,
                         ids=[f"{i}-" + (",".join(f"{k}={v}" for k, v in o.items()) or "plain") for i, o in CASES])
def test_matches_naive_formula_values_and_gradients(implementation, options):
    opts = dict(options)
    transpose_w = opts.get("transpose_w", False)
    ignore_index = opts.get("ignore_index", -100)
    x, w, labels = random_case(1, (3, 7), 24, 53, jnp.float32, transpose_w=transpose_w, ignore_index=ignore_index)
    config = SMALL if implementation == "xla_chunked" else None
    run = lambda x, w: stellax.linear_cross_entropy(x, w, labels, implementation=implementation, config=config, **opts)
    ref = lambda x, w: _naive(x, w, labels, **opts)
    out = jax.jit(run)(x, w)
    assert out.dtype == jnp.float32 and out.shape == ((3, 7) if opts.get("reduction") == "none" else ())
    assert_close(out, ref(x, w), rel_l2_tolerance=1e-5, name="loss")
    cot = jax.random.normal(jax.random.PRNGKey(3), out.shape)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * cot)
    grads = jax.jit(jax.grad(loss(run), argnums=(0, 1)))(x, w)
    ref_grads = jax.grad(loss(ref), argnums=(0, 1))(x, w)
    for name, g, r in zip(("dx", "dw"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert_close(g, r, rel_l2_tolerance=2e-5, name=name)


def test_matches_optax():
    optax = pytest.importorskip("optax", reason="the optax comparison needs optax: pip install optax")
    x, w, labels = random_case(2, (40,), 32, 101, jnp.float32, ignored=0.0)
    logits = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    for impl, config in (("xla_chunked", SMALL), ("xla_chunked", None), ("xla", None)):
        per = stellax.linear_cross_entropy(x, w, labels, reduction="none", implementation=impl, config=config)
        assert_close(per, expected, rel_l2_tolerance=1e-5, name=f"{impl} per token")
        mean = stellax.linear_cross_entropy(x, w, labels, implementation=impl, config=config)
        np.testing.assert_allclose(mean, jnp.mean(expected), rtol=1e-5)


def test_return_lse_and_z_loss():
    x, w, labels = random_case(4, (2, 9), 16, 45, jnp.float32)
    lam = 1e-2
    loss, lse, z = stellax.linear_cross_entropy(x, w, labels, z_loss=lam, return_lse=True, return_z_loss=True,
                                                config=SMALL)
    full = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)
    expected_lse = jax.nn.logsumexp(full, axis=-1)
    assert lse.shape == (2, 9) and lse.dtype == jnp.float32
    assert_close(lse, expected_lse, rel_l2_tolerance=1e-6, name="lse")  # every token, ignored ones too
    valid = labels != -100
    np.testing.assert_allclose(z, lam * jnp.sum(jnp.where(valid, expected_lse**2, 0)) / jnp.sum(valid), rtol=1e-5)
    np.testing.assert_allclose(loss, _naive(x, w, labels, z_loss=lam), rtol=1e-5)
    only_lse = stellax.linear_cross_entropy(x, w, labels, return_lse=True, config=SMALL)
    assert isinstance(only_lse, tuple) and len(only_lse) == 2


def test_gradients_through_lse_and_z_loss_outputs():
    """Cotangents on the extra outputs reach x and w (the general backward op path)."""
    x, w, labels = random_case(5, (11,), 24, 37, jnp.float32)
    opts = dict(z_loss=1e-2, label_smoothing=0.1, return_lse=True, return_z_loss=True)

    def objective(impl, config):
        def f(x, w):
            loss, lse, z = stellax.linear_cross_entropy(x, w, labels, implementation=impl, config=config, **opts)
            return loss + 0.3 * jnp.sum(jnp.sin(lse)) + 2.0 * z
        return f

    ref = jax.grad(objective("xla", None), argnums=(0, 1))(x, w)
    got = jax.jit(jax.grad(objective("xla_chunked", SMALL), argnums=(0, 1)))(x, w)
    for name, g, r in zip(("dx", "dw"), got, ref):
        assert_close(g, r, rel_l2_tolerance=2e-5, name=name)


def test_bfloat16_inputs_accumulate_in_float32():
    x, w, labels = random_case(6, (64,), 64, 300, jnp.bfloat16)
    ref = linear_cross_entropy_op.reference(x.astype(jnp.float32), w.astype(jnp.float32), labels)
    run = lambda x, w: stellax.linear_cross_entropy(x, w, labels, config=ChunkedConfig(16, 64))
    out = jax.jit(run)(x, w)
    assert out.dtype == jnp.float32
    assert_close(out, ref, dtype=jnp.bfloat16, name="loss")
    dx, dw = jax.jit(jax.grad(run, argnums=(0, 1)))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    rdx, rdw = jax.grad(lambda x, w: _naive(x, w, labels), argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    assert_close(dx, rdx, dtype=jnp.bfloat16, gradient=True, name="dx")
    assert_close(dw, rdw, dtype=jnp.bfloat16, gradient=True, name="dw")


def test_every_token_ignored_gives_zero_loss_and_gradients():
    x, w, _ = random_case(7, (6,), 16, 20, jnp.float32)
    labels = jnp.full((6,), -100, jnp.int32)
    run = lambda x, w: stellax.linear_cross_entropy(x, w, labels, config=SMALL)
    assert float(run(x, w)) == 0.0
    dx, dw = jax.grad(run, argnums=(0, 1))(x, w)
    assert not jnp.any(dx) and not jnp.any(dw)


def test_leading_axes_and_token_chunks_agree_across_configs():
    x, w, labels = random_case(8, (3, 11), 32, 70, jnp.float32)
    base = jax.value_and_grad(lambda x, w: stellax.linear_cross_entropy(x, w, labels, implementation="xla"),
                              argnums=(0, 1))(x, w)
    for config in (ChunkedConfig(1, 70), ChunkedConfig(33, 9)):
        got = jax.value_and_grad(lambda x, w: stellax.linear_cross_entropy(x, w, labels, config=config),
                                 argnums=(0, 1))(x, w)
        np.testing.assert_allclose(got[0], base[0], rtol=1e-5)
        for g, r in zip(got[1], base[1]):
            assert_close(g, r, rel_l2_tolerance=2e-5, name=str(config))


def test_chunked_gradients_are_deterministic():
    x, w, labels = random_case(9, (17,), 24, 61, jnp.float32)
    grad = jax.jit(jax.grad(lambda x, w: stellax.linear_cross_entropy(x, w, labels, config=SMALL), argnums=(0, 1)))
    assert_deterministic(grad, x, w)


def test_chunked_is_the_cpu_default():
    x, w, labels = random_case(10, (4,), 8, 10, jnp.float32)
    call = linear_cross_entropy_op.check(x, w, labels)
    assert linear_cross_entropy_op.select(call).name == "xla_chunked"


def test_chunked_memory_is_linear_not_tokens_times_vocab():
    """Peak temporaries of forward + backward: the chunked path stays far below the naive
    log_softmax version (which holds several [T, V] float32 arrays)."""
    t, d, v = 1024, 64, 8192
    x = jax.ShapeDtypeStruct((t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    labels = jax.ShapeDtypeStruct((t,), jnp.int32)

    def temp(loss):
        f = jax.value_and_grad(loss, argnums=(0, 1))
        return jax.jit(f).lower(x, w, labels).compile().memory_analysis().temp_size_in_bytes

    naive = temp(_naive)
    chunked = temp(lambda x, w, y: stellax.linear_cross_entropy(x, w, y, config=ChunkedConfig(128, 1024)))
    logits_bytes = t * v * 4
    assert naive >= 2 * logits_bytes, (naive, logits_bytes)
    assert chunked * 8 <= naive, (chunked, naive)


def test_out_of_range_label_under_jit_gives_nan():
    x, w, labels = random_case(11, (5,), 8, 10, jnp.float32, ignored=0.0)
    bad = labels.at[2].set(10)
    for impl in ("xla_chunked", "xla"):
        per = jax.jit(lambda x, w, y: stellax.linear_cross_entropy(x, w, y, reduction="none",
                                                                   implementation=impl))(x, w, bad)
        assert np.isnan(per[2]) and np.isfinite(np.delete(np.asarray(per), 2)).all()


@pytest.mark.parametrize("case, error, match", [
    (dict(labels=jnp.array([0, 1, 10, 2])), ValueError, r"labels: expected values in \[0, 10\).*got 10"),
    (dict(labels=jnp.array([0, -1, 3, 2])), ValueError, r"labels: expected values in \[0, 10\).*got -1"),
    (dict(labels=jnp.zeros((5,), jnp.int32)), ValueError, r"labels: expected shape \(4,\)"),
    (dict(labels=jnp.zeros((4,), jnp.float32)), TypeError, r"labels: expected an integer dtype"),
    (dict(w=jnp.ones((7, 10))), ValueError, r"w: expected shape \(8, \*\)"),
    (dict(w=jnp.ones((8, 10)), transpose_w=True), ValueError, r"w: expected shape \(\*, 8\)"),
    (dict(w=jnp.ones((8, 10), jnp.bfloat16)), TypeError, r"w: expected dtype float32"),
    (dict(reduction="avg"), ValueError, r"reduction: expected one of \['mean', 'sum', 'none'\], got 'avg'"),
    (dict(label_smoothing=1.0), ValueError, r"label_smoothing: expected a float in \[0.0, 1.0\), got 1.0"),
    (dict(z_loss=-1e-4), ValueError, r"z_loss: expected a float in >= 0.0, got -0.0001"),
    (dict(logit_soft_cap=0.0), ValueError, r"logit_soft_cap: expected a positive float, got 0.0"),
    (dict(x=jnp.ones((4, 8), jnp.int32)), TypeError, r"x: expected a floating dtype"),
])
def test_bad_inputs_raise_naming_the_argument(case, error, match):
    args = dict(x=jnp.ones((4, 8)), w=jnp.ones((8, 10)), labels=jnp.array([0, 1, 2, -100]))
    args.update(case)
    x, w, labels = args.pop("x"), args.pop("w"), args.pop("labels")
    with pytest.raises(error, match=match):
        stellax.linear_cross_entropy(x, w, labels, **args)


def test_ignore_index_is_accepted_when_out_of_vocabulary():
    x, w, labels = random_case(12, (6,), 8, 10, jnp.float32, ignored=0.5, ignore_index=-1)
    out = stellax.linear_cross_entropy(x, w, labels, ignore_index=-1)
    np.testing.assert_allclose(out, _naive(x, w, labels, ignore_index=-1), rtol=1e-5)


@pytest.mark.parametrize("make, match", [
    (lambda: ChunkedConfig(block_tokens=0), r"ChunkedConfig.block_tokens: expected a positive int, got 0"),
    (lambda: ChunkedConfig(block_vocab=2.5), r"ChunkedConfig.block_vocab: expected a positive int, got 2.5"),
    (lambda: LinearCrossEntropyConfig(block_t=48), r"LinearCrossEntropyConfig.block_t: expected a positive power of two"),
    (lambda: LinearCrossEntropyConfig(block_d=512), r"LinearCrossEntropyConfig.block_d: expected one of"),
])
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_triton_interpreted_per_token_outputs_and_gradients(dtype):
    """The Triton kernels (interpreted) with a config smaller than the shapes, per-token
    outputs, lse and z-loss, [V, D] weights and a soft cap, against the golden."""
    x, w, labels = random_case(13, (37,), 40, 70, dtype, transpose_w=True)
    opts = dict(transpose_w=True, logit_soft_cap=5.0, z_loss=1e-3, label_smoothing=0.05, reduction="none",
                return_lse=True)
    config = LinearCrossEntropyConfig(block_t=16, block_v=32, block_d=16, num_warps=4, num_stages=2)
    run = lambda x, w: stellax.linear_cross_entropy(x, w, labels, implementation="triton", config=config, **opts)
    ref = lambda x, w: linear_cross_entropy_op.reference(x.astype(jnp.float32), w.astype(jnp.float32), labels, **opts)
    with stellax.interpret_mode():
        out = jax.jit(run)(x, w)
        cots = [jax.random.normal(jax.random.PRNGKey(i), o.shape) for i, o in enumerate(out)]
        project = lambda f: lambda x, w: sum(jnp.sum(o * c) for o, c in zip(f(x, w), cots))
        grads = jax.jit(jax.grad(project(run), argnums=(0, 1)))(x, w)
    for o, r in zip(out, ref(x, w)):
        assert_close(o, r, dtype=dtype, name="outputs")
    ref_grads = jax.grad(project(ref), argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    for name, g, r in zip(("dx", "dw"), grads, ref_grads):
        assert g.dtype == dtype
        assert_close(g, r, dtype=dtype, gradient=True, name=name)
