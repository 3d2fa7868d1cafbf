"""The bad-data cases of issue 43 for the Mosaic TPU kernels: each case runs an op with
``implementation="mosaic_tpu"`` under ``jax.jit`` on invalid metadata and asserts the documented
result — NaN in exactly the affected rows (every other row bitwise what the same kernel gives on
valid metadata, and close to the ``xla`` implementation), NaN everywhere for a bad group offset, the
last write of a repeated cache slot — and, in checked mode (`stellax.checked`), that
``checkify`` reports the failed check naming the argument and the bad value.

Run natively on a TPU by `test_tpu_hardware_bad_data.py` (hardware tier) and interpreted on the CPU
by `test_tpu_hardware_bad_data_interpreted.py` (default tier): the same functions, the same code
path (``implementation="mosaic_tpu"``), only the interpret switch differs. Shapes follow the ops'
built-in examples that the hardware tier already runs on the chip.
"""

from __future__ import annotations

import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

import stellax
from stellax.ops.paged_attention import mla_inputs, paged_inputs, ragged_inputs

IMPL = "mosaic_tpu"
F32 = jnp.float32


def _nan_rows(out, axis_rows=0) -> list[int]:
    """Indices along ``axis_rows`` whose every element is NaN; a row partly NaN fails."""
    out = np.moveaxis(np.asarray(out, np.float32), axis_rows, 0).reshape(np.shape(out)[axis_rows], -1)
    full, some = np.isnan(out).all(axis=1), np.isnan(out).any(axis=1)
    assert (full == some).all(), f"rows {np.nonzero(some & ~full)[0].tolist()} are partly NaN"
    return np.nonzero(full)[0].tolist()


def _same_rows(got, want, keep, what: str) -> None:
    """Rows ``keep`` of ``got`` bitwise equal to ``want``'s (the kernel on valid metadata)."""
    np.testing.assert_array_equal(np.asarray(got, np.float32)[keep], np.asarray(want, np.float32)[keep],
                                  err_msg=f"{what}: the rows with valid metadata changed")


def _close(got, want, keep, what: str, tol: float = 2e-2) -> None:
    """Rows ``keep`` close to the ``xla`` implementation (a sanity check of the rows themselves; the
    tolerance covers a TPU's default float32 matmul precision)."""
    np.testing.assert_allclose(np.asarray(got, np.float32)[keep], np.asarray(want, np.float32)[keep], rtol=tol,
                               atol=tol, err_msg=what)


def _checked_error(f: Callable, *args) -> str | None:
    """``checkify`` of ``jax.jit(f)`` traced inside a `stellax.checked` block: the failed check's message."""
    with stellax.checked():
        err, _ = checkify.checkify(jax.jit(f))(*args)
    return err.get()


def _expect_message(message: str | None, pattern: str, what: str) -> None:
    assert message is not None and re.search(pattern, message), f"{what}: expected /{pattern}/, got {message!r}"


# -- paged attention -----------------------------------------------------------------------------
def paged_attention_bad_lengths_and_tables(impl: str = IMPL) -> None:
    q, kp, vp, tables, lengths = paged_inputs(0, lengths=[5, 37, 9, 16], page_size=16, kv_heads=2, q_heads=8,
                                              head_dim=64, dtype=F32)
    run = lambda impl: jax.jit(lambda t, l: stellax.paged_attention(q, kp, vp, t, l, implementation=impl))
    good = run(impl)(tables, lengths)
    assert _nan_rows(good) == []
    bad_t, bad_l = tables.at[2, 0].set(kp.shape[0] + 3), lengths.at[0].set(-4).at[3].set(10**6)
    out = run(impl)(bad_t, bad_l)
    assert _nan_rows(out) == [0, 2, 3], _nan_rows(out)
    _same_rows(out, good, [1], "paged_attention")
    _close(out, run("xla")(bad_t, bad_l), [1], "paged_attention vs xla")
    f = lambda t, l: stellax.paged_attention(q, kp, vp, t, l, implementation=impl)
    _expect_message(_checked_error(f, tables, lengths.at[1].set(99)),
                    r"lengths: expected values in \[0, 48\].*got lengths\[1\] = 99", "paged_attention checked")
    _expect_message(_checked_error(f, bad_t, lengths), rf"block_tables\[2, 0\] = {kp.shape[0] + 3}",
                    "paged_attention checked")
    assert _checked_error(f, tables, lengths) is None


