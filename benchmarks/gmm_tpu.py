"""Grouped matmul on a TPU: stellax's Mosaic kernels against XLA's ragged_dot and jax's megablox, in one process.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/gmm_tpu.py --out $OUT/gmm_tpu.json

Cases (issue 38, `CASES`), bfloat16 operands and outputs, every row in a group; without
``--cases`` the main set `MAIN_CASES` (about 150 s on a v5e, compiles included):

0. ``DeepSeek-like balanced M=16384 K=7168 N=2048 G=64``: DeepSeek-V3's expert projection
   with 64 experts (256 rows each), so that its weight gradient fits a v5e;
1. ``skewed (Dirichlet 0.3) M=32768 K=2048 N=1408 G=64``: group shares drawn from a
   symmetric Dirichlet(0.3) (seeded; some groups get a handful of rows or none); N is not a
   multiple of 256;
2. ``Mixtral-like balanced M=16384 K=4096 N=14336 G=8``;
3. ``Qwen3-MoE-like balanced M=32768 K=2048 N=768 G=128``;

then (``--cases 4,5,...``) Qwen3-MoE-like skewed and with every third group empty,
DeepSeek-V3-like (M=32768, G=256) balanced and skewed (forward only: its ``[G, K, N]``
weights are 7.5 GB), and more explicit tilings of the skewed case (index 8).

For each case, each pass (``--passes``) and each backward kernel alone (``--parts``), on the
same data; a case runs a pass or part only where its `Case.tiles` names it:

* ``fwd`` (``y = x @ w[g]``) and ``fwd+bwd`` (``y`` and, for a fixed cotangent, ``dx`` and
  ``dw`` by ``jax.vjp``): rows of op ``ragged_dot``;
* ``dlhs`` (``dx = dy @ w[g]ᵀ``, the transposed-rhs gmm) and ``tgmm`` (``dw[g] = x[g]ᵀ @
  dy[g]``) alone: rows of op ``ragged_dot_dlhs`` / ``ragged_dot_tgmm`` with pass ``fwd``
  (their own TFLOP/s, ``2·M·K·N``); the tgmm also with ``lhs = xᵀ [K, M]`` made outside the
  timing (config ``default, lhs=xT [K, M]``: the gradient's tgmm takes ``x [M, K]`` and
  contracts its row axis in the kernel, which may cost a transpose per step);

the contenders:

* ``stellax:mosaic_tpu`` with the configs stellax picks by itself (shipped cache, then
  heuristic; for ``fwd+bwd`` the forward, dlhs and tgmm each pick their own; ``default`` is
  true when the op would also pick the Mosaic kernel by itself), then the case's explicit
  tilings ``(block_m, block_k, block_n)`` (for ``fwd+bwd`` the same tiling for the three kernels);
* ``xla:ragged_dot``: `jax.lax.ragged_dot` / ``ragged_dot_general`` (and its own VJP), in the
  passes the case lists;
* ``jax:megablox_gmm``: `jax.experimental.pallas.ops.tpu.megablox` ``gmm`` (``fwd+bwd``: its
  custom VJP, gmm for dlhs and tgmm for dw; ``tgmm`` alone: its ``tgmm`` on ``xᵀ`` made
  outside the timing) at the case's tilings (the fastest row per case and pass marked ``best``).

Timing: each contender is compiled and run once, then timed ``--reps`` times
(``block_until_ready`` after each call; median) after ``--warmup`` runs.
``tflops`` counts ``2·M·K·N`` for ``fwd`` and three times that for ``fwd+bwd``
(the same for every contender); ``pct_peak`` is against the chip's bfloat16
peak (197 TFLOP/s on a v5e). Each contender's results are checked on sampled
groups (the first, the last, the largest and smallest non-empty ones, and up to
two empty ones) against float32 products of the same bfloat16 inputs at
``HIGHEST`` precision: ``rel_l2`` (‖out−ref‖/‖ref‖ over the sampled rows, and for
``fwd+bwd`` the worst of y, dx and dw), ``max_rel_err`` (max|out−ref| / max|ref|), and
``empty_dw_zero`` (the weight gradient of every sampled empty group exactly zero).

The JSON (``--out``) holds ``{"format": "stellax-gmm-tpu", "version": 1, "environment":
{...}, "rows": [ROW, ...]}``, rows in the suite's results schema (benchmarks/README.md:
op, case, pass, contender, default, peer, ms, tflops, pct_peak, bound, device, date,
skipped, error) plus ``config``, ``rel_l2``, ``max_rel_err``, ``empty_dw_zero``,
``compile_s`` and ``best`` (peers). It is rewritten after every contender; ``--budget``
seconds (default 150) stops starting new contenders (the rest are rows with
``skipped``), so a run cut short keeps what it measured.

``--dry-run`` runs the same code path on the CPU on tiny shapes with the Pallas
kernels interpreted (the test suite runs it so the script cannot rot).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
import numpy as np
from stellax.bench.chip_run import ChipRun, elapsed, mark_best, time_fn

#: bfloat16 MXU peak (TFLOP/s) by device kind; the dry run reports against a v5e's.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5": 459.0, "TPU v6 lite": 918.0, "TPU7x": 2307.0}
V5E_TFLOPS = 197.0

#: A group-size pattern: every third group empty, the rows shared equally by the others.
EMPTY_THIRD = "empty third"
#: The kernels timed alone (``--parts``): the dlhs gmm (``dy @ w[g]ᵀ``) and the tgmm (``x[g]ᵀ @ dy[g]``).
PARTS = ("dlhs", "tgmm")


@dataclasses.dataclass(frozen=True)
class Case:
    """A shape, its group sizes, and the contenders it runs per pass or part.

    ``tiles[p]``: stellax's explicit tilings ``(block_m, block_k, block_n)`` for pass or part ``p``
    (``fwd+bwd``: the same tiling for the forward, dlhs and tgmm); ``megablox[p]``: megablox
    tilings (its tiling searched; the fastest is marked ``best``); ``xla``: the passes and parts
    XLA's ragged_dot runs in. A pass or part with no entry in ``tiles`` is not run at all."""

    label: str
    m: int
    k: int
    n: int
    g: int
    alpha: object = None
    tiles: dict = dataclasses.field(default_factory=dict)
    megablox: dict = dataclasses.field(default_factory=dict)
    xla: tuple = ("fwd", "fwd+bwd", "dlhs", "tgmm")

    @property
    def name(self) -> str:
        return f"{self.label} M={self.m} K={self.k} N={self.n} G={self.g}"


