"""Communication and memory accounting for sharded programs.

`collective_traffic` reads the collectives of a lowered program (StableHLO
text of ``jax.jit(f).lower(...)``; inside ``shard_map`` the shapes are
per-device) and returns bytes moved per device, with the usual ring-algorithm
models (``G`` = replica-group size, ``X`` = the per-device result in bytes):

    all_gather          X·(G−1)/G          (receive the other G−1 pieces)
    all_to_all          X·(G−1)/G          (keep 1/G, exchange the rest)
    collective_permute  X                  (send one block, receive one)
    reduce_scatter      X·(G−1)            (operand X·G, ring reduce-scatter)
    all_reduce          2·X·(G−1)/G        (reduce-scatter + all-gather)

Functions called several times (``func.call``) are counted once per call;
loops (``while``) are counted once per textual occurrence — the context
parallel code unrolls its ring, so the counts are exact for it.

`memory_report` turns ``compiled.memory_analysis()`` into per-device bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

_DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "f8E4M3FN": 1, "f8E5M2": 1, "i64": 8, "i32": 4,
                "ui32": 4, "i16": 2, "i8": 1, "ui8": 1, "i1": 1, "complex<f32>": 8}
_OPS = ("all_gather", "all_to_all", "collective_permute", "reduce_scatter", "all_reduce")
_OP_RE = re.compile(r'"?stablehlo\.(' + "|".join(_OPS) + r')"?')
_FUNC_RE = re.compile(r"func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)")
_CALL_RE = re.compile(r"(?:func\.)?call\s+@([\w.$-]+)")
_TENSOR_RE = re.compile(r"tensor<([^>]*)>")
_GROUPS_RE = re.compile(r"replica_groups\s*=\s*dense<[^>]*>\s*:\s*tensor<(\d+)x(\d+)xi64>")


def _tensor_bytes(spec: str) -> int:
    parts = spec.split("x")
    dtype = parts[-1]
    dims = [int(d) for d in parts[:-1] if d.isdigit()]
    return int(np.prod(dims, dtype=np.int64)) * _DTYPE_BYTES.get(dtype, 4)


@dataclasses.dataclass
class Traffic:
    """Bytes moved per device, by collective kind, and the op counts."""

    bytes_by_kind: dict
    counts: dict

    @property
    def total(self) -> int:
        return int(sum(self.bytes_by_kind.values()))

    def __str__(self):
        kinds = ", ".join(f"{k}: {v / 2**20:.2f} MiB ×{self.counts[k]}" for k, v in sorted(self.bytes_by_kind.items()))
        return f"{self.total / 2**20:.2f} MiB per device ({kinds})"


def _op_bytes(kind: str, text: str) -> int:
    arrow = text.rfind("->")
    results = _TENSOR_RE.findall(text[arrow:]) if arrow >= 0 else []
    x = sum(_tensor_bytes(r) for r in results)
    groups = _GROUPS_RE.search(text)
    g = int(groups.group(2)) if groups else 1
    if kind in ("all_gather", "all_to_all"):
        return x * (g - 1) // max(g, 1)
    if kind == "collective_permute":
        return x
    if kind == "reduce_scatter":
        return x * (g - 1)
    return 2 * x * (g - 1) // max(g, 1)


def collective_traffic(lowered_or_text) -> Traffic:
    """Per-device collective traffic of a lowered program (or its StableHLO text)."""
    text = lowered_or_text if isinstance(lowered_or_text, str) else lowered_or_text.as_text()
    lines = text.splitlines()
    own = collections.defaultdict(lambda: collections.Counter())  # func -> Counter of (kind, bytes)
    calls = collections.defaultdict(collections.Counter)  # func -> Counter of callee
    func = "main"
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _FUNC_RE.search(line)
        if m:
            func = m.group(1)
        else:
            for callee in _CALL_RE.findall(line):
                calls[func][callee] += 1
            op = _OP_RE.search(line)
            if op:
                chunk, j = line, i
                # Ops with a reduction region close on a later line "}) : (...) -> ...".
                while "->" not in chunk[op.end():] and j + 1 < len(lines):
                    j += 1
                    chunk += "\n" + lines[j]
                    if lines[j].lstrip().startswith("})") and "->" in lines[j]:
                        break
                own[func][(op.group(1), _op_bytes(op.group(1), chunk))] += 1
                i = j
        i += 1

    memo = {}

    def totals(f, depth=0):
        if f in memo:
            return memo[f]
        acc = collections.Counter()
        cnt = collections.Counter()
        for (kind, nbytes), n in own[f].items():
            acc[kind] += nbytes * n
            cnt[kind] += n
        if depth < 64:
            for callee, n in calls[f].items():
                sub_acc, sub_cnt = totals(callee, depth + 1)
                for kind in sub_acc:
                    acc[kind] += sub_acc[kind] * n
                for kind in sub_cnt:
                    cnt[kind] += sub_cnt[kind] * n
        memo[f] = (acc, cnt)
        return memo[f]

    acc, cnt = totals("main")
    return Traffic(dict(acc), dict(cnt))


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