def ragged_paged_attention_bad_offsets(impl: str = IMPL) -> None:
    q, kp, vp, kv_lens, tables, cu, num = ragged_inputs(0, q_lens=[1, 5, 1, 12], kv_lens=[9, 5, 33, 40],
                                                        page_size=16, kv_heads=2, q_heads=4, head_dim=64, dtype=F32,
                                                        padding_seqs=2, padding_tokens=3)
    # cu = [0, 1, 6, 7, 19, 22?...]: 19 live tokens, then padding
    run = lambda impl: jax.jit(lambda k, c: stellax.ragged_paged_attention(q, kp, vp, k, tables, c, num,
                                                                            implementation=impl))
    good = run(impl)(kv_lens, cu)
    assert _nan_rows(good) == []
    starts = np.asarray(cu).tolist()
    out = run(impl)(kv_lens.at[1].set(3), cu)                      # sequence 1: 5 new tokens, kv_len 3
    want_nan = list(range(starts[1], starts[2]))
    assert _nan_rows(out) == want_nan, (_nan_rows(out), want_nan)
    keep = [t for t in range(q.shape[0]) if t not in want_nan]
    _same_rows(out, good, keep, "ragged_paged_attention (kv_lens)")
    _close(out, run("xla")(kv_lens.at[1].set(3), cu), keep, "ragged_paged_attention vs xla")
    bad_cu = cu.at[3].set(starts[2] - 1)                           # below cu_q_lens[2]
    out = run(impl)(kv_lens, bad_cu)
    want_nan = list(range(starts[2], q.shape[0]))
    assert _nan_rows(out) == want_nan, (_nan_rows(out), want_nan)
    _same_rows(out, good, list(range(starts[2])), "ragged_paged_attention (cu_q_lens)")
    f = lambda k, c: stellax.ragged_paged_attention(q, kp, vp, k, tables, c, num, implementation=impl)
    _expect_message(_checked_error(f, kv_lens, bad_cu), r"cu_q_lens\[3\] = \d+ below", "ragged checked")
    _expect_message(_checked_error(f, kv_lens.at[1].set(3), cu), r"sequence 1 with 5 new tokens and kv_lens = 3",
                    "ragged checked")
    assert _checked_error(f, kv_lens, cu) is None


def mla_decode_bad_length(impl: str = IMPL) -> None:
    qn, qp, lat, pe, tables, lengths = mla_inputs(0, lengths=[1, 20, 64], page_size=16, heads=16, latent_dim=128,
                                                  rope_dim=32, dtype=F32)
    run = lambda impl: jax.jit(lambda l: stellax.mla_decode(qn, qp, lat, pe, tables, l, scale=0.1,
                                                            implementation=impl))
    good = run(impl)(lengths)
    out = run(impl)(lengths.at[1].set(65))
    assert _nan_rows(out) == [1]
    _same_rows(out, good, [0, 2], "mla_decode")
    _close(out, run("xla")(lengths.at[1].set(65)), [0, 2], "mla_decode vs xla")
    f = lambda l: stellax.mla_decode(qn, qp, lat, pe, tables, l, scale=0.1, implementation=impl)
    _expect_message(_checked_error(f, lengths.at[1].set(65)), r"lengths\[1\] = 65", "mla_decode checked")


# -- grouped matmuls -----------------------------------------------------------------------------
def _moe_inputs():
    k1, k2 = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(k1, (256, 128), F32)
    rhs = jax.random.normal(k2, (2, 128, 128), F32) / 8
    return lhs, rhs, jnp.array([64, 96, 32, 64], jnp.int32)


def _numpy_local_groups(lhs, rhs, sizes, offset):
    lhs, rhs, sizes = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64), np.asarray(sizes)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    ends = np.cumsum(sizes)
    for g in range(rhs.shape[0]):
        lo, hi = ends[offset + g] - sizes[offset + g], ends[offset + g]
        out[lo:hi] = lhs[lo:hi] @ rhs[g]
    return out


