"""linear_cross_entropy's fused Mosaic TPU training sweep (`mosaic_tpu.fused_forward_backward`:
a scalar loss under differentiation; each logits tile computed once, kept in HBM as shifted
logits, read back for ``dz``/``dx``, ``dw`` accumulated over token chunks in two bfloat16 parts).

Interpreted against the golden: every option, both weight layouts, T not a multiple of the
token block, V not a multiple of the vocabulary tile, several chunks (the running ``dw`` read
and rewritten in place) and one, float32 and bfloat16, both gradients; large logits (where a
raw bfloat16 copy of the logits would be 6 % off); which path a call takes; determinism;
lowering for tpu; and (``-m tpu``, with libtpu) the real compiler's VMEM and HBM verdicts.
Interpreted TPU kernels run with race detection and NaN-filled uninitialized memory.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.loss import LossTpuConfig, linear_cross_entropy_op
from stellax.ops.loss.base import fused_sweep_cost
from stellax.ops.loss.configs import tpu_chunk
from stellax.ops.loss.examples import random_case
from stellax.testing import assert_close, lower_config

IMPL = "mosaic_tpu"
FUSED = ("stellax_linear_cross_entropy_logits_tpu", "stellax_linear_cross_entropy_dz_dx_tpu",
         "stellax_linear_cross_entropy_dw_chunk_tpu")
RECOMPUTE = ("stellax_linear_cross_entropy_dx_tpu", "stellax_linear_cross_entropy_dw_tpu")
#: 16-token blocks, 128-column tiles, chunks of 16 or 32 tokens: T=37 is three chunks of 16
#: (the last padded), T=38 too, V=200 two tiles (the second partial).
CHUNKED = LossTpuConfig(block_t=16, block_v=128, chunk_t=32)
#: The same tiles, one chunk: no running ``dw`` (and no ``lo`` part).
ONE_CHUNK = LossTpuConfig(block_t=16, block_v=128, chunk_t=2048)


def _kernels(fn, *args) -> set[str]:
    """The stellax loss kernels ``fn(*args)`` launches (names from its jaxpr)."""
    return set(re.findall(r"stellax_linear_cross_entropy_[a-z_]*_tpu", str(jax.make_jaxpr(fn)(*args))))


def _loss(labels, options, config):
    return lambda x, w: stellax.linear_cross_entropy(x, w, labels, implementation=IMPL, config=config, **options)


def _fused_and_golden(x, w, labels, options, config):
    """``(loss, (dx, dw))`` of the fused sweep, interpreted and jitted (checked to be the fused
    kernels), and of the float32 golden."""
    grad = jax.value_and_grad(_loss(labels, options, config), argnums=(0, 1))
    with stellax.interpret_mode():
        assert _kernels(grad, x, w) == set(FUSED)
        out = jax.jit(grad)(x, w)
    ref = lambda x, w: linear_cross_entropy_op.reference(x, w, labels, **options)
    f32 = lambda a: a.astype(jnp.float32)
    return out, jax.value_and_grad(ref, argnums=(0, 1))(f32(x), f32(w))


def _assert_matches(out, ref, dtype):
    (loss, grads), (ref_loss, ref_grads) = out, ref
    loose = np.dtype(dtype) != np.float32
    assert_close(loss, ref_loss, **({"dtype": dtype} if loose else {"rel_l2_tolerance": 1e-5}), name="loss")
    for name, g, r in zip(("dx", "dw"), grads, ref_grads):
        assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        tolerance = {"dtype": dtype, "gradient": True} if loose else {"rel_l2_tolerance": 2e-5}
        assert_close(g, r, name=name, **tolerance)


def _check_case(dtype, lead, d, v, config, options):
    tokens = int(np.prod(lead))
    chunks, _ = tpu_chunk(tokens, config.block_t, config.chunk_t)
    assert chunks > 1 if config is CHUNKED else chunks == 1
    x, w, labels = random_case(11, lead, d, v, dtype, transpose_w=options.get("transpose_w", False),
                               ignore_index=options.get("ignore_index", -100))
    _assert_matches(*_fused_and_golden(x, w, labels, options, config), dtype)


@pytest.mark.parametrize("lead, d, v, config, options", [
    pytest.param((2, 19), 64, 260, CHUNKED, {"transpose_w": True, "label_smoothing": 0.05, "z_loss": 1e-4},
                 id="chunks-w=[V,D]-mean-smoothing-zloss-leading-axes"),
    pytest.param((37,), 40, 200, ONE_CHUNK, {"reduction": "sum", "logit_soft_cap": 3.0, "ignore_index": 3},
                 id="one-chunk-w=[D,V]-sum-cap-ignore3"),
])
def test_fused_sweep_bfloat16_against_the_golden(lead, d, v, config, options):
    """bfloat16: loss and both gradients within bfloat16's tolerances, a quarter of the labels
    ignored, rows past T and columns past V at the edges; three chunks (the running ``dw`` read
    and rewritten in place, ``hi + lo``) and one (``dw`` written once)."""
    _check_case(jnp.bfloat16, lead, d, v, config, options)


@pytest.mark.parametrize("lead, d, v, config, options", [
    pytest.param((37,), 40, 200, CHUNKED,
                 {"label_smoothing": 0.2, "z_loss": 1e-3, "logit_soft_cap": 2.5, "ignore_index": 3},
                 id="chunks-w=[D,V]-mean-smoothing-zloss-cap-ignore3"),
    pytest.param((37,), 40, 200, CHUNKED,
                 {"transpose_w": True, "reduction": "sum", "logit_soft_cap": 4.0, "label_smoothing": 0.1},
                 id="chunks-w=[V,D]-sum-cap-smoothing"),
])
def test_fused_sweep_float32_against_the_golden(lead, d, v, config, options):
    """float32 (at ``HIGHEST``: float32 logits kept, one float32 running ``dw``): loss within
    1e-5 and gradients within 2e-5 of the golden, every option, both layouts, three chunks."""
    _check_case(jnp.float32, lead, d, v, config, options)


def test_large_logits_keep_bfloat16_accuracy():
    """Logits of standard deviation ~16 (max ~70), labels the second most likely class: the
    kept tiles are shifted by the running max, so dx and dw stay within bfloat16's tolerance
    (a raw bfloat16 copy of the logits gives ~6 % there: 2⁻⁹·|c| in every exponent)."""
    x, w, _ = random_case(3, (24,), 64, 256, jnp.bfloat16, ignored=0.0)
    w = (w.astype(jnp.float32) * 8).astype(jnp.bfloat16)
    c = x.astype(jnp.float32) @ w.astype(jnp.float32)
    assert float(jnp.std(c)) > 10
    labels = jnp.argsort(-c, axis=1)[:, 1].astype(jnp.int32)
    out, ref = _fused_and_golden(x, w, labels, {}, ONE_CHUNK)
    for name, g, r in zip(("dx", "dw"), out[1], ref[1]):
        assert_close(g, r, rel_l2_tolerance=5e-3, name=name)


def test_chunks_agree_and_runs_are_bitwise_equal():
    """Three chunks against one (float32: the same gradients up to summation order), and two runs
    of the chunked sweep bitwise equal (fixed order, no atomics). V=256 is whole tiles, so the
    interpreter runs the in-place updates (``dz`` over the kept logits, the running ``dw``) with
    their aliases and race detection (it drops an alias of an array with a partial block)."""
    x, w, labels = random_case(12, (37,), 40, 256, jnp.float32)
    chunked, whole = (jax.jit(jax.value_and_grad(_loss(labels, {}, c), argnums=(0, 1))) for c in (CHUNKED, ONE_CHUNK))
    with stellax.interpret_mode():
        (l1, g1), (l2, g2), (l3, g3) = chunked(x, w), chunked(x, w), whole(x, w)
    for a, b in zip((l1, *g1), (l2, *g2)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert_close(l1, l3, rel_l2_tolerance=1e-6, name="loss")
    for name, a, b in zip(("dx", "dw"), g1, g3):
        assert_close(a, b, rel_l2_tolerance=1e-6, name=name)


def test_float32_precision_contract_of_the_gradients():
    """float32 at each precision (`stellax.core.precision`), through the fused sweep: ``'default'``
    (one bfloat16 pass per matmul: bfloat16-like gradients), ``'high'`` (three) and ``'highest'``
    (float32, with float32 logits kept) against the float32 golden."""
    x, w, labels = random_case(14, (24,), 256, 200, jnp.float32)
    ref = jax.grad(lambda x, w: linear_cross_entropy_op.reference(x, w, labels), argnums=(0, 1))(x, w)
    errors = {}
    for precision in ("default", "high", "highest"):
        grad = jax.grad(_loss(labels, {"precision": precision}, ONE_CHUNK), argnums=(0, 1))
        with stellax.interpret_mode():
            grads = jax.jit(grad)(x, w)
        errors[precision] = max(float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) for g, r in zip(grads, ref))
    assert 1e-5 < errors["default"] < 3e-2, errors
    assert errors["high"] < 2e-5 and errors["highest"] < 2e-6, errors


@pytest.mark.parametrize("options, kernels", [
    ({}, FUSED),
    ({"reduction": "sum", "transpose_w": True}, FUSED),
    ({"reduction": "none"}, RECOMPUTE),
    ({"return_lse": True}, RECOMPUTE),
    ({"z_loss": 1e-3, "return_z_loss": True}, RECOMPUTE),
], ids=["mean", "sum-[V,D]", "none", "return_lse", "return_z_loss"])
def test_only_a_scalar_loss_takes_the_fused_sweep(options, kernels):
    """A scalar loss under differentiation runs the three fused kernels and nothing else; outputs
    with a per-token cotangent keep the recompute kernels; the undifferentiated loss runs the
    plain forward kernel alone (jaxprs only: nothing is compiled)."""
    x, w, labels = random_case(13, (20,), 16, 150, jnp.bfloat16, transpose_w=options.get("transpose_w", False))
    run = _loss(labels, options, ONE_CHUNK)
    scalar = lambda x, w: sum(jnp.sum(o) for o in jax.tree.leaves(run(x, w)))
    with stellax.interpret_mode():
        differentiated = _kernels(jax.grad(scalar, argnums=(0, 1)), x, w)
        assert _kernels(run, x, w) == {"stellax_linear_cross_entropy_forward_tpu"}
    expected = set(kernels) | ({"stellax_linear_cross_entropy_forward_tpu"} if kernels == RECOMPUTE else set())
    assert differentiated == expected


@pytest.mark.parametrize("transpose_w", [True, False], ids=["w=[V,D]", "w=[D,V]"])
def test_fused_sweep_lowers_for_tpu(transpose_w):
    """The gradient of a mean loss lowers to the fused kernels for a v5e at a Llama-3-sized head
    (T=3000: two chunks of 1536, V not a multiple of the tile), bfloat16 and float32."""
    tokens, d, v = 3000, 2048, 128256
    for dtype in (jnp.bfloat16, jnp.float32):
        args = (jax.ShapeDtypeStruct((tokens, d), dtype),
                jax.ShapeDtypeStruct((v, d) if transpose_w else (d, v), dtype),
                jax.ShapeDtypeStruct((tokens,), jnp.int32))
        _, gradient = lower_config(linear_cross_entropy_op, IMPL, args, {"transpose_w": transpose_w}, grad=True,
                                   target="v5e")
        text = gradient.as_text()
        assert all(name in text for name in FUSED) and not any(name in text for name in RECOMPUTE)


# -- chunks and the cost model -----------------------------------------------------------------------
@pytest.mark.parametrize("tokens, block_t, chunk_t, expected", [
    (8192, 512, 2048, (4, 2048)), (3000, 512, 2048, (2, 1536)), (2049, 512, 2048, (2, 1536)),
    (2049, 1024, 2048, (3, 1024)), (37, 16, 32, (3, 16)), (38, 16, 48, (1, 48)), (13, 512, 2048, (1, 13)),
])
def test_token_chunks_pad_least(tokens, block_t, chunk_t, expected):
    """Chunks of whole token blocks (or the whole call when it is one block), between half of
    ``chunk_t`` and all of it, the size that pads least (the largest of those): 3000 tokens are
    two chunks of 1536, 2049 tokens over 1024-token blocks three of 1024, not two of 2048."""
    chunks, chunk = tpu_chunk(tokens, block_t, chunk_t)
    assert (chunks, chunk) == expected and chunks * chunk >= tokens
    assert chunk % min(block_t, tokens) == 0


def test_cost_model_three_matmuls_streamed_under_the_mxu():
    """Issue 40's head on a v5e: three kernels of ``2·T·D·V`` flops each (the recompute path runs
    five), each moving less HBM than its MXU time covers at 197 TFLOP/s and 819 GB/s; 56 GiB in
    all, 134 ms of roofline."""
    with stellax.lowering_target("v5e"):
        costs = fused_sweep_cost(8192, 4096, 131072, 2, LossTpuConfig())
    assert [k.name for k in costs] == ["logits", "dz_dx", "dw_chunk"]
    matmul = 2.0 * 8192 * 4096 * 131072
    assert all(k.flops == matmul for k in costs)
    assert all(k.hbm_bytes / 819e9 < 0.65 * k.flops / 197e12 for k in costs)
    assert 55 * 2**30 < sum(k.hbm_bytes for k in costs) < 57 * 2**30
    assert 0.133 < sum(k.seconds(197e12, 819e9) for k in costs) < 0.135


# -- the real compiler (libtpu) --------------------------------------------------------------------
def _compile_gradient(tokens, d, v, dtype, generation, *, transpose_w=True, fn=None):
    """The compiled gradient of a mean loss (``fn``: the loss, default stellax's) for ``generation``."""
    from stellax.core import LOWERING_TARGETS, lowering_target
    from stellax.testing.lowering import on_device
    from stellax.testing.tpu_compile import libtpu_available, topology_device

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    args = (jax.ShapeDtypeStruct((tokens, d), dtype), jax.ShapeDtypeStruct((v, d) if transpose_w else (d, v), dtype),
            jax.ShapeDtypeStruct((tokens,), jnp.int32))
    fn = fn or (lambda x, w, y: stellax.linear_cross_entropy(x, w, y, transpose_w=transpose_w, implementation=IMPL))
    with lowering_target(LOWERING_TARGETS[generation]):
        traced = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).trace(*on_device(args, topology_device(generation)))
        return traced.lower().compile()


