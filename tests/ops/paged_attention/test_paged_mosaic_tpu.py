"""Mosaic TPU paged kernels (`paged_attention`, `ragged_paged_attention`,
`mla_decode`): interpreted numerics against the goldens, configs and
requirements, and the real Mosaic compiler (``tpu`` marker).

Interpreted TPU kernels cost 5–30 s of CPU each here (every page copy is an
interpreted DMA), so the default tier runs two small cases (a mixed
ragged batch with GQA, soft cap, window and sinks; an int4 paged decode) and
the configs; the registry tiers add the ops' examples (MLA included).
``-m slow`` runs every quantized format, bf16, combined pools,
full-precision windows, rotation, a small MLA and the MLA sizes of DeepSeek
(R = 512, P = 64).

jax's bundled ragged paged attention (`jax.experimental.pallas.ops.tpu.
ragged_paged_attention`) does not run interpreted on jax 0.10.2 (``'ReshapeTransform'
object has no attribute 'indices'``, `test_bundled_kernel_does_not_interpret`
keeps that fact checked), and it cannot be lowered for a compile-only TPU on a
CPU host either (its lowering asks the attached device for its generation:
``Unsupported TPU device kind: cpu``; `test_bundled_and_ours_compile` pins it
while checking that ours compiles for v5e and v6e on the same problem). So no
numerical or compile comparison with it is possible here; it is a peer of the
TPU suite, for the day a TPU runs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import lowering_target
from stellax.ops.paged_attention import (
    KVQuant, mla_decode, mla_decode_op, paged_attention, paged_attention_op, quantize_pages, ragged_paged_attention,
    ragged_paged_attention_op,
)
from stellax.ops.paged_attention import configs
from stellax.ops.paged_attention.configs import TpuMlaConfig, TpuPagedConfig, TpuRaggedConfig
from stellax.ops.paged_attention import mla_inputs, paged_inputs, ragged_inputs
from stellax.testing import assert_close

MIXED = dict(q_lens=[1, 7, 1, 12, 3], kv_lens=[9, 7, 40, 30, 3])  # decodes, a prefill, chunked prefills


def _golden(op, *args, **kw):
    return jax.jit(functools.partial(op.reference, **kw))(*args)


def _interpreted(fn, *args, **kw):
    with stellax.interpret_mode():
        return fn(*args, implementation="mosaic_tpu", **kw)


# -- default tier ------------------------------------------------------------------------------
def test_ragged_mixed_batch_gqa_softcap_window_sinks():
    """Decodes, a prefill and chunked prefills in one call (+ a dead padding
    sequence and padding tokens), 4 query heads per kv head, pages shuffled,
    two programs per long sequence (block_q 8), blocks of 2 pages (several kv
    heads: the slow tier and the registry examples)."""
    q, k, v, kv_lens, t, cu, n = ragged_inputs(1, **MIXED, page_size=8, kv_heads=1, q_heads=4, head_dim=32,
                                               dtype=jnp.float32, padding_seqs=1, padding_tokens=3)
    kw = dict(local_window_size=12, logits_soft_cap=5.0, sinks=jnp.linspace(-1, 1, 4))
    out = _interpreted(ragged_paged_attention, q, k, v, kv_lens, t, cu, n,
                       config=TpuRaggedConfig(pages_per_block=2, block_q=8), **kw)
    assert_close(out, _golden(ragged_paged_attention_op, q, k, v, kv_lens, t, cu, n, **kw))
    assert np.all(np.asarray(out[int(cu[int(n[0])]):]) == 0), "tokens past cu_q_lens[num_seqs] must be zeros"


def test_paged_int4_grouped_decode():
    """int4 keys and values with head-dim groups of 8 (scales and zero points
    expanded onto the two nibble parts in VMEM), two query tokens."""
    spec = KVQuant("int4", group_size=8)
    q, k, v, t, lengths = paged_inputs(2, lengths=[5, 37, 0], page_size=8, kv_heads=1, q_heads=2, head_dim=32,
                                       dtype=jnp.float32, q_tokens=2, quant=spec)
    out = _interpreted(paged_attention, q, k, v, t, lengths, config=TpuPagedConfig(pages_per_block=2))
    assert_close(out, _golden(paged_attention_op, q, k, v, t, lengths))


@pytest.mark.slow
def test_mla_decode_small():
    args = mla_inputs(3, lengths=[1, 20, 0], page_size=8, heads=8, latent_dim=64, rope_dim=16, dtype=jnp.float32)
    out = _interpreted(mla_decode, *args, scale=0.125, config=TpuMlaConfig(pages_per_block=2))
    assert out.shape == (3, 8, 64)
    assert_close(out, _golden(mla_decode_op, *args, scale=0.125))


def test_configs_heuristic_space_requirements():
    q, k, v, t, lengths = paged_inputs(0, lengths=[300, 17], page_size=16, kv_heads=2, q_heads=8, head_dim=128,
                                       dtype=jnp.bfloat16)
    call = paged_attention_op.check(q, k, v, t, lengths)
    for generation in ("v5e", "v6e"):
        with lowering_target(generation):
            space = configs.paged_tpu_space(call)
            best = configs.paged_tpu_heuristic(call)
        assert best in space
        # The table is 19 pages wide: blocks of at most 32 pages are in the space, and 32 pages of
        # 2 kv heads (256 KiB) are under the block target, so the heuristic takes the widest.
        assert max(c.pages_per_block for c in space) == 32
        assert best.pages_per_block == 32
    with pytest.raises(ValueError, match="block_q"):
        TpuRaggedConfig(pages_per_block=2, block_q=3)
    with pytest.raises(ValueError, match="pages_per_block"):
        TpuPagedConfig(pages_per_block=3)
    # int2 groups of 3 channels would straddle the four codes of a byte: refused, dispatch falls back.
    qq, kq, vq, tq, lq = paged_inputs(0, lengths=[5], page_size=8, kv_heads=1, q_heads=1, head_dim=24,
                                      dtype=jnp.float32, quant=KVQuant("int2", group_size=3))
    reason = configs.paged_tpu_requirements(paged_attention_op.check(qq, kq, vq, tq, lq))
    assert reason and "multiple of 4" in reason
    # int4 codes are one uint4 per channel: any group size is read (and right, interpreted).
    qq, kq, vq, tq, lq = paged_inputs(0, lengths=[5, 19], page_size=8, kv_heads=1, q_heads=1, head_dim=24,
                                      dtype=jnp.float32, quant=KVQuant("int4", group_size=3))
    assert configs.paged_tpu_requirements(paged_attention_op.check(qq, kq, vq, tq, lq)) is None
    out = _interpreted(paged_attention, qq, kq, vq, tq, lq, config=TpuPagedConfig(pages_per_block=2))
    assert_close(out, _golden(paged_attention_op, qq, kq, vq, tq, lq), name="int4 groups of 3")


def _decode_call(page_size, *, batch=8, context=8192, kv_heads=8, q_heads=32, head_dim=128, quant=None):
    """An abstract decode call (shape structs only: nothing is allocated)."""
    pages = context // page_size
    s = jax.ShapeDtypeStruct
    pool = s((batch * pages, page_size, kv_heads, head_dim), jnp.bfloat16)
    if quant is not None:
        pool = jax.eval_shape(lambda x: quantize_pages(x, quant), pool)
    return (s((batch, q_heads, head_dim), jnp.bfloat16), pool, pool, s((batch, pages), jnp.int32),
            s((batch,), jnp.int32))


@pytest.mark.parametrize("generation,target_mib", [("v5e", 2), ("v5p", 2), ("v6e", 4), ("tpu7x", 4)])
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_decode_heuristic_takes_blocks_of_the_target_size(generation, target_mib, page_size):
    """Issue 41's decode shapes (8 bf16 kv heads of 128): the default block copies the
    generation's target (2 MiB: 512 tokens on v5e; 4 MiB on v6e), not a fixed token count,
    and the autotuning space covers it and smaller blocks (larger too where VMEM and the
    64-page limit allow)."""
    with lowering_target(generation):
        call = paged_attention_op.check(*_decode_call(page_size))
        best = configs.paged_tpu_heuristic(call)
        space = [c.pages_per_block for c in configs.paged_tpu_space(call)]
    assert configs.block_bytes(call, "paged", best) == target_mib * 2**20
    assert best.pages_per_block * page_size == target_mib * 256       # 4 KiB of K and V per token
    assert min(space) < best.pages_per_block <= max(space)
    assert max(space) > best.pages_per_block or max(space) == max(configs.PAGES)


def test_head_groups_and_token_major_pages():
    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import source_arrays, token_major

    assert [configs.head_group(k) for k in (1, 2, 4, 6, 8, 12, 16, 32)] == [1, 2, 4, 6, 8, 12, 8, 8]
    for heads, merged in ((1, True), (2, True), (4, True), (8, False), (16, False)):
        pool = jnp.zeros((3, 16, heads, 128), jnp.bfloat16)
        src = as_source(pool)
        assert token_major(src) == merged
        assert source_arrays(src)["data"].shape == ((3, 16 * heads, 128) if merged else (3, 16, heads, 128))
    combined = jnp.zeros((3, 16, 2, 2, 128), jnp.bfloat16)
    assert not token_major(as_source(combined, 0))


def test_paged_head_groups_and_program_handover():
    """Two groups of 8 kv heads (16 kv heads) and a token-major pool (4 kv heads),
    bf16, lengths that end mid-page and mid-block, empty sequences between live
    ones (a program with no block hands the next one's prefetch over), blocks of
    2 pages of 8 (the tail block skips its pages past the sequence)."""
    lengths = [37, 0, 0, 20, 9, 0]
    for kv_heads, q_heads in ((16, 32), (4, 8)):
        q, k, v, t, l = paged_inputs(11, lengths=lengths, page_size=8, kv_heads=kv_heads, q_heads=q_heads,
                                     head_dim=128, dtype=jnp.bfloat16, max_pages=6)
        kw = dict(logits_soft_cap=30.0)
        out = _interpreted(paged_attention, q, k, v, t, l, config=TpuPagedConfig(pages_per_block=2), **kw)
        ref = _golden(paged_attention_op, q, k, v, t, l, **kw)
        assert_close(out, ref, name=f"K={kv_heads}")
        assert np.all(np.asarray(out[np.asarray(lengths) == 0], np.float32) == 0)


@pytest.mark.parametrize("quant,kv_heads,page_size", [(KVQuant("int8"), 8, 16), (KVQuant("fp8"), 4, 32),
                                                      (KVQuant("int4", group_size=64), 2, 64)], ids=str)
def test_paged_folded_scales(quant, kv_heads, page_size):
    """One scale per token and kv head and a page's scales a whole 128-lane row: the
    kernel multiplies the codes' logits and the probabilities by them (int4 with a
    whole-head group: zero points too, float16 scales decoded from their bits)."""
    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import source_folds

    q, k, v, t, l = paged_inputs(13, lengths=[70, 1, 0, 129], page_size=page_size, kv_heads=kv_heads,
                                 q_heads=2 * kv_heads, head_dim=64, dtype=jnp.float32, quant=quant)
    assert source_folds(as_source(k)) and source_folds(as_source(v))
    out = _interpreted(paged_attention, q, k, v, t, l, config=TpuPagedConfig(pages_per_block=2))
    assert_close(out, _golden(paged_attention_op, q, k, v, t, l))


@pytest.mark.parametrize("dtype,page_size,ppb,q_tokens", [
    (jnp.bfloat16, 64, 2, None), pytest.param(jnp.float32, 128, 1, 2, marks=pytest.mark.slow),
    pytest.param(jnp.bfloat16, 64, 4, 3, marks=pytest.mark.slow)],
    ids=lambda x: jnp.dtype(x).name if isinstance(x, type) else str(x))
def test_paged_int4_word_path(dtype, page_size, ppb, q_tokens):
    """Folded int4 pools of 8 kv heads, H = 128 (`mosaic_tpu_pages.word_codes`): the kernel reads
    the uint4 slot as int32 words and takes kv heads g and g + 4 as one group (their query rows,
    sinks and outputs reordered); bfloat16 codes carry an offset of 128 that the zero points and
    the probabilities' sum take out. Mixed lengths (empty, one token, partial and whole pages),
    multi-token queries with sinks, soft cap and a local window."""
    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import word_codes

    q, k, v, t, l = paged_inputs(23, lengths=[200, 1, 0, 129, 64], page_size=page_size, kv_heads=8,
                                 q_heads=32, head_dim=128, dtype=dtype, quant=KVQuant("int4"), q_tokens=q_tokens)
    assert word_codes(as_source(k)) and word_codes(as_source(v))
    kw = {} if q_tokens is None else dict(sinks=jnp.linspace(-1, 1, 32), logits_soft_cap=20.0, local_window_size=40)
    out = _interpreted(paged_attention, q, k, v, t, l, config=TpuPagedConfig(pages_per_block=ppb), **kw)
    assert_close(out, _golden(paged_attention_op, q, k, v, t, l, **kw))


@pytest.mark.slow
def test_paged_int4_word_path_rotation_and_windows():
    """The word path with a rotated int4 cache and full-precision sink / recent windows (the
    kernel writes partials, merged in the kernel's kv-head order back to the problem's)."""
    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import word_codes

    spec = KVQuant("int4", rotation=True, sink_tokens=2, recent_tokens=8)
    q, k, v, t, l = paged_inputs(7, lengths=[200, 3, 0, 129], page_size=64, kv_heads=8, q_heads=16, head_dim=128,
                                 dtype=jnp.float32, quant=spec, q_tokens=2)
    assert word_codes(as_source(k))
    kw = dict(sinks=jnp.linspace(-1, 1, 16))
    out = _interpreted(paged_attention, q, k, v, t, l, config=TpuPagedConfig(pages_per_block=2), **kw)
    assert_close(out, _golden(paged_attention_op, q, k, v, t, l, **kw))


@pytest.mark.slow
def test_ragged_int4_word_path():
    """The word path in a ragged batch: decodes, a prefill and a chunked prefill, programs of
    8 tokens (16 query rows per kv head pair), a dead sequence and padding tokens."""
    q, k, v, kv_lens, t, cu, n = ragged_inputs(4, q_lens=[1, 9, 1, 5], kv_lens=[150, 9, 64, 70], page_size=64,
                                               kv_heads=8, q_heads=16, head_dim=128, dtype=jnp.bfloat16,
                                               padding_seqs=1, padding_tokens=3, quant=KVQuant("int4"))
    kw = dict(sinks=jnp.linspace(-1, 1, 16))
    out = _interpreted(ragged_paged_attention, q, k, v, kv_lens, t, cu, n,
                       config=TpuRaggedConfig(pages_per_block=2, block_q=8), **kw)
    end = int(cu[int(n[0])])
    assert_close(out[:end], _golden(ragged_paged_attention_op, q, k, v, kv_lens, t, cu, n, **kw)[:end])


def test_paged_folded_fp8_reads_every_code():
    """Folded e4m3 pools are read as e4m3b11fnuz codes (the v5e's native unpack; their value / 16,
    the 16 folded into the scales) with -0, whose b11 reading is NaN, taken as 0: every one of
    the 256 codes (NaN 0x7F/0xFF aside) placed in the keys and values, -0 among them, gives the
    golden's output."""
    import dataclasses

    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import source_meta

    q, k, v, t, l = paged_inputs(17, lengths=[96, 40], page_size=32, kv_heads=4, q_heads=8, head_dim=64,
                                 dtype=jnp.float32, quant=KVQuant("fp8"))
    assert source_meta(as_source(k)).b11
    bits = np.arange(256, dtype=np.uint8)
    bits = bits[(bits & 0x7F) != 0x7F]                                   # e4m3fn's NaN codes
    n = int(np.prod(k.data.shape))
    codes = np.resize(np.random.default_rng(0).permutation(bits), n).reshape(k.data.shape)
    assert np.any(codes == 0x80)
    data = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn)
    k = dataclasses.replace(k, data=data)
    v = dataclasses.replace(v, data=data[::-1])
    out = _interpreted(paged_attention, q, k, v, t, l, config=TpuPagedConfig(pages_per_block=2))
    assert np.all(np.isfinite(np.asarray(out)))
    assert_close(out, _golden(paged_attention_op, q, k, v, t, l))


