"""Paged decode on a TPU: stellax's Mosaic kernel against XLA and jax's own kernels, in one process.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/paged_decode_tpu.py --out $OUT/paged_decode.json

Cases (issue 41's decode grid): batch 8 and 64 × context 4096 and 16384 ×
page size 16 and 64, then batch 4 at context 32768 and batch 1 at 131072
(page 16: where the first Mosaic decode kernel lost to XLA); GQA 32 query heads over 8 kv heads, head dim 128,
bfloat16 queries and pools, every sequence at the full context. For each
case, on the same data:

* ``stellax:mosaic_tpu``: `stellax.paged_attention` on its Mosaic TPU kernel
  with the config stellax picks by itself (shipped cache, then heuristic;
  ``default`` is true when the op would also pick that implementation by
  itself), then with a few explicit ``pages_per_block`` (the rows'
  ``config``);
* ``stellax:xla``: the op's XLA path;
* ``jax:paged_attention``: `jax.experimental.pallas.ops.tpu.paged_attention`
  on the same pages in its head-major layout ``[K, pages, page_size, H]``
  (the transposed copy is made once, outside the timing), with
  ``pages_per_compute_block`` searched over the powers of two that divide the
  table width and compile (one row per value, the fastest marked ``best``);
* ``jax:ragged_paged_attention`` (when it runs): jax's ragged kernel on the
  pages interleaved ``[pages, page_size, 2K, H]`` (k0 v0 k1 v1 ...), one query
  token per sequence, its tuned block sizes and a few explicit
  ``num_kv_pages_per_block``.

Timing: each contender is compiled and run once, then timed ``--reps`` times
(``block_until_ready`` after each call; median reported) after ``--warmup``
runs. ``gbps`` counts the same bytes for every contender of a case (the op's
byte model: the K/V pages the sequences read, plus q, the output, tables and
lengths); ``pct_peak`` is that against the chip's HBM bandwidth (819 GB/s on a
v5e). Each contender's output is compared once with the golden
(`paged_attention`'s float32 reference, computed a few sequences at a time on
the device): the rows' ``max_rel_err`` is ``max|out - ref| / max|ref|``,
``rel_l2`` the relative L2 error; both are printed.

The JSON (``--out``) holds ``{"format": "stellax-paged-decode-tpu", "version": 1,
"environment": {...}, "rows": [ROW, ...]}`` with rows in the suite's results
schema (benchmarks/README.md: op, case, pass, contender, default, peer, ms,
gbps, pct_peak, bound, device, date, skipped, error) plus ``config``,
``max_rel_err``, ``rel_l2`` and ``compile_s``. It is rewritten after every
case, so a run cut short keeps what it measured; ``--budget`` seconds (default
200) stops starting new cases before the chip's time runs out (a case takes
about 20-40 s, most of it compiling: the run fits in about 4 minutes).

``--dry-run`` runs the same code path on the CPU on tiny shapes with the
Mosaic kernels interpreted (the test suite runs it so the script cannot rot).
"""

from __future__ import annotations

import functools
import math
import sys

import chip_run
import jax
import jax.numpy as jnp
import numpy as np
from chip_run import ChipRun, elapsed, errors, mark_best, time_fn

#: HBM bandwidth (GB/s) by device kind; the dry run reports against a v5e's.
HBM_GBPS = {"TPU v5 lite": 819.0, "TPU v5e": 819.0, "TPU v5": 2765.0, "TPU v6 lite": 1640.0, "TPU7x": 7370.0}
V5E_GBPS = 819.0

#: The chip's cases: (batch, context, page_size); N=32, K=8, H=128, bfloat16. The last two are the
#: long-context, small-batch shapes where the first Mosaic decode kernel lost to XLA (issue 41).
CASES = [(b, ctx, ps) for b in (8, 64) for ctx in (4096, 16384) for ps in (16, 64)] + [(4, 32768, 16), (1, 131072, 16)]
DRY_CASES = [(2, 64, 16)]
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DRY_SHAPE = (4, 2, 128)


#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 20), (0, 3)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=200.0)
    p.add_argument("--no-peers", action="store_true", help="only stellax's contenders")
    return p.parse_args(argv)


# -- inputs ----------------------------------------------------------------------------------
def make_inputs(seed: int, batch: int, context: int, page_size: int, q_heads: int, kv_heads: int, head_dim: int,
                dtype):
    """``(q [B, N, H], k_pages, v_pages [pages, PS, K, H], tables [B, P], lengths [B])``:
    every sequence at ``context`` tokens on its own shuffled pages (made on the
    device in ``dtype``, no float32 copy of the pools)."""
    pages_per_seq = context // page_size
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(seed)
    tables = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32))
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (num_pages, page_size, kv_heads, head_dim)
    q = jax.random.normal(kq, (batch, q_heads, head_dim), dtype)
    k = jax.jit(lambda key: jax.random.normal(key, shape, dtype))(kk)
    v = jax.jit(lambda key: jax.random.normal(key, shape, dtype))(kv)
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, k, v, tables, lengths


