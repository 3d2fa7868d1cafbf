"""Flash attention on a TPU: stellax's Mosaic kernels against jax's splash attention and XLA (issue 37).

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/attention_tpu.py --out $OUT/attention_tpu.json

Cases (`CASES`, bf16, B=1 unless said; ``--cases`` takes indices, ``main`` (the default) or ``all``):
MHA causal and full at T = 4096 / 8192 / 16384 (N=16, D=128) and D=64 / D=256 at T=8192; GQA (N=32,
K=8) and MQA (N=16, K=1) causal T=8192; sliding window 1024 and 4096 (causal) and chunked 2048 at
T=16384; 8 documents per row of 16384 (segment ids, causal); soft cap 30 and attention sinks (causal)
at T=8192. The main set (`MAIN`: MHA causal and full T=8192, window 1024, GQA, documents) is the one
that fits about 200 s on a v5e; ``--budget`` stops starting new cases (and contenders) past it.

Contenders, per case and pass (``fwd``: the output; ``fwd+bwd``: the output and the gradients of
q, k, v for a random cotangent, through ``jax.vjp``), on the same data:

* ``stellax:mosaic_tpu`` ``default``: `stellax.dot_product_attention` with ``implementation=None`` and no
  config (on a TPU the dispatcher picks the kernel and its config: shipped cache, then heuristic; the
  configs it picked, seen by `stellax.core.observe_calls`, are in the row's ``config``). The dry run
  names ``mosaic_tpu`` (a CPU dispatch would pick XLA).
* ``stellax:mosaic_tpu`` explicit: the combos `EXPLICIT` names in ``--configs`` (forward
  ``SplashConfig`` and backward ``SplashBackwardConfig``, the dq and dk/dv kernels' blocks chosen
  independently, or the fused backward: names ending ``-fused``), through `stellax.use_configs`; a
  forward config already timed is not timed again, nor a combo equal to the default's configs.
  Fused against unfused against splash in one run: ``--cases 0,3 --passes fwd+bwd --configs
  f1024-b1024,f1024-b1024-fused,f1024-b512-fused --splash 1024,1024-unfused``.
* ``jax:splash``: jax's bundled splash attention (``make_splash_mha``; GQA/MQA by its kv-head
  grouping) on its own heads-first layout ``[N, T, D]`` (vmapped over the batch; the transposes are
  outside the timing), its block sizes searched over `SPLASH` (``--splash``); its masks: CausalMask,
  FullMask, LocalMask for windows, ChunkedCausalMask, SegmentIds for documents,
  ``attn_logits_soft_cap`` and ``sinks``. ``vs_splash`` is the best splash time over the row's
  (default search 512 and 1024 tiles; ``--splash all`` adds 2048×1024, 1024×2048 and 2048×512).
  By default splash takes the same ``[B, T, N, D]`` operands as stellax and its layout transposes are
  timed with it (the contract the issue's numbers were measured with); ``--splash-layout native``
  times it on its own layout instead.
* with ``--xla`` (or ``xla`` in ``--contenders``): ``stellax:xla_chunked`` (stellax's memory-linear XLA
  path, the fallback) and ``jax.nn.dot_product_attention[xla]`` (where its materialized logits fit: no
  segments/sinks/chunks). ``vs_xla`` is the best of the two over the row's.

``--contenders`` picks the groups timed (``default``, ``explicit``, ``splash``, ``xla``); the
ratios are set again over all rows of a case and pass (`set_ratios`), so XLA rows timed in a later
run (``--contenders xla``) give the earlier rows their ``vs_xla``.

Correctness: every output and gradient is compared, once per contender, with a float32 golden
(stellax's ``xla_chunked`` on float32 copies at 'highest' precision, one program per case):
``max_rel_err`` (max|x - ref| / max|ref|) and ``rel_l2`` over the leaves, computed on the device.

Rates: ``tflops`` counts ``4·B·N·T·S·D·f`` for the forward (``f``: the fraction of visible (query, key)
pairs, so causal counts about half, a window its band, documents their blocks) and 3.5 times that for
forward+backward (the backward's five matmuls against the forward's two); ``pct_peak`` is against
197 TFLOP/s (v5e bf16). The JSON (``--out``, rewritten after every case) holds ``{"format":
"stellax-attention-tpu", "version": 1, "environment", "seconds", "rows"}`` with rows in the suite's
results schema (benchmarks/README.md) plus ``config``, ``vs_splash``, ``vs_xla``, ``max_rel_err``, ``rel_l2`` and
``compile_s``. A contender that cannot express a case is a row with ``skipped`` saying why.

``--dry-run`` runs the same code on the CPU with tiny shapes (T/16, N=2-4, blocks /4) and every
kernel interpreted (tests/test_attention_tpu.py), so the script is ready for the chip.
"""

