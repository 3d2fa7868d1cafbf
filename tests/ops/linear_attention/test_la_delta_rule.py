"""Gated DeltaNet and Kimi Delta Attention (XLA chunked path) against the
naive float32 recurrence: outputs, final states and the gradients of every
input; state continuity, varlen, KDA ⊇ GDN and bad inputs."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.linear_attention import chunk_gated_delta_rule_op, chunk_kda_op
from stellax.ops.linear_attention.examples import make_inputs
from stellax.testing import assert_close

from la_helpers import check_against_golden

F32, BF16 = jnp.float32, jnp.bfloat16


def _case(T, K, V, group, l2, init, decay, dtype, per_channel=False, B=2, H=2, seed=0):
    HV = H * group
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(seed), B, T, H, HV, K, V, dtype=dtype,
                                       per_channel=per_channel, decay=decay, normalized_keys=not l2)
    if l2:
        k = (k.astype(F32) * 0.3).astype(dtype)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if init:
        diff["initial_state"] = h0
    return diff


def _run_chunk(per_channel, implementation="xla", chunk_size=None, **options):
    fn = stellax.chunk_kda if per_channel else stellax.chunk_gated_delta_rule

    def run(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("q", "k", "v", "g", "beta")]
        return fn(*args, **d, **s, output_final_state=True, implementation=implementation, chunk_size=chunk_size,
                  **options)
    return run


def _golden(per_channel, **options):
    op = chunk_kda_op if per_channel else chunk_gated_delta_rule_op

    def ref(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("q", "k", "v", "g", "beta")]
        return op.reference(*args, **d, **s, output_final_state=True, **options)
    return ref


FULL_GRID = list(itertools.product((1, 63, 64, 65, 300), (32, 64, 128), (1, 4), (False, True), (False, True),
                                   (1.0, 20.0), (F32, BF16)))
# The default tier: every value of every axis at least once.
DEFAULT_GRID = [
    (1, 32, 1, False, True, 1.0, F32),
    (63, 64, 4, True, False, 20.0, F32),
    (65, 32, 4, False, True, 20.0, BF16),
    (300, 32, 1, True, True, 1.0, F32),
    (64, 128, 1, False, True, 1.0, BF16),
]


def _grid_id(case):
    T, D, group, l2, init, decay, dtype = case
    return f"T{T}-KV{D}-HVx{group}-l2{int(l2)}-init{int(init)}-g{decay:g}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("case", DEFAULT_GRID, ids=_grid_id)
def test_chunked_matches_golden(case, per_channel):
    T, D, group, l2, init, decay, dtype = case
    diff = _case(T, D, D, group, l2, init, decay, dtype, per_channel, B=1 if T == 300 else 2)
    options = {"use_qk_l2norm": l2}
    check_against_golden(_run_chunk(per_channel, **options), _golden(per_channel, **options), diff, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("case", FULL_GRID, ids=_grid_id)
def test_chunked_matches_golden_full_grid(case, per_channel):
    T, D, group, l2, init, decay, dtype = case
    diff = _case(T, D, D, group, l2, init, decay, dtype, per_channel, B=1)
    options = {"use_qk_l2norm": l2}
    check_against_golden(_run_chunk(per_channel, **options), _golden(per_channel, **options), diff, dtype=dtype,
                         gradients=T != 1 or D == 32)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_size_does_not_change_the_result(chunk_size):
    diff = _case(150, 32, 16, 2, False, True, 1.0, F32)
    ref = jax.jit(_run_chunk(False, chunk_size=64))(diff, {})
    out = jax.jit(_run_chunk(False, chunk_size=chunk_size))(diff, {})
    for o, r in zip(out, ref):
        assert_close(o, r, dtype=F32)


def test_strong_decay_is_finite_forward_and_backward():
    """g = −20 every step (and −1e4 once): no overflow or NaN anywhere."""
    for per_channel in (False, True):
        diff = _case(130, 32, 32, 1, False, True, 1.0, F32, per_channel)
        diff["g"] = jnp.full_like(diff["g"], -20.0).at[:, 5].set(-1e4)
        run = _run_chunk(per_channel)
        out = jax.jit(run)(diff, {})
        grads = jax.jit(jax.grad(lambda d: sum(jnp.sum(x) for x in run(d, {}))))(diff)
        for leaf in jax.tree_util.tree_leaves((out, grads)):
            assert bool(jnp.isfinite(leaf).all())
        ref = _golden(per_channel)(diff, {})
        assert_close(out[0], ref[0], dtype=F32)


def test_two_parts_equal_one_run():
    diff = _case(200, 32, 32, 2, True, True, 1.0, F32)
    run = jax.jit(_run_chunk(False, use_qk_l2norm=True))
    o, final = run(diff, {})
    first = {n: (x[:, :77] if n != "initial_state" else x) for n, x in diff.items()}
    o1, s1 = run(first, {})
    second = {n: x[:, 77:] for n, x in diff.items() if n != "initial_state"}
    second["initial_state"] = s1
    o2, s2 = run(second, {})
    assert_close(jnp.concatenate([o1, o2], axis=1), o, dtype=F32)
    assert_close(s2, final, dtype=F32)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_recurrent_token_by_token_equals_chunked(per_channel):
    diff = _case(40, 32, 16, 2, False, True, 1.0, F32, per_channel)
    o, final = jax.jit(_run_chunk(per_channel))(diff, {})
    recurrent = stellax.fused_recurrent_kda if per_channel else stellax.fused_recurrent_gated_delta_rule
    step = jax.jit(lambda q, k, v, g, b, s: recurrent(q, k, v, g, b, initial_state=s, output_final_state=True))
    state = diff["initial_state"]
    outs = []
    for t in range(40):
        piece = [diff[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")]
        o_t, state = step(*piece, state)
        outs.append(o_t)
    assert_close(jnp.concatenate(outs, axis=1), o, dtype=F32, name="o")
    assert_close(state, final, dtype=F32, name="final_state")


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("traced", [False, True], ids=["concrete", "traced"])
def test_varlen_equals_each_sequence_alone(per_channel, traced):
    lengths = [37, 0, 1, 90]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, n = int(cu[-1]), len(lengths)
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(5), 1, total, 2, 4, 32, 16, per_channel=per_channel,
                                       n_states=n)
    fn = stellax.chunk_kda if per_channel else stellax.chunk_gated_delta_rule

    def packed(q, k, v, g, beta, h0, cu):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)

    cu_arg = jnp.asarray(cu)
    o, final = (jax.jit(packed)(q, k, v, g, beta, h0, cu_arg) if traced
                else packed(q, k, v, g, beta, h0, cu_arg))
    for i in range(n):
        a, b = int(cu[i]), int(cu[i + 1])
        o_i, s_i = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[i:i + 1],
                      output_final_state=True)
        if b > a:
            assert_close(o[:, a:b], o_i, dtype=F32, name=f"o[{i}]")
        assert_close(final[i:i + 1], s_i, dtype=F32, name=f"final[{i}]")


def test_varlen_gradients_match_golden():
    cu = jnp.array([0, 20, 20, 85], jnp.int32)
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(2), 1, 85, 1, 2, 32, 16, n_states=3)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    check_against_golden(_run_chunk(False), _golden(False), diff, {"cu_seqlens": cu}, dtype=F32)


def test_kda_with_constant_per_channel_decay_equals_gdn():
    diff = _case(100, 32, 16, 2, False, True, 1.0, F32)
    gdn = jax.jit(_run_chunk(False))(diff, {})
    kda_inputs = dict(diff, g=jnp.broadcast_to(diff["g"][..., None], diff["g"].shape + (32,)))
    kda = jax.jit(_run_chunk(True))(kda_inputs, {})
    for a, b in zip(kda, gdn):
        assert_close(a, b, dtype=F32)


@pytest.mark.parametrize("lower_bound, with_params", [(None, True), (-5.0, False)])
def test_kda_fused_gate(lower_bound, with_params):
    diff = _case(70, 32, 16, 2, False, True, 1.0, F32, per_channel=True)
    diff["g"] = jax.random.normal(jax.random.PRNGKey(9), diff["g"].shape)  # raw gate input
    if with_params:
        diff["A_log"] = 0.3 * jax.random.normal(jax.random.PRNGKey(10), (4,))
        diff["dt_bias"] = 0.3 * jax.random.normal(jax.random.PRNGKey(12), (4 * 32,))
    options = {"use_gate_in_kernel": True, "lower_bound": lower_bound}
    check_against_golden(_run_chunk(True, **options), _golden(True, **options), diff, dtype=F32)
    # The documented formula.
    g, A_log, dt_bias = diff["g"], diff.get("A_log"), diff.get("dt_bias")
    x = g + (0 if dt_bias is None else dt_bias.reshape(4, 32))
    a = 1.0 if A_log is None else jnp.exp(A_log)[:, None]
    expected = -a * jax.nn.softplus(x) if lower_bound is None else lower_bound * jax.nn.sigmoid(a * x)
    assert_close(stellax.ops.linear_attention.kda_gate(g, A_log, dt_bias, lower_bound), expected, dtype=F32)


def test_fla_argument_alias_and_defaults():
    diff = _case(30, 32, 16, 1, True, False, 1.0, F32)
    args = [diff[n] for n in ("q", "k", "v", "g", "beta")]
    a, none = stellax.chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True)
    b, _ = stellax.chunk_gated_delta_rule(*args, use_qk_l2norm=True, scale=32 ** -0.5)
    assert none is None
    assert_close(a, b, dtype=F32)


# -- bad input ------------------------------------------------------------------
def _bad(**changes):
    diff = _case(16, 16, 16, 1, False, False, 1.0, F32, B=1)
    kwargs = {n: diff.pop(n) for n in ("q", "k", "v", "g", "beta")}
    kwargs.update(changes)
    args = [kwargs.pop(n) for n in ("q", "k", "v", "g", "beta")]
    return args, kwargs


@pytest.mark.parametrize("changes, error, match", [
    ({"v": jnp.zeros((1, 16, 3, 16))}, ValueError, "multiple of the number of query/key heads"),
    ({"cu_seqlens": jnp.array([0, 9, 5, 16])}, ValueError, "non-decreasing"),
    ({"cu_seqlens": jnp.array([0, 5, 12])}, ValueError, "end at T = 16"),
    ({"cu_seqlens": jnp.array([1, 5, 16])}, ValueError, "start at 0"),
    ({"cu_seqlens": jnp.array([0.0, 16.0])}, TypeError, "integer"),
    ({"initial_state": jnp.zeros((1, 2, 16, 8))}, ValueError, "initial_state: expected shape"),
    ({"initial_state": jnp.zeros((2, 2, 16, 16)), "cu_seqlens": jnp.array([0, 4, 9, 16])}, ValueError,
     "initial_state: expected shape"),
    ({"g": jnp.zeros((1, 16, 2, 16))}, ValueError, "g: expected rank 3"),
    ({"beta": jnp.zeros((1, 16, 3))}, ValueError, "beta: expected shape"),
    ({"k": jnp.zeros((1, 16, 2, 8))}, ValueError, "k: expected shape"),
    ({"q": jnp.zeros((1, 16, 2, 16), jnp.int32)}, TypeError, "q: expected a floating dtype"),
    ({"chunk_size": 48}, ValueError, "power of two"),
    ({"scale": -1.0}, ValueError, "scale"),
])
def test_bad_input_raises_clear_errors(changes, error, match):
    args, kwargs = _bad(**changes)
    with pytest.raises(error, match=match):
        stellax.chunk_gated_delta_rule(*args, **kwargs)


def test_batch_above_one_with_cu_seqlens_is_rejected():
    diff = _case(16, 16, 16, 1, False, False, 1.0, F32, B=2)
    args = [diff[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="batch size 1"):
        stellax.chunk_gated_delta_rule(*args, cu_seqlens=jnp.array([0, 16]))
    with pytest.raises(ValueError, match="batch size 1"):
        stellax.fused_recurrent_gated_delta_rule(*args, cu_seqlens=jnp.array([0, 16]))


def test_kda_bad_gate_arguments():
    diff = _case(16, 16, 16, 1, False, False, 1.0, F32, B=1, per_channel=True)
    args = [diff[n] for n in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="use_gate_in_kernel=True"):
        stellax.chunk_kda(*args, A_log=jnp.zeros((2,)))
    with pytest.raises(ValueError, match=r"dt_bias: expected shape \(32,\)"):
        stellax.chunk_kda(*args, use_gate_in_kernel=True, dt_bias=jnp.zeros((16,)))
    with pytest.raises(ValueError, match="g: expected rank 4"):
        stellax.chunk_kda(*args[:3], args[3][..., 0], args[4])
    with pytest.raises(ValueError, match="negative"):
        stellax.chunk_kda(*args, use_gate_in_kernel=True, lower_bound=1.0)
