"""Bad data through the torch front end (issue 43): without checks the torch entry points return the
JAX ops' documented result (NaN rows for bad varlen offsets, paged metadata, a bad MoE permutation
or group offset and a positive linear-attention decay; dropped copies for bad expert ids; the last
write of a repeated cache slot); inside `stellax.checked()` or with ``STELLAX_CHECKS=1`` the same
calls raise a ``ValueError`` naming the op, the argument and the bad value, eagerly and under
`torch.compile`. Valid data in checked mode runs forward and backward."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")

import stellax  # noqa: E402
import stellax.torch as st  # noqa: E402
from stellax.core import runtime_checks  # noqa: E402
from stellax.ops.paged_attention import paged_inputs, ragged_inputs  # noqa: E402


def _nan_rows(out: torch.Tensor) -> list[int]:
    rows = out.reshape(out.shape[0], -1).isnan()
    assert (rows.all(dim=1) | ~rows.any(dim=1)).all(), "a row is partly NaN"
    return torch.nonzero(rows.all(dim=1)).reshape(-1).tolist()


def _raises(message: str, op: str):
    return pytest.raises(ValueError, match=rf"^stellax::{op}: .*{message}")


# -- varlen attention: cu_seqlens ----------------------------------------------------------------
GEN = torch.Generator().manual_seed(0)
Q, K = torch.randn(6, 2, 8, generator=GEN), torch.randn(6, 2, 8, generator=GEN)
GOOD_CU = torch.tensor([0, 2, 6], dtype=torch.int32)
VARLEN_CASES = [   # (cu_seqlens_q, cu_seqlens_k, NaN rows, message)
    ([1, 2, 6], GOOD_CU, [0, 1, 2, 3, 4, 5], r"cu_seqlens_q\[0\]: expected 0, got 1"),
    ([0, 2, 7], GOOD_CU, [2, 3, 4, 5], r"cu_seqlens_q\[-1\]: expected <= 6 \(q.shape\[0\]\), got 7"),
    (GOOD_CU, [0, 2, 7], [2, 3, 4, 5], r"cu_seqlens_k\[-1\]: expected <= 6 \(k.shape\[0\]\), got 7"),
]


def _varlen(cu_q, cu_k, q=Q):
    return st.dot_product_attention_varlen(q, K, K, torch.as_tensor(cu_q, dtype=torch.int32),
                                           torch.as_tensor(cu_k, dtype=torch.int32), 4, 4)


@pytest.mark.parametrize("cu_q,cu_k,nan_rows,message", VARLEN_CASES)
def test_varlen_bad_offsets(cu_q, cu_k, nan_rows, message):
    out = _varlen(cu_q, cu_k)
    assert _nan_rows(out) == nan_rows
    want = jax.jit(lambda cq, ck: stellax.dot_product_attention_varlen(Q.numpy(), K.numpy(), K.numpy(), cq, ck, 4, 4))(
        np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32))
    np.testing.assert_allclose(out.numpy(), np.asarray(want), rtol=1e-6, atol=1e-6)   # the JAX op's (jit) result
    with stellax.checked():
        with _raises(message, "dot_product_attention_varlen"):
            _varlen(cu_q, cu_k)


def test_varlen_environment_switch(monkeypatch):
    monkeypatch.setenv(runtime_checks.ENV, "1")
    with _raises(r"cu_seqlens_q\[0\]: expected 0, got 1", "dot_product_attention_varlen"):
        _varlen([1, 2, 6], GOOD_CU)
    monkeypatch.setenv(runtime_checks.ENV, "0")
    assert _nan_rows(_varlen([1, 2, 6], GOOD_CU)) == list(range(6))


def test_checked_mode_valid_data_forward_and_backward():
    """Checked mode does not change valid results and the backward (run with checks off, the
    forward having checked) works; the gradient is the unchecked one."""
    q = Q.clone().requires_grad_(True)
    out = _varlen(GOOD_CU, GOOD_CU, q)
    out.square().sum().backward()
    want_out, want_grad = out.detach(), q.grad.clone()
    q.grad = None
    with stellax.checked():
        out = _varlen(GOOD_CU, GOOD_CU, q)
        out.square().sum().backward()
    torch.testing.assert_close(out.detach(), want_out, rtol=0, atol=0)
    torch.testing.assert_close(q.grad, want_grad, rtol=0, atol=0)


def test_checked_mode_under_torch_compile():
    f = torch.compile(lambda q, cu: st.dot_product_attention_varlen(q, K, K, cu, GOOD_CU, 4, 4), fullgraph=True)
    assert _nan_rows(f(Q, torch.tensor([0, 2, 7], dtype=torch.int32))) == [2, 3, 4, 5]
    with stellax.checked():
        with _raises(r"cu_seqlens_q\[-1\]: expected <= 6", "dot_product_attention_varlen"):
            f(Q, torch.tensor([0, 2, 7], dtype=torch.int32))
        assert _nan_rows(f(Q, GOOD_CU)) == []


# -- paged attention: block tables and lengths ---------------------------------------------------
PQ, PK, PV, TABLES, LENGTHS = (torch.from_numpy(np.array(a)) for a in paged_inputs(
    0, lengths=[3, 20, 9], page_size=16, kv_heads=1, q_heads=2, head_dim=16, dtype=jnp.float32))
PAGED_CASES = [   # (tables, lengths, NaN rows, message)
    (TABLES, [3, 33, 9], [1], r"lengths\[1\] = 33"),
    (TABLES, [3, 20, -1], [2], r"lengths\[2\] = -1"),
    ("bad_table", LENGTHS, [1], rf"block_tables\[1, 1\] = {PK.shape[0]}"),
]


@pytest.mark.parametrize("tables,lengths,nan_rows,message", PAGED_CASES)
def test_paged_bad_metadata(tables, lengths, nan_rows, message):
    if isinstance(tables, str):
        tables = TABLES.clone()
        tables[1, 1] = PK.shape[0]
    lengths = torch.as_tensor(lengths, dtype=torch.int32)
    out = st.paged_attention(PQ, PK, PV, tables, lengths)
    assert _nan_rows(out) == nan_rows
    good = st.paged_attention(PQ, PK, PV, TABLES, LENGTHS)
    keep = [b for b in range(3) if b not in nan_rows]
    torch.testing.assert_close(out[keep], good[keep], rtol=0, atol=0)
    with stellax.checked():
        with _raises(message, "paged_attention"):
            st.paged_attention(PQ, PK, PV, tables, lengths)
        torch.testing.assert_close(st.paged_attention(PQ, PK, PV, TABLES, LENGTHS), good, rtol=0, atol=0)


def test_ragged_paged_bad_offsets_and_mla_bad_length():
    q, k, v, kv_lens, tables, cu, num = (torch.from_numpy(np.array(a)) for a in ragged_inputs(
        0, q_lens=[2, 1, 3], kv_lens=[5, 17, 3], page_size=8, kv_heads=1, q_heads=2, head_dim=16,
        dtype=jnp.float32, padding_seqs=1, padding_tokens=2))
    bad_cu = cu.clone()
    bad_cu[2] = 1
    out = st.ragged_paged_attention(q, k, v, kv_lens, tables, bad_cu, num)
    assert _nan_rows(out) == [2, 3, 4, 5, 6, 7]
    with stellax.checked():
        with _raises(r"cu_q_lens\[2\] = 1 below", "ragged_paged_attention"):
            st.ragged_paged_attention(q, k, v, kv_lens, tables, bad_cu, num)
    gen = torch.Generator().manual_seed(1)
    latent, pe = torch.randn(PK.shape[0], 16, 16, generator=gen), torch.randn(PK.shape[0], 16, 8, generator=gen)
    qn, qp = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 8, generator=gen)
    bad = torch.tensor([100, 20, 9], dtype=torch.int32)
    assert _nan_rows(st.mla_decode(qn, qp, latent, pe, TABLES, bad, scale=0.2)) == [0]
    with stellax.checked():
        with _raises(r"lengths\[0\] = 100", "mla_decode"):
            st.mla_decode(qn, qp, latent, pe, TABLES, bad, scale=0.2)


# -- paged cache writes: repeated and out-of-range slots -----------------------------------------
SLOTS = torch.tensor([5, 2, 5, -1, 2, 40, 5, 11], dtype=torch.int32)   # 4 pages x 4 slots = 16
REPEATS = torch.where(SLOTS == 40, -1, SLOTS)   # the repeats without the slot past the pool


def _last_writes(pool, rows, slots):
    flat = pool.clone().reshape(16, *pool.shape[2:])
    for t, slot in enumerate(slots.tolist()):
        if 0 <= slot < 16:
            flat[slot] = rows[t]
    return flat.reshape(pool.shape)


def test_update_kv_cache_in_place_last_write_wins_and_checked():
    gen = torch.Generator().manual_seed(2)
    kp, vp = torch.full((4, 4, 2, 8), 7.0), torch.zeros(4, 4, 2, 8)
    new_k, new_v = torch.randn(8, 2, 8, generator=gen), torch.randn(8, 2, 8, generator=gen)
    want_k, want_v = _last_writes(kp, new_k, SLOTS), _last_writes(vp, new_v, SLOTS)
    st.update_kv_cache_(kp, vp, new_k, new_v, SLOTS)   # slot 40 is past the pool: dropped, no error
    torch.testing.assert_close(kp, want_k, rtol=0, atol=0)
    torch.testing.assert_close(vp, want_v, rtol=0, atol=0)
    torch.testing.assert_close(kp.reshape(16, 2, 8)[5], new_k[6], rtol=0, atol=0)   # the last of three
    with stellax.checked():
        with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 5: the slot is already written by "
                                             r"slot_mapping\[0\]"):
            st.update_kv_cache_(kp, vp, new_k, new_v, REPEATS)
        with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 40: expected a slot in \[0, 16\)"):
            st.update_kv_cache_(kp, vp, new_k[:2], new_v[:2], torch.tensor([3, 40]))
    torch.testing.assert_close(kp, want_k, rtol=0, atol=0)   # a refused write leaves the pool as it was


def test_update_kv_cache_functional_last_write_wins_and_checked():
    gen = torch.Generator().manual_seed(3)
    kp, vp = torch.full((4, 4, 2, 8), 7.0), torch.zeros(4, 4, 2, 8)
    new = torch.randn(8, 2, 8, generator=gen)
    k2, v2 = st.update_kv_cache(kp, vp, new, new, SLOTS)
    torch.testing.assert_close(k2, _last_writes(kp, new, SLOTS), rtol=0, atol=0)
    torch.testing.assert_close(v2, _last_writes(vp, new, SLOTS), rtol=0, atol=0)
    with stellax.checked():
        with _raises(r"slot_mapping\[2\] = 5: the slot is already written by slot_mapping\[0\]", "update_kv_cache"):
            st.update_kv_cache(kp, vp, new, new, REPEATS)
        with _raises(r"slot_mapping\[5\] = 40: expected a slot in \[0, 16\)", "update_kv_cache"):
            st.update_kv_cache(kp, vp, new, new, SLOTS)


# -- MoE: expert ids, permutation, group offset --------------------------------------------------
X = torch.arange(12.0).reshape(4, 3)
IDS = torch.tensor([[0, 1], [2, 1], [1, 0], [2, 0]], dtype=torch.int32)


@pytest.mark.parametrize("bad_id", [3, -1])
def test_permute_bad_expert_id_drops_the_copy_and_checked(bad_id):
    ids = IDS.clone()
    ids[1, 0] = bad_id
    rows, sizes, perm = st.permute(X, ids, 3)
    assert sizes.tolist() == [3, 3, 1] and int(perm[-1]) == 2 and sorted(perm.tolist()) == list(range(8))
    assert (rows[-1] == 0).all()
    with stellax.checked():
        with _raises(rf"expert_ids\[1, 0\]: expected an expert in \[0, 3\) \(num_experts\), got {bad_id}",
                     "permute"):
            st.permute(X, ids, 3)
        with _raises(rf"expert_ids\[1, 0\]: expected an expert in \[0, 3\).*got {bad_id}", "load_balancing_loss"):
            st.load_balancing_loss(torch.randn(4, 3), ids)


def test_unpermute_bad_permutation_nan_tokens_and_checked():
    perm = torch.tensor([0, 5, 7, 1, 3, 4, 2, 6], dtype=torch.int32)
    rows = X[perm.long() // 2]
    torch.testing.assert_close(st.unpermute(rows, perm, torch.full((4, 2), 0.5)), X, rtol=0, atol=0)
    bad = perm.clone()
    bad[2] = 99   # copy 7 (token 3) has no row
    assert _nan_rows(st.unpermute(rows, bad, torch.ones(4, 2))) == [3]
    with stellax.checked():
        with _raises(r"permutation\[2\]: expected a copy index in \[0, 8\) \(y.shape\[0\]\), got 99", "unpermute"):
            st.unpermute(rows, bad, torch.ones(4, 2))


def test_ragged_dot_bad_group_offset_nan_and_checked():
    gen = torch.Generator().manual_seed(4)
    lhs, rhs = torch.randn(8, 4, generator=gen), torch.randn(2, 4, 3, generator=gen)
    sizes = torch.tensor([2, 3, 1, 2], dtype=torch.int32)
    assert st.ragged_dot(lhs, rhs, sizes, group_offset=-1).isnan().all()
    assert st.ragged_dot(lhs, rhs, sizes, group_offset=1).isfinite().all()
    with stellax.checked():
        with _raises(r"group_offset: expected a value in \[0, 2\].*got -1", "ragged_dot"):
            st.ragged_dot(lhs, rhs, sizes, group_offset=-1)


# -- linear attention: positive log decay --------------------------------------------------------
@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
                                  "fused_recurrent_kda"])
def test_linear_attention_positive_decay_nan_head_and_checked(name):
    gen = torch.Generator().manual_seed(5)
    b, t, h, d = 2, 10, 2, 8
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    k = k / 3
    g = -torch.rand((b, t, h) + ((d,) if "kda" in name else ()), generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    fn = getattr(st, name)
    good, good_state = fn(q, k, v, g, beta, output_final_state=True)
    bad_g = g.clone()
    bad_g[1, 4, 0] = 30.0
    out, state = fn(q, k, v, bad_g, beta, output_final_state=True)
    nan = out.isnan().all(dim=-1)
    want = torch.zeros(b, t, h, dtype=torch.bool)
    want[1, :, 0] = True
    assert torch.equal(nan, want) and not out[~want].isnan().any()
    torch.testing.assert_close(out[~want], good[~want], rtol=0, atol=0)
    assert state[1, 0].isnan().all() and not state[0].isnan().any() and not state[1, 1].isnan().any()
    with stellax.checked():
        with _raises(r"g: expected a log-space decay <= 0.*largest value of 30.0", name):
            fn(q, k, v, bad_g, beta)
        q_grad = q.clone().requires_grad_(True)
        o, _ = fn(q_grad, k, v, g, beta)
        o.sum().backward()
        assert q_grad.grad.isfinite().all()


def test_error_names_the_op_and_the_argument_only_once_checked():
    """The message is the op's checked-mode message, prefixed by the op (one failed check)."""
    with stellax.checked():
        with pytest.raises(ValueError) as info:
            _varlen([0, 4, 2], GOOD_CU)
    assert re.match(r"stellax::dot_product_attention_varlen: cu_seqlens_q: expected non-decreasing", str(info.value))
    assert str(info.value).count("stellax::") == 1