def test_megacore_split_runs_every_program():
    """Grid ``(cores, per_core)`` with two cores (v5p's megacore): an odd number of
    programs (one padded), each core's first program starting its own pipeline."""
    from stellax.ops.paged_attention import plan as plan_mod
    from stellax.ops.paged_attention.mosaic_tpu import attention_rows

    q, k, v, t, l = paged_inputs(12, lengths=[30, 5, 0, 17, 64], page_size=8, kv_heads=2, q_heads=4,
                                 head_dim=64, dtype=jnp.float32, max_pages=8)
    call = paged_attention_op.check(q, k, v, t, l)
    problem, finish = plan_mod.paged_problem(call)
    tables = jnp.clip(t, 0, k.shape[0] - 1)
    with stellax.interpret_mode():
        out = finish(attention_rows(problem, tables, pages_per_block=2, cores=2))
    assert_close(out, _golden(paged_attention_op, q, k, v, t, l))


# -- slow: every quantized format and option ---------------------------------------------------------
FORMATS = {
    "int8": KVQuant("int8"),
    "fp8": KVQuant("fp8"),
    "int8_rotated": KVQuant("int8", rotation=True),
    "int4_token_groups": KVQuant("int4", group_axis="token", group_size=8),
    "int2_groups": KVQuant("int2", group_size=16),
    "int2_windows": KVQuant("int2", group_size=16, sink_tokens=4, recent_tokens=8),
    "int4_rotated_windows": KVQuant("int4", group_size=32, rotation=True, sink_tokens=2, recent_tokens=8),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMATS))
