"""Collective traffic and memory accounting on tiny sharded programs with
hand-computed sizes."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from stellax.parallel import attention_traffic_model, collective_traffic, memory_report

from .cp_cases import mesh_1d


def test_collective_traffic_counts_bytes_per_device():
    mesh = mesh_1d(4)

    def body(x):  # x: [8, 16] float32 per device (512 B)
        g = lax.all_gather(x, "cp", axis=0, tiled=True)  # [32, 16]: receives 3 × 512 B
        y = lax.ppermute(x, "cp", [(i, (i + 1) % 4) for i in range(4)])  # sends/receives 512 B
        z = lax.all_to_all(x, "cp", 0, 1, tiled=True)  # [2, 64]: exchanges 3/4 of 512 B
        s = lax.psum(x, "cp")  # all-reduce: 2 · 512 · 3/4
        return g[:8] + y + z.reshape(8, 16) + s

    @jax.jit
    def f(x):
        inner = jax.shard_map(body, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False)
        return inner(x) + inner(2 * x)  # the shard_map body is called twice

    x = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    traffic = collective_traffic(f, x)
    per_call = {"all_gather": 1536, "ppermute": 512, "all_to_all": 384, "all_reduce": 768}
    for kind, nbytes in per_call.items():
        assert traffic.bytes_by_kind.get(kind, 0) == 2 * nbytes, (kind, traffic)
    assert traffic.total == 2 * sum(per_call.values())
    report = memory_report(f.lower(x).compile())
    assert report["argument"] == 512 and report["output"] == 512 and report["peak"] >= 1024


def test_traffic_model_scaling():
    kw = dict(batch=1, heads=8, kv_heads=8, head_dim=64, itemsize=2)
    ring = [attention_traffic_model("ring", seq_len=t, axis_size=4, **kw) for t in (1024, 2048)]
    assert ring[1] == 2 * ring[0]
    # Ulysses per-device traffic shrinks with the axis size; all-gather's does not.
    uly = [attention_traffic_model("ulysses", seq_len=4096, axis_size=p, **kw) for p in (2, 8)]
    ag = [attention_traffic_model("all_gather", seq_len=4096, axis_size=p, **kw) for p in (2, 8)]
    assert uly[1] < uly[0] and ag[1] > ag[0]


def test_scan_and_grad_are_counted():
    mesh = mesh_1d(2)

    def body(x):
        def step(c, _):
            return lax.ppermute(c, "cp", [(0, 1), (1, 0)]) * 2.0, None
        return lax.scan(step, x, None, length=3)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=P("cp"), out_specs=P("cp"), check_vma=False)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)  # [2, 8] per device: 64 B
    assert collective_traffic(f, x).bytes_by_kind == {"ppermute": 3 * 64}
    grad = jax.grad(lambda x: f(x).sum())
    assert collective_traffic(grad, x).bytes_by_kind == {"ppermute": 6 * 64}