MB = (256, 1024, 1024)  # megablox's best tiling on the 64-expert DeepSeek-like case (v5e, 2026-12-06)
CASES = [
    # 0: the DeepSeek-V3-like projection (K=7168, N=2048) with 64 experts: it fits with its gradient.
    Case("DeepSeek-like balanced", 16384, 7168, 2048, 64, None,
         tiles={"fwd": [(256, 2048, 1024)], "fwd+bwd": [],
                "dlhs": [(256, 1024, 1024), (256, 2048, 1024), (512, 2048, 1024)],
                "tgmm": [(256, 1024, 1024), (256, 1024, 2048), (512, 1024, 2048)]},
         megablox={"fwd": [MB], "fwd+bwd": [MB], "dlhs": [MB], "tgmm": [MB]}, xla=("fwd",)),
    # 1: issue 38's skewed case (N=1408 is not a multiple of 256). The explicit tilings take the
    # heuristic's K/N blocks with 256- and 512-row tiles (the heuristic picks 128 rows): the row tile
    # each kernel wants when group boundaries fall inside tiles.
    Case("skewed (Dirichlet 0.3)", 32768, 2048, 1408, 64, 0.3,
         tiles={"fwd": [(256, 2048, 1408), (512, 2048, 1408)], "fwd+bwd": [],
                "dlhs": [(256, 1408, 2048), (512, 1408, 2048)], "tgmm": [(256, 1024, 1408), (256, 2048, 1408), (512, 1024, 1408)]},
         megablox={"fwd": [MB], "fwd+bwd": [MB], "dlhs": [MB], "tgmm": [MB]},
         xla=("fwd", "fwd+bwd", "tgmm")),
    # 2: Mixtral-like: few experts, big N (the 85 % of peak goal).
    Case("Mixtral-like balanced", 16384, 4096, 14336, 8, None,
         tiles={"fwd": [(512, 1024, 1024)], "fwd+bwd": [], "dlhs": [(512, 2048, 2048)],
                "tgmm": [(256, 1024, 2048), (512, 1024, 2048)]},
         megablox={"fwd": [(512, 1024, 1024)], "fwd+bwd": [(512, 1024, 1024)], "tgmm": [(512, 1024, 1024)]},
         xla=("fwd",)),
    # 3: Qwen3-MoE-like: many small experts (N=768).
    Case("Qwen3-MoE-like balanced", 32768, 2048, 768, 128, None,
         tiles={"fwd": [(256, 2048, 768)], "fwd+bwd": [], "dlhs": [(256, 768, 2048)], "tgmm": [(256, 2048, 768)]},
         megablox={"fwd": [(256, 1024, 256)], "fwd+bwd": [(256, 1024, 256)]}, xla=("fwd", "fwd+bwd")),
    # 4-: more of issue 38's shapes, run with --cases.
    Case("Qwen3-MoE-like skewed (Dirichlet 0.3)", 32768, 2048, 768, 128, 0.3,
         tiles={"fwd": [], "fwd+bwd": []}, megablox={"fwd": [(256, 1024, 256)], "fwd+bwd": [(256, 1024, 256)]},
         xla=("fwd", "fwd+bwd")),
    Case("Qwen3-MoE-like, a third of the groups empty", 32768, 2048, 768, 128, EMPTY_THIRD,
         tiles={"fwd": [], "fwd+bwd": []}, megablox={"fwd": [(256, 1024, 256)], "fwd+bwd": [(256, 1024, 256)]},
         xla=("fwd", "fwd+bwd")),
    # DeepSeek-V3-like with all 256 experts: [G, K, N] weights of 7.5 GB, no room for their gradient.
    Case("DeepSeek-V3-like balanced", 32768, 7168, 2048, 256, None, tiles={"fwd": []},
         megablox={"fwd": [MB]}, xla=("fwd",)),
    Case("DeepSeek-V3-like skewed (Dirichlet 0.3)", 32768, 7168, 2048, 256, 0.3, tiles={"fwd": []},
         megablox={"fwd": [MB]}, xla=("fwd",)),
    Case("skewed (Dirichlet 0.3) tiles", 32768, 2048, 1408, 64, 0.3,
         tiles={"fwd": [(256, 2048, 512), (512, 2048, 512), (128, 2048, 1024)],
                "fwd+bwd": [(256, 1024, 512)], "dlhs": [(128, 512, 2048), (256, 512, 2048)],
                "tgmm": [(512, 1024, 512), (512, 2048, 512)]},
         megablox={"fwd": [(512, 1024, 1024)], "tgmm": [(512, 1024, 512)]}, xla=()),
]
#: The cases run without ``--cases``: about 150 s on a v5e.
MAIN_CASES = (0, 1, 2, 3)
DRY_CASES = [
    Case("balanced", 512, 256, 256, 4, None,
         tiles={"fwd": [(256, 256, 256)], "fwd+bwd": [(256, 256, 256)], "dlhs": [(128, 128, 128)], "tgmm": []},
         megablox={"fwd": [(128, 128, 128)], "fwd+bwd": [(128, 128, 128)], "dlhs": [(128, 128, 128)],
                   "tgmm": [(128, 128, 128)]}),
    Case("skewed (Dirichlet 0.3)", 640, 256, 384, 6, 0.3,
         tiles={"fwd": [(128, 128, 256)], "fwd+bwd": [(256, 256, 256)], "dlhs": [], "tgmm": [(128, 256, 256)]},
         megablox={"fwd": [(128, 128, 128)], "fwd+bwd": [(128, 128, 128)], "dlhs": [(128, 128, 128)],
                   "tgmm": [(128, 128, 128)]}),
]