def test_context_parallel_linear_attention_positive_decay_checked():
    """An op that places its arrays on a mesh itself (not jitted by the registry) is checked the
    same way: the check inside its shard_map is reported by the device that holds the bad decay."""
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:4]), ("cp",))
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 16, 2, generator=gen), torch.rand(1, 16, 2, generator=gen)
    bad = g.clone()
    bad[0, 5, 1] = 3.0   # token 5: the second of the 4 sequence shards
    out, _ = st.context_parallel_gated_delta_rule(q, k / 3, v, bad, beta, mesh=mesh, axis_name="cp", chunk_size=4)
    # unchecked: head 1 is NaN from the bad token's shard on (the passed state carries the NaN); the
    # first shard's tokens, which do not depend on token 5, keep their values (the single-device op
    # makes the whole (sequence, head) NaN)
    nan = out.isnan().all(dim=-1)[0]
    assert nan[:, 0].tolist() == [False] * 16 and nan[:, 1].tolist() == [False] * 4 + [True] * 12
    good, _ = st.context_parallel_gated_delta_rule(q, k / 3, v, g, beta, mesh=mesh, axis_name="cp", chunk_size=4)
    torch.testing.assert_close(out[0, :4, 1], good[0, :4, 1], rtol=0, atol=0)
    with stellax.checked():
        with _raises(r"at mapped index 1: g: expected a log-space decay <= 0.*largest value of 3.0",
                     "context_parallel_gated_delta_rule"):
            st.context_parallel_gated_delta_rule(q, k / 3, v, bad, beta, mesh=mesh, axis_name="cp", chunk_size=4)
        out, _ = st.context_parallel_gated_delta_rule(q, k / 3, v, g, beta, mesh=mesh, axis_name="cp", chunk_size=4)
    torch.testing.assert_close(out, good, rtol=0, atol=0)
