"""Garbage in the unused slots of a paged cache never reaches the output.

A freshly allocated or recycled page can hold anything. Every slot that no
live position of any sequence maps to (the tail of a sequence's last page,
whole free pages, the pages block-table entries past a sequence's live pages
point at) is filled with NaN, +-inf and huge finite values (codes: random
bytes; scales and zero points of groups with no live token: NaN / huge), and
the outputs must equal the outputs on the clean (zero-filled) cache bit for
bit: the masked positions are excluded (selected away), not multiplied by a
zero probability (0 * NaN = NaN).

Every kernel path of the XLA and (interpreted) Triton and Mosaic TPU implementations:
finalized single split and merged splits, several pages per step, dense f32 /
bf16, combined kv_pages, every quantization layout (per-token column scales,
head-dim groups, token groups, rotation, full-precision windows), multi-token
queries with a local window, soft cap and sinks, ragged batches with dead
sequences and padding tokens, and MLA. The whole autotuning space of each
op runs under ``slow``. The Mosaic TPU kernels add their own edge: the last
block of a program copies only the pages below its key range, so the rest of
its VMEM slot holds an earlier block's pages (or, interpreted, NaN), which
must be selected away like the garbage.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.paged_attention import (
    KVQuant, MlaConfig, PagedConfig, QuantizedPages, RaggedConfig, mla_decode, paged_attention,
    ragged_paged_attention,
)
from stellax.ops.paged_attention.configs import TpuMlaConfig, TpuPagedConfig, TpuRaggedConfig
from stellax.ops.paged_attention import mla_inputs, paged_inputs, ragged_inputs

QUANTS = [None, KVQuant("int8"), KVQuant("fp8"), KVQuant("int4", group_size=32),
          KVQuant("int2", group_size=32, rotation=True), KVQuant("int4", group_axis="token", group_size=8),
          KVQuant("int4", group_size=32, sink_tokens=4, recent_tokens=8, rotation=True)]


def _qid(spec):
    return "dense" if spec is None else f"{spec.format}-{spec.group_axis}-rot{int(spec.rotation)}-w{spec.window}"


# -- which slots are live ---------------------------------------------------------------
def live_slots(tables, lengths, num_pages: int, page_size: int, rows=None) -> np.ndarray:
    """bool ``[num_pages, page_size]``: slots some live position maps to."""
    tables, lengths = np.asarray(tables), np.asarray(lengths)
    rows = range(tables.shape[0]) if rows is None else rows
    live = np.zeros((num_pages, page_size), bool)
    for b in rows:
        for p in range(int(lengths[b])):
            live[tables[b, p // page_size], p % page_size] = True
    return live


def _garbage(shape, dtype, rng) -> np.ndarray:
    """NaN, +-inf and huge finite values (floats) or random bytes (codes)."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):                 # uint4 codes too (int4 pools)
        info = jnp.iinfo(dtype)
        return rng.integers(int(info.min), int(info.max), size=shape, endpoint=True).astype(dtype)
    finfo = jnp.finfo(dtype)
    choices = np.array([np.nan, np.inf, -np.inf, float(finfo.max), -float(finfo.max), 1e30], np.float64)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize == 1:  # fp8 codes: no inf
        choices = np.array([np.nan, float(finfo.max), -float(finfo.max)], np.float64)
    picked = choices[rng.integers(0, len(choices), size=shape)]
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(jnp.asarray(picked.astype(np.float32)).astype(dtype))


def _fill(array, unused: np.ndarray, rng, value=None):
    """``array [NP, PS_or_groups, ...]`` with the positions ``unused [NP, X]`` replaced."""
    a = np.array(array)
    sel = np.broadcast_to(unused.reshape(unused.shape + (1,) * (a.ndim - 2)), a.shape)
    fill = _garbage(a.shape, a.dtype, rng) if value is None else np.full(a.shape, value, a.dtype)
    return jnp.asarray(np.where(sel, fill, a))