from __future__ import annotations

import dataclasses
import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
from stellax.bench.chip_run import ChipRun, elapsed, time_fn

#: v5e bf16 peak (TFLOP/s); the dry run reports against it too.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0}
V5E_TFLOPS = 197.0
#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 10), (0, 2)


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem: ``q [B, T, N, D]``, ``k, v [B, T, K, D]`` bf16, and its mask."""

    name: str
    t: int
    n: int = 16
    k: int = 16
    d: int = 128
    b: int = 1
    causal: bool = False
    window: int | None = None      # left window (with causal: a sliding window)
    chunk: int | None = None       # chunked (local) attention, causal inside a chunk
    documents: int | None = None   # equal documents per row via segment ids (causal)
    soft_cap: float | None = None
    sinks: bool = False

    def dry(self) -> Case:
        """The tiny stand-in of the dry run: T/16 (windows and chunks too), N=2 (grouped: N=4, K=2 or 1)."""
        n, k = (2, 2) if self.n == self.k else (4, 1 if self.k == 1 else 2)
        return dataclasses.replace(self, t=self.t // 16, n=n, k=k,
                                   window=None if self.window is None else self.window // 16,
                                   chunk=None if self.chunk is None else self.chunk // 16)

    def kwargs(self) -> dict:
        """`stellax.dot_product_attention`'s mask keywords (segment ids and sinks passed separately)."""
        kw = {"is_causal": self.causal}
        if self.window is not None:
            kw["local_window_size"] = (self.window, 0)
        if self.chunk is not None:
            kw["chunk_size"] = self.chunk
        if self.soft_cap is not None:
            kw["logits_soft_cap"] = self.soft_cap
        return kw

    def visible_fraction(self) -> float:
        """Fraction of the ``T×T`` (query, key) pairs the mask keeps."""
        from stellax.ops.attention.masks import MaskSpec, visible_fraction

        if self.documents:
            length = self.t // self.documents
            return self.documents * length * (length + 1) / 2 / self.t ** 2
        spec = MaskSpec(causal=self.causal or self.chunk is not None,
                        window_left=self.window, chunk_size=self.chunk)
        return visible_fraction(spec, self.t, self.t)

    def flops(self, pass_: str) -> float:
        fwd = 4.0 * self.b * self.n * self.t * self.t * self.d * self.visible_fraction()
        return fwd if pass_ == "fwd" else 3.5 * fwd


CASES = [
    Case("MHA causal T=8192 D=128", 8192, causal=True),                               # 0
    Case("MHA full T=8192 D=128", 8192),                                               # 1
    Case("sliding window 1024 causal T=16384 D=128", 16384, causal=True, window=1024),  # 2
    Case("GQA N=32 K=8 causal T=8192 D=128", 8192, n=32, k=8, causal=True),           # 3
    Case("documents 8x2048 causal T=16384 D=128", 16384, causal=True, documents=8),   # 4
    Case("MHA causal T=4096 D=128", 4096, causal=True),                               # 5
    Case("MHA full T=4096 D=128", 4096),                                               # 6
    Case("MHA causal T=16384 D=128", 16384, causal=True),                             # 7
    Case("MHA full T=16384 D=128", 16384),                                             # 8
    Case("MHA causal T=8192 D=64", 8192, d=64, causal=True),                          # 9
    Case("MHA full T=8192 D=64", 8192, d=64),                                          # 10
    Case("MHA causal T=8192 D=256", 8192, d=256, causal=True),                        # 11
    Case("MHA full T=8192 D=256", 8192, d=256),                                        # 12
    Case("MQA N=16 K=1 causal T=8192 D=128", 8192, n=16, k=1, causal=True),           # 13
    Case("sliding window 4096 causal T=16384 D=128", 16384, causal=True, window=4096),  # 14
    Case("chunked 2048 T=16384 D=128", 16384, causal=True, chunk=2048),               # 15
    Case("soft cap 30 causal T=8192 D=128", 8192, causal=True, soft_cap=30.0),        # 16
    Case("sinks causal T=8192 D=128", 8192, causal=True, sinks=True),                 # 17
]
MAIN = [0, 1, 2, 3, 4]