def golden(q, k, v, tables, lengths, chunk: int):
    """The op's float32 reference, ``chunk`` sequences at a time (bounded memory)."""
    from stellax.ops.paged_attention import paged_attention_op

    ref = jax.jit(paged_attention_op.reference)
    outs = [ref(q[i:i + chunk], k, v, tables[i:i + chunk], lengths[i:i + chunk])
            for i in range(0, q.shape[0], chunk)]
    return jnp.concatenate(outs, axis=0).astype(jnp.float32)


# -- contenders -----------------------------------------------------------------------------------
def stellax_contenders(call_args, dry: bool):
    """``(contender, config label, fn, is_default_config)`` of stellax."""
    from stellax.ops.paged_attention import paged_attention
    from stellax.ops.paged_attention.configs import TpuPagedConfig

    q, k, v, tables, lengths = call_args
    width = tables.shape[1]
    out = []
    mosaic = functools.partial(paged_attention, implementation="mosaic_tpu")
    out.append(("stellax:mosaic_tpu", "default", jax.jit(mosaic), True))
    page_size = k.shape[1]
    for tokens in ((32,) if dry else (128, 256, 1024)):
        ppb = max(1, tokens // page_size)
        if ppb <= width:
            cfg = TpuPagedConfig(pages_per_block=ppb)
            out.append(("stellax:mosaic_tpu", f"pages_per_block={ppb}",
                        jax.jit(functools.partial(mosaic, config=cfg)), False))
    out.append(("stellax:xla", "default", jax.jit(functools.partial(paged_attention, implementation="xla")), True))
    return out


def jax_paged_contenders(call_args, dry: bool):
    """jax's paged_attention over head-major pages, one per ``pages_per_compute_block``."""
    from jax.experimental.pallas.ops.tpu.paged_attention import (
        paged_attention as jax_paged,
    )

    q, k, v, tables, lengths = call_args
    width, page_size = tables.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])      # jax's kernel does not scale the logits: the query is pre-scaled
    tokens = (32,) if dry else (128, 256, 512, 1024)
    choices = sorted({max(1, t // page_size) for t in tokens})
    out = []
    for ppcb in [c for c in choices if width % c == 0]:
        def fn(q, kh, vh, tables, lengths, ppcb=ppcb):
            q = (q.astype(jnp.float32) * scale).astype(q.dtype)
            return jax_paged(q, kh, vh, lengths, tables, pages_per_compute_block=ppcb)
        out.append(("jax:paged_attention", f"pages_per_compute_block={ppcb}", jax.jit(fn)))
    return out


def jax_ragged_contenders(call_args, dry: bool):
    """jax's ragged_paged_attention on interleaved pages: tuned block sizes, then explicit ones."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    q, k, v, tables, lengths = call_args
    scale = 1.0 / math.sqrt(q.shape[-1])
    width = tables.shape[1]
    out = []
    explicit = (2,) if dry else (max(1, 512 // k.shape[1]),)
    for kvp in ([None] + [c for c in explicit if c <= width]):
        kw = {} if kvp is None else dict(num_kv_pages_per_block=kvp, num_queries_per_block=8)

        def fn(q, kv, tables, lengths, kw=kw):
            b = q.shape[0]
            cu = jnp.arange(b + 1, dtype=jnp.int32)
            return rpa.ragged_paged_attention(q, kv, lengths, tables, cu, jnp.asarray([b], jnp.int32),
                                              sm_scale=scale, **kw)
        out.append(("jax:ragged_paged_attention", "tuned" if kvp is None else
                    f"num_kv_pages_per_block={kvp},num_queries_per_block=8", jax.jit(fn)))
    return out


# -- the run ---------------------------------------------------------------------------------------
class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-paged-decode-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_GBPS if self.dry else HBM_GBPS.get(self.device)

    def row(self, case, contender, config, *, default, peer, ms=None, nbytes=None, errs=(None, None),
            compile_s=None, error=None):
        gbps = None if ms is None or not ms == ms else nbytes / (ms * 1e-3) / 1e9
        pct = None if gbps is None or self.peak is None else 100.0 * gbps / self.peak
        r = {"op": "paged_attention", "case": case, "pass": "fwd", "contender": contender, "config": config,
             "default": default, "peer": peer, "ms": ms, "gbps": gbps, "pct_peak": pct, "bound": "memory",
             "max_rel_err": errs[0], "rel_l2": errs[1], "compile_s": compile_s,
             "device": self.device, "date": self.date, "skipped": None, "error": error}
        self.rows.append(r)
        if error:
            print(f"  {contender:28s} {config:48s} ERROR {error[:160]}", flush=True)
        else:
            print(f"  {contender:28s} {config:48s} {ms:9.4f} ms {gbps:8.1f} GB/s {pct or 0:5.1f}% "
                  f"max_rel_err {errs[0]:.2e} rel_l2 {errs[1]:.2e} (first call {compile_s:.1f} s)", flush=True)
        return r

    def measure(self, case, contender, config, fn, args, ref, nbytes, *, default, peer):
        try:
            first, ms, out = time_fn(fn, args, self.reps, self.warmup)
            return self.row(case, contender, config, default=default, peer=peer, ms=ms, nbytes=nbytes,
                            errs=errors(out, ref), compile_s=first)
        except Exception as e:  # noqa: BLE001 - a contender that does not compile or run is a row
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")
            return self.row(case, contender, config, default=default, peer=peer, error=msg[:400])

    def run_case(self, seed, batch, context, page_size, q_heads, kv_heads, head_dim):
        from stellax.ops.paged_attention import paged_attention_op

        dtype = jnp.bfloat16
        case = f"decode B={batch} ctx={context} K={kv_heads} N={q_heads} H={head_dim} page={page_size}"
        print(f"== {case}", flush=True)
        args = make_inputs(seed, batch, context, page_size, q_heads, kv_heads, head_dim, dtype)
        call = paged_attention_op.check(*args)
        nbytes = float(paged_attention_op.bytes_accessed(call))
        picked = self.default_implementation(call)
        ref = golden(*args, chunk=4)
        for contender, config, fn, is_default in stellax_contenders(args, self.dry):
            impl = contender.split(":", 1)[1]
            self.measure(case, contender, config, fn, args, ref, nbytes,
                         default=bool(is_default and picked == impl), peer=False)
        if not self.args.no_peers:
            self.peers(case, args, ref, nbytes)
        del args, ref

    def default_implementation(self, call) -> str | None:
        if self.dry:  # on a CPU dispatch never picks an interpreted kernel; the dry run stands for a TPU
            return "mosaic_tpu"
        from stellax.ops.paged_attention import paged_attention_op
        try:
            return paged_attention_op.select(call).name
        except Exception:  # noqa: BLE001
            return None

    def peers(self, case, args, ref, nbytes):
        q, k, v, tables, lengths = args
        try:
            kh, vh = jnp.swapaxes(k, 0, 2).swapaxes(1, 2), jnp.swapaxes(v, 0, 2).swapaxes(1, 2)   # [K, pages, PS, H]
            kh, vh = jax.block_until_ready((kh, vh))
        except Exception as e:  # noqa: BLE001
            self.row(case, "jax:paged_attention", "layout", default=False, peer=True, error=str(e)[:400])
            kh = vh = None
        if kh is not None:
            timed = []
            for contender, config, fn in jax_paged_contenders(args, self.dry):
                timed.append(self.measure(case, contender, config, fn, (q, kh, vh, tables, lengths), ref, nbytes,
                                          default=False, peer=True))
            mark_best(timed)
        del kh, vh
        try:
            kv = jnp.stack([k, v], axis=3).reshape(k.shape[0], k.shape[1], 2 * k.shape[2], k.shape[3])
            kv = jax.block_until_ready(kv)
        except Exception as e:  # noqa: BLE001
            self.row(case, "jax:ragged_paged_attention", "layout", default=False, peer=True, error=str(e)[:400])
            return
        timed = []
        for contender, config, fn in jax_ragged_contenders(args, self.dry):
            timed.append(self.measure(case, contender, config, fn, (q, kv, tables, lengths), ref, nbytes,
                                      default=False, peer=True))
        mark_best(timed)
        del kv

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        shape = DRY_SHAPE if self.dry else (Q_HEADS, KV_HEADS, HEAD_DIM)
        picked = self.picked_cases(len(cases))
        print(f"paged decode on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), "
              f"{len(picked)} cases, reps {self.reps}, warmup {self.warmup}", flush=True)
        for i in picked:
            if self.over_budget():
                print(f"budget of {self.args.budget:.0f} s spent: cases from {i} not run", flush=True)
                self.env["left"] = picked[picked.index(i):]
                break
            batch, context, page_size = cases[i]
            self.run_case(i, batch, context, page_size, *shape)
            self.save()
        self.save()
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def summary(rows):
    """Per case: stellax's default and best, XLA and jax's kernels at their best (ms, % of HBM peak)."""
    print("\nsummary (ms, % of HBM peak; x = jax's best time / stellax default's)", flush=True)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        rs = [r for r in rows if r["case"] == case and r.get("ms") is not None and r.get("error") is None]

        def best(contender):
            c = [r for r in rs if r["contender"] == contender]
            return min(c, key=lambda r: r["ms"]) if c else None

        default = next((r for r in rs if r["contender"] == "stellax:mosaic_tpu" and r["config"] == "default"), None)
        cells = []
        for label, r in (("default", default), ("stellax best", best("stellax:mosaic_tpu")), ("xla", best("stellax:xla")),
                         ("jax paged", best("jax:paged_attention")), ("jax ragged", best("jax:ragged_paged_attention"))):
            cells.append(f"{label} " + ("-" if r is None else f"{r['ms']:.3f} ({r['pct_peak'] or 0:.0f}%)"))
        peers = [r for r in (best("jax:paged_attention"), best("jax:ragged_paged_attention")) if r is not None]
        if default is not None and peers:
            cells.append(f"x {min(p['ms'] for p in peers) / default['ms']:.2f}")
        print(f"  {case}: " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv), tpu_interpret=True)


if __name__ == "__main__":
    sys.exit(main())
