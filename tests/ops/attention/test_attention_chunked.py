"""xla_chunked specifics (memory-linear, CPU default) and the mask description."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.attention import attention_backward_op, attention_op
from stellax.ops.attention.masks import (
    EMPTY, FULL, MaskSpec, classify_blocks, dense_mask, visible_fraction, visit_schedule,
)
from stellax.testing import check_example, check_op

from .attention_cases import check_against_golden, make_inputs


def temp_bytes(impl, t, grad=False):
    sd = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32)

    def f(q, k, v):
        return stellax.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    fn = jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 1, 2)) if grad else f
    return jax.jit(fn).lower(sd, sd, sd).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("grad", [False, True])
def test_peak_memory_grows_linearly(grad):
    lengths = (512, 1024, 2048)
    chunked = [temp_bytes("xla_chunked", t, grad) for t in lengths]
    dense = [temp_bytes("xla", t, grad) for t in lengths]
    for small, big in zip(chunked, chunked[1:]):
        assert big <= 2.2 * small, chunked        # doubling T at most ~doubles the temporaries
    for small, big in zip(dense, dense[1:]):
        assert big >= 3.5 * small, dense         # the golden materializes T×S logits
    assert chunked[-1] * 10 < dense[-1]


def test_cpu_default_is_xla_chunked():
    q = jnp.zeros((1, 64, 2, 16))
    seen = []
    from stellax.core import observe_calls
    with observe_calls(lambda op, impl, call, cfg: seen.append((op.name, impl.name))):
        jax.jit(lambda q: stellax.dot_product_attention(q, q, q, is_causal=True)).lower(q)
    assert ("attention", "xla_chunked") in seen


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow),
                                   pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_chunked_small_blocks_every_option(dtype):
    from stellax.ops.attention.configs import ChunkedConfig
    args, kwargs = make_inputs(11, 2, 45, 70, 4, 2, 32, 24, dtype, bias=(2, 1, 45, 70), mask=(1, 4, 45, 70),
                               sinks=True, segments=True, lengths=True)
    configs = {("attention", "xla_chunked"): ChunkedConfig(16, 32),
               ("attention_backward", "xla_chunked"): ChunkedConfig(32, 16)}
    check_against_golden("xla_chunked", args, {**kwargs, "is_causal": True, "local_window_size": (30, 2),
                                               "logits_soft_cap": 4.0}, configs=configs, repeat=True)


@pytest.mark.parametrize("op,index", [(attention_op, 2), (attention_backward_op, 1)])
def test_check_examples(op, index):
    """What `stellax check` runs, on one built-in example per op (all of them under -m slow)."""
    result = check_example(op, "xla_chunked", op.examples(jnp.float32)[index], jnp.float32)
    assert result.passed, str(result)


@pytest.mark.slow
def test_check_op_all_examples():
    for op in (attention_op, attention_backward_op):
        results = check_op(op, implementations=["xla_chunked", "xla"], dtypes=(jnp.float32, jnp.bfloat16))
        assert results and all(r.passed for r in results), [str(r) for r in results if not r.passed]


# -- the mask description ------------------------------------------------------------------
SPECS = [MaskSpec(causal=True), MaskSpec(window_left=7, window_right=3), MaskSpec(window_left=None, window_right=0),
         MaskSpec(chunk_size=12, causal=True), MaskSpec(causal=True, window_left=20, chunk_size=32),
         MaskSpec(segments=True), MaskSpec(causal=True, segments=True)]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("t,s,bq,bk", [(50, 50, 8, 16), (17, 61, 16, 8), (64, 20, 16, 16)])
def test_block_classes_are_exact_for_empty_and_full(spec, t, s, bq, bk):
    rng = np.random.default_rng(t * s)
    q_pos = jnp.arange(t, dtype=jnp.int32)[None] + (s - t)
    kv_pos = jnp.arange(s, dtype=jnp.int32)[None]
    q_seg = jnp.asarray(np.sort(rng.integers(0, 3, (1, t)), axis=1), jnp.int32) if spec.segments else None
    kv_seg = jnp.asarray(np.sort(rng.integers(0, 3, (1, s)), axis=1), jnp.int32) if spec.segments else None
    classes = np.asarray(classify_blocks(spec, q_pos, kv_pos, q_seg, kv_seg, block_q=bq, block_k=bk))[0]
    visible = np.asarray(dense_mask(spec, q_pos, kv_pos, q_seg, kv_seg))[0]
    nq, nk = classes.shape
    for i in range(nq):
        for j in range(nk):
            tile = visible[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            full_tile = tile.shape[1] == bk and tile.all()
            if classes[i, j] == EMPTY:
                assert not tile.any(), (i, j)
            if classes[i, j] == FULL:
                assert full_tile, (i, j)
            if spec.has_position_mask and not spec.segments:
                # Positions alone (monotone): the bounds are tight.
                assert (classes[i, j] == EMPTY) == (not tile.any())
                assert (classes[i, j] == FULL) == full_tile
    sched = np.asarray(visit_schedule(jnp.asarray(classes)))
    for i in range(nq):
        lo, flo, fhi, hi = sched[i]
        assert lo <= flo <= fhi <= hi
        assert not any(classes[i, j] != EMPTY for j in range(nk) if j < lo or j >= hi)
        assert all(classes[i, j] == FULL for j in range(flo, fhi))


def test_visible_fraction():
    assert visible_fraction(MaskSpec(), 10, 10) == 1.0
    assert visible_fraction(MaskSpec(causal=True), 4, 4) == pytest.approx(10 / 16)
    assert visible_fraction(MaskSpec(causal=True), 2, 4) == pytest.approx(7 / 8)  # bottom-right aligned
    flops = attention_op.flops(attention_op.check(jnp.zeros((1, 64, 2, 16)), jnp.zeros((1, 64, 2, 16)),
                                                  jnp.zeros((1, 64, 2, 16)), is_causal=True))
    assert flops == pytest.approx(2 * 2 * 64 * 64 * 32 * (64 * 65 / 2) / (64 * 64))
