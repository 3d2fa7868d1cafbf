"""Communication and memory accounting for sharded programs.

`collective_traffic` walks the jaxpr of a function (``jax.make_jaxpr``:
inside ``shard_map`` the shapes are per-device) and adds up the bytes each
device moves, with the usual ring-algorithm models (``G`` = the collective's
group size, ``X`` = its per-device result in bytes):

    all_gather          X·(G−1)/G          (receive the other G−1 pieces)
    all_to_all          X·(G−1)/G          (keep 1/G, exchange the rest)
    ppermute            X                  (send one block, receive one)
    reduce_scatter      X·(G−1)            (operand X·G, ring reduce-scatter)
    psum (all-reduce)   2·X·(G−1)/G        (reduce-scatter + all-gather)

A ``scan`` body counts ``length`` times, a ``cond`` its most expensive
branch, a ``while`` body once (its trip count is unknown; `Traffic.while_loops`
says how many were seen). Differentiate first (``jax.grad``) to count a
training step: the custom VJPs' backward passes are then in the jaxpr.

`memory_report` turns ``compiled.memory_analysis()`` into per-device bytes.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.extend
import numpy as np

_KINDS = {"all_gather": "all_gather", "all_gather_invariant": "all_gather", "all_to_all": "all_to_all",
          "ppermute": "ppermute", "psum": "all_reduce", "psum_invariant": "all_reduce", "psum2": "all_reduce",
          "reduce_scatter": "reduce_scatter"}


@dataclasses.dataclass
class Traffic:
    """Bytes moved per device, by collective kind, and the op counts (executions)."""

    bytes_by_kind: dict
    counts: dict
    while_loops: int = 0

    @property
    def total(self) -> int:
        return int(sum(self.bytes_by_kind.values()))

    def __str__(self):
        kinds = ", ".join(f"{k}: {v / 2**20:.2f} MiB ×{self.counts[k]}" for k, v in sorted(self.bytes_by_kind.items()))
        return f"{self.total / 2**20:.2f} MiB per device ({kinds})"


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _group_size(axis_name, sizes) -> int:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return int(np.prod([sizes.get(a, 1) for a in names]))


def _eqn_bytes(kind, eqn, sizes) -> int:
    x = sum(_nbytes(v.aval) for v in eqn.outvars)
    g = _group_size(eqn.params.get("axis_name", eqn.params.get("axes", ())), sizes)
    if kind in ("all_gather", "all_to_all"):
        return x * (g - 1) // max(g, 1)
    if kind == "ppermute":
        return x
    if kind == "reduce_scatter":
        return x * (g - 1)
    return 2 * x * (g - 1) // max(g, 1)


def _sub_jaxprs(value):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        return [value.jaxpr]
    if isinstance(value, jax.extend.core.Jaxpr):
        return [value]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _walk(jaxpr, sizes, acc, cnt, mult, state):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        kind = _KINDS.get(name)
        if kind is not None:
            acc[kind] += mult * _eqn_bytes(kind, eqn, sizes)
            cnt[kind] += mult
            continue
        inner_sizes = sizes
        mesh = eqn.params.get("mesh")
        if mesh is not None and hasattr(mesh, "shape"):
            inner_sizes = {**sizes, **dict(mesh.shape)}
        if name == "cond":
            best = None
            for branch in eqn.params["branches"]:
                a, c = collections.Counter(), collections.Counter()
                _walk(branch.jaxpr, inner_sizes, a, c, mult, state)
                if best is None or sum(a.values()) > sum(best[0].values()):
                    best = (a, c)
            if best:
                acc.update(best[0])
                cnt.update(best[1])
            continue
        inner = mult * (int(eqn.params["length"]) if name == "scan" else 1)
        if name == "while":
            state["while"] += 1
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                _walk(sub, inner_sizes, acc, cnt, inner, state)


def collective_traffic(fn, *args, **kwargs) -> Traffic:
    """Per-device collective traffic of ``fn(*args, **kwargs)`` (args may be
    ``jax.ShapeDtypeStruct``); see the module docstring for the model."""
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    acc, cnt = collections.Counter(), collections.Counter()
    state = {"while": 0}
    _walk(closed.jaxpr, {}, acc, cnt, 1, state)
    return Traffic(dict(acc), dict(cnt), state["while"])


def memory_report(compiled) -> dict:
    """Per-device bytes from ``compiled.memory_analysis()``: arguments, outputs,
    temporaries and ``peak`` = arguments + outputs + temporaries − aliased."""
    m = compiled.memory_analysis()
    if m is None:  # pragma: no cover - backend without the analysis
        return {}
    get = lambda name: int(getattr(m, name, 0) or 0)
    report = {"argument": get("argument_size_in_bytes"), "output": get("output_size_in_bytes"),
              "temp": get("temp_size_in_bytes"), "alias": get("alias_size_in_bytes")}
    report["peak"] = report["argument"] + report["output"] + report["temp"] - report["alias"]
    return report


def attention_traffic_model(strategy: str, *, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                            axis_size: int, itemsize: int = 2, ulysses_size: int | None = None,
                            backward: bool = False) -> float:
    """Analytic bytes moved per device by one forward (or forward + backward)
    of `context_parallel_attention`, ignoring the small int position/segment
    arrays. ``P`` = ``axis_size`` (total shards); for ``usp`` give the Ulysses
    group size ``U`` (the ring size is ``P / U``).

      all_gather: (P−1)/P · 2·K·T·H            backward adds the reduce-scatter of dK, dV
      ulysses:    (P−1)/P · (2N + 2K')·T·H / P  (q, k, v, out; K' = K repeated to a multiple of P)
      ring:       (P−1) · 2·K·(T/P)·H          backward: K/V again + P hops of f32 dK/dV
    """
    p, t, h = axis_size, seq_len, head_dim
    kv_bytes = 2 * batch * t * kv_heads * h * itemsize  # K and V, whole sequence
    if strategy == "all_gather":
        fwd = kv_bytes * (p - 1) / p
        return fwd * (2 if backward else 1)
    if strategy in ("ulysses", "usp"):
        u = p if strategy == "ulysses" else ulysses_size
        r = p // u
        kv_rep = kv_heads * u // np.gcd(kv_heads, u)
        local_t = t // r  # tokens in a Ulysses group
        a2a = batch * local_t * h * itemsize * (2 * heads + 2 * kv_rep) / u * (u - 1) / u
        if strategy == "ulysses":
            return a2a * (2 if backward else 1)
        ring_kv = 2 * batch * local_t * (kv_rep // u) * h * itemsize
        fwd = a2a + (r - 1) * ring_kv
        return fwd + (a2a + (r - 1) * ring_kv + r * ring_kv * 4 / itemsize if backward else 0)
    if strategy == "ring":
        block = kv_bytes / p
        fwd = (p - 1) * block
        return fwd + ((p - 1) * block + p * block * 4 / itemsize if backward else 0)
    raise ValueError(f"strategy: expected one of all_gather/ulysses/ring/usp, got {strategy!r}")
