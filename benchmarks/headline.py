"""The headline benchmarks of the GPU suite, in the order they are measured.

Each `Case` is one problem (shape, dtype, mode) timed first with the stellax
kernel, then with its peers; a record carries the median time, TFLOP/s, % of
the bf16 peak (datasheet and measured), GB/s, the ratio to each peer and the
cost model's prediction for the config the kernel ran with:

1. attention forward, bf16, head dim 128, T = 16k, non-causal then causal,
   against cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``)
   and torch SDPA;
2. attention forward + backward, the same shapes and peers;
3. ``ragged_dot`` M=16384 K=7168 N=2048 G=64, balanced then skewed groups,
   against ``jax.lax.ragged_dot`` and a dense matmul of the same FLOPs;
4. paged decode (B=8, 8k context, GQA 64/8, head dim 128) against the copy
   bandwidth measured by the calibration;
5. Gated DeltaNet forward (``chunk_gated_delta_rule``) at T = 32k.

``dry=True`` gives tiny float32/bfloat16 shapes for a CPU rehearsal (kernels
interpreted). `run_cases` measures in order until ``deadline`` (a callable
clock, so the suite can simulate a slow device; the first case always) and
records the rest as skipped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

#: bf16 dense peak of the H200 (datasheet) and the measured ceilings on the lent machine.
PEAK_BF16_FLOPS = 989e12
MEASURED_BF16_FLOPS = 790e12


@dataclasses.dataclass
class Case:
    """One headline problem: the stellax op call and its peers."""

    name: str
    op: str  # registered op name
    implementation: str
    args: tuple
    kwargs: dict
    mode: str = "forward"
    peers: dict = dataclasses.field(default_factory=dict)  # label → fn(*args) for stellax.benchmark
    torch_peer: Callable | None = None  # (args, mode) → (median_ms or raise)
    copy_peer: bool = False  # compare GB/s with the calibrated copy bandwidth


def _attention_cases(dry: bool) -> list[Case]:
    import jax
    import jax.numpy as jnp

    t, n, d, dtype = (64, 2, 32, jnp.bfloat16) if dry else (16384, 16, 128, jnp.bfloat16)
    shape = (1, t, n, d)
    args = tuple(jax.ShapeDtypeStruct(shape, dtype) for _ in range(3))
    cases = []
    for mode in ("forward", "forward_backward"):
        for causal in (False, True):
            cudnn = _jax_nn(causal, "cudnn")
            cases.append(Case(f"attention {'fwd' if mode == 'forward' else 'fwd+bwd'} bf16 T={t} N={n} D={d} "
                              f"{'causal' if causal else 'full'}", "attention", "triton", args,
                              {"is_causal": causal}, mode, peers={"jax.nn (cudnn)": cudnn},
                              torch_peer=_torch_sdpa(causal)))
    return cases


def _jax_nn(causal: bool, implementation: str):
    import jax

    def peer(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
    return peer


def _torch_sdpa(causal: bool):
    def run(args, mode: str, min_time: float) -> float:
        import torch
        import torch.nn.functional as F

        device = "cuda" if torch.cuda.is_available() else "cpu"
        b, t, n, d = args[0].shape
        dtype = torch.bfloat16
        q, k, v = (torch.randn(b, n, t, d, device=device, dtype=dtype, requires_grad=mode != "forward")
                   for _ in range(3))
        grad = torch.randn(b, n, t, d, device=device, dtype=dtype)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if mode != "forward":
                out.backward(grad)
        return _time_torch(step, device, min_time)
    return run


def _time_torch(step, device: str, min_time: float) -> float:
    """Median ms of ``step()`` (CUDA events on a GPU, the wall clock on a CPU)."""
    import statistics

    import torch

    step()
    times = []
    spent = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - spent < min_time and len(times) < 200):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _pick(op, label_part: str, dry: bool, dtype_name: str = "float32"):
    """The op's benchmark example whose label contains ``label_part`` (dry: its first float32
    example), its float operands as shape structs (the measurement draws them; nothing else is
    built)."""
    import jax.numpy as jnp

    from stellax.testing.static_gpu import abstract_examples

    if dry:
        return abstract_examples(lambda: op.examples(jnp.dtype(dtype_name)))[0]
    examples = abstract_examples(op.benchmarks)
    for example in examples:
        if label_part in example.label:
            return example
    raise LookupError(f"{op.name}: no benchmark shape with {label_part!r} in its label; "
                      f"have {[e.label for e in examples]}")


def _moe_cases(ops, dry: bool) -> list[Case]:
    import jax
    import jax.numpy as jnp

    op = ops["ragged_dot"]
    cases = []
    for skew in ("balanced", "skewed"):
        e = _pick(op, f"M=16384 K=7168 N=2048 G=64 {skew}", dry)
        if dry and skew == "skewed":
            continue  # one rehearsal case is enough on a CPU

        def ragged(lhs, rhs, group_sizes):
            return jax.lax.ragged_dot(lhs, rhs, group_sizes)

        def dense(lhs, rhs, group_sizes):
            return jnp.dot(lhs, rhs[0], preferred_element_type=jnp.float32).astype(lhs.dtype)
        cases.append(Case(f"ragged_dot {e.label}", "ragged_dot", "triton", e.args, e.kwargs,
                          peers={"jax.lax.ragged_dot": ragged, "dense matmul (same FLOPs)": dense}))
    return cases


def headline_cases(ops, dry: bool = False):
    """Every headline case, in measuring order (a generator: a family's shapes are built when
    its turn comes, so the first case starts at once)."""
    yield from _attention_cases(dry)
    yield from _moe_cases(ops, dry)
    paged = _pick(ops["paged_attention"], "decode B=8 ctx=8192", dry)
    yield Case(f"paged decode {paged.label}", "paged_attention", "triton", paged.args, paged.kwargs,
               copy_peer=True)
    gdn = _pick(ops["chunk_gated_delta_rule"], "T=32768", dry)
    yield Case(f"GDN forward {gdn.label}", "chunk_gated_delta_rule", "triton", gdn.args, gdn.kwargs)


def _record_json(rec) -> dict:
    roof = rec.roofline or {}
    return {"median_ms": rec.median_ms, "min_ms": rec.min_ms, "iqr_ms": rec.iqr_ms, "timer": rec.timer,
            "flops": rec.flops, "bytes": rec.bytes_accessed, "tflops": roof.get("tflops"),
            "gbps": roof.get("gbps"), "pct_roofline": roof.get("pct_roofline"), "error": rec.error,
            "skipped": rec.skipped, "compile_time_s": rec.compile_time_s}


def _predict(op, case: Case) -> dict | None:
    """The cost model's estimate for the config dispatch picks for this call."""
    from stellax.bench import cost_model

    try:
        call = op.check(*case.args, **case.kwargs)
        impl = op.implementations[case.implementation]
        config = impl.default_config(call)
        out = cost_model.estimate(op, case.implementation, call, config).to_json()
        out["config"] = repr(config)
        out["covers"] = "forward" if case.mode != "forward" else case.mode
        return out
    except Exception as e:  # noqa: BLE001 - the prediction is informative only
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def measure_case(case: Case, ops, *, interpret: bool, min_time: float, calibration: dict | None,
                 log: Callable[[str], None] = print) -> dict:
    """Time ``case`` with stellax, then its peers; the record of the case."""
    import stellax
    from stellax.core.platform import interpret_mode

    from stellax.bench.inputs import materialize_example
    from stellax.core import Example

    op = ops[case.op]
    concrete = materialize_example(Example(case.name, case.args, case.kwargs))
    case = dataclasses.replace(case, args=concrete.args, kwargs=concrete.kwargs)
    result: dict = {"case": case.name, "op": case.op, "implementation": case.implementation, "mode": case.mode,
                    "prediction": _predict(op, case), "peers": {}}

    def ours(*args):
        return op(*args, implementation=case.implementation, **case.kwargs)
    with interpret_mode(True) if interpret else _Null():
        rec = stellax.benchmark(ours, *case.args, mode=case.mode, min_time=min_time, input_sets=2,
                                name=case.name)
    result["stellax"] = _record_json(rec)
    flops, ms = rec.flops, rec.median_ms
    if ms and flops:
        result["stellax"]["pct_peak_bf16"] = 100 * flops / (ms * 1e-3) / PEAK_BF16_FLOPS
        result["stellax"]["pct_measured_bf16"] = 100 * flops / (ms * 1e-3) / MEASURED_BF16_FLOPS
    log(f"  {case.name}: stellax {_fmt(result['stellax'])}")
    for label, fn in case.peers.items():
        try:
            peer = stellax.benchmark(fn, *case.args, mode=case.mode, min_time=min_time, input_sets=2,
                                     flops=flops, bytes_accessed=rec.bytes_accessed, name=label)
            entry = _record_json(peer)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here is reported
            entry = {"error": f"{type(e).__name__}: {e}"[:300]}
        _ratio(entry, ms)
        result["peers"][label] = entry
        log(f"    vs {label}: {_fmt(entry)}")
    if case.torch_peer is not None:
        try:
            peer_ms = case.torch_peer(case.args, case.mode, min_time)
            entry = {"median_ms": peer_ms, "timer": "torch.cuda.Event or wall",
                     "tflops": flops / (peer_ms * 1e-3) / 1e12 if flops else None}
        except Exception as e:  # noqa: BLE001
            entry = {"error": f"{type(e).__name__}: {e}"[:300]}
        _ratio(entry, ms)
        result["peers"]["torch SDPA"] = entry
        log(f"    vs torch SDPA: {_fmt(entry)}")
    if case.copy_peer and calibration and ms and rec.bytes_accessed:
        copy = calibration.get("copy", {})
        copy_bps = copy.get("bytes_per_s") or (copy["bytes"] / (copy["median_ms"] * 1e-3) if copy.get("median_ms")
                                               else None)
        gbps = rec.bytes_accessed / (ms * 1e-3)
        result["peers"]["copy bandwidth"] = {"gbps": copy_bps / 1e9 if copy_bps else None,
                                             "fraction_of_copy": gbps / copy_bps if copy_bps else None}
        log(f"    vs copy: {gbps / 1e9:.0f} GB/s of {copy_bps / 1e9 if copy_bps else float('nan'):.0f} GB/s")
    return result


