"""The vLLM backend's pure logic, without vLLM: option refusals, the version
range, the step metadata, the zero-copy cache view, and one mixed
prefill/decode step through the same path the backend runs (cache write in
place, then `stellax.torch.ragged_paged_attention` over the view) against a
float64 reference. vLLM's engine itself: tests/integrations/test_vllm_e2e.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stellax.integrations.vllm import fp8, support  # noqa: E402
from stellax.integrations.vllm.metadata import bucket, build_metadata, paged_kv_view  # noqa: E402


# -- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.32.0", "0.32.7.dev2+gabc", "0.32"])
def test_supported_versions(version):
    support.check_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0"])
def test_versions_outside_the_range_are_refused(version):
    with pytest.raises(support.UnsupportedByStellax, match=r"vllm version: .*>=0\.32\.0,<0\.33\.0.*" + version):
        support.check_version(version)


def test_unparsable_version():
    with pytest.raises(support.UnsupportedByStellax, match="vllm version"):
        support.check_version("dev")


# vLLM 0.32's other CacheDType values, each refused with its reason.
@pytest.mark.parametrize("dtype, why", [
    ("int8_per_token_head", "scale inline"), ("fp8_per_token_head", "scale inline"),
    ("int4_per_token_head", "scale inline"), ("nvfp4", "NVFP4"), ("nvfp4_4over6", "NVFP4"),
    ("turboquant_k8v4", "TurboQuant"), ("ultraquant_4bit", "UltraQuant"), ("fp8_ds_mla", "MLA"),
    ("fp8_inc", "Gaudi"), ("int8", "in place"),
])
def test_other_quantized_cache_dtypes_are_refused_naming_the_option(dtype, why):
    with pytest.raises(support.UnsupportedByStellax, match=f"^kv_cache_dtype: .*got '{dtype}' .*{why}"):
        support.check_kv_cache_dtype(dtype)


@pytest.mark.parametrize("dtype", support.KV_CACHE_DTYPES)
def test_dense_and_fp8_cache_dtypes_pass(dtype):
    support.check_kv_cache_dtype(dtype)


# -- vLLM's fp8 codes -----------------------------------------------------------------------
def _truncating_reference(x, scale, dtype):
    """The float8 value of largest magnitude not above |x / scale| (same sign), clamped to the
    largest finite value: built from the format's 256 codes, independently of `fp8.fp8_codes`."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).float()
    finite = torch.isfinite(values) & (codes < 0x80)           # the non-negative half
    pos_codes, pos_values = codes[finite], values[finite]
    v = x.float() * (torch.tensor(1.0) / torch.tensor(scale, dtype=torch.float32))   # vLLM: x · (1 / scale)
    mag = v.abs().clamp(max=float(pos_values.max()))
    order = pos_values.argsort()
    idx = torch.searchsorted(pos_values[order], mag.contiguous(), right=True) - 1
    byte = pos_codes[order][idx.clamp(min=0)].to(torch.int32)
    byte = torch.where((v < 0) & (byte != 0), byte | 0x80, byte)
    neg_zero = (v < 0) & (byte == 0) & (v != 0)
    return torch.where(neg_zero, torch.full_like(byte, 0x80), byte).to(torch.uint8)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.037, 3.7])
def test_fp8_codes_truncate_like_vllm_cpu(cache_dtype, scale):
    """vLLM's CPU backend truncates the mantissa of x · (1/scale) (csrc/cpu/cpu_attn_fp8.hpp); the exact
    bytes against vLLM's own op are checked in its venv (test_vllm_e2e.py)."""
    torch.manual_seed(0)
    x = torch.randn(4096) * torch.logspace(-10, 6, 4096)
    got = fp8.fp8_codes(x, scale, cache_dtype)
    dtype = fp8.FP8_CACHE_DTYPES[cache_dtype]
    assert got.dtype == torch.uint8
    assert torch.equal(got, _truncating_reference(x, scale, dtype))
    back = fp8.dequantize(got, scale, cache_dtype)
    limit = 448.0 if cache_dtype == "fp8" else 57344.0
    assert bool((back.abs() <= (x.abs().clamp(max=limit * scale) * (1 + 1e-6))).all())   # toward zero
    special = fp8.fp8_codes(torch.tensor([0.0, -0.0, float("nan"), 1e30, -1e30]), 1.0, cache_dtype)
    top = 0x7E if cache_dtype == "fp8" else 0x7B                 # the largest finite code (e4m3fn / e5m2)
    assert special.tolist() == [0, 0, top, top, 0x80 | top]