def test_ragged_quantized_formats(name):
    spec = FORMATS[name]
    q, k, v, kv_lens, t, cu, n = ragged_inputs(4, **MIXED, page_size=16, kv_heads=2, q_heads=4, head_dim=64,
                                               dtype=jnp.float32, padding_seqs=1, quant=spec)
    kw = dict(sinks=jnp.linspace(-0.5, 0.5, 4))
    out = _interpreted(ragged_paged_attention, q, k, v, kv_lens, t, cu, n,
                       config=TpuRaggedConfig(pages_per_block=2, block_q=4), **kw)
    assert_close(out, _golden(ragged_paged_attention_op, q, k, v, kv_lens, t, cu, n, **kw), name=name)


@pytest.mark.slow
def test_paged_bfloat16_combined_pool_deterministic():
    """A combined ``kv_pages [NP, PS, 2, K, H]`` in bf16; two runs bitwise equal."""
    q, k, v, t, lengths = paged_inputs(5, lengths=[33, 64, 1], page_size=16, kv_heads=2, q_heads=8, head_dim=128,
                                       dtype=jnp.bfloat16, q_tokens=3)
    kv = jnp.stack([k, v], axis=2)
    kw = dict(logits_soft_cap=20.0, local_window_size=40)
    first = _interpreted(paged_attention, q, kv, None, t, lengths, config=TpuPagedConfig(pages_per_block=2), **kw)
    again = _interpreted(paged_attention, q, kv, None, t, lengths, config=TpuPagedConfig(pages_per_block=2), **kw)
    assert np.asarray(first).tobytes() == np.asarray(again).tobytes(), "two runs differ"
    assert_close(first, _golden(paged_attention_op, q, kv, None, t, lengths, **kw))