def ragged_dot_bad_group_offset(impl: str = IMPL) -> None:
    lhs, rhs, sizes = _moe_inputs()
    f = jax.jit(lambda o: stellax.ragged_dot(lhs, rhs, sizes, precision="highest", group_offset=o,
                                             implementation=impl))
    for bad in (-1, 3, 100):
        assert bool(jnp.all(jnp.isnan(f(jnp.int32(bad))))), bad
    good = f(jnp.int32(1))
    np.testing.assert_allclose(np.asarray(good), _numpy_local_groups(lhs, rhs, sizes, 1), rtol=1e-3, atol=1e-3)
    tgmm = jax.jit(lambda o: stellax.ragged_dot_tgmm(lhs.T, lhs[:, :128], sizes, group_offset=o,
                                                     num_local_groups=2, implementation=impl))
    assert bool(jnp.all(jnp.isnan(tgmm(jnp.int32(-1))))) and bool(jnp.all(jnp.isfinite(tgmm(jnp.int32(2)))))
    _expect_message(_checked_error(lambda o: stellax.ragged_dot(lhs, rhs, sizes, group_offset=o, implementation=impl),
                                   jnp.int32(-1)),
                    r"group_offset: expected a value in \[0, 2\].*got -1", "ragged_dot checked")
    _expect_message(_checked_error(lambda s: stellax.ragged_dot(lhs, rhs, s, group_offset=0, implementation=impl),
                                   sizes.at[1].set(-2)),
                    r"group_sizes: expected non-negative sizes, got -2 at index 1", "ragged_dot checked")


def quantized_ragged_dot_bad_group_offset(impl: str = IMPL) -> None:
    lhs, rhs, sizes = _moe_inputs()
    w = stellax.quantize(rhs, "int8", axis=1, block_size=128)
    f = jax.jit(lambda o: stellax.ragged_dot(lhs, w, sizes, group_offset=o, implementation=impl))
    assert bool(jnp.all(jnp.isnan(f(jnp.int32(-1)))))
    good = f(jnp.int32(1))
    want = _numpy_local_groups(lhs, stellax.dequantize(w, F32), sizes, 1)
    np.testing.assert_allclose(np.asarray(good), want, rtol=3e-2, atol=3e-2)


# -- linear attention ----------------------------------------------------------------------------
def _linear_inputs(per_channel: bool, t: int = 40):
    rng = np.random.default_rng(0)
    b, h, d = 2, 2, 64
    f = lambda *s: jnp.asarray(rng.standard_normal(s), F32)
    q, k, v = f(b, t, h, d), f(b, t, h, d) / 8, f(b, t, h, d)
    g = -jnp.asarray(rng.random((b, t, h) + ((d,) if per_channel else ())), F32)
    beta = jnp.asarray(rng.random((b, t, h)), F32)
    return q, k, v, g, beta


def _positive_decay(op, per_channel: bool, impl: str) -> None:
    q, k, v, g, beta = _linear_inputs(per_channel)
    run = lambda impl: jax.jit(lambda g: op(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True,
                                            implementation=impl))
    o_good, s_good = run(impl)(g)
    bad = g.at[1, 4, 0].set(30.0)
    o, s = run(impl)(bad)
    nan = np.isnan(np.asarray(o)).all(axis=-1)          # [B, T, H]
    want = np.zeros(nan.shape, bool)
    want[1, :, 0] = True
    np.testing.assert_array_equal(nan, want)
    assert not np.isnan(np.asarray(o)[~want]).any()
    np.testing.assert_array_equal(np.isnan(np.asarray(s)).all(axis=(2, 3)), want[:, 0])
    np.testing.assert_array_equal(np.asarray(o)[~want], np.asarray(o_good)[~want])
    np.testing.assert_array_equal(np.asarray(s)[~want[:, 0]], np.asarray(s_good)[~want[:, 0]])
    o_xla, _ = run("xla")(bad)
    np.testing.assert_allclose(np.asarray(o)[~want], np.asarray(o_xla)[~want], rtol=3e-2, atol=3e-2)
    f = lambda g: op(q, k, v, g, beta, use_qk_l2norm=True, implementation=impl)
    _expect_message(_checked_error(f, bad), r"g: expected a log-space decay <= 0.*largest value of 30.0",
                    f"{op.__name__} checked")
    assert _checked_error(f, g) is None