#: Timed and untimed runs per contender: (dry run, chip).
REPS, WARMUP = (1, 10), (0, 2)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=150.0, stops="contender",
                        passes=True)
    p.add_argument("--parts", default=",".join(PARTS),
                   help="backward kernels timed alone: dlhs and/or tgmm, comma-separated (default both; '' none)")
    p.add_argument("--no-peers", action="store_true", help="only stellax's contenders")
    return p.parse_args(argv)


# -- inputs ----------------------------------------------------------------------------------
def group_sizes(m: int, g: int, alpha, seed: int) -> np.ndarray:
    """``g`` sizes summing to ``m``: equal (``alpha`` None), equal over two groups in three with every
    third group empty (`EMPTY_THIRD`), or Dirichlet(``alpha``) shares rounded down with the
    remainder on the largest group."""
    if alpha is None or alpha == EMPTY_THIRD:
        live = np.arange(g) % 3 != 2 if alpha == EMPTY_THIRD else np.ones(g, bool)
        sizes = np.zeros(g, np.int64)
        sizes[live] = m // live.sum()
        sizes[np.flatnonzero(live)[: m - sizes.sum()]] += 1
        return sizes.astype(np.int32)
    shares = np.random.default_rng(seed).dirichlet(np.full(g, alpha))
    sizes = np.floor(shares * m).astype(np.int64)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes.astype(np.int32)


