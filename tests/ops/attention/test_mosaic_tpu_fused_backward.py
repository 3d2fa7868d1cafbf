"""The fused Mosaic TPU attention backward (`mosaic_tpu_backward`, ``SplashBackwardConfig.fused``):
one kv-block-major kernel computing dq, dk and dv, the head group's dq resident in VMEM.

* interpreted numerics against the float32 golden (forward + every gradient through
  `stellax.dot_product_attention`) over the layouts and masks: MHA in place (direct layout),
  GQA/MQA grouped with padded odd lengths, causal / window / chunk / documents with fully
  masked rows, soft cap, sinks, float32 and bf16;
* the fused kernel against the unfused pair on the same residuals (`backward` called directly);
* configs: validation, the tuning space, the default rule (`configs.fused_backward_default`);
* Mosaic ``tpu`` lowering of the fused kernel over the fused configs of the space, and (``tpu``
  marker) the real compiler for v5e, v5p, v6e and TPU7x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import lowering_target, use_configs
from stellax.ops.attention import attention_op, base, mosaic_tpu, mosaic_tpu_backward
from stellax.ops.attention.configs import (
    FUSED_BACKWARD_BY_DEFAULT, SplashBackwardConfig, SplashConfig, fused_backward_fits, fused_dq_bytes,
    splash_backward_heuristic, splash_backward_space,
)
from stellax.testing import assert_close

from .attention_cases import check_against_golden, make_inputs

FUSED = {("attention", "mosaic_tpu"): SplashConfig(block_q=128, block_kv=128),
         ("attention_backward", "mosaic_tpu"): SplashBackwardConfig(128, 128, 128, 128, fused=True)}
FUSED_NAME = "stellax_splash_attention_backward_fused"


def _lowered_backward_text(q, kv, generation="v5e", configs=None, **mask):
    """The StableHLO text of the gradients of a causal attention loss, lowered for a TPU."""
    loss = lambda q, k, v: jnp.sum(stellax.dot_product_attention(q, k, v, **mask).astype(jnp.float32))
    with lowering_target(generation), use_configs(configs or {}):
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
            lowering_platforms=("tpu",)).as_text()


# -- interpreted numerics -----------------------------------------------------------------------------
def _documents(t: int, sizes):
    return jnp.asarray(np.repeat(np.arange(len(sizes)), sizes)[None, :t], jnp.int32)


def _check_fused(shape, dtype, opt):
    """Forward + gradients (q, k, v, sinks) with the fused backward at 128×128 blocks (several
    kv blocks per query block, so a dq missing one kv block's share fails) against the golden."""
    t, s, n, kh, h, hv = shape
    args, kwargs = make_inputs(t + s + n, 1, t, s, n, kh, h, hv, dtype, sinks=True)
    check_against_golden("mosaic_tpu", args, {**kwargs, **opt}, configs=FUSED)


def test_fused_matches_golden_mha_direct_layout():
    """MHA, lane-aligned heads, block-multiple lengths (the in-place ``[B, T, N·D]`` layout, dq
    written as one ``[T, H]`` window per head), causal with T != S."""
    _check_fused((384, 512, 2, 2, 128, 128), jnp.float32, {"is_causal": True})


@pytest.mark.parametrize("name, shape, dtype, opt", [
    # GQA 2, odd padded lengths, T > S (leading rows see nothing), soft cap
    ("gqa padded softcap", (300, 256, 4, 2, 64, 64), jnp.float32, {"is_causal": True, "logits_soft_cap": 5.0}),
    # MQA, sliding window inside documents; the last document has no keys (fully masked rows)
    ("mqa window documents", (384, 384, 4, 1, 64, 64), jnp.float32,
     {"local_window_size": (100, 0), "is_causal": True,
      "q_segment_ids": _documents(384, [150, 150, 84]), "kv_segment_ids": _documents(384, [150, 234, 0])}),
    # chunks, bf16, Hv != H, T < S
    ("chunk bf16", (256, 384, 2, 1, 128, 64), jnp.bfloat16, {"chunk_size": 160}),
])
def test_fused_matches_golden(name, shape, dtype, opt):
    """The grouped layout (GQA/MQA, dq as ``[K, nq·R, H]`` blocks) over padded lengths, masks,
    documents with fully masked rows, soft cap and bf16 (`_check_fused`)."""
    _check_fused(shape, dtype, opt)


def _residuals(t, s, n, kh, h, hv, **opt):
    """Canonical operands with ``opt`` (float32), the forward's ``(out, lse)`` and random
    cotangents ``(d_out, d_lse)``."""
    (q, k, v, _, _), kwargs = make_inputs(7, 2, t, s, n, kh, h, hv, jnp.float32, sinks=True)
    c = base.canonicalize(attention_op.check(q, k, v, sinks=kwargs["sinks"], **opt))
    with stellax.interpret_mode():
        out, lse = jax.jit(lambda c: mosaic_tpu.forward(c, SplashConfig(128, 128)))(c)
    keys = jax.random.split(jax.random.PRNGKey(8), 2)
    d_out = jax.random.normal(keys[0], out.shape, out.dtype)
    d_lse = jax.random.normal(keys[1], lse.shape, jnp.float32)
    return c, out, lse, d_out, d_lse


def test_fused_equals_unfused_kernels():
    """Same residuals, batch 2, GQA 2, documents + causal + soft cap + sinks + dlse: the fused
    kernel's (dq, dk, dv, dsinks) equal the dq and dk/dv kernels' to float32 rounding, and dq
    is non-zero in every query block of the (non-empty) documents."""
    seg = jnp.broadcast_to(_documents(256, [100, 60, 96]), (2, 256))
    c, out, lse, d_out, d_lse = _residuals(256, 256, 4, 2, 64, 64, is_causal=True, logits_soft_cap=8.0,
                                           q_segment_ids=seg, kv_segment_ids=seg)

    def run(fused: bool):
        config = SplashBackwardConfig(128, 128, 128, 128, fused=fused)
        return jax.jit(lambda *a: mosaic_tpu_backward.backward(*a, config))(c, out, lse, d_out, d_lse)

    with stellax.interpret_mode():
        fused, unfused = run(True), run(False)
    for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), fused, unfused):
        if b is None:
            assert a is None, name
            continue
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()),
                                   err_msg=name)
    per_block = np.abs(np.asarray(fused[0])).reshape(2, 2, 128, -1).max(axis=(2, 3))
    assert (per_block > 0).all(), per_block