def chunk_gated_delta_rule_positive_decay(impl: str = IMPL) -> None:
    _positive_decay(stellax.chunk_gated_delta_rule, False, impl)


def chunk_kda_positive_decay(impl: str = IMPL) -> None:
    _positive_decay(stellax.chunk_kda, True, impl)


def fused_recurrent_gated_delta_rule_positive_decay(impl: str = IMPL) -> None:
    _positive_decay(stellax.fused_recurrent_gated_delta_rule, False, impl)


def fused_recurrent_kda_positive_decay(impl: str = IMPL) -> None:
    _positive_decay(stellax.fused_recurrent_kda, True, impl)


def chunk_gated_delta_rule_bad_cu_seqlens(impl: str = IMPL) -> None:
    q, k, v, g, beta = (a[:1] for a in _linear_inputs(False))
    f = jax.jit(lambda cu: stellax.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True,
                                                          implementation=impl))
    o, s = f(jnp.array([0, 12, 12, 40], jnp.int32))
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    o, s = f(jnp.array([0, 30, 12, 40], jnp.int32))
    assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(s)).all()


# -- varlen attention ----------------------------------------------------------------------------
def varlen_attention_bad_cu_seqlens(impl: str = IMPL) -> None:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((96, 4, 64)), F32)
    k = jnp.asarray(rng.standard_normal((96, 2, 64)), F32)
    good_cu = jnp.array([0, 40, 96], jnp.int32)
    run = lambda impl: jax.jit(lambda cq, ck: stellax.dot_product_attention_varlen(
        q, k, k, cq, ck, 64, 64, is_causal=True, implementation=impl))
    good = run(impl)(good_cu, good_cu)
    assert _nan_rows(good) == []
    bad_cu = jnp.array([0, 40, 97], jnp.int32)                     # past q.shape[0]
    out = run(impl)(bad_cu, good_cu)
    assert _nan_rows(out) == list(range(40, 96)), _nan_rows(out)
    _same_rows(out, good, list(range(40)), "varlen attention")
    _close(out, run("xla")(bad_cu, good_cu), list(range(40)), "varlen attention vs xla")
    f = lambda cq: stellax.dot_product_attention_varlen(q, k, k, cq, good_cu, 64, 64, implementation=impl)
    _expect_message(_checked_error(f, bad_cu), r"cu_seqlens_q\[-1\]: expected <= 96 \(q.shape\[0\]\), got 97",
                    "varlen checked")


# -- the paged cache write on the device (an XLA scatter on every backend) -----------------------
def update_kv_cache_repeated_slots(impl: str = IMPL) -> None:
    """The last write of a repeated slot wins on the device too (XLA leaves the order of repeated
    scatter indices unspecified; the op hands it unique rows). ``impl`` is unused: there is no kernel."""
    del impl
    rng = np.random.default_rng(0)
    kp, vp = stellax.init_kv_cache(8, 16, 2, 128, dtype=F32)
    slots = rng.integers(-1, 96, size=512).astype(np.int32)       # 96 slots written ~5 times each
    new = jnp.asarray(rng.standard_normal((512, 2, 128)), F32)
    k2, _ = jax.jit(stellax.update_kv_cache)(kp, vp, new, new, jnp.asarray(slots))
    flat = np.zeros((8 * 16, 2, 128), np.float32)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            flat[slot] = np.asarray(new[t])
    np.testing.assert_array_equal(np.asarray(k2).reshape(8 * 16, 2, 128), flat)


#: name -> case(impl); every case runs the ``mosaic_tpu`` implementation unless said otherwise.
CASES: dict[str, Callable[[str], None]] = {f.__name__: f for f in (
    paged_attention_bad_lengths_and_tables, ragged_paged_attention_bad_offsets, mla_decode_bad_length,
    ragged_dot_bad_group_offset, quantized_ragged_dot_bad_group_offset, chunk_gated_delta_rule_positive_decay,
    chunk_kda_positive_decay, fused_recurrent_gated_delta_rule_positive_decay, fused_recurrent_kda_positive_decay,
    chunk_gated_delta_rule_bad_cu_seqlens, varlen_attention_bad_cu_seqlens, update_kv_cache_repeated_slots,
)}