LAYER = dict(num_heads=8, num_kv_heads=2, head_size=64)


def test_supported_layer_options_pass():
    support.check_layer(**LAYER, sliding_window=128, logits_soft_cap=30.0, extra={"sinks": object()})


@pytest.mark.parametrize("change, option", [
    (dict(alibi_slopes=[0.5] * 8), "alibi_slopes"),
    (dict(attn_type="encoder_only"), "attn_type"),
    (dict(head_size_v=32), "head_size_v"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(kv_sharing_target_layer_name="model.layers.0.attn"), "kv_sharing_target_layer_name"),
    (dict(extra={"use_alibi_sqrt": True}), "use_alibi_sqrt"),
])
def test_unsupported_layer_options_are_refused_naming_the_option(change, option):
    with pytest.raises(support.UnsupportedByStellax, match=f"^{option}: "):
        support.check_layer(**{**LAYER, **change})


def test_window_and_soft_cap_conventions():
    # vLLM's window of w keys includes the query's own position; stellax counts past keys.
    assert support.window_left(16) == 15 and support.window_left(None) is None
    assert support.soft_cap(0) is None and support.soft_cap(None) is None and support.soft_cap(30) == 30.0


# -- metadata ---------------------------------------------------------------------------------
def test_bucket():
    assert [bucket(n, 16) for n in (0, 1, 16, 17, 100)] == [16, 16, 16, 32, 128]


def test_build_metadata_pads_to_buckets():
    qsl = torch.tensor([0, 5, 6, 7], dtype=torch.int32)        # a 5-token prefill and two decodes
    seq_lens = torch.tensor([5, 40, 9], dtype=torch.int32)
    table = torch.arange(3 * 4, dtype=torch.int32).reshape(3, 4)
    slots = torch.arange(7, dtype=torch.int64)
    m = build_metadata(query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                       num_reqs=3, num_actual_tokens=7)
    assert (m.padded_tokens, m.num_reqs) == (16, 3)
    assert m.cu_q_lens.tolist() == [0, 5, 6, 7] + [7] * 5       # S = 8: padding requests own no tokens
    assert m.kv_lens.tolist() == [5, 40, 9] + [0] * 5
    assert m.block_tables.shape == (8, 4) and m.block_tables[:3].tolist() == table.tolist()
    assert not m.block_tables[3:].any()
    assert m.num_seqs.tolist() == [3] and m.slot_mapping.tolist() == list(range(7))
    assert {m.cu_q_lens.dtype, m.kv_lens.dtype, m.block_tables.dtype, m.num_seqs.dtype} == {torch.int32}


def test_build_metadata_checks_its_inputs():
    with pytest.raises(ValueError, match="query_start_loc"):
        build_metadata(query_start_loc=torch.tensor([0, 1]), seq_lens=torch.tensor([1, 1]),
                       block_table=torch.zeros(2, 1, dtype=torch.int32), slot_mapping=torch.zeros(2),
                       num_reqs=2, num_actual_tokens=2)


