"""Paged decode on a TPU: stellax's Mosaic kernel against XLA and jax's own kernels, in one process.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/paged_decode_tpu.py --out $OUT/paged_decode.json

Cases (`CASES`; ``--cases`` takes indices into it, the default is the main
set `MAIN`, about 2 minutes on a v5e; ``--list`` prints them): issue 41's decode
grid — batch 8 / 64 / 256, context 1k / 4k / 16k, every sequence at the full
context or mixed lengths (``mixed``: uniform in ``[ctx/8, ctx]``), GQA 32 or
64 query heads over 8 kv heads, head dim 128, pages of 16, 64 or 128 tokens,
bfloat16 queries and pools — and the quantized-cache cases (``quant``: one
batch at 16k context with the bf16, int8, fp8 and int4 caches on the same
keys and values, stellax only: the goal is their throughput against the bf16
cache's). For each case, on the same data:

* ``stellax:mosaic_tpu``: `stellax.paged_attention` on its Mosaic TPU kernel
  with the config stellax picks by itself (shipped cache, then heuristic;
  ``default`` is true when the op would also pick that implementation by
  itself), then with a few explicit ``pages_per_block`` (the rows' ``config``;
  quantized caches are the config's suffix, e.g. ``int8 default``);
* ``stellax:xla`` (``--xla``): the op's XLA path (known slower, 1.4-2.1x on
  the first chip run; off by default to save the chip's time);
* ``jax:paged_attention``: `jax.experimental.pallas.ops.tpu.paged_attention`
  on the same pages in its head-major layout ``[K, pages, page_size, H]``
  (made once, outside the timing), ``pages_per_compute_block`` searched over
  a few values that divide the table width (one row each, the fastest marked
  ``best``);
* ``jax:ragged_paged_attention``: jax's ragged kernel on the pages
  interleaved ``[pages, page_size, 2K, H]`` (k0 v0 k1 v1 ...), one query
  token per sequence: its tuned block sizes with a 100 MiB VMEM limit (at the
  default limit they do not compile on a v5e) and explicit
  ``num_kv_pages_per_block`` / ``num_queries_per_block``.

Timing: each contender is compiled and run once, then timed ``--reps`` times
(``block_until_ready`` after each call; median reported) after ``--warmup``
runs; then ``ms_back_to_back`` (and ``pct_peak_back_to_back``): up to `BACK_TO_BACK` calls
dispatched without waiting, one ``block_until_ready`` at the end, per call: the device's time
once the host's dispatch and the per-call synchronization overlap it (on the 2026-12-06 v5e runs
every contender's ``ms`` fitted about 0.5 ms + bytes / 700-770 GB/s across batches and contexts:
a fixed cost per synchronized call, which this separates from the kernel's time). ``gbps`` counts the same bytes for every contender of a case (the op's
byte model: the K/V pages the sequences read at their lengths, plus q, the
output, tables and lengths); ``pct_peak`` is that against the chip's HBM
bandwidth (819 GB/s on a v5e). Each contender's output is compared once with
the golden (`paged_attention`'s float32 reference) on the first
`CHECK_ROWS` sequences, whose slots past their lengths hold NaN (a kernel
that reads them leaks NaN and the row's error is ``inf``; jax's kernels do, on
mixed lengths: their times still count, their rows' errors say so): ``max_rel_err`` is
``max|out - ref| / max|ref|``, ``rel_l2`` the relative L2 error.

The JSON (``--out``) holds ``{"format": "stellax-paged-decode-tpu", "version": 1,
"environment": {...}, "rows": [ROW, ...]}`` with rows in the suite's results
schema (benchmarks/README.md: op, case, pass, contender, default, peer, ms,
gbps, pct_peak, bound, device, date, skipped, error) plus ``config``,
``max_rel_err``, ``rel_l2``, ``compile_s``, ``ms_back_to_back`` and ``pct_peak_back_to_back``; a quantized
cache's default row also has ``vs_bf16`` / ``vs_bf16_back_to_back`` (`speedup_vs_bf16`). It is rewritten after every
case, so a run cut short keeps what it measured; ``--budget`` seconds stops
starting new cases.

``--dry-run`` runs the same code path on the CPU on tiny shapes with the
Mosaic kernels interpreted (the test suite runs it so the script cannot rot).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
import numpy as np
from stellax.bench.chip_run import ChipRun, elapsed, errors, mark_best, time_fn

#: HBM bandwidth (GB/s) by device kind; the dry run reports against a v5e's.
HBM_GBPS = {"TPU v5 lite": 819.0, "TPU v5e": 819.0, "TPU v5": 2765.0, "TPU v6 lite": 1640.0, "TPU7x": 7370.0}
V5E_GBPS = 819.0
KV_HEADS, HEAD_DIM = 8, 128
#: Sequences of each case compared with the golden (the first ones; a mixed batch's are of mixed lengths).
CHECK_ROWS = 4


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode case: ``batch`` sequences of up to ``context`` tokens on pages of ``page_size``,
    ``q_heads`` query heads over `KV_HEADS`; ``mixed`` lengths; ``quant``: the cache formats timed
    (stellax only) instead of the bf16 cache against the peers."""

    batch: int
    context: int
    page_size: int
    q_heads: int = 32
    mixed: bool = False
    quant: tuple = ()
    tokens: tuple = (1024,)           # explicit stellax blocks (keys per block) besides the default
    peers: bool = True

    def label(self, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> str:
        s = (f"decode B={self.batch} ctx={self.context}{' mixed' if self.mixed else ''} K={kv_heads} "
             f"N={self.q_heads} H={head_dim} page={self.page_size}")
        return s + (f" caches={'/'.join(('bf16',) + self.quant)}" if self.quant else "")


CASES = [
    Case(64, 4096, 64, tokens=(256, 1024)),                    # 0 the first chip run's case (2.04 ms, 64 %)
    Case(256, 1024, 16),                                       # 1 many short sequences, small pages
    Case(8, 16384, 128, q_heads=64),                           # 2 long context, 64q/8kv, large pages
    Case(64, 4096, 16, q_heads=64, mixed=True),                # 3 mixed lengths, small pages
    Case(8, 16384, 64, quant=("int8", "fp8", "int4"), tokens=()),        # 4 quantized caches at 16k
    Case(4, 32768, 16),                                        # 5 long, tiny batch (jax's ragged won: 1.30 vs 1.37)
    Case(8, 1024, 64),                                         # 6 launch overhead: 32 MiB of pages
    Case(256, 1024, 128, q_heads=64),                          # 7
    Case(64, 16384, 64, mixed=True),                           # 8
    Case(8, 4096, 16, q_heads=64),                             # 9
]
#: The main set (default ``--cases``, in this order; ``--budget`` stops starting cases past 120 s).
MAIN = (0, 1, 4, 3, 2)
DRY_CASES = [Case(2, 64, 16, q_heads=4, tokens=(32,)), Case(3, 64, 16, q_heads=4, mixed=True, tokens=(), peers=False),
             Case(2, 64, 16, q_heads=4, quant=("int8", "int4"), tokens=())]
DRY_SHAPE = (2, 128)                  # kv heads, head dim of the dry run


#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 20), (0, 3)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=120.0)
    p.add_argument("--no-peers", action="store_true", help="only stellax's contenders")
    p.add_argument("--xla", action="store_true", help="time the op's XLA path too")
    p.add_argument("--list", action="store_true", help="print the cases (index, label, main set) and exit")
    return p.parse_args(argv)


# -- inputs ----------------------------------------------------------------------------------
def case_lengths(seed: int, case: Case) -> np.ndarray:
    """Every sequence at ``context``, or (``mixed``) uniform in ``[context/8, context]``."""
    if not case.mixed:
        return np.full((case.batch,), case.context, np.int32)
    rng = np.random.default_rng(seed + 1000)
    return rng.integers(max(1, case.context // 8), case.context + 1, case.batch).astype(np.int32)


def poison_free_slots(pages, tables, lengths, rows: int):
    """``pages`` with the slots past the lengths of the first ``rows`` sequences set to NaN
    (their last pages' tails and the pages after them): a kernel reading them fails the check."""
    ps = pages.shape[1]
    t = np.asarray(tables[:rows])
    n = np.asarray(lengths[:rows])
    ids, offs = [], []
    for row, length in zip(t, n):
        for j, page in enumerate(row):
            start = max(0, int(length) - j * ps)
            if start < ps:
                ids += [int(page)] * (ps - start)
                offs += list(range(start, ps))
    if not ids:
        return pages
    return pages.at[jnp.asarray(ids), jnp.asarray(offs)].set(jnp.nan)


def make_inputs(seed: int, case: Case, kv_heads: int, head_dim: int, dtype):
    """``(q [B, N, H], k_pages, v_pages [pages, PS, K, H], tables [B, P], lengths [B])``:
    each sequence on its own shuffled pages (the table's full width allocated), made on the
    device in ``dtype``; the checked sequences' free slots hold NaN."""
    pages_per_seq = case.context // case.page_size
    num_pages = case.batch * pages_per_seq
    rng = np.random.default_rng(seed)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(case.batch, pages_per_seq).astype(np.int32))
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (num_pages, case.page_size, kv_heads, head_dim)
    q = jax.random.normal(kq, (case.batch, case.q_heads, head_dim), dtype)
    make = jax.jit(lambda key: jax.random.normal(key, shape, dtype))
    lengths = jnp.asarray(case_lengths(seed, case))
    k = poison_free_slots(make(kk), tables, lengths, CHECK_ROWS)
    v = poison_free_slots(make(kv), tables, lengths, CHECK_ROWS)
    return q, k, v, tables, lengths


def quantized(args, fmt: str):
    """``args`` with both pools quantized to ``fmt`` (`stellax.quantize_pages`, its default groups)."""
    from stellax.ops.paged_attention import quantize_pages

    q, k, v, tables, lengths = args
    # The NaN slots would make a group's scale NaN: quantize the pages with them zeroed, then the
    # kernel sees codes there (the check still covers reading past the lengths through the scales).
    clean = lambda x: jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
    return q, quantize_pages(clean(k), fmt), quantize_pages(clean(v), fmt), tables, lengths


def golden(fn_args, rows: int):
    """The op's float32 reference on the first ``rows`` sequences."""
    from stellax.ops.paged_attention import paged_attention_op

    q, k, v, tables, lengths = fn_args
    return jax.jit(paged_attention_op.reference)(q[:rows], k, v, tables[:rows], lengths[:rows]).astype(jnp.float32)


# -- contenders -----------------------------------------------------------------------------------
def stellax_contenders(case: Case, width: int, page_size: int, *, xla: bool, fmt: str = ""):
    """``(contender, config label, fn, is_default_config)`` of stellax."""
    from stellax.ops.paged_attention import paged_attention
    from stellax.ops.paged_attention.configs import TpuPagedConfig

    prefix = f"{fmt} " if fmt else ""
    mosaic = functools.partial(paged_attention, implementation="mosaic_tpu")
    out = [("stellax:mosaic_tpu", prefix + "default", jax.jit(mosaic), True)]
    for tokens in case.tokens:
        ppb = max(1, tokens // page_size)
        if ppb <= width:
            cfg = TpuPagedConfig(pages_per_block=ppb)
            out.append(("stellax:mosaic_tpu", f"{prefix}pages_per_block={ppb}",
                        jax.jit(functools.partial(mosaic, config=cfg)), False))
    if xla:
        out.append(("stellax:xla", prefix + "default",
                    jax.jit(functools.partial(paged_attention, implementation="xla")), True))
    return out


def jax_paged_contenders(width: int, page_size: int, head_dim: int, dry: bool):
    """jax's paged_attention over head-major pages, one per ``pages_per_compute_block``."""
    from jax.experimental.pallas.ops.tpu.paged_attention import (
        paged_attention as jax_paged,
    )

    scale = 1.0 / math.sqrt(head_dim)      # jax's kernel does not scale the logits: the query is pre-scaled
    tokens = (32,) if dry else (1024, 2048)    # the first chip run: its best was always the largest tried
    choices = sorted({min(width, max(1, t // page_size)) for t in tokens})
    out = []
    for ppcb in [c for c in choices if width % c == 0]:
        def fn(q, kh, vh, tables, lengths, ppcb=ppcb):
            q = (q.astype(jnp.float32) * scale).astype(q.dtype)
            return jax_paged(q, kh, vh, lengths, tables, pages_per_compute_block=ppcb)
        out.append(("jax:paged_attention", f"pages_per_compute_block={ppcb}", jax.jit(fn)))
    return out


#: VMEM limit given to jax's ragged kernel for its tuned block sizes (a v5e has 128 MiB).
JAX_RAGGED_VMEM = 100 * 1024 * 1024


def jax_ragged_contenders(width: int, page_size: int, head_dim: int, blocks, dry: bool):
    """jax's ragged_paged_attention on interleaved pages: its tuned block sizes (with
    `JAX_RAGGED_VMEM`), then ``blocks``: ``(kv tokens per block, queries per block)`` pairs.
    The functions take ``(q [T, N, H], kv, kv_lens, tables, cu_q_lens, num_seqs)``."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    scale = 1.0 / math.sqrt(head_dim)
    kws = [("tuned, vmem_limit=100MiB", dict(vmem_limit_bytes=JAX_RAGGED_VMEM))] if not dry else []
    seen = set()
    for tokens, nq in blocks:
        kvp = min(width, max(1, tokens // page_size))
        if (kvp, nq) not in seen:
            seen.add((kvp, nq))
            kws.append((f"num_kv_pages_per_block={kvp},num_queries_per_block={nq}",
                        dict(num_kv_pages_per_block=kvp, num_queries_per_block=nq,
                             vmem_limit_bytes=None if dry else JAX_RAGGED_VMEM)))
    out = []
    for label, kw in kws:
        def fn(q, kv, kv_lens, tables, cu, num_seqs, kw=kw):
            return rpa.ragged_paged_attention(q, kv, kv_lens, tables, cu, num_seqs, sm_scale=scale, **kw)
        out.append(("jax:ragged_paged_attention", label, jax.jit(fn)))
    return out


def interleaved(k, v):
    """``[pages, PS, K, H]`` pools → jax's ragged layout ``[pages, PS, 2K, H]`` (k0 v0 k1 v1 ...)."""
    kv = jnp.stack([k, v], axis=3).reshape(k.shape[0], k.shape[1], 2 * k.shape[2], k.shape[3])
    return jax.block_until_ready(kv)


# -- the run ---------------------------------------------------------------------------------------
#: Calls dispatched back to back for ``ms_back_to_back`` (dry run, chip): at most this many, and
#: about `BACK_TO_BACK_MS` of device time per run (at least 3 calls).
BACK_TO_BACK = (2, 50)
BACK_TO_BACK_MS = 100.0


def back_to_back_ms(fn, args, calls: int) -> float:
    """Median over 3 runs of: ``calls`` calls of ``fn(*args)`` dispatched without waiting (jax's
    asynchronous dispatch queues them on the device), one ``block_until_ready`` on all outputs at
    the end, divided by ``calls`` — a call's device time once the host's dispatch and the
    per-call synchronization overlap the device's work (``ms`` minus this is the launch and
    synchronization overhead a single synchronized call pays)."""
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(calls)])
        runs.append((time.perf_counter() - t0) * 1e3 / calls)
    return float(np.median(runs))


def speedup_vs_bf16(row: dict, bf16: dict) -> None:
    """Set ``vs_bf16`` (and ``vs_bf16_back_to_back``) of a quantized cache's default row: the bf16
    cache's time over this one's on the same keys and values (issue 41's goal at 16k context:
    int8 / fp8 >= 1.7, int4 >= 3); None when either row has no time."""
    for key, out in (("ms", "vs_bf16"), ("ms_back_to_back", "vs_bf16_back_to_back")):
        mine, base = row.get(key), bf16.get(key)
        row[out] = base / mine if mine and base else None
    if row["vs_bf16"] is not None:
        print(f"  {row['config']:>20s}: {row['vs_bf16']:.2f}x the bf16 cache's throughput", flush=True)


class Timed(ChipRun):
    """What the paged TPU benchmarks share: rows in the suite's schema and the timed, checked call."""

    op = "paged_attention"

    def __init__(self, args, fmt: str):
        super().__init__(args, fmt, reps=REPS, warmup=WARMUP)
        self.peak = V5E_GBPS if self.dry else HBM_GBPS.get(self.device)

    def row(self, case, contender, config, *, default, peer, ms=None, nbytes=None, flops=None, errs=(None, None),
            compile_s=None, error=None, op=None, ms_b2b=None):
        gbps = None if ms is None or not ms == ms else nbytes / (ms * 1e-3) / 1e9
        pct = None if gbps is None or self.peak is None else 100.0 * gbps / self.peak
        pct_b2b = None if ms_b2b is None or self.peak is None else 100.0 * nbytes / (ms_b2b * 1e-3) / 1e9 / self.peak
        r = {"op": op or self.op, "case": case, "pass": "fwd", "contender": contender, "config": config,
             "default": default, "peer": peer, "ms": ms, "gbps": gbps, "pct_peak": pct, "bound": "memory",
             "max_rel_err": errs[0], "rel_l2": errs[1], "compile_s": compile_s,
             "device": self.device, "date": self.date, "skipped": None, "error": error,
             "ms_back_to_back": ms_b2b, "pct_peak_back_to_back": pct_b2b}
        if flops is not None:
            r["tflops"] = None if ms is None else flops / (ms * 1e-3) / 1e12
        self.rows.append(r)
        if error:
            print(f"  {contender:28s} {config:52s} ERROR {error[:160]}", flush=True)
        else:
            extra = "" if r.get("tflops") is None else f" {r['tflops']:6.1f} TFLOP/s"
            if ms_b2b is not None:
                extra += f" | back to back {ms_b2b:.4f} ms {pct_b2b or 0:5.1f}%"
            print(f"  {contender:28s} {config:52s} {ms:9.4f} ms {gbps:8.1f} GB/s {pct or 0:5.1f}%{extra} "
                  f"max_rel_err {errs[0]:.2e} rel_l2 {errs[1]:.2e} (first call {compile_s:.1f} s)", flush=True)
        return r

    def measure(self, case, contender, config, fn, args, ref, nbytes, *, default, peer, pick=None, flops=None,
                op=None):
        """Time ``fn(*args)`` and compare ``pick(out)`` (default: the first rows) with ``ref``."""
        pick = pick or (lambda out: out[:ref.shape[0]])
        try:
            first, ms, out = time_fn(fn, args, self.reps, self.warmup)
            most = BACK_TO_BACK[0 if self.dry else 1]
            b2b = back_to_back_ms(fn, args, most if self.dry else max(3, min(most, int(BACK_TO_BACK_MS / ms))))
            return self.row(case, contender, config, default=default, peer=peer, ms=ms, nbytes=nbytes,
                            flops=flops, errs=errors(pick(out), ref), compile_s=first, op=op, ms_b2b=b2b)
        except Exception as e:  # noqa: BLE001 - a contender that does not compile or run is a row
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")
            return self.row(case, contender, config, default=default, peer=peer, error=msg[:400], op=op)

    def default_implementation(self, op, call) -> str | None:
        if self.dry:  # on a CPU dispatch never picks an interpreted kernel; the dry run stands for a TPU
            return "mosaic_tpu"
        try:
            return op.select(call).name
        except Exception:  # noqa: BLE001
            return None


class Run(Timed):
    def __init__(self, args):
        super().__init__(args, "stellax-paged-decode-tpu")

    def run_case(self, seed, case: Case, kv_heads, head_dim):
        from stellax.ops.paged_attention import paged_attention_op

        label = case.label(kv_heads, head_dim)
        print(f"== {label}", flush=True)
        args = make_inputs(seed, case, kv_heads, head_dim, jnp.bfloat16)
        width = args[3].shape[1]
        rows = min(CHECK_ROWS, case.batch)
        bf16 = None                                   # the bf16 cache's default mosaic row
        for fmt in ("",) + case.quant:
            fargs = quantized(args, fmt) if fmt else args
            call = paged_attention_op.check(*fargs)
            nbytes = float(paged_attention_op.bytes_accessed(call))
            picked = self.default_implementation(paged_attention_op, call)
            ref = golden(fargs, rows)
            for contender, config, fn, is_default in stellax_contenders(case, width, case.page_size,
                                                                        xla=self.args.xla, fmt=fmt):
                impl = contender.split(":", 1)[1]
                r = self.measure(label, contender, config, fn, fargs, ref, nbytes,
                                 default=bool(is_default and picked == impl), peer=False)
                if impl == "mosaic_tpu" and config.endswith("default"):
                    bf16 = r if not fmt else bf16
                    if fmt and bf16 is not None:
                        speedup_vs_bf16(r, bf16)
            if fmt:
                del fargs
                continue
            if case.peers and not self.args.no_peers and not case.quant:
                self.peers(label, args, ref, nbytes)
        del args

    def peers(self, case, args, ref, nbytes):
        q, k, v, tables, lengths = args
        width, ps, h = tables.shape[1], k.shape[1], q.shape[-1]
        try:
            kh = jax.block_until_ready(jnp.transpose(k, (2, 0, 1, 3)))                  # [K, pages, PS, H]
            vh = jax.block_until_ready(jnp.transpose(v, (2, 0, 1, 3)))
        except Exception as e:  # noqa: BLE001
            self.row(case, "jax:paged_attention", "layout", default=False, peer=True, error=str(e)[:400])
            kh = vh = None
        if kh is not None:
            timed = [self.measure(case, c, cfg, fn, (q, kh, vh, tables, lengths), ref, nbytes, default=False,
                                  peer=True) for c, cfg, fn in jax_paged_contenders(width, ps, h, self.dry)]
            mark_best(timed)
        del kh, vh
        try:
            kv = interleaved(k, v)
        except Exception as e:  # noqa: BLE001
            self.row(case, "jax:ragged_paged_attention", "layout", default=False, peer=True, error=str(e)[:400])
            return
        b = q.shape[0]
        cu = jnp.arange(b + 1, dtype=jnp.int32)
        num = jnp.asarray([b], jnp.int32)
        blocks = ((32, 8),) if self.dry else ((512, 8),)
        timed = [self.measure(case, c, cfg, fn, (q, kv, lengths, tables, cu, num), ref, nbytes, default=False,
                              peer=True)
                 for c, cfg, fn in jax_ragged_contenders(width, ps, h, blocks, self.dry)]
        mark_best(timed)
        del kv

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        shape = DRY_SHAPE if self.dry else (KV_HEADS, HEAD_DIM)
        picked = self.picked_cases(len(cases), MAIN)
        print(f"paged decode on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), "
              f"cases {picked}, reps {self.reps}, warmup {self.warmup}", flush=True)
        self.run_cases(picked, lambda i: self.run_case(i, cases[i], *shape))
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def summary(rows):
    """Per case: stellax's default and best, XLA and jax's kernels at their best (ms, % of HBM
    peak), and for the quantized caches each format's default against the bf16 cache's."""
    print("\nsummary (ms, % of HBM peak; x = jax's best time / stellax default's)", flush=True)
    for case in dict.fromkeys(r["case"] for r in rows):
        rs = [r for r in rows if r["case"] == case and r.get("ms") is not None and r.get("error") is None]

        def best(contender, fmt=""):
            c = [r for r in rs if r["contender"] == contender and config_format(r["config"]) == fmt]
            return min(c, key=lambda r: r["ms"]) if c else None

        fmts = list(dict.fromkeys(config_format(r["config"]) for r in rs if r["contender"] == "stellax:mosaic_tpu"))
        defaults = {f: next((r for r in rs if r["contender"] == "stellax:mosaic_tpu"
                             and r["config"] == (f"{f} default" if f else "default")), None) for f in fmts}
        default = defaults.get("")
        cells = []
        for label, r in (("default", default), ("stellax best", best("stellax:mosaic_tpu")),
                         ("xla", best("stellax:xla")), ("jax paged", best("jax:paged_attention")),
                         ("jax ragged", best("jax:ragged_paged_attention"))):
            if r is not None:
                b2b = r.get("pct_peak_back_to_back")
                cells.append(f"{label} {r['ms']:.3f} ({r['pct_peak'] or 0:.0f}%"
                             + ("" if b2b is None else f"; back to back {r['ms_back_to_back']:.3f}, {b2b:.0f}%") + ")")
        peers = [r for r in (best("jax:paged_attention"), best("jax:ragged_paged_attention")) if r is not None]
        if default is not None and peers:
            cells.append(f"x {min(p['ms'] for p in peers) / default['ms']:.2f}")
        for f in fmts:
            if f and defaults[f] is not None and default is not None:
                cells.append(f"{f} {defaults[f]['ms']:.3f} ({default['ms'] / defaults[f]['ms']:.2f}x bf16)")
        print(f"  {case}: " + ", ".join(cells), flush=True)


def config_format(config: str) -> str:
    """The cache format a stellax row's config names (``"int8 default"`` → ``int8``; bf16: ``""``)."""
    head = config.split(" ", 1)[0]
    return head if " " in config and "=" not in head else ""


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        return chip_run.list_cases(CASES, MAIN)
    return chip_run.run(Run, args, tpu_interpret=True)


if __name__ == "__main__":
    sys.exit(main())