# -- configs -------------------------------------------------------------------------------------
def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="fused must be a bool, got 1"):
        SplashBackwardConfig(fused=1)
    assert SplashBackwardConfig.from_dict({"block_q_dq": 256}).fused is False  # older cache entries


def _call(t, n, kh, h=128, dtype=jnp.bfloat16, b=1):
    q = jax.ShapeDtypeStruct((b, t, n, h), dtype)
    kv = jax.ShapeDtypeStruct((b, t, kh, h), dtype)
    return attention_op.check(q, kv, kv, is_causal=True)


def test_resident_dq_bytes_and_the_default_rule():
    """The resident dq is ``T·G·H`` float32 plus two output buffers (one for a grid of one
    (batch, kv head)); the heuristic fuses where it fits seven eighths of VMEM (T=8192 MHA and
    GQA 4 on a v5e) and not where it does not (T=131072 MHA: 128 MiB of dq) — unless
    `FUSED_BACKWARD_BY_DEFAULT` is off — and the tuning space holds both forms exactly where it
    fits."""
    assert fused_dq_bytes(8192, 1, 128, 2, 1024) == 8192 * 128 * 8
    assert fused_dq_bytes(1000, 4, 64, 4, 128) == 1024 * 4 * 128 * 12  # T padded, lanes padded
    assert fused_dq_bytes(8192, 16, 128, 2, 128, output_buffers=1) == 8192 * 16 * 128 * 6
    for generation, call, fused in (("v5e", _call(8192, 16, 16), True), ("v5e", _call(8192, 32, 8), True),
                                    ("v6e", _call(8192, 16, 16), True), ("v5e", _call(131072, 16, 16), False),
                                    ("tpu7x", _call(65536, 16, 16), False)):
        with lowering_target(generation):
            config = splash_backward_heuristic(call)
            space = splash_backward_space(call)
            from stellax.core.platform import target_generation

            gen = target_generation()
        assert config.fused is (fused and FUSED_BACKWARD_BY_DEFAULT), (generation, call.query.shape)
        assert config in space
        pairs = {(c.block_q_dkv, c.block_kv_dkv) for c in space}
        for bq, bk in pairs:
            fits = fused_backward_fits(call, bq, bk, gen)
            forms = {c.fused for c in space if (c.block_q_dkv, c.block_kv_dkv) == (bq, bk)}
            assert forms == ({False, True} if fits else {False}), (generation, bq, bk)


def test_mqa_backward_takes_the_fused_kernel_at_large_tiles_where_it_fits():
    """MQA (16 heads on one kv head) at T=8192, one sequence: the fused kernel at the forward's
    large tiles (128 × 1024, 110 MiB with its resident dq; measured on a v5e 8.10 ms forward +
    backward against 10.33 at the unfused 128 × 512); two sequences double-buffer the dq output
    block and do not fit, so they keep the unfused pair."""
    with lowering_target("v5e"):
        one = splash_backward_heuristic(_call(8192, 16, 1))
        two = splash_backward_heuristic(_call(8192, 16, 1, b=2))
    if FUSED_BACKWARD_BY_DEFAULT:
        assert (one.block_q_dkv, one.block_kv_dkv, one.fused) == (128, 1024, True)
    assert not two.fused and (two.block_q_dkv, two.block_kv_dkv) == (128, 512)