@pytest.mark.slow
@pytest.mark.parametrize("quant", [None, "int8"])
def test_mla_deepseek_sizes(quant):
    """R = 512, P = 64, 16 heads, bf16; int8 latent with an int4 rope cache."""
    qn, qp, c, pe, t, l = mla_inputs(6, lengths=[1, 40, 77], page_size=16, heads=16, latent_dim=512, rope_dim=64,
                                     dtype=jnp.bfloat16, quant=quant)
    if quant is not None:
        pe = quantize_pages(pe, KVQuant("int4", group_size=32))
    out = _interpreted(mla_decode, qn, qp, c, pe, t, l, scale=0.07, config=TpuMlaConfig(pages_per_block=2))
    assert_close(out, _golden(mla_decode_op, qn, qp, c, pe, t, l, scale=0.07))


# -- the bundled kernel as an oracle ------------------------------------------------------------------
def _bundled_inputs():
    """One mixed batch in the bundled kernel's layout (combined heads interleaved k0 v0 k1 v1 ...)."""
    ps, kv_heads, heads, h = 16, 2, 8, 128
    q, k, v, kv_lens, t, cu, n = ragged_inputs(7, q_lens=[1, 9, 24], kv_lens=[17, 9, 60], page_size=ps,
                                               kv_heads=kv_heads, q_heads=heads, head_dim=h, dtype=jnp.bfloat16)
    combined = jnp.stack([k, v], axis=3).reshape(k.shape[0], ps, 2 * kv_heads, h)
    return (q, k, v, kv_lens, t, cu, n), (q, combined, kv_lens, t, cu, n)