def _ratio(entry: dict, ms: float | None) -> None:
    if ms and entry.get("median_ms"):
        entry["stellax_speedup"] = entry["median_ms"] / ms


def _fmt(entry: dict) -> str:
    if entry.get("error") or entry.get("skipped"):
        return f"unavailable: {(entry.get('error') or entry.get('skipped'))[:120]}"
    parts = [f"{entry['median_ms']:.4g} ms"]
    if entry.get("tflops"):
        parts.append(f"{entry['tflops']:.1f} TFLOP/s")
    if entry.get("pct_peak_bf16"):
        parts.append(f"{entry['pct_peak_bf16']:.0f}% of bf16 peak")
    if entry.get("stellax_speedup"):
        parts.append(f"stellax {entry['stellax_speedup']:.2f}x")
    return ", ".join(parts)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_cases(cases, ops, *, now: Callable[[], float], deadline: float, interpret: bool,
              min_time: float, calibration: dict | None, log: Callable[[str], None] = print) -> list[dict]:
    """Measure ``cases`` in order while ``now() < deadline`` (the first one always); later ones
    are recorded as skipped."""
    out = []
    for case in cases:
        if out and now() >= deadline:
            out.append({"case": case.name, "op": case.op, "mode": case.mode, "skipped": "time budget exhausted"})
            continue
        started = now()
        try:
            entry = measure_case(case, ops, interpret=interpret, min_time=min_time, calibration=calibration, log=log)
        except Exception as e:  # noqa: BLE001 - a failed case is recorded, the suite goes on
            entry = {"case": case.name, "op": case.op, "mode": case.mode, "error": f"{type(e).__name__}: {e}"[:400]}
            log(f"  {case.name}: FAILED {entry['error'][:200]}")
        entry["elapsed_s"] = round(now() - started, 2)
        entry["finished_at_s"] = round(now(), 2)
        out.append(entry)
    return out


def summary_lines(records: list[dict]) -> list[str]:
    """One line per headline case for the suite's summary."""
    lines = [f"{'headline case':<58} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'pred %roof':>10}  peers (stellax speedup)"]
    for r in records:
        s = r.get("stellax") or {}
        if not s.get("median_ms"):
            lines.append(f"{r['case'][:58]:<58} {(r.get('skipped') or r.get('error') or s.get('error') or '')[:60]}")
            continue
        pred = (r.get("prediction") or {}).get("fraction_of_roofline")
        peers = ", ".join(f"{k}: {v['stellax_speedup']:.2f}x" if v.get("stellax_speedup") else
                          (f"{k}: {100 * v['fraction_of_copy']:.0f}% of copy" if v.get("fraction_of_copy") else
                           f"{k}: n/a") for k, v in r.get("peers", {}).items())
        lines.append(f"{r['case'][:58]:<58} {s['median_ms']:>9.4g} {s.get('tflops') or 0:>8.1f} "
                     f"{s.get('pct_peak_bf16') or 0:>6.1f} {'' if pred is None else f'{100 * pred:.0f}':>10}  {peers}")
    return lines

