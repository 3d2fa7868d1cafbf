"""Bad exchange metadata under jit (issue 43): `ragged_all_to_all_padded`, the CPU form of expert
parallelism's ``ragged_all_to_all``, on 4 simulated CPU devices (the session's 8, tests/conftest.py).
Valid metadata gives exactly the ``ragged_all_to_all`` result (a numpy model of its contract); a
device that receives a slice with invalid metadata (negative size, input or output range outside its
array, a destination past ``max_send``, ``recv_sizes`` disagreeing with the sender, overlapping output
ranges) has every output row NaN, the other devices exact. In checked mode each condition is a
checkify check naming the argument, the index and the values; off, no check is in the program."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import Mesh, PartitionSpec

import stellax
from stellax.ops.moe import moe_mlp, moe_mlp_expert_parallel, ragged_all_to_all_padded

P, S, ROWS_IN, ROWS_OUT, MAX_SEND = 4, 2, 12, 16, 6   # devices, slices per destination, rows, bound


def _mesh():
    return Mesh(np.array(jax.devices()[:P]), ("ep",))


def _exchange(max_send=MAX_SEND):
    """A fresh jitted ``shard_map`` of the exchange over stacked per-device arguments ``[P, ...]``
    (fresh: checked mode is read when it is traced)."""
    def body(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
        return ragged_all_to_all_padded(operand[0], output[0], input_offsets[0], send_sizes[0], output_offsets[0],
                                        recv_sizes[0], axis_name="ep", max_send=max_send)[None]
    spec = PartitionSpec("ep")
    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=(spec,) * 6, out_specs=spec, check_vma=False))


def _metadata(seed=0):
    """Consistent metadata: device s sends ``sizes[s, j]`` rows (slice j to device j // S) packed from
    row 0; each receiver lays its slices out by (source, local slice) from row 0."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 3, size=(P, P * S)).astype(np.int32)
    input_offsets = np.concatenate([np.zeros((P, 1), np.int32), np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    output_offsets = np.zeros((P, P * S), np.int32)
    recv_sizes = np.zeros((P, P * S), np.int32)
    for d in range(P):
        row = 0
        for s in range(P):
            for i in range(S):
                output_offsets[s, d * S + i] = row
                recv_sizes[d, s * S + i] = sizes[s, d * S + i]
                row += sizes[s, d * S + i]
    operand = rng.standard_normal((P, ROWS_IN, 3)).astype(np.float32)
    output = np.full((P, ROWS_OUT, 3), 7.0, np.float32)   # rows no slice writes keep their value
    return dict(operand=operand, output=output, input_offsets=input_offsets.astype(np.int32), send_sizes=sizes,
                output_offsets=output_offsets, recv_sizes=recv_sizes)


def _model(m):
    """numpy: the ``jax.lax.ragged_all_to_all`` contract on valid metadata."""
    out = m["output"].copy()
    for s in range(P):
        for j in range(P * S):
            size, start, dest = m["send_sizes"][s, j], m["input_offsets"][s, j], m["output_offsets"][s, j]
            out[j // S, dest:dest + size] = m["operand"][s, start:start + size]
    return out


def _run(m, **kw):
    return np.asarray(_exchange(**kw)(*m.values()))


def _with(m, name, index, value):
    m = {k: v.copy() for k, v in m.items()}
    m[name][index] = value
    return m


def test_valid_metadata_is_the_ragged_all_to_all_result():
    for seed in range(3):
        m = _metadata(seed)
        np.testing.assert_array_equal(_run(m), _model(m))


# (argument, index, bad value, the devices whose output is NaN, the checked-mode message)
BAD = {
    "negative_size": ("send_sizes", (1, 5), -1, [2],
                      r"at mapped index 1: send_sizes\[5\] = -1: expected a size >= 0"),
    "input_past_operand": ("input_offsets", (0, 2), ROWS_IN, [1],
                           r"at mapped index 0: input_offsets\[2\] = 12 with send_sizes\[2\] = 1: expected a slice "
                           r"inside the 12 rows of operand"),
    "negative_input": ("input_offsets", (3, 6), -1, [3], r"at mapped index 3: input_offsets\[6\] = -1"),
    "output_past_output": ("output_offsets", (2, 1), ROWS_OUT, [0],
                           r"at mapped index 2: output_offsets\[1\] = 16 with send_sizes\[1\] = 1: expected a slice "
                           r"inside the 16 rows of output"),
    "past_max_send": ("send_sizes", (0, 4), MAX_SEND + 1, [2],
                      rf"at mapped index 0: send_sizes: 7 rows for device 2 \(the sum of its 2 slices\): expected at "
                      rf"most max_send = {MAX_SEND}"),
    "recv_disagrees": ("recv_sizes", (3, 0), 9, [3],
                       r"at mapped index 3: recv_sizes\[0\] = 9: expected the size its source sends, \d \(send_sizes "
                       r"on device 0"),
    "overlap": ("output_offsets", (2, 6), 0, [3],
                r"at mapped index 3: output_offsets: the slices received from device 1 \(rows \[0, 2\)\) and from "
                r"device 2 \(rows \[0, 2\)\) overlap"),
}


def _bad(case):
    name, index, value, nan_devices, message = BAD[case]
    m = _metadata()
    # the cases point at live slices (seed 0); "overlap" moves device 2's 2 rows for device 3 onto the
    # rows [0, 2) device 1's slice already writes there
    if name != "send_sizes":
        assert m["send_sizes"][index] > 0, (case, m["send_sizes"])
    m = _with(m, name, index, value)
    if case == "past_max_send":   # the receiver agrees, so only the sender's bound is broken
        m = _with(m, "recv_sizes", (2, index[1] % S), value)
    if case == "negative_size":   # the receiver agrees too
        m = _with(m, "recv_sizes", (2, 1 * S + index[1] % S), value)
    return m, nan_devices, message


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_metadata_makes_the_receiving_device_nan(case):
    m, nan_devices, _ = _bad(case)
    out = _run(m)
    nan = np.isnan(out)
    assert [d for d in range(P) if nan[d].all()] == nan_devices
    assert not nan[[d for d in range(P) if d not in nan_devices]].any()
    good = _model(_metadata())
    for d in range(P):
        if d not in nan_devices:
            np.testing.assert_array_equal(out[d], good[d])


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_metadata_checked_names_the_argument(case):
    m, _, message = _bad(case)
    with stellax.checked():
        err, _ = checkify.checkify(_exchange())(*m.values())
        assert err.get() is not None and re.search(message, err.get()), err.get()
        err, out = checkify.checkify(_exchange())(*_metadata().values())
        assert err.get() is None
        np.testing.assert_array_equal(np.asarray(out), _model(_metadata()))


def test_integer_rows_get_the_lowest_value():
    m = _metadata()
    m["operand"] = np.arange(P * ROWS_IN * 3, dtype=np.int32).reshape(P, ROWS_IN, 3)
    m["output"] = np.zeros((P, ROWS_OUT, 3), np.int32)
    np.testing.assert_array_equal(_run(m), _model(m))
    out = _run(_with(m, "recv_sizes", (1, 0), 5))
    assert (out[1] == np.iinfo(np.int32).min).all() and (out[[0, 2, 3]] > np.iinfo(np.int32).min).all()


def test_no_check_in_the_program_when_off():
    m = _metadata()
    text = str(jax.make_jaxpr(_exchange())(*m.values())).replace("check_vma", "")   # shard_map's option
    assert "check" not in text and "assert" not in text
    off = str(jax.make_jaxpr(checkify.checkify(_exchange()))(*m.values()))
    with stellax.checked():
        assert str(jax.make_jaxpr(checkify.checkify(_exchange()))(*m.values())) != off


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_parallel_metadata_passes_checked_mode(capacity_factor):
    """The exchange's metadata that expert parallelism builds itself is always valid: checked mode
    finds nothing and the result equals the single-device MoE."""
    experts, tokens, d, f = 8, 16, 8, 16
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (tokens, d))
    logits = jax.random.normal(keys[1], (tokens, experts))
    w_gate_up = jax.random.normal(keys[2], (experts, d, 2, f)) / d ** 0.5
    w_down = jax.random.normal(keys[3], (experts, f, d)) / f ** 0.5
    kw = dict(top_k=2, capacity_factor=capacity_factor, implementation="xla")
    with stellax.checked():
        err, out = checkify.checkify(jax.jit(lambda *a: moe_mlp_expert_parallel(
            *a, mesh=_mesh(), axis_name="ep", collective="padded", **kw)))(x, logits, w_gate_up, w_down)
    assert err.get() is None
    want = moe_mlp(x, logits, w_gate_up, w_down, **kw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert jnp.isfinite(out).all()