#: Explicit stellax configs: name → (forward (block_q, block_kv) or None for the default,
#: backward (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv[, fused]) or None for the default;
#: ``fused`` (default False: the dq and dk/dv kernels) runs the fused backward on the dk/dv blocks).
#: The query blocks count rows of a step's tile (``G·block_q``): with ``G`` query heads per kv head
#: (GQA/MQA) the config's ``block_q`` is that over ``G`` (at least 128).
EXPLICIT = {
    "f1024-b512": ((1024, 1024), (512, 512, 512, 512)),
    "f1024-b1024": ((1024, 1024), (1024, 1024, 1024, 1024)),
    "f1024-bq1024": ((1024, 1024), (1024, 512, 512, 1024)),    # big on each kernel's resident side
    "f1024-bkv1024": ((1024, 1024), (512, 1024, 1024, 512)),   # big on each kernel's streamed side
    "f2048x1024-b512": ((2048, 1024), (512, 512, 512, 512)),
    "f512-b512": ((512, 512), (512, 512, 512, 512)),
    # the fused backward (one kernel, dq resident in VMEM) on its dk/dv blocks (block_q × block_kv)
    "f1024-b1024-fused": ((1024, 1024), (1024, 1024, 1024, 1024, True)),
    "f1024-b512-fused": ((1024, 1024), (512, 512, 512, 512, True)),
    "f1024-b512x1024-fused": ((1024, 1024), (512, 1024, 512, 1024, True)),
    # 2048-key forward steps computed in 1024-key sub-blocks (mosaic_tpu.KV_CHUNK): half the grid steps
    "f1024x2048-b1024-fused": ((1024, 2048), (1024, 1024, 1024, 1024, True)),
}
#: The heuristic default fuses where the resident dq fits (`configs.fused_backward_default`), so the
#: default explicit set times the unfused pair at the same blocks and a smaller fused tile.
DEFAULT_EXPLICIT = "f1024-b1024,f1024-b1024-fused,f1024-b512-fused"

#: jax splash block sizes: name → (block_q, block_kv, block_kv_compute, block_q_dkv, block_kv_dkv, fused,
#: block_q_dq, block_kv_dq) (the dq blocks only without the fused dkv+dq kernel).
SPLASH = {
    "512": (512, 512, 512, 512, 512, True, None, None),
    "1024": (1024, 1024, 1024, 1024, 1024, True, None, None),
    "1024-kv512": (1024, 1024, 512, 1024, 1024, True, None, None),
    "1024-unfused": (1024, 1024, 1024, 1024, 1024, False, 1024, 1024),
    "512-unfused": (512, 512, 512, 512, 512, False, 512, 512),
    # larger forward tiles; all compile for a v5e (libtpu, CPU; 2048x2048 exceeds its scoped VMEM)
    "2048x1024": (2048, 1024, 1024, 1024, 1024, True, None, None),
    "1024x2048": (1024, 2048, 1024, 1024, 1024, True, None, None),
    "1024x2048-kv2048": (1024, 2048, 2048, 1024, 2048, True, None, None),
    "2048x512": (2048, 512, 512, 1024, 512, True, None, None),
}
#: Splash's block sizes searched by default: its two usual tiles (``--splash all``: every `SPLASH` entry).
DEFAULT_SPLASH = "512,1024"


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=200.0, passes=True)
    p.set_defaults(cases="main")
    p.add_argument("--configs", default=DEFAULT_EXPLICIT,
                   help=f"explicit stellax configs, comma-separated names of {sorted(EXPLICIT)} or 'none' "
                        f"(default {DEFAULT_EXPLICIT})")
    p.add_argument("--splash", default=DEFAULT_SPLASH,
                   help=f"splash block sizes searched, names of {sorted(SPLASH)}, 'all' or 'none' "
                        f"(default {DEFAULT_SPLASH})")
    p.add_argument("--xla", action="store_true", help="also time the XLA paths (adds 'xla' to --contenders)")
    p.add_argument("--contenders", default="default,explicit,splash",
                   help=f"comma list of {list(CONTENDERS)}: stellax's own pick, the --configs, splash's block "
                        "sizes, the XLA paths (default default,explicit,splash; 'xla' alone adds XLA rows "
                        "to cases measured before)")
    p.add_argument("--splash-layout", choices=("btnd", "native"), default="btnd",
                   help="btnd (default): splash takes stellax's [B, T, N, D] operands and transposes them "
                        "inside its timing (the same contract, as tpu_peers.splash_peer); native: its own "
                        "[B, N, T, D], the transposes outside the timing")
    return p.parse_args(argv)