def _token_groups(unused: np.ndarray, g: int) -> np.ndarray:
    num_pages, page_size = unused.shape
    return unused.reshape(num_pages, page_size // g, g).all(axis=-1)


def dirty(pool, live: np.ndarray, rng, *, clean: bool = False):
    """The pool with every unused slot filled with garbage (``clean``: zeros)."""
    unused = ~live
    value = 0 if clean else None
    if pool is None:
        return None
    if not isinstance(pool, QuantizedPages):
        return _fill(pool, unused, rng, value)
    spec = pool.spec
    data = _fill(pool.data, unused, rng, value)
    if spec.group_axis == "token":
        group_unused = _token_groups(unused, spec.group(pool.head_dim))
    else:
        group_unused = unused
    scale = _fill(pool.scale, group_unused, rng, value)
    zero = None if pool.zero is None else _fill(pool.zero, group_unused, rng, value)
    return dataclasses.replace(pool, data=data, scale=scale, zero=zero)


def _combined(k, v):
    return jnp.stack([k, v], axis=2)


# -- cases ----------------------------------------------------------------------------------
def _run(fn, impl, *args, **kw):
    with stellax.interpret_mode(impl in ("triton", "mosaic_tpu")):
        return np.asarray(fn(*args, implementation=impl, **kw).astype(jnp.float32))


def _assert_bitwise(clean, dirty_out):
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(dirty_out.view(np.uint32), clean.view(np.uint32))


def check_paged(impl, config, *, spec=None, dtype=jnp.float32, q_tokens=None, combined=False, seed=0, kv_heads=2,
                q_heads=4, page_size=16, head_dim=32, lengths=(0, 5, 16, 37), **kw):
    q, k, v, t, l = paged_inputs(seed, lengths=list(lengths), page_size=page_size, kv_heads=kv_heads,
                                 q_heads=q_heads, head_dim=head_dim, dtype=dtype, q_tokens=q_tokens, max_pages=3,
                                 quant=spec,
                                 value_quant=None if spec is None else dataclasses.replace(spec))
    live = live_slots(t, l, k.shape[0], k.shape[1])
    rng = np.random.default_rng(seed)
    outs = []
    for clean in (True, False):
        kd, vd = dirty(k, live, rng, clean=clean), dirty(v, live, rng, clean=clean)
        args = (q, _combined(kd, vd), None) if combined else (q, kd, vd)
        outs.append(_run(paged_attention, impl, *args, t, l, config=config, **kw))
    _assert_bitwise(*outs)


def check_ragged(impl, config, *, spec=None, seed=1):
    q, k, v, kv, t, cu, n = ragged_inputs(seed, q_lens=[1, 7, 3], kv_lens=[20, 7, 40], page_size=16,
                                          kv_heads=2, q_heads=4, head_dim=32, dtype=jnp.float32,
                                          padding_seqs=1, padding_tokens=3, quant=spec)
    live = live_slots(t, kv, k.shape[0], k.shape[1], rows=range(int(n[0])))
    rng = np.random.default_rng(seed)
    outs = [_run(ragged_paged_attention, impl, q, dirty(k, live, rng, clean=c), dirty(v, live, rng, clean=c),
                 kv, t, cu, n, config=config, sinks=jnp.linspace(-1.0, 1.0, 4)) for c in (True, False)]
    _assert_bitwise(*outs)


def check_mla(impl, config, *, spec=None, q_tokens=None, seed=2):
    qn, qp, lat, pe, t, l = mla_inputs(seed, lengths=[3, 0, 33], page_size=16, heads=8, latent_dim=32,
                                       rope_dim=16, dtype=jnp.float32, q_tokens=q_tokens, quant=spec)
    live = live_slots(t, l, lat.shape[0], lat.shape[1])
    rng = np.random.default_rng(seed)
    outs = [_run(mla_decode, impl, qn, qp, dirty(lat, live, rng, clean=c), dirty(pe, live, rng, clean=c), t, l,
                 config=config, scale=0.1) for c in (True, False)]
    _assert_bitwise(*outs)


EXTRAS = dict(sinks=jnp.linspace(-1.0, 1.0, 4), logits_soft_cap=20.0, local_window_size=9)


# -- default tier: the main kernel paths once; the other combinations under slow -----------------
SLOW = pytest.mark.slow
#: Quantization layouts run by default per implementation (the rest: slow).
FAST_XLA = {"dense"}
FAST_TRITON = {"int8-head_dim-rot0-w0", "int4-token-rot0-w0", "int4-head_dim-rot1-w12"}
#: Mosaic TPU by default: dense (the unmasked/masked block split, a skipped
#: tail page, an empty program between live ones) and full-precision windows
#: (the key range ends before kv_len, so pages below kv_len go uncopied).
FAST_MOSAIC = {"dense", "int4-head_dim-rot1-w12"}


def _specs(fast):
    return [pytest.param(s, id=_qid(s), marks=() if _qid(s) in fast else SLOW) for s in QUANTS]


@pytest.mark.parametrize("spec", _specs(FAST_XLA))
def test_paged_xla_garbage_is_excluded(spec):
    check_paged("xla", None, spec=spec, q_tokens=2, **EXTRAS)


@pytest.mark.parametrize("spec", _specs(FAST_TRITON))
def test_paged_triton_garbage_is_excluded(spec):
    check_paged("triton", PagedConfig(pages_per_block=2, num_splits=2), spec=spec, q_tokens=2, **EXTRAS)


@pytest.mark.parametrize("spec", _specs(FAST_MOSAIC))
def test_paged_mosaic_tpu_garbage_is_excluded(spec):
    check_paged("mosaic_tpu", TpuPagedConfig(pages_per_block=2), spec=spec, q_tokens=2, **EXTRAS)


@pytest.mark.parametrize("spec", [KVQuant("int8"), KVQuant("fp8"), pytest.param(KVQuant("int4", group_size=32),
                                                                                  marks=SLOW)], ids=_qid)
def test_paged_mosaic_tpu_folded_scales_garbage_is_excluded(spec):
    """8 kv heads of pages of 16: one scale per token and head, 128 per page, so the
    Mosaic kernel applies them to the logits and probabilities (`configs.folds_scales`;
    int4 with a whole-head group adds zero points) instead of dequantizing."""
    check_paged("mosaic_tpu", TpuPagedConfig(pages_per_block=2), spec=spec, q_tokens=2, kv_heads=8, q_heads=16,
                **{**EXTRAS, "sinks": jnp.linspace(-1.0, 1.0, 16)})


def test_paged_mosaic_tpu_int4_word_path_garbage_is_excluded():
    """Folded int4 pools of 8 kv heads, H = 128, pages of 64 (`mosaic_tpu_pages.word_codes`):
    NaN / huge scales and zero points and random codes in the unused slots and pages, the last
    block's uncopied page included, leave the output bit for bit unchanged."""
    check_paged("mosaic_tpu", TpuPagedConfig(pages_per_block=2), spec=KVQuant("int4"), dtype=jnp.bfloat16,
                q_tokens=2, kv_heads=8, q_heads=16, page_size=64, head_dim=128, lengths=(0, 5, 64, 130),
                **{**EXTRAS, "sinks": jnp.linspace(-1.0, 1.0, 16)})


@SLOW
def test_paged_mosaic_tpu_bf16_and_combined():
    check_paged("mosaic_tpu", TpuPagedConfig(pages_per_block=2), dtype=jnp.bfloat16)
    check_paged("mosaic_tpu", TpuPagedConfig(pages_per_block=4), combined=True, q_tokens=3, **EXTRAS)


@pytest.mark.parametrize("config", [pytest.param(PagedConfig(pages_per_block=1, num_splits=1), marks=SLOW),
                                    pytest.param(PagedConfig(pages_per_block=4, num_splits=1), marks=SLOW)], ids=str)
def test_paged_triton_finalized_dense_bf16_and_combined(config):
    check_paged("triton", config, dtype=jnp.bfloat16)
    check_paged("triton", config, combined=True, q_tokens=3, **EXTRAS)


@SLOW
def test_paged_xla_bf16_and_combined():
    check_paged("xla", None, dtype=jnp.bfloat16)
    check_paged("xla", None, combined=True, q_tokens=3, **EXTRAS)


@pytest.mark.parametrize("impl,config", [pytest.param("xla", None, marks=SLOW),
                                         ("triton", RaggedConfig(block_q=4, pages_per_block=1, num_splits=2)),
                                         pytest.param("mosaic_tpu", TpuRaggedConfig(block_q=4, pages_per_block=2),
                                                      marks=SLOW)])
@pytest.mark.parametrize("spec", [None, pytest.param(KVQuant("int4", group_size=32, rotation=True), marks=SLOW)],
                         ids=_qid)
def test_ragged_garbage_is_excluded(impl, config, spec):
    check_ragged(impl, config, spec=spec)


@pytest.mark.parametrize("impl,config,spec,q_tokens", [
    pytest.param("xla", None, None, None, marks=SLOW),
    ("triton", MlaConfig(pages_per_block=1, num_splits=2), KVQuant("int8"), 2),
    pytest.param("xla", None, KVQuant("int8"), 2, marks=SLOW),
    pytest.param("triton", MlaConfig(pages_per_block=2, num_splits=1), None, None, marks=SLOW),
    pytest.param("mosaic_tpu", TpuMlaConfig(pages_per_block=2), KVQuant("int8"), 2, marks=SLOW)], ids=str)
def test_mla_garbage_is_excluded(impl, config, spec, q_tokens):
    check_mla(impl, config, spec=spec, q_tokens=q_tokens)


def test_garbage_really_is_garbage():
    """The helper fills what it claims: every unused slot non-finite or huge, every live slot untouched."""
    q, k, v, t, l = paged_inputs(0, lengths=[5, 16], page_size=16, kv_heads=1, q_heads=1, head_dim=16,
                                 dtype=jnp.float32, max_pages=3)
    live = live_slots(t, l, k.shape[0], 16)
    assert live.sum() == 21 and (~live).sum() == k.shape[0] * 16 - 21
    d = np.asarray(dirty(k, live, np.random.default_rng(0)))
    assert (~np.isfinite(d[~live]) | (np.abs(d[~live]) >= 1e30)).all()
    np.testing.assert_array_equal(d[live], np.asarray(k)[live])


# -- slow: every config of each autotuning space ------------------------------------------------
def _space(config_type, **fixed):
    fields = dict(pages_per_block=(1, 2, 4), num_splits=(1, 2, 4))
    fields.update(fixed)
    for values in itertools.product(*fields.values()):
        yield config_type(**dict(zip(fields, values)))


@pytest.mark.slow
@pytest.mark.parametrize("config", list(_space(PagedConfig)), ids=str)
@pytest.mark.parametrize("spec", QUANTS, ids=_qid)
def test_paged_every_config_slow(config, spec):
    check_paged("triton", config, spec=spec, q_tokens=2, **EXTRAS)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(_space(RaggedConfig, block_q=(1, 4, 16))), ids=str)
def test_ragged_every_config_slow(config):
    check_ragged("triton", config)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(_space(MlaConfig)), ids=str)
def test_mla_every_config_slow(config):
    check_mla("triton", config, q_tokens=2)
