"""Frictions found running stellax against real client code (issue 20, item 3):
left-padded batches (stellax, like sdpa, gives zeros for query rows that see no
key; eager gives the mean of the values), the Hugging Face Gated DeltaNet mixer
run on stellax kernels as a drop-in (its cache and padding mask kept), mamba_ssm's
tied-head-dim ``ssd_step`` shapes, and jax.nn's ``return_residual`` / list
lengths in ``dot_product_attention``."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pip install 'torch==2.13.0'")
transformers = pytest.importorskip("transformers", reason="pip install 'stellax[transformers]'")

import stellax  # noqa: E402
import stellax.torch as st  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One torch intra-op thread (torch's OpenMP workers spinning beside XLA's pool slow a loaded CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _left_padded(batch=2, length=8, pad=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return ids, mask


# -- left padding: rows that see no key -------------------------------------------------------
def test_left_padded_rows_that_see_no_key_are_zero_like_sdpa_not_the_eager_mean():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    st.register_transformers_attention("stellax")
    ids, mask = _left_padded()
    # labels whose prediction comes from a position that sees no key (a pad position) are ignored
    predicted_from_pad = torch.nn.functional.pad(mask, (1, 0))[:, :-1] == 0
    labels_masked = ids.masked_fill((mask == 0) | predicted_from_pad, -100)
    out = {}
    for impl in ("eager", "sdpa", "stellax"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = (model(ids, attention_mask=mask).logits, model(ids, attention_mask=mask, labels=ids).loss,
                         model(ids, attention_mask=mask, labels=labels_masked).loss)
    real = slice(3, None)
    for impl in ("sdpa", "stellax"):  # real tokens: every backend agrees
        torch.testing.assert_close(out[impl][0][:, real], out["eager"][0][:, real], atol=1e-5, rtol=1e-5)
    # the pad rows of sequence 0 see no key: stellax equals sdpa exactly, eager differs
    torch.testing.assert_close(out["stellax"][0][0, :3], out["sdpa"][0][0, :3], atol=1e-6, rtol=1e-6)
    assert (out["stellax"][0][0, :3] - out["eager"][0][0, :3]).abs().max() > 1e-2
    # so the loss differs from eager when the prediction from the last pad position counts (as with labels that
    # only mask the pad tokens themselves: the first real token is predicted from the last pad position) ...
    only_pads = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        losses = {impl: (model.set_attn_implementation(impl),
                         model(ids, attention_mask=mask, labels=only_pads).loss)[1] for impl in ("eager", "stellax")}
    assert abs(losses["stellax"].item() - losses["eager"].item()) > 1e-4
    torch.testing.assert_close(out["stellax"][1], out["sdpa"][1], atol=1e-6, rtol=1e-6)
    assert abs(out["stellax"][1].item() - out["eager"][1].item()) > 1e-4
    # ... and matches once padding is masked in the labels
    torch.testing.assert_close(out["stellax"][2], out["eager"][2], atol=1e-5, rtol=1e-5)


def test_attention_rows_with_no_visible_key_return_zeros():
    q = torch.randn(1, 4, 2, 8)
    kv = torch.randn(1, 4, 2, 8)
    seg = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)  # rows 0-1 are padding: kv segment 0, query segment 1
    out = st.dot_product_attention(q, kv, kv, is_causal=True, q_segment_ids=torch.ones_like(seg), kv_segment_ids=seg)
    assert torch.equal(out[:, :2], torch.zeros_like(out[:, :2]))
    assert out[:, 2:].abs().max() > 0


# -- the HF Gated DeltaNet mixer, patched -------------------------------------------------------
def _qwen3_next_linear_only():
    cfg = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[0, 1],
        tie_word_embeddings=False)
    torch.manual_seed(3)
    return transformers.Qwen3NextForCausalLM(cfg).eval()


def test_patched_qwen3_next_mixer_is_a_drop_in_with_cache_and_padding_mask():
    ref = _qwen3_next_linear_only()
    ours = copy.deepcopy(ref)
    report = st.apply_kernels(ours, attention=False, norm=False, mlp=False, moe=False, loss=False)
    mixer, ref_mixer = ours.model.layers[0].linear_attn, ref.model.layers[0].linear_attn
    assert report.count("linear attention") == 1 and type(mixer) is type(ref_mixer)
    ids, mask = _left_padded()
    with torch.no_grad():  # prefill with a left-padded batch: the mixer's own padding mask is applied
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[:, 3:], want[:, 3:], atol=1e-4, rtol=1e-4)
        # decode through the model's cache (conv + recurrent states; the decode step is fused_recurrent)
        gen_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        gen = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(gen, gen_ref)
    # training the patched model trains the model's own fused projections (nothing was copied)
    ours.train()
    ours(ids, attention_mask=mask, labels=ids).loss.backward()
    ref.train()
    ref(ids, attention_mask=mask, labels=ids).loss.backward()
    for name in ("in_proj_qkvz", "in_proj_ba", "conv1d", "out_proj"):
        got_grad = getattr(mixer, name).weight.grad
        want_grad = getattr(ref_mixer, name).weight.grad
        assert got_grad is not None, name
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_gated_delta_net_from_module_is_gone():
    assert not hasattr(st.GatedDeltaNet, "from_module")


# -- ssd_step with mamba_ssm's tied-head-dim shapes --------------------------------------------
def _selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None):
    """mamba_ssm's ``selective_state_update_ref`` with per-(head, head_dim) dt/dt_bias/D and
    per-(head, head_dim, state) A, in float64 torch."""
    state, x, dt, A, B, C, D, dt_bias = (t.double() for t in (state, x, dt, A, B, C, D, dt_bias))
    heads, groups = x.shape[1], B.shape[1]
    dt = torch.nn.functional.softplus(dt + dt_bias)
    dA = torch.exp(dt[..., None] * A)
    Bh = B.repeat_interleave(heads // groups, dim=1)
    Ch = C.repeat_interleave(heads // groups, dim=1)
    state = state * dA + (dt * x)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, Ch) + D * x
    if z is not None:
        y = y * torch.nn.functional.silu(z.double())
    return y, state


def test_ssd_step_accepts_tied_head_dim_shapes():
    g = torch.Generator().manual_seed(7)
    b, h, p, n, groups = 2, 4, 3, 5, 2
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    state, x, z = r(b, h, p, n), r(b, h, p), r(b, h, p)
    dt, A = r(b, h, p), -torch.exp(r(h, p, n))  # different per head dim and state dim: the general contract
    B, C, D, dt_bias = r(b, groups, n), r(b, groups, n), r(h, p), r(h, p)
    y, new = st.ssd_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    want_y, want_state = _selective_state_update(state, x, dt, A, B, C, D, dt_bias, z)
    torch.testing.assert_close(y.double(), want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new.double(), want_state, atol=1e-5, rtol=1e-5)
    # the tied values mamba2's decode passes (expanded views) equal the [B, H] / [H] call
    dt2, A2, D2, bias2 = r(b, h), -torch.exp(r(h)), r(h), r(h)
    tied = st.ssd_step(state, x, dt2[..., None].expand(-1, -1, p), A2[:, None, None].expand(-1, p, n), B, C,
                       D=D2[:, None].expand(-1, p), dt_bias=bias2[:, None].expand(-1, p), dt_softplus=True)
    plain = st.ssd_step(state, x, dt2, A2, B, C, D=D2, dt_bias=bias2, dt_softplus=True)
    for a, c in zip(tied, plain):
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)
    # gradients flow through the tied shapes too
    A.requires_grad_()
    dt.requires_grad_()
    st.ssd_step(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)[0].sum().backward()
    A64, dt64 = A.detach().double().requires_grad_(), dt.detach().double().requires_grad_()
    _selective_state_update(state, x, dt64, A64, B, C, D, dt_bias)[0].sum().backward()
    torch.testing.assert_close(A.grad.double(), A64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dt.grad.double(), dt64.grad, atol=1e-5, rtol=1e-5)


def test_ssd_step_rejects_mismatched_tied_shapes():
    state, x = jnp.zeros((1, 2, 3, 4)), jnp.zeros((1, 2, 3))
    B = C = jnp.zeros((1, 1, 4))
    with pytest.raises(ValueError, match=r"A: .*\[H\] or \[H, P, N\]"):
        stellax.ssd_step(state, x, jnp.zeros((1, 2)), jnp.zeros((2, 3, 5)), B, C)
    with pytest.raises(ValueError, match=r"dt: .*\[B, H\] or \[B, H, P\]"):
        stellax.ssd_step(state, x, jnp.zeros((1, 2, 4)), jnp.zeros((2,)), B, C)
    with pytest.raises(ValueError, match=r"dt_bias: .*\[H\] or \[H, P\]"):
        stellax.ssd_step(state, x, jnp.zeros((1, 2)), jnp.zeros((2,)), B, C, dt_bias=jnp.zeros((2, 4)))


# -- dot_product_attention with jax.nn's spellings ------------------------------------------------
def test_dot_product_attention_takes_jax_nn_return_residual_and_list_lengths():
    q = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
    k = jax.random.normal(jax.random.key(1), (2, 8, 2, 16))
    v = jax.random.normal(jax.random.key(2), (2, 8, 2, 16))
    out, lse = stellax.dot_product_attention(q, k, v, query_seq_lengths=[5, 8], key_value_seq_lengths=(6, 8),
                                             return_residual=True)
    want, want_lse = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([5, 8]),
                                                  key_value_seq_lengths=jnp.array([6, 8]), return_residual=True)
    assert lse.shape == want_lse.shape == (2, 8, 4)  # jax.nn's [B, T, N] layout
    valid = np.array([[True] * 5 + [False] * 3, [True] * 8])
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(want)[valid], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse)[valid], np.asarray(want_lse)[valid], atol=1e-5, rtol=1e-5)
    assert not np.asarray(out)[~valid].any()  # rows past the query length are zeros
    # stellax's own spelling keeps its [B, N, T] layout; return_residual=False gives the output alone
    _, own = stellax.dot_product_attention(q, k, v, query_seq_lengths=[5, 8], return_residuals=True)
    assert own.shape == (2, 4, 8)
    plain = stellax.dot_product_attention(q, k, v, query_seq_lengths=[5, 8], return_residual=False)
    _, plain_lse = stellax.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([5, 8]), return_residuals=True)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(
        stellax.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([5, 8]))))
    np.testing.assert_array_equal(np.asarray(own), np.asarray(plain_lse))  # a list and an array: the same call


def test_dot_product_attention_argument_errors():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="return_residual / return_residuals: pass one of the two"):
        stellax.dot_product_attention(q, q, q, return_residual=True, return_residuals=True)
    with pytest.raises(TypeError, match="query_seq_lengths: expected an int array or a list of ints"):
        stellax.dot_product_attention(q, q, q, query_seq_lengths=[2.5])