# -- the cache view ----------------------------------------------------------------------------
def vllm_layer_view(raw, num_blocks, kv_heads, block_size, head_size, layout):
    """vLLM's logical [B, H, N, 2D] view of one layer in a physical layout ("LBNHC": [B, N, H, 2D]; "LBHNC": [B, H, N, 2D])."""
    if layout == "LBNHC":
        return raw.view(num_blocks, block_size, kv_heads, 2 * head_size).permute(0, 2, 1, 3)
    return raw.view(num_blocks, kv_heads, block_size, 2 * head_size)


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_paged_view_shares_memory(layout):
    raw = torch.zeros(6 * 16 * 2 * 2 * 8)
    cache = vllm_layer_view(raw, 6, 2, 16, 8, layout)
    view = paged_kv_view(cache, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    assert view.shape == (6, 16, 2, 2, 8) and view.is_contiguous()
    assert view.data_ptr() == raw.data_ptr()
    view[3, 5, 1, 0, 2] = 7.0                                   # the same bytes
    assert raw.view(6, -1)[3].count_nonzero() == 1


def test_paged_view_refuses_padded_pages():
    raw = torch.zeros(4, 16 * 2 * 16 + 8)                       # 8 values of padding after every page
    cache = raw[:, : 16 * 2 * 16].view(4, 1, 16, 32)
    with pytest.raises(ValueError, match="kv_cache: expected one contiguous run of pages"):
        paged_kv_view(cache, block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)


# -- one step through the backend's path ---------------------------------------------------------
def reference(q, k_seq, v_seq, q_len, scale, window, soft_cap, sinks):
    """float64 causal attention of the last q_len positions of one sequence (GQA by head groups)."""
    t, n, _ = q.shape
    kv_len, kh, _ = k_seq.shape
    g = n // kh
    out = np.zeros(q.shape)
    for i in range(q_len):
        pos = kv_len - q_len + i
        for h in range(n):
            s = k_seq[: pos + 1, h // g] @ q[i, h] * scale
            if soft_cap:
                s = soft_cap * np.tanh(s / soft_cap)
            keys = np.arange(pos + 1)
            if window is not None:
                s = np.where(keys >= pos - window, s, -np.inf)
            m = s.max() if sinks is None else max(s.max(), sinks[h])
            p = np.exp(s - m)
            denom = p.sum() + (0.0 if sinks is None else math.exp(sinks[h] - m))
            out[i, h] = (p / denom) @ v_seq[: pos + 1, h // g]
    return out


def _step(rng, tables, kv_lens, q_lens, slots, n, d):
    """The step's metadata (as the builder makes it from vLLM's fields), random queries ``[T, n, d]`` (float64)
    and the padded float32 query rows passed to stellax."""
    table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.int32)
    for s, row in enumerate(tables):
        table[s, : len(row)] = torch.tensor(row)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    m = build_metadata(query_start_loc=qsl, seq_lens=torch.tensor(kv_lens), block_table=table,
                       slot_mapping=torch.tensor(slots), num_reqs=len(tables), num_actual_tokens=sum(q_lens))
    q = rng.standard_normal((sum(q_lens), n, d))
    qp = torch.zeros(m.padded_tokens, n, d)
    qp[: len(q)] = torch.from_numpy(q).float()
    return m, q, qp


@pytest.mark.parametrize("window, soft_cap, with_sinks", [(None, None, False), (6, 20.0, True)])
def test_mixed_step_matches_reference(window, soft_cap, with_sinks):
    import stellax.torch as st

    rng = np.random.default_rng(0)
    n, kh, d, ps, num_blocks = 4, 2, 16, 16, 12
    raw = torch.zeros(num_blocks * ps * 2 * kh * d)
    pages = paged_kv_view(vllm_layer_view(raw, num_blocks, kh, ps, d, "LBNHC"), block_size=ps, num_kv_heads=kh,
                          head_size=d, dtype=torch.float32)
    # Three requests: a 20-token prefill, a decode at 35 cached tokens, a 7-token chunk at 7..13.
    kv_lens, q_lens = [20, 35, 14], [20, 1, 7]
    tables = [[3, 7], [0, 5, 9], [11]]
    seqs_k = [rng.standard_normal((L, kh, d)) for L in kv_lens]
    seqs_v = [rng.standard_normal((L, kh, d)) for L in kv_lens]
    for s, L in enumerate(kv_lens):                             # what earlier steps wrote
        for p in range(L - q_lens[s]):
            pages[tables[s][p // ps], p % ps, 0] = torch.from_numpy(seqs_k[s][p]).float()
            pages[tables[s][p // ps], p % ps, 1] = torch.from_numpy(seqs_v[s][p]).float()
    new_k = np.concatenate([seqs_k[s][L - q_lens[s]:] for s, L in enumerate(kv_lens)])
    new_v = np.concatenate([seqs_v[s][L - q_lens[s]:] for s, L in enumerate(kv_lens)])
    slots = [tables[s][p // ps] * ps + p % ps for s, L in enumerate(kv_lens) for p in range(L - q_lens[s], L)]
    st.update_kv_cache_(pages[:, :, 0], pages[:, :, 1], torch.from_numpy(new_k).float(),
                        torch.from_numpy(new_v).float(), torch.tensor(slots))   # do_kv_cache_update
    m, q, qp = _step(rng, tables, kv_lens, q_lens, slots, n, d)
    sinks = rng.standard_normal(n) if with_sinks else None
    scale = d ** -0.5
    out = st.ragged_paged_attention(qp, pages, None, m.kv_lens, m.block_tables, m.cu_q_lens, m.num_seqs,
                                    scale=scale, logits_soft_cap=soft_cap, local_window_size=window,
                                    sinks=None if sinks is None else torch.from_numpy(sinks).float())
    assert raw.data_ptr() == pages.data_ptr()
    start = 0
    for s, L in enumerate(kv_lens):
        want = reference(q[start:start + q_lens[s]], seqs_k[s], seqs_v[s], q_lens[s], scale, window, soft_cap,
                         sinks)
        np.testing.assert_allclose(out[start:start + q_lens[s]].numpy(), want, atol=2e-5, rtol=2e-5)
        start += q_lens[s]
    assert not out[start:].any()                                # padding rows are zeros


@pytest.mark.parametrize("cache_dtype, k_scale, v_scale", [("fp8", 0.05, 2.0), ("fp8_e5m2", 1.0, 0.3)])
def test_fp8_mixed_step_matches_reference(cache_dtype, k_scale, v_scale):
    """The backend's fp8 path: `fp8.write_kv` into the uint8 view of vLLM-layout pages, then
    `stellax.torch.ragged_paged_attention` over `fp8.kv_pools` (the float8 view, read in place) equals
    float64 attention over the dequantized codes (dequantize-then-attend)."""
    import stellax.torch as st

    rng = np.random.default_rng(1)
    n, kh, d, ps, num_blocks = 4, 2, 16, 16, 8
    raw = torch.zeros(num_blocks * ps * 2 * kh * d, dtype=torch.uint8)
    cache = vllm_layer_view(raw, num_blocks, kh, ps, d, "LBHNC")
    u8 = paged_kv_view(cache, block_size=ps, num_kv_heads=kh, head_size=d, dtype=torch.uint8)
    codes = paged_kv_view(cache, block_size=ps, num_kv_heads=kh, head_size=d, dtype=fp8.FP8_CACHE_DTYPES[cache_dtype])
    kv_lens, q_lens, tables = [20, 33], [20, 1], [[3, 6], [0, 5, 7]]
    new_k = rng.standard_normal((sum(kv_lens), kh, d)) * 3
    new_v = rng.standard_normal((sum(kv_lens), kh, d))
    slots = [tables[s][p // ps] * ps + p % ps for s, L in enumerate(kv_lens) for p in range(L)]
    fp8.write_kv(u8, torch.from_numpy(new_k).float(), torch.from_numpy(new_v).float(), torch.tensor(slots),
                 k_scale, v_scale, cache_dtype)
    kp, vp = fp8.kv_pools(codes, torch.tensor(k_scale), torch.tensor(v_scale), cache_dtype, d)
    assert kp.data.data_ptr() == vp.data.data_ptr() == raw.data_ptr()
    dq_k = fp8.dequantize(fp8.fp8_codes(torch.from_numpy(new_k).float(), k_scale, cache_dtype), k_scale,
                          cache_dtype).double().numpy()
    dq_v = fp8.dequantize(fp8.fp8_codes(torch.from_numpy(new_v).float(), v_scale, cache_dtype), v_scale,
                          cache_dtype).double().numpy()
    m, q, qp = _step(rng, tables, kv_lens, q_lens, slots, n, d)
    out = st.ragged_paged_attention(qp, kp, vp, m.kv_lens, m.block_tables, m.cu_q_lens, m.num_seqs, scale=d ** -0.5)
    start, first = 0, 0
    for s, L in enumerate(kv_lens):
        want = reference(q[start:start + q_lens[s]], dq_k[first:first + L], dq_v[first:first + L], q_lens[s],
                         d ** -0.5, None, None, None)
        np.testing.assert_allclose(out[start:start + q_lens[s]].numpy(), want, atol=2e-5, rtol=2e-5)
        start, first = start + q_lens[s], first + L
