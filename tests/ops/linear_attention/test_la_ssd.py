"""Mamba2 SSD (XLA chunked path) and ssd_step against the naive float32 recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.linear_attention import ssd_op
from stellax.ops.linear_attention.examples import make_ssd_inputs
from stellax.testing import assert_close

from la_helpers import check_against_golden

F32, BF16 = jnp.float32, jnp.bfloat16
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _inputs(batch, T, H, P, G, N, dtype=F32, n_states=None, seed=0):
    values = make_ssd_inputs(jax.random.PRNGKey(seed), batch, T, H, P, G, N, dtype=dtype, n_states=n_states)
    return dict(zip(NAMES, values))


def _run(implementation="xla", chunk_size=32, **options):
    def run(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("x", "dt", "A", "B", "C")]
        return stellax.ssd(*args, **d, **s, chunk_size=chunk_size, return_final_states=True,
                           implementation=implementation, **options)
    return run


def _golden(**options):
    def ref(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("x", "dt", "A", "B", "C")]
        return ssd_op.reference(*args, **d, **s, return_final_states=True, **options)
    return ref


@pytest.mark.parametrize("T, dtype, chunk_size", [(1, F32, 64), (65, F32, 32), (300, F32, 64), (70, BF16, 16)])
def test_ssd_matches_golden(T, dtype, chunk_size):
    diff = _inputs(2 if T < 300 else 1, T, 4, 16, 2, 32, dtype)
    check_against_golden(_run(chunk_size=chunk_size, dt_softplus=True), _golden(dt_softplus=True), diff, dtype=dtype)


def test_ssd_optional_inputs_and_dt_limit():
    diff = _inputs(1, 50, 2, 16, 1, 16)
    diff["D"] = jax.random.normal(jax.random.PRNGKey(1), (2, 16))  # per-channel D [H, P]
    for drop in ("z", "dt_bias", "initial_states"):
        diff.pop(drop)
    options = {"dt_softplus": True, "dt_limit": (0.01, 0.5)}
    check_against_golden(_run(**options), _golden(**options), diff, dtype=F32)


def test_ssd_strong_decay_is_finite():
    diff = _inputs(1, 130, 2, 16, 1, 16)
    diff["A"] = jnp.full((2,), -1e3)
    diff["dt"] = jnp.abs(diff["dt"]) + 0.02  # dt·A ≤ −20 every step
    diff.pop("dt_bias")
    out = jax.jit(_run())(diff, {})
    grads = jax.jit(jax.grad(lambda d: sum(jnp.sum(o) for o in _run()(d, {}))))(diff)
    for leaf in jax.tree_util.tree_leaves((out, grads)):
        assert bool(jnp.isfinite(leaf).all())
    assert_close(out[0], _golden()(diff, {})[0], dtype=F32)


def test_ssd_varlen_equals_each_sequence_alone():
    lengths = [10, 70, 0, 33]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    diff = _inputs(1, int(cu[-1]), 2, 16, 1, 16, n_states=len(lengths))
    run = _run(dt_softplus=True)
    y, final = jax.jit(run)(diff, {"cu_seqlens": jnp.asarray(cu)})
    for i in range(len(lengths)):
        a, b = int(cu[i]), int(cu[i + 1])
        piece = {n: (v[:, a:b] if n in ("x", "dt", "B", "C", "z") else v) for n, v in diff.items()}
        piece["initial_states"] = diff["initial_states"][i:i + 1]
        y_i, s_i = run(piece, {})
        if b > a:
            assert_close(y[:, a:b], y_i, dtype=F32, name=f"y[{i}]")
        assert_close(final[i:i + 1], s_i, dtype=F32, name=f"final[{i}]")
    check_against_golden(run, _golden(dt_softplus=True), diff, {"cu_seqlens": jnp.asarray(cu)}, dtype=F32)


def test_ssd_step_token_by_token_equals_ssd():
    diff = _inputs(2, 20, 4, 16, 2, 32)
    y, final = jax.jit(_run(dt_softplus=True))(diff, {})
    step = jax.jit(lambda s, x, dt, B, C, z: stellax.ssd_step(s, x, dt, diff["A"], B, C, D=diff["D"], z=z,
                                                                dt_bias=diff["dt_bias"], dt_softplus=True))
    state = diff["initial_states"]
    ys = []
    for t in range(20):
        y_t, state = step(state, diff["x"][:, t], diff["dt"][:, t], diff["B"][:, t], diff["C"][:, t],
                          diff["z"][:, t])
        ys.append(y_t)
    assert_close(jnp.stack(ys, axis=1), y, dtype=F32, name="y")
    assert_close(state, final, dtype=F32, name="state")


def test_ssd_two_parts_equal_one_run():
    diff = _inputs(1, 150, 2, 16, 1, 16)
    run = jax.jit(_run(dt_softplus=True))
    y, final = run(diff, {})
    seq = ("x", "dt", "B", "C", "z")
    y1, s1 = run({n: (v[:, :61] if n in seq else v) for n, v in diff.items()}, {})
    y2, s2 = run(dict({n: (v[:, 61:] if n in seq else v) for n, v in diff.items()}, initial_states=s1), {})
    assert_close(jnp.concatenate([y1, y2], axis=1), y, dtype=F32)
    assert_close(s2, final, dtype=F32)


@pytest.mark.parametrize("changes, error, match", [
    ({"B": jnp.zeros((1, 16, 3, 8)), "C": jnp.zeros((1, 16, 3, 8))}, ValueError, "multiple of the number of groups"),
    ({"A": jnp.zeros((3,))}, ValueError, "A: expected shape"),
    ({"dt": jnp.zeros((1, 16, 4, 1))}, ValueError, "dt: expected shape"),
    ({"initial_states": jnp.zeros((1, 4, 8, 9))}, ValueError, "initial_states: expected shape"),
    ({"cu_seqlens": jnp.array([0, 10, 5, 16])}, ValueError, "non-decreasing"),
    ({"cu_seqlens": jnp.array([0, 10])}, ValueError, "end at T = 16"),
    ({"dt_limit": (1.0, 0.5)}, ValueError, "dt_limit"),
    ({"D": jnp.zeros((4, 3))}, ValueError, "D: expected shape"),
])
def test_ssd_bad_input(changes, error, match):
    kwargs = {"x": jnp.zeros((1, 16, 4, 8)), "dt": jnp.zeros((1, 16, 4)), "A": -jnp.ones((4,)),
              "B": jnp.zeros((1, 16, 2, 8)), "C": jnp.zeros((1, 16, 2, 8))}
    kwargs.update(changes)
    args = [kwargs.pop(n) for n in ("x", "dt", "A", "B", "C")]
    with pytest.raises(error, match=match):
        stellax.ssd(*args, **kwargs)


def test_ssd_batch_above_one_with_cu_seqlens_is_rejected():
    d = _inputs(2, 16, 2, 8, 1, 8)
    with pytest.raises(ValueError, match="batch size 1"):
        stellax.ssd(d["x"], d["dt"], d["A"], d["B"], d["C"], cu_seqlens=jnp.array([0, 16]))


def test_ssd_step_bad_state():
    d = _inputs(2, 1, 2, 8, 1, 8)
    with pytest.raises(ValueError, match="state: expected shape"):
        stellax.ssd_step(jnp.zeros((2, 2, 8, 4)), d["x"][:, 0], d["dt"][:, 0], d["A"], d["B"][:, 0], d["C"][:, 0])
