"""Run as a script (by `test_interpret_collectives.py`, in a process of its own): ring and USP
context parallelism and expert parallelism in interpret mode on 4 simulated CPU devices, forward
and gradients, each compared with the single-device result; and the refusal of what jax's Mosaic
TPU interpreter cannot run between collectives (an explicit ``mosaic_tpu`` in ring attention and
in expert parallelism: seen hanging or aborting, forward and backward, depending on thread timing)
before anything runs.

A collective that deadlocks aborts the process (XLA:CPU's rendezvous timeout), so the test runs this
in a subprocess and reads its last line: ``ok <seconds>`` or a failure."""

from __future__ import annotations

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["STELLAX_INTERPRET"] = "1"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import stellax  # noqa: E402
from stellax.parallel import context_parallel_attention  # noqa: E402
from stellax.testing import assert_close  # noqa: E402


def _attention_case(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (1, 64, 4, 16))
    k = jax.random.normal(keys[1], (1, 64, 2, 16))
    v = jax.random.normal(keys[2], (1, 64, 2, 16))
    return q, k, v, jax.random.normal(keys[3], (1, 64, 4, 16))


def context_parallel(strategy: str, implementation=None, gradients=True):
    q, k, v, do = _attention_case()
    devices = np.array(jax.devices()[:4])
    if strategy == "usp":
        mesh, axes = Mesh(devices.reshape(2, 2), ("ring", "uly")), dict(ring_axis="ring", ulysses_axis="uly")
    else:
        mesh, axes = Mesh(devices, ("cp",)), dict(axis_name="cp")

    def loss(q, k, v, parallel):
        if parallel:
            out = context_parallel_attention(q, k, v, mesh=mesh, strategy=strategy, is_causal=True,
                                             implementation=implementation, **axes)
        else:
            out = stellax.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return jnp.sum(out * do), out

    if not gradients:
        got, want = (jax.jit(lambda q, k, v, p=p: loss(q, k, v, p)[1])(q, k, v) for p in (True, False))
        assert_close(got, want, name=f"{strategy} {implementation} out")
        return
    for parallel, name in ((True, strategy), (False, "single")):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True), static_argnums=3)(
            q, k, v, parallel)
        if parallel:
            got = (out, grads)
    assert_close(got[0], out, name=f"{strategy} out")
    for n, g, r in zip(("dq", "dk", "dv"), got[1], grads):
        assert_close(g, r, gradient=True, name=f"{strategy} {n}")


def expert_parallel(implementation=None):
    experts, tokens, d, f = 8, 32, 16, 32
    keys = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(keys[0], (tokens, d))
    logits = jax.random.normal(keys[1], (tokens, experts))
    w_gate_up = jax.random.normal(keys[2], (experts, d, 2, f)) / d ** 0.5
    w_down = jax.random.normal(keys[3], (experts, f, d)) / f ** 0.5
    cot = jax.random.normal(keys[4], (tokens, d))
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))

    def loss(x, w_gate_up, w_down, parallel):
        if parallel:
            out = stellax.moe_mlp_expert_parallel(x, logits, w_gate_up, w_down, mesh=mesh, axis_name="ep", top_k=2,
                                                  implementation=implementation)
        else:
            out = stellax.moe_mlp(x, logits, w_gate_up, w_down, top_k=2, implementation="xla")
        return jnp.sum(out * cot), out

    results = [jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True), static_argnums=3)(x, w_gate_up, w_down, p)
               for p in (True, False)]
    (_, out), grads = results[0]
    (_, want), want_grads = results[1]
    assert_close(out, want, name="expert parallel out")
    for n, g, r in zip(("dx", "dw_gate_up", "dw_down"), grads, want_grads):
        assert_close(g, r, gradient=True, name=f"expert parallel {n}")


def refused(run) -> None:
    try:
        run()
    except stellax.UnsupportedError as e:
        assert "interpret mode across 4 simulated CPU devices" in str(e), e
        return
    raise AssertionError("expected UnsupportedError")


CASES = {
    "ring": lambda: context_parallel("ring"),
    "usp": lambda: context_parallel("usp"),
    "ring-mosaic-refused": lambda: refused(lambda: context_parallel("ring", "mosaic_tpu", gradients=False)),
    "expert": expert_parallel,
    "expert-mosaic-refused": lambda: refused(lambda: expert_parallel("mosaic_tpu")),
}

if __name__ == "__main__":
    start = time.time()
    for case in sys.argv[1:] or CASES:
        CASES[case]()
        print(f"{case} {time.time() - start:.1f}s", flush=True)
    print(f"ok {time.time() - start:.1f}", flush=True)
