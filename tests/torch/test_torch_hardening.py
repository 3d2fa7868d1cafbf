"""The torch front end: no silent float -> int casts, one device per call,
group sizes checked as the JAX front end checks them."""

import pytest
import torch

import stellax.torch as st


def test_float_index_tensors_are_type_errors():
    q, kp = torch.ones(2, 2, 16), torch.ones(4, 16, 1, 16)
    tables, lengths = torch.zeros(2, 2, dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match="^lengths: expected an integer tensor, got torch.float32"):
        st.paged_attention(q, kp, kp, tables, lengths.float())
    with pytest.raises(TypeError, match="^block_tables: expected an integer tensor"):
        st.paged_attention(q, kp, kp, tables.float(), lengths)
    with pytest.raises(TypeError, match="^group_sizes: expected an integer tensor"):
        st.ragged_dot(torch.ones(4, 8), torch.ones(2, 8, 3), torch.tensor([2.0, 2.0]))


def test_group_sizes_values_checked_eagerly():
    lhs, rhs = torch.ones(4, 8), torch.ones(2, 8, 3)
    with pytest.raises(ValueError, match=r"^group_sizes: expected sum\(group_sizes\) <= 4 \(lhs.shape\[0\]\), got 6"):
        st.ragged_dot(lhs, rhs, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="^group_sizes: expected non-negative"):
        st.ragged_dot(lhs, rhs, torch.tensor([-1, 3]))
    assert st.ragged_dot(lhs, rhs, torch.tensor([1, 2]))[3].abs().sum() == 0  # rows past the sum: zeros


def test_mixed_devices_are_an_error():
    with pytest.raises(ValueError, match="^scale: expected a tensor on meta"):
        st.rms_norm(torch.ones(4, 8, device="meta"), torch.ones(8))
    with pytest.raises(ValueError, match="^rhs: expected a tensor on meta"):
        st.ragged_dot(torch.ones(4, 8, device="meta"), torch.ones(2, 8, 3), torch.tensor([2, 2], device="meta"))
    out = st.rms_norm(torch.ones(4, 8, device="meta"), torch.ones(8, device="meta"))  # one device: the fake
    assert out.device.type == "meta" and tuple(out.shape) == (4, 8)
