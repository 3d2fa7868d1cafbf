"""Shared helpers for the context-parallel tests: meshes, inputs, and the
single-device comparison (forward and all gradients)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import stellax
from stellax.parallel import context_parallel_attention, reorder_for_load_balance, restore_from_load_balance
from stellax.testing import assert_close


def need_devices(n: int):
    import pytest
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (tests/conftest.py sets --xla_force_host_platform_device_count=8)")


def mesh_1d(size: int, name: str = "cp") -> Mesh:
    need_devices(size)
    return Mesh(np.array(jax.devices()[:size]), (name,))


def mesh_2d(ring: int, uly: int) -> Mesh:
    need_devices(ring * uly)
    return Mesh(np.array(jax.devices()[:ring * uly]).reshape(ring, uly), ("ring", "uly"))


def attention_inputs(seed=0, b=1, t=32, n=4, kh=2, h=8, hv=None, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 5)
    hv = h if hv is None else hv
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    k = jax.random.normal(keys[1], (b, t, kh, h), dtype)
    v = jax.random.normal(keys[2], (b, t, kh, hv), dtype)
    do = jax.random.normal(keys[3], (b, t, n, hv), dtype)
    return q, k, v, do


def run_cp(q, k, v, do, *, strategy, mesh, axis_size, load_balance=None, sinks=None, segment_ids=None,
           implementation="xla", **mask):
    """``(out, (dq, dk, dv[, dsinks]))`` of the context-parallel attention in natural token order."""
    kw = (dict(ulysses_axis="uly", ring_axis="ring") if strategy == "usp" else dict(axis_name=mesh.axis_names[0]))
    lay = lambda x: reorder_for_load_balance(x, axis_size, load_balance)
    args = (q, k, v) + (() if sinks is None else (sinks,))

    def loss(q, k, v, *rest):
        seg = None if segment_ids is None else lay(segment_ids)
        out = context_parallel_attention(lay(q), lay(k), lay(v), mesh=mesh, strategy=strategy,
                                         load_balance=load_balance, segment_ids=seg,
                                         sinks=rest[0] if rest else None, implementation=implementation,
                                         **kw, **mask)
        out = restore_from_load_balance(out, axis_size, load_balance)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return out, grads


def run_single(q, k, v, do, *, sinks=None, segment_ids=None, **mask):
    args = (q, k, v) + (() if sinks is None else (sinks,))

    def loss(q, k, v, *rest):
        out = stellax.dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                            sinks=rest[0] if rest else None, implementation="xla", **mask)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return out, grads


def check_against_single(strategy, mesh, axis_size, *, load_balance=None, seed=0, inputs=None, sinks=None,
                         segment_ids=None, implementation="xla", **mask):
    q, k, v, do = attention_inputs(seed) if inputs is None else inputs
    out, grads = run_cp(q, k, v, do, strategy=strategy, mesh=mesh, axis_size=axis_size, load_balance=load_balance,
                        sinks=sinks, segment_ids=segment_ids, implementation=implementation, **mask)
    ref, ref_grads = run_single(q, k, v, do, sinks=sinks, segment_ids=segment_ids, **mask)
    assert_close(out, ref, name=f"{strategy} out")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert_close(g, r, gradient=True, name=f"{strategy} {name}")