#: What ``--contenders`` can name: each is a group of rows per case and pass.
CONTENDERS = ("default", "explicit", "splash", "xla")


def _names(value: str, table: dict, flag: str) -> list[str]:
    names = [] if value in ("", "none") else [n for n in value.split(",") if n]
    for n in names:
        if n not in table:
            raise SystemExit(f"{flag}: expected names of {sorted(table)}, got {n!r}")
    return names


def _scaled(block, dry: bool):
    """A block size, divided by 4 (at least 128) in the dry run's tiny shapes."""
    return None if block is None else (max(128, block // 4) if dry else block)


# -- inputs -----------------------------------------------------------------------------------------
def make_inputs(case: Case, seed: int):
    """``(q, k, v, d_out, segment_ids | None, sinks | None)`` on the device, bf16 (sinks float32)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    rand = jax.jit(lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16),
                   static_argnums=(1,))
    q = rand(keys[0], (case.b, case.t, case.n, case.d))
    k = rand(keys[1], (case.b, case.t, case.k, case.d))
    v = rand(keys[2], (case.b, case.t, case.k, case.d))
    d_out = rand(keys[3], (case.b, case.t, case.n, case.d))
    seg = None
    if case.documents:
        seg = jnp.broadcast_to(jnp.arange(case.t, dtype=jnp.int32) // (case.t // case.documents), (case.b, case.t))
    sinks = jax.random.normal(keys[4], (case.n,), jnp.float32) if case.sinks else None
    return q, k, v, d_out, seg, sinks


def program(attend, pass_: str, configs=None):
    """A jitted ``f(q, k, v, d_out)``: ``attend(q, k, v)`` (``fwd``) or it and the gradients of
    ``(q, k, v)`` for the cotangent ``d_out`` (``fwd+bwd``), traced inside
    `stellax.use_configs(configs)` (so the backward op sees them too)."""
    import stellax

    def fwd(q, k, v, d_out):
        with stellax.use_configs(configs or {}):
            return attend(q, k, v)

    def fwd_bwd(q, k, v, d_out):
        with stellax.use_configs(configs or {}):
            out, pullback = jax.vjp(attend, q, k, v)
            return out, pullback(d_out)

    return jax.jit(fwd if pass_ == "fwd" else fwd_bwd)


# -- stellax -----------------------------------------------------------------------------------------
def stellax_attend(case: Case, seg, sinks, *, implementation):
    """``attend(q, k, v)`` on ``[B, T, N, D]`` through `stellax.dot_product_attention`."""
    import stellax

    def attend(q, k, v):
        return stellax.dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, sinks=sinks,
                                             implementation=implementation, **case.kwargs())

    return attend


def explicit_table(name: str, dry: bool, g: int) -> dict:
    """The `use_configs` table of an `EXPLICIT` combo (forward and backward ops' mosaic_tpu configs)
    for ``g`` query heads per kv head (query blocks are rows: divided by ``g``)."""
    from stellax.ops.attention.configs import SplashBackwardConfig, SplashConfig

    rows = lambda b: max(128, _scaled(b, dry) // g)
    fwd, bwd = EXPLICIT[name]
    table = {}
    if fwd is not None:
        table[("attention", "mosaic_tpu")] = SplashConfig(rows(fwd[0]), _scaled(fwd[1], dry))
    if bwd is not None:
        fused = bool(bwd[4]) if len(bwd) > 4 else False
        table[("attention_backward", "mosaic_tpu")] = SplashBackwardConfig(
            rows(bwd[0]), _scaled(bwd[1], dry), rows(bwd[2]), _scaled(bwd[3], dry), fused=fused)
    return table


def _describe(config) -> str:
    if config is None:
        return "-"
    fields = dataclasses.asdict(config)
    return "/".join(str(v) for v in fields.values())


# -- splash ----------------------------------------------------------------------------------------
def splash_kernel(case: Case, name: str, dry: bool, scale: float):
    """jax's splash attention kernel for ``case`` with the `SPLASH` block sizes ``name``:
    ``kernel(q [N, T, D], k [K, T, D], v, segment_ids=None, sinks=None)``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    from stellax.core import interpret_enabled

    bq, bkv, bkvc, bqd, bkvd, fused, bqdq, bkvdq = SPLASH[name]
    shape = (case.t, case.t)
    if case.chunk is not None:
        mask = masks.ChunkedCausalMask(shape, chunk_size=case.chunk)
    elif case.window is not None:
        mask = masks.LocalMask(shape, window_size=(case.window, 0 if case.causal else None), offset=0)
    elif case.causal:
        mask = masks.CausalMask(shape)
    else:
        mask = masks.FullMask(shape)
    s = lambda b: _scaled(b, dry)
    sizes = splash.BlockSizes(block_q=s(bq), block_kv=s(bkv), block_kv_compute=s(bkvc), block_q_dkv=s(bqd),
                              block_kv_dkv=s(bkvd), block_kv_dkv_compute=s(bkvd), block_q_dq=s(bqdq),
                              block_kv_dq=s(bkvdq), use_fused_bwd_kernel=fused)
    return splash.make_splash_mha(masks.MultiHeadMask([mask] * case.n), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, attn_logits_soft_cap=case.soft_cap, interpret=interpret_enabled())


def splash_attend(kernel, seg, sinks, scale: float, *, transpose: bool):
    """``attend(q, k, v)`` on splash's heads-first ``[B, N, T, D]`` (with ``transpose``: on
    ``[B, T, N, D]``, transposed in and out). Queries are pre-scaled: splash does not scale
    the logits."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )

    def heads_first_attend(q, k, v):
        q = q * jnp.asarray(scale, q.dtype)
        if seg is None:
            return jax.vmap(lambda q_, k_, v_: kernel(q_, k_, v_, sinks=sinks))(q, k, v)
        ids = splash.SegmentIds(q=seg, kv=seg)
        return jax.vmap(lambda q_, k_, v_, i: kernel(q_, k_, v_, segment_ids=i, sinks=sinks))(q, k, v, ids)

    if not transpose:
        return heads_first_attend
    return lambda q, k, v: heads_first(heads_first_attend(heads_first(q), heads_first(k), heads_first(v)))


def heads_first(x):
    return jnp.swapaxes(x, 1, 2)


# -- XLA -------------------------------------------------------------------------------------------------
def jax_nn_attend(case: Case):
    """``jax.nn.dot_product_attention`` (XLA) where it can express the case (None otherwise)."""
    if case.documents or case.sinks or case.chunk or case.soft_cap is not None:
        return None
    window = None if case.window is None else (case.window, 0)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, local_window_size=window,
                                            implementation="xla")

    return attend


# -- errors on the device ------------------------------------------------------------------------------
@jax.jit
def _leaf_errors(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    diff = x - ref
    finite = jnp.all(jnp.isfinite(x))
    max_rel = jnp.max(jnp.abs(diff)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30)
    l2 = jnp.linalg.norm(diff.ravel()) / jnp.maximum(jnp.linalg.norm(ref.ravel()), 1e-30)
    return jnp.where(finite, max_rel, jnp.inf), jnp.where(finite, l2, jnp.inf)


def device_errors(out, ref) -> tuple[float, float]:
    """``(max|out - ref| / max|ref|, largest relative L2)`` over the leaves, reduced on the device."""
    worst = [0.0, 0.0]
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref), strict=True):
        m, l2 = (float(e) for e in _leaf_errors(o, r))
        worst = [max(worst[0], m), max(worst[1], l2)]
    return worst[0], worst[1]


# -- the run ---------------------------------------------------------------------------------------------
class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-attention-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)
        self.explicit = _names(args.configs, EXPLICIT, "--configs")
        self.splash = list(SPLASH) if args.splash == "all" else _names(args.splash, SPLASH, "--splash")
        self.contenders = set(_names(args.contenders, dict.fromkeys(CONTENDERS), "--contenders"))
        if args.xla:
            self.contenders.add("xla")

    def picked(self) -> list[int]:
        if self.args.cases == "main":
            return list(MAIN)
        if self.args.cases == "all":
            return list(range(len(CASES)))
        picked = [int(i) for i in self.args.cases.split(",") if i]
        for i in picked:
            if not 0 <= i < len(CASES):
                raise SystemExit(f"--cases: expected indices in [0, {len(CASES)}), 'main' or 'all', got {i}")
        return picked

    def row(self, case: Case, pass_, contender, config, *, default=False, peer=False, ms=None,
            errs=(None, None), compile_s=None, error=None, skipped=None):
        flops = case.flops(pass_)
        tflops = None if ms is None else flops / (ms * 1e-3) / 1e12
        r = {"op": "attention", "case": case.name, "pass": pass_, "contender": contender, "config": config,
             "default": default, "peer": peer, "ms": ms, "tflops": tflops,
             "pct_peak": None if tflops is None or self.peak is None else 100.0 * tflops / self.peak,
             "bound": "compute", "vs_splash": None, "vs_xla": None, "max_rel_err": errs[0], "rel_l2": errs[1],
             "compile_s": compile_s, "device": self.device, "date": self.date, "skipped": skipped,
             "error": error}
        self.rows.append(r)
        if skipped:
            print(f"  {pass_:8s} {contender:26s} {config:34s} skipped: {skipped}", flush=True)
        elif error:
            print(f"  {pass_:8s} {contender:26s} {config:34s} ERROR {error[:300]}", flush=True)
        else:
            err = "no golden" if errs[0] is None else f"max_rel_err {errs[0]:.1e} rel_l2 {errs[1]:.1e}"
            print(f"  {pass_:8s} {contender:26s} {config:34s} {ms:9.3f} ms {tflops:7.1f} TFLOP/s "
                  f"{r['pct_peak'] or 0:5.1f}% {err} (first call {compile_s:.1f} s)", flush=True)
        return r

    def timed(self, case, pass_, contender, config, fn, operands, ref, to_ref=None, **flags):
        """Time ``fn(*operands)`` and add its row (an exception is an error row)."""
        if self.over_budget():
            return self.row(case, pass_, contender, config, skipped="budget spent", **flags)
        try:
            first, ms, out = time_fn(fn, operands, self.reps, self.warmup)
            if to_ref is not None:
                out = to_ref(out)
            errs = device_errors(out, ref) if ref is not None else (None, None)
            del out
        except Exception as e:  # noqa: BLE001 - a contender that does not run is a row
            return self.row(case, pass_, contender, config,
                            error=f"{type(e).__name__}: {e}".replace("\n", " ")[:600], **flags)
        return self.row(case, pass_, contender, config, ms=ms, errs=errs, compile_s=first, **flags)

    def run_case(self, index: int):
        case = CASES[index].dry() if self.dry else CASES[index]
        print(f"== [{index}] {case.name}" + (f" (dry: T={case.t} N={case.n} K={case.k})" if self.dry else ""),
              flush=True)
        q, k, v, d_out, seg, sinks = make_inputs(case, index)
        operands = (q, k, v, d_out)
        scale = 1.0 / case.d ** 0.5
        golden = None
        try:  # the float32 golden, forward and gradients, once
            golden = jax.block_until_ready(program(
                stellax_attend(case, seg, sinks, implementation="xla_chunked"), "fwd+bwd")(
                *(x.astype(jnp.float32) for x in operands)))
        except Exception as e:  # noqa: BLE001
            print(f"  golden failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        refs = {"fwd": None if golden is None else golden[0], "fwd+bwd": golden}
        for pass_ in self.passes:
            ref = refs[pass_]
            default_configs = {}
            if "default" in self.contenders:
                default_configs = self.time_default(case, pass_, seg, sinks, operands, ref)
            if "explicit" in self.contenders:
                self.time_explicit(case, pass_, seg, sinks, operands, ref, default_configs)
            if "splash" in self.contenders:
                self.time_splash(case, pass_, seg, sinks, operands, ref, scale)
            if "xla" in self.contenders:
                self.time_xla(case, pass_, seg, sinks, operands, ref)
        set_ratios(self.rows)
        del golden, refs, q, k, v, d_out, operands

    def time_default(self, case, pass_, seg, sinks, operands, ref) -> dict:
        """stellax with the config it picks by itself; returns the picked configs by op name."""
        from stellax.core import observe_calls

        seen = {}

        def observe(op, implementation, call, config):
            seen[op.name] = (implementation.name, config)

        impl = "mosaic_tpu" if self.dry else None
        fn = program(stellax_attend(case, seg, sinks, implementation=impl), pass_)
        with observe_calls(observe):
            r = self.timed(case, pass_, "stellax:mosaic_tpu", "default", fn, operands, ref)
        chosen = [f"{name}={impl_}:{_describe(cfg)}" for name, (impl_, cfg) in sorted(seen.items())]
        r["config"] = "default(" + ", ".join(chosen) + ")"
        picked_kernel = all(impl_ == "mosaic_tpu" for impl_, _ in seen.values()) and bool(seen)
        r["default"] = picked_kernel
        if not picked_kernel and r["error"] is None and r["skipped"] is None:
            r["contender"] = "stellax:" + "+".join(sorted({i for i, _ in seen.values()}))
        return {name: cfg for name, (impl_, cfg) in seen.items() if impl_ == "mosaic_tpu"}

    def time_explicit(self, case, pass_, seg, sinks, operands, ref, default_configs):
        """stellax at the --configs (a forward config timed once; none that is the default's)."""
        timed_forwards = set()
        for name in self.explicit:
            table = explicit_table(name, self.dry, case.n // case.k)
            ops = ("attention",) if pass_ == "fwd" else ("attention", "attention_backward")
            if all(table.get((op, "mosaic_tpu")) == default_configs.get(op) for op in ops):
                continue
            if pass_ == "fwd":
                if EXPLICIT[name][0] in timed_forwards:
                    continue
                timed_forwards.add(EXPLICIT[name][0])
            label = (name if pass_ == "fwd+bwd" else f"f{'x'.join(map(str, EXPLICIT[name][0] or ()))}") + \
                f" [{', '.join(_describe(c) for c in table.values())}]"
            fn = program(stellax_attend(case, seg, sinks, implementation="mosaic_tpu"), pass_, table)
            self.timed(case, pass_, "stellax:mosaic_tpu", label, fn, operands, ref)

    def time_splash(self, case, pass_, seg, sinks, operands, ref, scale):
        """jax's splash attention, its block sizes searched."""
        q, k, v, d_out = operands
        native = self.args.splash_layout == "native"
        split = (heads_first(q), heads_first(k), heads_first(v), heads_first(d_out)) if native else operands
        back = lambda out: (heads_first(out) if pass_ == "fwd" else
                            (heads_first(out[0]), tuple(heads_first(g) for g in out[1])))
        for name in self.splash:
            try:
                kernel = splash_kernel(case, name, self.dry, scale)
            except Exception as e:  # noqa: BLE001 - block sizes it does not take
                self.row(case, pass_, "jax:splash", f"blocks {name}", peer=True,
                         error=f"{type(e).__name__}: {e}".replace("\n", " ")[:600])
                continue
            fn = program(splash_attend(kernel, seg, sinks, scale, transpose=not native), pass_)
            self.timed(case, pass_, "jax:splash", f"blocks {name}", fn, split, ref, to_ref=back if native else None,
                       peer=True)
            del kernel, fn

    def time_xla(self, case, pass_, seg, sinks, operands, ref):
        """The XLA paths: stellax's memory-linear ``xla_chunked`` and ``jax.nn.dot_product_attention``
        where its materialized float32 logits fit."""
        fn = program(stellax_attend(case, seg, sinks, implementation="xla_chunked"), pass_)
        self.timed(case, pass_, "stellax:xla_chunked", "default", fn, operands, ref, peer=True)
        attend = jax_nn_attend(case)
        logits_bytes = 4 * case.b * case.n * case.t * case.t
        if attend is None:
            self.row(case, pass_, "jax.nn.dot_product_attention[xla]", "-", peer=True,
                     skipped="cannot express segment ids / sinks / chunks / soft cap")
        elif logits_bytes > 4 * 2 ** 30:
            self.row(case, pass_, "jax.nn.dot_product_attention[xla]", "-", peer=True,
                     skipped=f"materialized float32 logits {logits_bytes / 2 ** 30:.0f} GiB > 4 GiB")
        else:
            self.timed(case, pass_, "jax.nn.dot_product_attention[xla]", "-", program(attend, pass_),
                       operands, ref, peer=True)

    def main(self):
        picked = self.picked()
        print(f"attention on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), cases {picked}, "
              f"explicit {self.explicit}, splash {self.splash}, reps {self.reps}, warmup {self.warmup}", flush=True)
        self.run_cases(picked, self.run_case)
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


#: The contenders ``vs_xla`` compares with.
XLA_CONTENDERS = ("stellax:xla_chunked", "jax.nn.dot_product_attention[xla]")


def set_ratios(rows) -> None:
    """Each timed row's ``vs_splash`` (best splash time / its time) and ``vs_xla`` (best XLA time /
    its time) within its case and pass; None where that peer has no time. Rows merged from several
    runs (the suite adds XLA rows to cases measured before) get their ratios here again."""
    best = {}
    for r in rows:
        if r.get("ms") is None:
            continue
        peer = "splash" if r["contender"] == "jax:splash" else "xla" if r["contender"] in XLA_CONTENDERS else None
        if peer and r.get("peer"):  # not stellax's default row, had dispatch picked its XLA path
            key = (r["case"], r["pass"], peer)
            best[key] = min(best.get(key, r["ms"]), r["ms"])
    for r in rows:
        for peer in ("splash", "xla"):
            t = best.get((r["case"], r["pass"], peer))
            r[f"vs_{peer}"] = t / r["ms"] if t is not None and r.get("ms") is not None else None


def summary(rows):
    """Per case and pass: stellax default, best stellax, best splash (ms, TFLOP/s, x = splash / stellax)."""
    print("\nsummary (ms, TFLOP/s; x = best splash time / this)", flush=True)
    for case, pass_ in dict.fromkeys((r["case"], r["pass"]) for r in rows):
        rs = [r for r in rows if (r["case"], r["pass"]) == (case, pass_) and r["ms"] is not None]
        default = next((r for r in rs if r["config"].startswith("default(")), None)
        ours = [r for r in rs if r["contender"] == "stellax:mosaic_tpu"]
        best = min(ours, key=lambda r: r["ms"]) if ours else None
        splash = [r for r in rs if r["contender"] == "jax:splash"]
        best_splash = min(splash, key=lambda r: r["ms"]) if splash else None
        xla = [r for r in rs if r["contender"] in XLA_CONTENDERS]
        best_xla = min(xla, key=lambda r: r["ms"]) if xla else None
        cells = []
        for label, r in (("default", default), ("best", best), ("splash", best_splash), ("xla", best_xla)):
            if r is None:
                cells.append(f"{label} -")
                continue
            ratio = "" if r["vs_splash"] is None or label in ("splash", "xla") else f" {r['vs_splash']:.2f}x"
            extra = f" [{r['config']}]" if label != "default" else ""
            cells.append(f"{label} {r['ms']:.3f} ({r['tflops']:.0f}){ratio}{extra}")
        print(f"  {case:44s} {pass_:8s} " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv), tpu_interpret=True)


if __name__ == "__main__":
    sys.exit(main())