@pytest.mark.slow
def test_bundled_kernel_does_not_interpret():
    """jax 0.10.2's bundled kernel fails interpreted (why only tier 3 compares with it);
    when a jax release fixes this, this test fails and a numerical comparison should replace it."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as bundled

    _, theirs = _bundled_inputs()
    with pytest.raises(Exception, match="ReshapeTransform"):
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            jax.block_until_ready(bundled.ragged_paged_attention(*theirs, sm_scale=0.1, num_kv_pages_per_block=2,
                                                                 num_queries_per_block=8))


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_bundled_and_ours_compile(generation):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as bundled

    from stellax.testing.lowering import on_device
    from stellax.testing.tpu_compile import compile_config, libtpu_available, topology_device

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    ours, theirs = _bundled_inputs()
    result = compile_config(ragged_paged_attention_op, "mosaic_tpu", ours, {"scale": 0.1}, generation=generation)
    assert result.ok, result.describe()
    # The bundled kernel asks the attached TPU for its generation while lowering (Mosaic's
    # `get_tpu_info`), so it cannot even lower for a compile-only topology device on a CPU host.
    # When that changes, this fails and the bundled kernel's compile becomes the assertion.
    fn = functools.partial(bundled.ragged_paged_attention, sm_scale=0.1, num_kv_pages_per_block=2,
                           num_queries_per_block=8)
    with pytest.raises(Exception, match="Unsupported TPU device kind"):
        jax.jit(fn).trace(*on_device(theirs, topology_device(generation))).lower().compile()


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "int4_groups", "int4_token_groups", "int2_groups"])
def test_largest_block_of_the_space_compiles(generation, name):
    """The VMEM model's edge (`configs.paged_tpu_vmem`): on issue 41's decode shape the
    largest block of each cache format's space compiles with the real compiler (the
    ones past it do not fit: `benchmarks/results/tpu_compile_paged_attention_cpu.json`)."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    quant = {"bf16": None, "int8": KVQuant("int8"), "int4": KVQuant("int4"),
             "int4_groups": KVQuant("int4", group_size=32),
             "int4_token_groups": KVQuant("int4", group_axis="token", group_size=16),
             "int2_groups": KVQuant("int2", group_size=32)}[name]
    args = _decode_call(16, quant=quant)
    with lowering_target(generation):
        space = configs.paged_tpu_space(paged_attention_op.check(*args))
    result = compile_config(paged_attention_op, "mosaic_tpu", args, generation=generation,
                            config=max(space, key=lambda c: c.pages_per_block))
    assert result.ok, result.describe()


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_formats_compile(generation, name):
    """The heuristic config of every quantized format compiles with the real compiler."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    args = ragged_inputs(8, q_lens=[1, 9, 24], kv_lens=[17, 9, 60], page_size=16, kv_heads=2, q_heads=8,
                         head_dim=128, dtype=jnp.bfloat16, quant=FORMATS[name])
    result = compile_config(ragged_paged_attention_op, "mosaic_tpu", args, generation=generation)
    assert result.ok, result.describe()


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
def test_folded_fp8_decode_compiles(generation):
    """Issue 41's decode shape (8 kv heads, pages of 64) with an fp8 cache, whose scales fold and
    whose codes are read as e4m3b11fnuz (`mosaic_tpu_pages.B11_SCALE`), compiles with the real
    compiler for every generation."""
    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import source_meta
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    args = _decode_call(64, batch=4, context=2048, quant=KVQuant("fp8"))
    assert source_meta(as_source(args[1])).b11
    result = compile_config(paged_attention_op, "mosaic_tpu", args, generation=generation)
    assert result.ok, result.describe()


@pytest.mark.tpu
def test_folded_fp8_pool_is_not_copied_around_the_kernel():
    """The e4m3 -> e4m3b11fnuz bitcast happens in VMEM: the compiled v5e program has no
    ``bitcast-convert`` (done in XLA it compiled to one over each whole pool, a copy per call:
    measured on a v5e, the fp8 cache fell to 0.56x the bf16 cache's throughput)."""
    from stellax.testing.tpu_compile import LOWERING_TARGETS, libtpu_available, lower_config, topology_device

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    args = _decode_call(64, batch=4, context=2048, quant=KVQuant("fp8"))
    texts = [m.compile().as_text() for m in lower_config(paged_attention_op, "mosaic_tpu", args, {}, config=None,
                                                         platform="tpu", grad=False, target=LOWERING_TARGETS["v5e"],
                                                         device=topology_device("v5e"))]
    assert texts and all("custom-call" in t for t in texts)
    assert not any("bitcast-convert(" in t for t in texts)


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("page_size", [64, 128])
def test_int4_word_path_decode_compiles(generation, page_size):
    """Issue 41's decode shape with a (folded) int4 cache takes the word path
    (`mosaic_tpu_pages.word_codes`: the uint4 slot bitcast to int32 words, bfloat16 keys and
    values built from two nibbles) and compiles with the real compiler for every generation."""
    from stellax.ops.paged_attention.cache import as_source
    from stellax.ops.paged_attention.mosaic_tpu_pages import word_codes
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    args = _decode_call(page_size, batch=4, context=2048, quant=KVQuant("int4"))
    assert word_codes(as_source(args[1]))
    result = compile_config(paged_attention_op, "mosaic_tpu", args, generation=generation)
    assert result.ok, result.describe()


# -- the float32 precision contract (docs/precision.md) --------------------------------------------
def test_paged_decode_float32_precision_default_is_bf16_like_high_is_float32_accurate():
    """Interpreted, ``'default'`` is one bfloat16 pass per matmul (bf16-like error
    against the golden), ``'high'`` three (float32-accurate)."""
    from stellax.testing.numerics import compare, golden

    q, k, v, t, lengths = paged_inputs(35, lengths=[13, 29], page_size=8, kv_heads=1, q_heads=2, head_dim=32,
                                       dtype=jnp.float32)
    ref = golden(lambda *a: _golden(paged_attention_op, *a), q, k, v, t, lengths)
    errors = {p: compare(_interpreted(paged_attention, q, k, v, t, lengths, precision=p,
                                      config=TpuPagedConfig(pages_per_block=2)), ref).rel_l2
              for p in ("default", "high")}
    assert 1e-4 < errors["default"] < 3e-2, errors
    assert errors["high"] < 1e-4, errors