def _full_logits(x, w, labels):
    """The mean loss as written in ``jnp`` (benchmarks/loss_tpu.py's ``xla:full_logits``)."""
    logits = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    valid = labels != -100
    nll = -jnp.take_along_axis(logp, jnp.where(valid, labels, 0)[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("dtype, transpose_w", [(jnp.bfloat16, True), (jnp.float32, False)], ids=["bf16", "f32"])
def test_fused_sweep_compiles_on_every_generation(generation, dtype, transpose_w):
    """The heuristic's fused kernels fit each generation's VMEM at issue 40's hidden size (D=4096,
    two chunks of 2048 tokens, the soft cap; V=131072 in bfloat16, 32768 in float32, whose
    compile takes minutes: VMEM does not depend on V)."""
    fn = lambda x, w, y: stellax.linear_cross_entropy(x, w, y, transpose_w=transpose_w, logit_soft_cap=30.0,
                                                      implementation=IMPL)
    vocab = 131072 if dtype == jnp.bfloat16 else 32768
    _compile_gradient(4096, 4096, vocab, dtype, generation, transpose_w=transpose_w, fn=fn)


@pytest.mark.tpu
def test_fused_sweep_hbm_against_full_logits_on_v5e():
    """Issue 40's case (T=8192, D=4096, V=131072, bf16, [V, D]) compiled for a v5e: the sweep's
    temporaries (one chunk's [2048, V] logits, the running ``dw``'s ``lo`` part) are about a
    quarter of the full-logits version's (its float32 [T, V] logits and their gradient)."""
    ours = _compile_gradient(8192, 4096, 131072, jnp.bfloat16, "v5e").memory_analysis()
    full = _compile_gradient(8192, 4096, 131072, jnp.bfloat16, "v5e", fn=_full_logits).memory_analysis()
    gib = 2**30
    assert ours.temp_size_in_bytes <= 2.1 * gib and full.temp_size_in_bytes >= 7.9 * gib, (
        ours.temp_size_in_bytes / gib, full.temp_size_in_bytes / gib)