def test_narrow_window_backward_takes_512_tiles():
    """A sliding window of at most 1024 keys takes the fused backward at 512-row tiles (measured on a
    v5e, window 1024 causal T=16384: 8.19 ms forward + backward against 8.83 at 1024 tiles); a wider
    window keeps the 1024 tiles."""
    def blocks(n, kh, window):
        q = jax.ShapeDtypeStruct((1, 16384, n, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 16384, kh, 128), jnp.bfloat16)
        with lowering_target("v5e"):
            c = splash_backward_heuristic(attention_op.check(q, kv, kv, is_causal=True, local_window_size=(window, 0)))
        return c.block_q_dkv, c.block_kv_dkv, c.fused

    if FUSED_BACKWARD_BY_DEFAULT:
        assert blocks(16, 16, 1024) == (512, 512, True)
        assert blocks(32, 8, 1024) == (128, 512, True)      # GQA 4: the same 512 rows
    assert blocks(16, 16, 4096)[:2] == (1024, 1024)


# -- Mosaic lowering and the real compiler ----------------------------------------------------------------
def test_default_lowers_the_fused_kernel_only():
    """On a v5e at T=2048 (the heuristic fuses, `FUSED_BACKWARD_BY_DEFAULT`) the gradients run
    the fused kernel and neither of the unfused pair; with ``fused=False`` the pair, not the
    fused kernel."""
    q = jax.ShapeDtypeStruct((1, 2048, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2048, 2, 128), jnp.bfloat16)
    text = _lowered_backward_text(q, kv, is_causal=True)
    assert (FUSED_NAME in text) is FUSED_BACKWARD_BY_DEFAULT
    assert ("stellax_splash_attention_backward_dkdv" in text) is not FUSED_BACKWARD_BY_DEFAULT
    unfused = {("attention_backward", "mosaic_tpu"): SplashBackwardConfig(512, 512, 512, 512, fused=False)}
    text = _lowered_backward_text(q, kv, configs=unfused, is_causal=True)
    assert FUSED_NAME not in text and "stellax_splash_attention_backward_dkdv" in text


@pytest.mark.parametrize("shape, mask", [
    ((2048, 4, 4, 128), {"is_causal": True}),                                 # MHA: direct layout
    ((1000, 4, 1, 64), {"local_window_size": (256, 0), "is_causal": True}),  # MQA, padded: grouped
])
def test_lowering_every_fused_config(shape, mask):
    """Mosaic ``tpu`` lowering of the fused kernel for every fused config of the v5e space."""
    t, n, kh, h = shape
    q = jax.ShapeDtypeStruct((1, t, n, h), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, kh, h), jnp.bfloat16)
    with lowering_target("v5e"):
        space = [c for c in splash_backward_space(attention_op.check(q, kv, kv, **mask)) if c.fused]
    assert space
    for config in space:
        text = _lowered_backward_text(q, kv, configs={("attention_backward", "mosaic_tpu"): config}, **mask)
        assert FUSED_NAME in text, config


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
def test_mqa_heuristic_backward_compiles(generation):
    """MQA (16 heads, one kv head), B=1, T=8192, D=128, bf16: the heuristic's backward (fused
    at 128 × 1024 on a v5e, where its resident dq takes 96 MiB) compiles with gradients."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    q = jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8192, 1, 128), jnp.bfloat16)
    with lowering_target(generation):
        config = splash_backward_heuristic(attention_op.check(q, kv, kv, is_causal=True))
    with use_configs({("attention_backward", "mosaic_tpu"): config}):
        result = compile_config(attention_op, "mosaic_tpu", (q, kv, kv), {"is_causal": True}, generation=generation,
                                grad=True)
    assert result.ok, (config, result.describe())


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("n, kh, mask", [(16, 16, {"is_causal": True}),                           # MHA, direct
                                         (32, 8, {"is_causal": True}),                            # GQA 4
                                         (8, 2, {"chunk_size": 1024}),                             # GQA, chunks
                                         (8, 8, {"local_window_size": (1024, 0), "is_causal": True})])
def test_fused_compiles(generation, n, kh, mask):
    """B=1, T=S=8192, D=128, bf16: the heuristic's blocks with ``fused=True`` compile (forward
    and gradients) for each generation."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    q = jax.ShapeDtypeStruct((1, 8192, n, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8192, kh, 128), jnp.bfloat16)
    with lowering_target(generation):
        config = splash_backward_heuristic(attention_op.check(q, kv, kv, **mask)).replace(fused=True)
    with use_configs({("attention_backward", "mosaic_tpu"): config}):
        result = compile_config(attention_op, "mosaic_tpu", (q, kv, kv), mask, generation=generation, grad=True)
    assert result.ok, result.describe()
    assert FUSED_NAME in _lowered_backward_text(q, kv, generation, {("attention_backward", "mosaic_tpu"): config},
                                                **mask)
