"""stellax's Mosaic TPU attention kernels and jax's splash attention at the same
shapes and blocks, on abstract operands: what the static schedule tool
(`stellax.testing.llo_schedule`) compiles to compare the two kernels' grid steps
without a TPU (issue 37).

`kernel_case` builds ``(fn, args)`` for one contender — ``impl="stellax"``
(`dot_product_attention`, ``mosaic_tpu``, an explicit `SplashConfig` and, with
``backward``, `SplashBackwardConfig`) or ``impl="splash"`` (jax's
``make_splash_mha``, queries pre-scaled outside the kernel, as splash expects)
— on ``q [B=1, T, N, D]``, ``k, v [1, T, K, D]`` bfloat16, a causal or full mask:

    python -m stellax.testing.llo_schedule stellax.testing.attention_schedule:kernel_case \\
        impl='"splash"' t=8192 block=1024

With ``backward`` the function is the VJP (forward with residuals, then the
backward kernels). `per_tile` divides a kernel's static cycles by the logits
tiles of a grid step, so the two kernels compare per visited ``1024 × 1024``
logits tile even where stellax stacks a GQA head group into one step's rows.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

import jax
import jax.numpy as jnp

IMPLS = ("stellax", "splash")


def _shapes(t: int, n: int, k: int, d: int, dtype):
    q = jax.ShapeDtypeStruct((1, t, n, d), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((1, t, k, d), jnp.dtype(dtype))
    return q, kv


@dataclasses.dataclass(frozen=True)
class Mask:
    """The mask and logits options of a case (the issue's): ``causal``, a causal sliding window
    of ``window`` keys to the left (0: none), causal ``chunk`` s (0: none), ``documents`` equal
    segments per row (0: none; causal), ``soft_cap`` (0: none) and per-head ``sinks``."""

    causal: bool = True
    window: int = 0
    chunk: int = 0
    documents: int = 0
    soft_cap: float = 0.0
    sinks: bool = False

    def stellax_kwargs(self) -> dict:
        kw = {"is_causal": self.causal or bool(self.chunk)}
        if self.window:
            kw["local_window_size"] = (self.window, 0)
        if self.chunk:
            kw["chunk_size"] = self.chunk
        if self.soft_cap:
            kw["logits_soft_cap"] = self.soft_cap
        return kw

    def splash_mask(self, t: int):
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

        if self.chunk:
            return masks.ChunkedCausalMask((t, t), chunk_size=self.chunk)
        if self.window:
            return masks.LocalMask((t, t), window_size=(self.window, 0 if self.causal else None), offset=0)
        return masks.CausalMask((t, t)) if self.causal else masks.FullMask((t, t))

    def segment_ids(self, t: int):
        """The documents' segment ids ``[1, t]`` int32 (None without documents)."""
        if not self.documents:
            return None
        return (jnp.arange(t, dtype=jnp.int32) // (t // self.documents))[None]

    def spec(self):
        """stellax's `MaskSpec` of the mask, with the default positions."""
        from stellax.ops.attention.masks import MaskSpec

        return MaskSpec(causal=self.causal or bool(self.chunk), window_left=self.window or None,
                        chunk_size=self.chunk or None, segments=bool(self.documents), default_positions=True)


def _stellax(t, n, k, d, block, causal, backward, fused, block_bwd, mask, block_kv):
    import stellax
    from stellax.ops.attention.configs import SplashBackwardConfig, SplashConfig

    g = n // k
    rows = lambda b: max(128, b // g)
    bb = block_bwd or block
    table = {("attention", "mosaic_tpu"): SplashConfig(rows(block), block_kv or block),
             ("attention_backward", "mosaic_tpu"): SplashBackwardConfig(rows(bb), bb, rows(bb), bb, fused=fused)}
    kwargs = mask.stellax_kwargs()

    def attend(q, kk, v, seg=None, sinks=None):
        return stellax.dot_product_attention(q, kk, v, q_segment_ids=seg, kv_segment_ids=seg, sinks=sinks,
                                             implementation="mosaic_tpu", **kwargs)
    return attend, table


def _splash(t, n, k, d, block, causal, backward, fused, block_bwd, mask, block_kv):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    bb = block_bwd or block
    bkv = block_kv or block
    sizes = splash.BlockSizes(block_q=block, block_kv=bkv, block_kv_compute=min(bkv, 1024), block_q_dkv=bb,
                              block_kv_dkv=bb, block_kv_dkv_compute=bb, block_q_dq=None if fused else bb,
                              block_kv_dq=None if fused else bb, use_fused_bwd_kernel=fused)
    kernel = splash.make_splash_mha(masks.MultiHeadMask([mask.splash_mask(t)] * n), block_sizes=sizes,
                                    head_shards=1, q_seq_shards=1, attn_logits_soft_cap=mask.soft_cap or None)
    scale = d ** -0.5

    def attend(q, kk, v, seg=None, sinks=None):
        q = jnp.swapaxes(q[0], 0, 1) * jnp.asarray(scale, q.dtype)
        ids = None if seg is None else splash.SegmentIds(q=seg[0], kv=seg[0])
        out = kernel(q, jnp.swapaxes(kk[0], 0, 1), jnp.swapaxes(v[0], 0, 1), segment_ids=ids, sinks=sinks)
        return jnp.swapaxes(out, 0, 1)[None]
    return attend, None


def kernel_case(impl: str = "stellax", t: int = 8192, n: int = 16, k: int = 16, d: int = 128, block: int = 1024,
                causal: bool = True, backward: bool = False, fused: bool = True, block_bwd: int = 0,
                dtype: str = "bfloat16", window: int = 0, chunk: int = 0, documents: int = 0,
                soft_cap: float = 0.0, sinks: bool = False, block_kv: int = 0):
    """``(fn, args)``: ``impl``'s (`IMPLS`) attention on ``q [1, t, n, d]``, ``k, v [1, t, k, d]``
    (``dtype``) with ``block × block`` forward tiles (stellax: ``block / G`` query rows per head,
    ``G = n / k``, so a step's logits tile is ``block × block`` too; ``block_kv`` (0: ``block``) keys
    per forward step, splash computing them 1024 at a time) and ``block_bwd`` backward
    tiles (0: ``block``; ``fused``: one backward kernel); the mask and logits options as `Mask`
    (``window``, ``chunk``, ``documents``: segment ids ``[1, t]`` int32 as the last argument,
    ``soft_cap``, ``sinks``: ``[n]`` float32); with ``backward`` ``fn(q, k, v, [seg,] [sinks,] dout)``
    returns the VJP's ``(dq, dk, dv)``, else ``fn(q, k, v, [seg,] [sinks])`` returns the output."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if n % k:
        raise ValueError(f"n: expected a multiple of k={k}, got {n}")
    if documents and t % documents:
        raise ValueError(f"documents: expected a divisor of t={t}, got {documents}")
    mask = Mask(causal, window, chunk, documents, soft_cap, sinks)
    attend, table = (_stellax if impl == "stellax" else _splash)(t, n, k, d, block, causal, backward, fused,
                                                                 block_bwd, mask, block_kv)
    q, kv = _shapes(t, n, k, d, dtype)
    extra = []
    if documents:
        extra.append(jax.ShapeDtypeStruct((1, t), jnp.int32))
    if sinks:
        extra.append(jax.ShapeDtypeStruct((n,), jnp.float32))

    def split(rest):
        seg = rest[0] if documents else None
        sink = rest[int(bool(documents))] if sinks else None
        return seg, sink

    def configured(fn):
        """``fn`` traced with stellax's configs (the backward's are looked up when the VJP runs)."""
        if table is None:
            return fn

        def run(*args):
            import stellax
            with stellax.use_configs(table):
                return fn(*args)
        return run

    if not backward:
        def forward(q_, k_, v_, *rest):
            seg, sink = split(rest)
            return attend(q_, k_, v_, seg, sink)
        return configured(forward), (q, kv, kv, *extra)

    def grads(q_, k_, v_, *rest):
        seg, sink = split(rest[:-1])
        _, vjp = jax.vjp(lambda a, b, c: attend(a, b, c, seg, sink), q_, k_, v_)
        return vjp(rest[-1])
    return configured(grads), (q, kv, kv, *extra, q)


def grid_tiles(impl: str, t: int, n: int, k: int, block: int, causal: bool) -> int:
    """Grid steps that compute a ``block × block`` logits tile in the forward: the visited
    (query block, kv block) pairs over every head (stellax: per kv head, its ``G`` heads stacked)."""
    nb = t // block
    pairs = nb * (nb + 1) // 2 if causal else nb * nb
    return pairs * (n if impl == "splash" else k)


# -- the regions of a kernel's schedule -------------------------------------------------------------
_ADDRESS = re.compile(r"^\s*0x([0-9a-f]+)\s+(\w+:)?")
_REGION_START = re.compile(r"Start region (\d+)")


@dataclasses.dataclass(frozen=True)
class Region:
    """A straight run of a kernel's final bundles between control points (a branch, or a bundle
    that starts a region): ``start`` (bundle address), ``bundles``, ``ops`` (opcode histogram as
    in `llo_schedule`) and ``units`` (per functional unit: instructions over its issue width)."""

    start: int
    bundles: int
    ops: dict
    units: dict

    def count(self, prefix: str) -> int:
        return sum(n for op, n in self.ops.items() if op.startswith(prefix))


def regions(directory: str, kernel_prefix: str) -> list[Region]:
    """The `Region` s of the kernel whose dump name starts with ``kernel_prefix`` under the libtpu
    dump ``directory`` (`llo_schedule.dump_flags`), in address order."""
    from stellax.testing.llo_schedule import _OPCODE, _opcode

    bundle_files = [p for p in glob.glob(os.path.join(directory, "*-final_bundles.txt"))
                    if os.path.basename(p).split("-", 1)[1].startswith(kernel_prefix)]
    if len(bundle_files) != 1:
        raise ValueError(f"kernel_prefix: expected one kernel named {kernel_prefix!r}* under {directory}, "
                         f"got {len(bundle_files)}")
    path = bundle_files[0]
    units_path = glob.glob(path.replace("-final_bundles.txt", "").rsplit("-", 1)[0] +
                           "-*final_hlo-static-per-bundle-utilization.txt")
    names, widths, rows = [], [], []
    if units_path:
        with open(units_path[0]) as f:
            lines = [line.split("#")[0].strip() for line in f]
        header = [i for i, line in enumerate(lines) if line.startswith("== CAPAC")][0]
        names = [n.strip() for n in lines[header + 1].split(",")]
        widths = [int(x) for x in lines[header + 2].split()]
        rows = [[int(x) for x in line.split()] for line in lines[header + 3:]
                if len(line.split()) == len(names) and all(x.isdigit() for x in line.split())]
    out, current = [], None

    def close():
        if current is not None:
            out.append(current)

    with open(path) as f:
        for line in f:
            found = _ADDRESS.match(line)
            if not found:
                continue
            address = int(found.group(1), 16)
            if current is None or found.group(2) or "Start region" in line:
                close()
                current = [address, 0, collections.Counter(), [0] * len(names)]
            current[1] += 1
            for instruction in line.split(";;"):
                op = _OPCODE.search(instruction)
                if op:
                    current[2][_opcode(op.group(1))] += 1
            if address < len(rows):
                current[3] = [a + b for a, b in zip(current[3], rows[address])]
            if "sbr.rel" in line:
                close()
                current = None
    close()
    return [Region(start, n, dict(ops), {u: -(-t // w) for u, t, w in zip(names, totals, widths) if w})
            for start, n, ops, totals in out]


# -- stellax against splash, per visited block -----------------------------------------------------------
#: Kernel dump names: (stellax, splash) per pass.
KERNELS = {"fwd": ("stellax_splash_attention_forward", "splash_mha_fwd"),
           "bwd": ("transpose_jvp_stellax_splash_attention_backward", "splash_mha_dkv")}


@dataclasses.dataclass(frozen=True)
class StepCycles:
    """Static bundles of one kernel's grid step kinds: ``full`` (a visited block with no mask),
    ``partial`` (a visited block whose whole mask is evaluated; splash has one kind, evaluating its
    mask on every block: both equal), ``edges`` (stellax's one-sided masked steps, per block class
    `masks.UPPER_EDGE` / `masks.LOWER_EDGE`: the causal or the window comparison alone; empty when
    the mask has no such class) and ``finish`` (once per row of blocks: the output's
    normalization; 0 when not found), with the units of the ``full`` step."""

    full: int
    partial: int
    finish: int
    units: dict
    edges: dict = dataclasses.field(default_factory=dict)

    def masked(self, cls: int) -> int:
        """Bundles of a step of masked block class ``cls`` (`partial` unless `edges` has it)."""
        return self.edges.get(cls, self.partial)

    def per_block(self, visited: int, masked: int, rows: int) -> float:
        """Bundles per visited block over a schedule of ``visited`` blocks, ``masked`` of them
        partial, ``rows`` rows of blocks (finishes)."""
        return ((visited - masked) * self.full + masked * self.partial + rows * self.finish) / visited


def step_cycles(directory: str, kernel_prefix: str, classes: tuple = ()) -> StepCycles:
    """The `StepCycles` of a kernel from its libtpu dump: its regions that issue matmuls are the
    block steps, the largest region with a reciprocal and no matmul the finish. With ``classes``
    (stellax's masked block classes in `Step.visit` order, `masks.edge_parts`) of more than one
    class the kernel has ``1 + len(classes)`` step regions in that order after the unmasked one
    (which must have the fewest selects); otherwise one or two: the one with fewer selects is the
    unmasked one."""
    from stellax.ops.attention.masks import PARTIAL

    found = regions(directory, kernel_prefix)
    finishes = [r for r in found if r.count("vrcp") and not r.count("vmatmul")]
    finish = max((r.bundles for r in finishes), default=0)
    in_order = [r for r in found if r.count("vmatmul")]
    if len(classes) > 1:
        if len(in_order) != 1 + len(classes):
            raise ValueError(f"{kernel_prefix}: expected {1 + len(classes)} matmul regions (unmasked, then "
                             f"classes {tuple(classes)}), got {len(in_order)}")
        if min(r.count("vsel") for r in in_order) != in_order[0].count("vsel"):
            raise ValueError(f"{kernel_prefix}: the first matmul region is not the unmasked step")
        by_class = dict(zip(classes, in_order[1:]))
        edges = {cls: r.bundles for cls, r in by_class.items() if cls != PARTIAL}
        return StepCycles(in_order[0].bundles, by_class[PARTIAL].bundles, finish, in_order[0].units, edges)
    steps = sorted(in_order, key=lambda r: r.count("vsel"))
    if not steps or len(steps) > 2:
        raise ValueError(f"{kernel_prefix}: expected one or two matmul regions, got {len(steps)}")
    return StepCycles(steps[0].bundles, steps[-1].bundles, finish, steps[0].units)


def _mask_of(case: dict) -> Mask:
    return Mask(case.get("causal", True), case.get("window", 0), case.get("chunk", 0), case.get("documents", 0),
                case.get("soft_cap", 0.0), case.get("sinks", False))


def masked_classes(impl: str, case: dict) -> tuple:
    """The masked block classes of ``impl``'s kernel for ``case`` in its step order: stellax's
    `masks.edge_parts` of the case's mask; splash has one masked step (``()``)."""
    if impl != "stellax":
        return ()
    from stellax.ops.attention.masks import edge_parts

    return tuple(edge_parts(_mask_of(case).spec()))


def compile_steps(impl: str, generation: str = "v5e", timeout: float = 900, **case) -> StepCycles:
    """`step_cycles` of ``impl``'s kernel of `kernel_case` ``(impl=impl, **case)`` compiled for
    ``generation`` in a fresh process (`stellax.testing.llo_schedule`)."""
    import json
    import subprocess
    import sys
    import tempfile

    pass_ = "bwd" if case.get("backward") else "fwd"
    kernel = KERNELS[pass_][IMPLS.index(impl)]
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "stellax.testing.llo_schedule", "stellax.testing.attention_schedule:kernel_case",
                   f"--generation={generation}", f"--dump={directory}", f"impl={json.dumps(impl)}"]
        command += [f"{key}={json.dumps(value)}" for key, value in case.items()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            raise RuntimeError(f"compiling {impl} {case} for {generation} failed: {done.stderr[-600:]}")
        return step_cycles(directory, kernel, masked_classes(impl, case))


#: The comparison `main` prints: the benchmark's cases (benchmarks/attention_tpu.py) at its block sizes.
COMPARISONS = {
    "MHA causal T=8192 D=128, 1024 blocks, fwd": dict(t=8192, n=16, k=16, block=1024),
    "MHA causal T=8192 D=128, 512 blocks, fwd": dict(t=8192, n=16, k=16, block=512),
    "GQA N=32 K=8 causal T=8192 D=128, 1024 blocks, fwd": dict(t=8192, n=32, k=8, block=1024),
    "GQA N=32 K=8 causal T=8192 D=128, 512 blocks, fwd": dict(t=8192, n=32, k=8, block=512),
    "MHA causal T=8192 D=128, 1024 blocks, fused bwd": dict(t=8192, n=16, k=16, block=1024, backward=True),
    "MHA causal T=8192 D=128, 512 blocks, fused bwd": dict(t=8192, n=16, k=16, block=512, backward=True),
    "GQA N=32 K=8 causal T=8192 D=128, 1024 blocks, fused bwd": dict(t=8192, n=32, k=8, block=1024,
                                                                    backward=True),
}


def compare(case: dict, generation: str = "v5e") -> dict:
    """stellax's and splash's `StepCycles` for ``case`` (`kernel_case` keywords, causal) and the
    static bundles per visited ``block × block`` logits tile over the causal schedule."""
    ours, theirs = compile_steps("stellax", generation, **case), compile_steps("splash", generation, **case)
    nb = case["t"] // case["block"]
    visited, rows = nb * (nb + 1) // 2, nb
    finish = not case.get("backward")
    per = lambda s: s.per_block(visited, nb, rows if finish else 0)
    return {"stellax": ours, "splash": theirs, "stellax_per_block": per(ours), "splash_per_block": per(theirs),
            "ratio": per(ours) / per(theirs)}


# -- whole kernels: every visited grid step of a case ------------------------------------------------------
#: The issue's cases (`kernel_case` keywords at the benchmark's shapes, bf16, B=1).
ISSUE_CASES = {
    "MHA causal T=8192 D=128": dict(t=8192, n=16, k=16),
    "MHA full T=8192 D=128": dict(t=8192, n=16, k=16, causal=False),
    "MHA causal T=8192 D=64": dict(t=8192, n=16, k=16, d=64),
    "MHA full T=8192 D=64": dict(t=8192, n=16, k=16, d=64, causal=False),
    "MHA causal T=8192 D=256": dict(t=8192, n=16, k=16, d=256),
    "MHA full T=8192 D=256": dict(t=8192, n=16, k=16, d=256, causal=False),
    "GQA N=32 K=8 causal T=8192": dict(t=8192, n=32, k=8),
    "MQA N=16 K=1 causal T=8192": dict(t=8192, n=16, k=1),
    "window 1024 causal T=16384": dict(t=16384, n=16, k=16, window=1024),
    "window 4096 causal T=16384": dict(t=16384, n=16, k=16, window=4096),
    "chunked 2048 T=16384": dict(t=16384, n=16, k=16, chunk=2048),
    "documents 8x2048 causal T=16384": dict(t=16384, n=16, k=16, documents=8),
    "soft cap 30 causal T=8192": dict(t=8192, n=16, k=16, soft_cap=30.0),
    "sinks causal T=8192": dict(t=8192, n=16, k=16, sinks=True),
}


def compile_shape(case: dict) -> dict:
    """The small stand-in of ``case`` whose kernels are compiled for their step code (a step's
    code does not depend on T or the head count, only on the tile, the group ``G``, the layout
    and the mask options): T=4096 (2 documents with documents), 2 kv heads (MQA: 1), same ``G``."""
    g = case["n"] // case["k"]
    kh = 1 if case["k"] == 1 else 2
    small = {**case, "t": min(case["t"], 4096), "n": g * kh, "k": kh}
    if case.get("documents"):
        small["documents"] = max(1, case["documents"] * small["t"] // case["t"])
    return small


@dataclasses.dataclass(frozen=True)
class Visits:
    """The grid of one kernel over a whole case: ``steps`` (grid steps, empty ones included),
    ``full`` / ``partial`` (visited blocks computed without / with the whole mask), ``edges``
    (stellax's one-sided masked blocks per class, `masks.UPPER_EDGE` / `LOWER_EDGE`),
    ``finishes`` (rows of blocks normalized: the forward's output writes)."""

    steps: int
    full: int
    partial: int
    finishes: int
    edges: dict = dataclasses.field(default_factory=dict)

    @property
    def masked(self) -> int:
        """Visited blocks that evaluate some mask (`partial` and the one-sided ones)."""
        return self.partial + sum(self.edges.values())

    def cycles(self, s: StepCycles, backward: bool) -> int:
        """Static bundles of the visited steps (empty steps and DMA waits not counted)."""
        edges = sum(n * s.masked(cls) for cls, n in self.edges.items())
        return self.full * s.full + self.partial * s.partial + edges + (0 if backward else self.finishes * s.finish)


def stellax_visits(case: dict) -> Visits:
    """`Visits` of stellax's kernel for ``case`` (`kernel_case` keywords): its block classes
    (`masks.classify_blocks` on the default positions and the documents' segment ids) and its
    grid width (`mosaic_tpu.grid_width`), the forward per query block, the fused backward per
    key block; a step holds the ``G`` heads of a kv head."""
    import numpy as np

    from stellax.ops.attention.masks import (
        FULL, LOWER_EDGE, PARTIAL, UPPER_EDGE, classify_blocks, default_positions, static_block_counts,
    )

    t, n, k = case["t"], case["n"], case.get("k", case["n"])
    mask = _mask_of(case)
    backward = case.get("backward", False)
    block = (case.get("block_bwd") or case.get("block", 1024)) if backward else case.get("block", 1024)
    bq, bk = max(128, block // (n // k)), (block if backward else case.get("block_kv") or block)
    q_pos, kv_pos = default_positions(t, t)
    seg = mask.segment_ids(t)
    classes = np.asarray(classify_blocks(mask.spec(), q_pos, kv_pos, seg, seg, block_q=bq, block_k=bk,
                                         sides=True))[0]
    per_row, per_col = static_block_counts(mask.spec(), t, t, block_q=bq, block_k=bk)
    nq, nk = classes.shape
    steps = k * (nk * min(nq, per_col) if backward else nq * min(nk, per_row))
    edges = {cls: k * int((classes == cls).sum()) for cls in (UPPER_EDGE, LOWER_EDGE) if (classes == cls).any()}
    return Visits(steps, k * int((classes == FULL).sum()), k * int((classes == PARTIAL).sum()), k * nq, edges)


def splash_visits(case: dict) -> Visits:
    """`Visits` of jax's splash kernel for ``case``: its mask info (`process_mask`, the backward's
    `process_mask_dkv`: blocks 0 empty, 1 partial, 2 full, the grid shrunk to the widest row),
    one step per head; with segment ids every visited block evaluates the mask (partial)."""
    import numpy as np
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info_lib

    t, n = case["t"], case["n"]
    mask = _mask_of(case)
    backward = case.get("backward", False)
    block = (case.get("block_bwd") or case.get("block", 1024)) if backward else case.get("block", 1024)
    process = info_lib.process_mask_dkv if backward else info_lib.process_mask
    block_kv = block if backward else case.get("block_kv") or block
    info, _ = process(masks.MultiHeadMask([mask.splash_mask(t)]), (block, block_kv))
    nb = t // block
    if info.block_mask is None:
        blocks = np.full((nb, t // block_kv), 2)
        steps = blocks.size
    else:
        blocks = np.asarray(info.block_mask)[0]
        steps = blocks.size
    full, partial = int((blocks == 2).sum()), int((blocks == 1).sum())
    if mask.documents:
        full, partial = 0, full + partial
    return Visits(n * steps, n * full, n * partial, n * nb)


def whole_kernel(case: dict, generation: str = "v5e") -> dict:
    """stellax against splash over every visited grid step of ``case`` (`kernel_case` keywords
    at full size, e.g. an `ISSUE_CASES` entry plus ``block`` / ``backward``): each kernel's
    `StepCycles` (compiled at `compile_shape`) weighted by its `Visits`; ``ratio`` = stellax's
    static cycles over splash's. Static bundles, not measured times."""
    small = compile_shape(case)
    backward = case.get("backward", False)
    out = {}
    for impl, visits in (("stellax", stellax_visits), ("splash", splash_visits)):
        steps = compile_steps(impl, generation, **small)
        v = visits(case)
        out[impl] = {"steps": steps, "visits": v, "cycles": v.cycles(steps, backward)}
    out["ratio"] = out["stellax"]["cycles"] / out["splash"]["cycles"]
    return out


def _describe(r: dict, name: str) -> str:
    """One contender's line of `main`: cycles, visits × step bundles, grid steps."""
    v, s = r["visits"], r["steps"]
    edges = "".join(f" + {n} {EDGE_NAMES[cls]} x {s.masked(cls)}" for cls, n in v.edges.items())
    return (f"{name} {r['cycles'] / 1e6:.2f} Mcycles ({v.full} full x {s.full} + {v.partial} partial x "
            f"{s.partial}{edges} + {v.finishes} x {s.finish}; {v.steps} steps)")


#: How `main` names stellax's one-sided masked blocks (`masks.UPPER_EDGE`, `masks.LOWER_EDGE`).
EDGE_NAMES = {3: "causal-edge", 4: "window-edge"}


def main(argv=None) -> int:
    """Print `COMPARISONS` (all, or the indices given; static, libtpu's schedule for v5e, no TPU
    needed): ``python -m stellax.testing.attention_schedule [0 1 ...]``; with ``--whole``, the
    whole-kernel comparison of `ISSUE_CASES` (names containing the given words, all without),
    forward and fused backward at ``--block`` (default 1024):
    ``python -m stellax.testing.attention_schedule --whole [--block 512] [--bwd] [window ...]``."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if "--whole" in args:
        args = [a for a in args if a != "--whole"]
        block = 1024
        if "--block" in args:
            at = args.index("--block")
            block = int(args[at + 1])
            del args[at:at + 2]
        passes = [False, True]
        if "--bwd" in args or "--fwd" in args:
            passes = [a == "--bwd" for a in args if a in ("--fwd", "--bwd")]
            args = [a for a in args if a not in ("--fwd", "--bwd")]
        print("whole kernels, static bundles of the visited grid steps (libtpu v5e schedule, not measured)")
        for name, case in ISSUE_CASES.items():
            if args and not any(w in name for w in args):
                continue
            for backward in passes:
                full = {**case, "block": block, "backward": backward}
                head = f"{name}, {block} blocks, {'fused bwd' if backward else 'fwd'}: "
                try:
                    r = whole_kernel(full)
                except RuntimeError as error:  # splash's chunked mask does not compile on a CPU-default host
                    steps = compile_steps("stellax", **compile_shape(full))
                    v = stellax_visits(full)
                    ours = {"steps": steps, "visits": v, "cycles": v.cycles(steps, backward)}
                    print(head + _describe(ours, "stellax") + f"; splash not compiled ({str(error)[-120:]!r})",
                          flush=True)
                    continue
                print(head + _describe(r["stellax"], "stellax") + ", " + _describe(r["splash"], "splash")
                      + f": {r['ratio']:.3f}x", flush=True)
        return 0
    names = [list(COMPARISONS)[int(i)] for i in args] if args else list(COMPARISONS)
    print("static bundles per grid step (libtpu v5e schedule, not measured): full / partial / finish; "
          "per visited block over the causal schedule")
    for name in names:
        r = compare(COMPARISONS[name])
        s, p = r["stellax"], r["splash"]
        print(f"{name}: stellax {s.full} / {s.partial} / {s.finish}, splash {p.full} / {p.partial} / {p.finish}; "
              f"per block {r['stellax_per_block']:.0f} vs {r['splash_per_block']:.0f} "
              f"({r['ratio']:.3f}x splash's)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