def make_inputs(seed: int, m: int, k: int, n: int, g: int, alpha):
    """``(x [M, K], w [G, K, N], sizes [G] int32, dy [M, N])`` in bfloat16, made on the device."""
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.jit(lambda key: jax.random.normal(key, (m, k), jnp.bfloat16))(kx)
    w = jax.jit(lambda key: (jax.random.normal(key, (g, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16))(kw)
    dy = jax.jit(lambda key: jax.random.normal(key, (m, n), jnp.bfloat16))(kd)
    sizes = group_sizes(m, g, alpha, seed)
    return x, w, jnp.asarray(sizes), dy


def sampled_groups(sizes: np.ndarray) -> list[int]:
    """The groups whose results are checked: first, last, largest, smallest non-empty, two empty."""
    nonempty = [i for i in range(len(sizes)) if sizes[i] > 0]
    empty = [i for i in range(len(sizes)) if sizes[i] == 0][:2]
    picks = [0, len(sizes) - 1, int(np.argmax(sizes))]
    if nonempty:
        picks.append(min(nonempty, key=lambda i: sizes[i]))
    return sorted(set(picks + empty))


def golden(x, w, sizes: np.ndarray, dy, groups) -> dict:
    """Per sampled group ``g`` (rows ``[s, e)``): float32 ``y``, ``dx`` and ``dw`` of the bfloat16 inputs."""
    hi = jax.lax.Precision.HIGHEST
    ends = np.cumsum(sizes)
    out = {}
    for gr in groups:
        s, e = int(ends[gr] - sizes[gr]), int(ends[gr])
        xs, ws, ds = (a.astype(jnp.float32) for a in (x[s:e], w[gr], dy[s:e]))
        out[gr] = dict(rows=(s, e), y=jnp.dot(xs, ws, precision=hi), dx=jnp.dot(ds, ws.T, precision=hi),
                       dw=jnp.dot(xs.T, ds, precision=hi))
    return out


@jax.jit
def _take(a, idx):
    """``a[idx]`` along axis 0: one program per shape, shared by every contender of a case (a
    slice per sampled group would compile a program for each group's bounds)."""
    return jnp.take(a, idx, axis=0)


def errors(results: dict, ref: dict) -> tuple[float, float, bool | None]:
    """``(rel_l2, max_rel_err, empty_dw_zero)`` of ``results`` (``y`` and, for fwd+bwd, ``dx``,
    ``dw``) on the sampled groups: the worst over the outputs present."""
    worst_l2 = worst_max = 0.0
    empty_zero = None
    groups = list(ref)
    rows = np.concatenate([np.arange(*ref[gr]["rows"]) for gr in groups]).astype(np.int32)
    for name in ("y", "dx", "dw"):
        if name not in results:
            continue
        if name == "dw":
            picked = np.asarray(_take(results["dw"], jnp.asarray(groups, jnp.int32)), np.float32)
            got = []
            for i, gr in enumerate(groups):
                s, e = ref[gr]["rows"]
                if s == e:
                    zero = not bool(np.any(picked[i] != 0))
                    empty_zero = zero if empty_zero is None else (empty_zero and zero)
                got.append(picked[i].ravel())
            o = np.concatenate(got)
        else:
            o = np.asarray(_take(results[name], jnp.asarray(rows)), np.float32).ravel() if rows.size else \
                np.zeros(0, np.float32)
        w = np.concatenate([np.asarray(ref[gr][name]).ravel() for gr in groups])
        if not np.all(np.isfinite(o)):
            return math.inf, math.inf, empty_zero
        l2 = float(np.linalg.norm(w)) or 1.0
        scale = float(np.max(np.abs(w))) if w.size else 1.0
        worst_l2 = max(worst_l2, float(np.linalg.norm(o - w)) / l2)
        worst_max = max(worst_max, float(np.max(np.abs(o - w))) / (scale or 1.0) if w.size else 0.0)
    return worst_l2, worst_max, empty_zero


# -- contenders -----------------------------------------------------------------------------------
def _with_pass(forward, kind: str, context=contextlib.nullcontext):
    """A jitted ``(x, w, sizes, dy) -> {"y"[, "dx", "dw"]}`` of ``forward(x, w, sizes)``; ``context()``
    is entered while it is traced (the configs stellax's ops resolve)."""
    if kind == "fwd":
        def fn(x, w, sizes, dy):
            with context():
                return {"y": forward(x, w, sizes)}
    else:
        def fn(x, w, sizes, dy):
            with context():
                y, pull = jax.vjp(lambda a, b: forward(a, b, sizes), x, w)
                dx, dw = pull(dy)
            return {"y": y, "dx": dx, "dw": dw}
    return jax.jit(fn)


def _tile_label(tiling, kind: str) -> str:
    return f"tiling={tuple(tiling)}" + (" (fwd, dlhs, tgmm)" if kind == "fwd+bwd" else "")


def stellax_contenders(case: Case, kind: str):
    """``(contender, config label, fn, is_default_config)`` of stellax for pass ``kind``: its own
    configs, then ``case.tiles[kind]``."""
    import stellax
    from stellax.core import use_configs
    from stellax.ops.moe.configs import TpuGroupedMatmulConfig

    mosaic = functools.partial(stellax.ragged_dot, implementation="mosaic_tpu")
    out = [("stellax:mosaic_tpu", "default", _with_pass(mosaic, kind), True)]
    for tiling in case.tiles.get(kind, ()):
        cfg = TpuGroupedMatmulConfig(*tiling)
        table = {("ragged_dot", "mosaic_tpu"): cfg, ("ragged_dot_tgmm", "mosaic_tpu"): cfg}
        out.append(("stellax:mosaic_tpu", _tile_label(tiling, kind),
                    _with_pass(mosaic, kind, functools.partial(use_configs, table)), False))
    return out


def peer_contenders(case: Case, kind: str):
    """``(contender, config label, fn)`` of XLA's ragged_dot (when ``case.xla`` has ``kind``) and
    megablox at ``case.megablox[kind]``."""
    out = []
    if kind in case.xla:
        out.append(("xla:ragged_dot", "default",
                    _with_pass(lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=x.dtype), kind)))
    try:
        from jax.experimental.pallas.ops.tpu import megablox
    except Exception:  # noqa: BLE001 - a jax without megablox: no megablox rows
        return out
    for tiling in case.megablox.get(kind, ()):
        def fn(x, w, s, tiling=tuple(tiling)):
            return megablox.gmm(x, w, s, x.dtype, tiling)
        out.append(("jax:megablox_gmm", f"tiling={tuple(tiling)}" + ("" if kind == "fwd" else " (gmm, tgmm)"),
                    _with_pass(fn, kind)))
    return out


# -- the backward kernels alone (--parts) ------------------------------------------------------------
#: ``dy [M, N] @ w[g]ᵀ`` (w ``[G, K, N]``): the transposed-rhs layout of ragged_dot_general.
DLHS_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
#: ``x[rows of g]ᵀ @ dy[rows of g]`` (x ``[M, K]``, dy ``[M, N]``) → ``[G, K, N]``.
TGMM_DIMS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def part_contenders(case: Case, part: str):
    """``(contender, config label, fn, is_default_config, peer)`` for the backward kernel ``part``
    alone; every ``fn(x, w, sizes, dy, xt)`` returns ``{"dx": ...}`` (dlhs) or ``{"dw": ...}``
    (tgmm). ``xt`` is ``x`` transposed, made once outside the timing (megablox's tgmm takes
    ``[K, M]``; its VJP transposes ``x`` itself, which the ``fwd+bwd`` rows include)."""
    import stellax
    from stellax.ops.moe.configs import TpuGroupedMatmulConfig

    def stellax_fn(cfg):
        if part == "dlhs":
            return jax.jit(lambda x, w, s, dy, xt: {"dx": stellax.ragged_dot_general(
                dy, w, s, DLHS_DIMS, implementation="mosaic_tpu", config=cfg)})
        return jax.jit(lambda x, w, s, dy, xt: {"dw": stellax.ragged_dot_tgmm(
            x, dy, s, transpose_lhs=True, implementation="mosaic_tpu", config=cfg)})

    out = [("stellax:mosaic_tpu", "default", stellax_fn(None), True, False)]
    if part == "tgmm":  # lhs [K, M] (xᵀ made outside, as megablox's VJP does): no transpose in the kernel
        out.append(("stellax:mosaic_tpu", "default, lhs=xT [K, M]", jax.jit(lambda x, w, s, dy, xt: {
            "dw": stellax.ragged_dot_tgmm(xt, dy, s, implementation="mosaic_tpu")}), False, False))
    for tiling in case.tiles.get(part, ()):
        out.append(("stellax:mosaic_tpu", _tile_label(tiling, part), stellax_fn(TpuGroupedMatmulConfig(*tiling)),
                    False, False))
    if part in case.xla:
        if part == "dlhs":
            fn = jax.jit(lambda x, w, s, dy, xt: {"dx": jax.lax.ragged_dot_general(
                dy, w, s, DLHS_DIMS, preferred_element_type=dy.dtype)})
        else:
            fn = jax.jit(lambda x, w, s, dy, xt: {"dw": jax.lax.ragged_dot_general(
                x, dy, s, TGMM_DIMS, preferred_element_type=x.dtype)})
        out.append(("xla:ragged_dot", "default", fn, False, True))
    try:  # the package's ``gmm`` name is the function: the kernels' module by its full name
        megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    except Exception:  # noqa: BLE001
        return out
    for tiling in case.megablox.get(part, ()):
        tiling = tuple(tiling)
        if part == "dlhs":
            def fn(x, w, s, dy, xt, tiling=tiling):
                return {"dx": megablox.gmm(dy, w, s, dy.dtype, tiling, transpose_rhs=True)}
        else:
            def fn(x, w, s, dy, xt, tiling=tiling):
                return {"dw": megablox.tgmm(xt, dy, s, x.dtype, tiling)}
        out.append(("jax:megablox_gmm", f"tiling={tiling}", jax.jit(fn), False, True))
    return out


# -- the run ---------------------------------------------------------------------------------------
class Run(ChipRun):
    def __init__(self, args):
        super().__init__(args, "stellax-gmm-tpu", reps=REPS, warmup=WARMUP)
        self.peak = V5E_TFLOPS if self.dry else PEAK_TFLOPS.get(self.device)

    def row(self, case, kind, contender, config, *, default, peer, flops, ms=None, errs=(None, None, None),
            compile_s=None, error=None, skipped=None, op="ragged_dot"):
        tflops = None if ms is None or not ms == ms else flops / (ms * 1e-3) / 1e12
        pct = None if tflops is None or self.peak is None else 100.0 * tflops / self.peak
        r = {"op": op, "case": case, "pass": kind, "contender": contender, "config": config,
             "default": default, "peer": peer, "ms": ms, "tflops": tflops, "pct_peak": pct, "bound": "compute",
             "rel_l2": errs[0], "max_rel_err": errs[1], "empty_dw_zero": errs[2], "compile_s": compile_s,
             "device": self.device, "date": self.date, "skipped": skipped, "error": error}
        self.rows.append(r)
        self.save()
        tag = OP_PART.get(op, kind)
        if skipped:
            print(f"  {tag:7s} {contender:20s} {config:44s} skipped: {skipped}", flush=True)
        elif error:
            print(f"  {tag:7s} {contender:20s} {config:44s} ERROR {error[:200]}", flush=True)
        else:
            print(f"  {tag:7s} {contender:20s} {config:44s} {ms:9.3f} ms {tflops:7.1f} TFLOP/s {pct or 0:5.1f}% "
                  f"rel_l2 {errs[0]:.2e} max_rel_err {errs[1]:.2e} empty_dw_zero {errs[2]} "
                  f"(first call {compile_s:.1f} s)", flush=True)
        return r

    def measure(self, case, kind, contender, config, fn, args, ref, flops, *, default, peer, op="ragged_dot"):
        row = functools.partial(self.row, case, kind, contender, config, default=default, peer=peer, flops=flops,
                                op=op)
        if self.over_budget():
            return row(skipped=f"budget of {self.args.budget:.0f} s spent")
        try:
            first, ms, out = time_fn(fn, args, self.reps, self.warmup)
            errs = errors(out, ref)
            del out
            return row(ms=ms, errs=errs, compile_s=first)
        except Exception as e:  # noqa: BLE001 - a contender that does not compile or run is a row
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")
            return row(error=msg[:400])

    def default_implementation(self, x, w, sizes) -> str | None:
        if self.dry:  # on a CPU dispatch never picks an interpreted kernel; the dry run stands for a TPU
            return "mosaic_tpu"
        from stellax.ops.moe import ragged_dot_op
        try:
            return ragged_dot_op.select(ragged_dot_op.check(x, w, sizes)).name
        except Exception:  # noqa: BLE001
            return None

    def run_case(self, index, c: Case):
        case, m, k, n = c.name, c.m, c.k, c.n
        args = make_inputs(index, m, k, n, c.g, c.alpha)
        sizes = np.asarray(args[2])
        print(f"== {case}: group sizes min {sizes.min()} max {sizes.max()} empty {(sizes == 0).sum()}", flush=True)
        ref = golden(*args[:2], sizes, args[3], sampled_groups(sizes))
        picked = self.default_implementation(*args[:3])
        for kind in [p for p in self.passes if p in c.tiles]:
            flops = 2.0 * m * k * n * (1 if kind == "fwd" else 3)
            kept = ref if kind == "fwd+bwd" else _only(ref, "y")
            for contender, config, fn, is_default in stellax_contenders(c, kind):
                self.measure(case, kind, contender, config, fn, args, kept, flops,
                             default=bool(is_default and picked == "mosaic_tpu"), peer=False)
            if self.args.no_peers:
                continue
            self._peers(case, kind, "ragged_dot", [(n_, cf, fn) for n_, cf, fn in peer_contenders(c, kind)], args,
                        kept, flops)
        parts = [p for p in self.args.parts.split(",") if p]
        for part in parts:
            if part not in PARTS:
                raise SystemExit(f"--parts: expected dlhs and/or tgmm, got {part!r}")
        parts = [p for p in parts if p in c.tiles]
        if parts:
            full = (*args, jax.jit(jnp.transpose)(args[0]))
            for part in parts:
                op, kept, flops = PART_OP[part], _only(ref, "dx" if part == "dlhs" else "dw"), 2.0 * m * k * n
                contenders = part_contenders(c, part)
                for contender, config, fn, is_default, peer in contenders:
                    if not peer:
                        self.measure(case, "fwd", contender, config, fn, full, kept, flops,
                                     default=bool(is_default and picked == "mosaic_tpu"), peer=False, op=op)
                if not self.args.no_peers:
                    self._peers(case, "fwd", op, [(n_, cf, fn) for n_, cf, fn, _, peer in contenders if peer],
                                full, kept, flops)
            del full
        del args, ref

    def _peers(self, case, kind, op, contenders, args, ref, flops):
        """Time the peers' ``(contender, config, fn)`` and mark each contender's fastest ``best``."""
        timed = {}
        for contender, config, fn in contenders:
            r = self.measure(case, kind, contender, config, fn, args, ref, flops, default=False, peer=True, op=op)
            timed.setdefault(contender, []).append(r)
        for rows in timed.values():
            mark_best(rows)
        self.save()

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        picked = self.picked_cases(len(cases), MAIN_CASES)
        print(f"grouped matmul on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), "
              f"{len(picked)} cases, passes {self.passes}, parts {self.args.parts!r}, reps {self.reps}, "
              f"warmup {self.warmup}, budget {self.args.budget:.0f} s", flush=True)
        for i in picked:
            self.run_case(i, cases[i])
        self.save()
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


#: The op of the rows of each backward kernel timed alone (their ``pass`` is ``fwd``: the op's own).
PART_OP = {"dlhs": "ragged_dot_dlhs", "tgmm": "ragged_dot_tgmm"}
OP_PART = {op: part for part, op in PART_OP.items()}


def _only(ref: dict, name: str) -> dict:
    """The golden of the sampled groups with only their rows and ``name`` (``y``, ``dx`` or ``dw``)."""
    return {gr: {key: v for key, v in r.items() if key in ("rows", name)} for gr, r in ref.items()}


def summary(rows):
    """Per case and pass: stellax's default and best, XLA and megablox's best (ms, % of peak), and
    the ratio best peer / stellax default (the issue's goal: at least 1.10)."""
    print("\nsummary (ms, % of bf16 peak; x = best peer time / stellax default's)", flush=True)
    keys = list(dict.fromkeys((r["op"], r["case"], r["pass"]) for r in rows))
    for op, case, kind in keys:
        rs = [r for r in rows if r["op"] == op and r["case"] == case and r["pass"] == kind
              and r.get("ms") is not None and r.get("error") is None]

        def best(contender):
            c = [r for r in rs if r["contender"] == contender]
            return min(c, key=lambda r: r["ms"]) if c else None

        default = next((r for r in rs if r["contender"] == "stellax:mosaic_tpu" and r["config"] == "default"), None)
        cells = []
        for name, r in (("default", default), ("stellax best", best("stellax:mosaic_tpu")),
                        ("xla", best("xla:ragged_dot")), ("megablox", best("jax:megablox_gmm"))):
            cells.append(f"{name} " + ("-" if r is None else f"{r['ms']:.3f} ({r['pct_peak'] or 0:.0f}%)"
                                       + ("" if name != "stellax best" else f" {r['config']}")))
        peers = [r for r in (best("xla:ragged_dot"), best("jax:megablox_gmm")) if r is not None]
        if default is not None and peers:
            cells.append(f"x {min(p['ms'] for p in peers) / default['ms']:.2f}")
        print(f"  {case} [{OP_PART.get(op, kind)}]: " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    return chip_run.run(Run, parse_args(argv), tpu_interpret=True)


if __name__ == "__main__":
    sys.exit(main())
