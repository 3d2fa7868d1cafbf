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


def _stellax(t, n, k, d, block, causal, backward, fused, block_bwd):
    import stellax
    from stellax.ops.attention.configs import SplashBackwardConfig, SplashConfig

    g = n // k
    rows = lambda b: max(128, b // g)
    bb = block_bwd or block
    table = {("attention", "mosaic_tpu"): SplashConfig(rows(block), block),
             ("attention_backward", "mosaic_tpu"): SplashBackwardConfig(rows(bb), bb, rows(bb), bb, fused=fused)}

    def attend(q, kk, v):
        return stellax.dot_product_attention(q, kk, v, is_causal=causal, implementation="mosaic_tpu")
    return attend, table


def _splash(t, n, k, d, block, causal, backward, fused, block_bwd):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    bb = block_bwd or block
    mask = masks.CausalMask((t, t)) if causal else masks.FullMask((t, t))
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=bb,
                              block_kv_dkv=bb, block_kv_dkv_compute=bb, block_q_dq=None if fused else bb,
                              block_kv_dq=None if fused else bb, use_fused_bwd_kernel=fused)
    kernel = splash.make_splash_mha(masks.MultiHeadMask([mask] * n), block_sizes=sizes, head_shards=1,
                                    q_seq_shards=1)
    scale = d ** -0.5

    def attend(q, kk, v):
        q = jnp.swapaxes(q[0], 0, 1) * jnp.asarray(scale, q.dtype)
        out = kernel(q, jnp.swapaxes(kk[0], 0, 1), jnp.swapaxes(v[0], 0, 1))
        return jnp.swapaxes(out, 0, 1)[None]
    return attend, None


def kernel_case(impl: str = "stellax", t: int = 8192, n: int = 16, k: int = 16, d: int = 128, block: int = 1024,
                causal: bool = True, backward: bool = False, fused: bool = True, block_bwd: int = 0,
                dtype: str = "bfloat16"):
    """``(fn, args)``: ``impl``'s (`IMPLS`) attention on ``q [1, t, n, d]``, ``k, v [1, t, k, d]``
    (``dtype``) with ``block × block`` forward tiles (stellax: ``block / G`` query rows per head,
    ``G = n / k``, so a step's logits tile is ``block × block`` too) and ``block_bwd`` backward
    tiles (0: ``block``; ``fused``: one backward kernel); with ``backward`` ``fn(q, k, v, dout)``
    returns the VJP's ``(dq, dk, dv)``, else ``fn(q, k, v)`` returns the output."""
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if n % k:
        raise ValueError(f"n: expected a multiple of k={k}, got {n}")
    attend, table = (_stellax if impl == "stellax" else _splash)(t, n, k, d, block, causal, backward, fused,
                                                                 block_bwd)
    q, kv = _shapes(t, n, k, d, dtype)

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
        return configured(attend), (q, kv, kv)

    def grads(q_, k_, v_, dout):
        _, vjp = jax.vjp(attend, q_, k_, v_)
        return vjp(dout)
    return configured(grads), (q, kv, kv, q)


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
    ``partial`` (a visited block whose mask is evaluated; splash has one kind, evaluating its
    mask on every block: both equal) and ``finish`` (once per row of blocks: the output's
    normalization; 0 when not found), with the units of the ``full`` step."""

    full: int
    partial: int
    finish: int
    units: dict

    def per_block(self, visited: int, masked: int, rows: int) -> float:
        """Bundles per visited block over a schedule of ``visited`` blocks, ``masked`` of them
        partial, ``rows`` rows of blocks (finishes)."""
        return ((visited - masked) * self.full + masked * self.partial + rows * self.finish) / visited


def step_cycles(directory: str, kernel_prefix: str) -> StepCycles:
    """The `StepCycles` of a kernel from its libtpu dump: its regions that issue matmuls are the
    block steps (two: the one with fewer selects is the unmasked one), the largest region with a
    reciprocal and no matmul the finish."""
    found = regions(directory, kernel_prefix)
    steps = sorted((r for r in found if r.count("vmatmul")), key=lambda r: r.count("vsel"))
    if not steps or len(steps) > 2:
        raise ValueError(f"{kernel_prefix}: expected one or two matmul regions, got {len(steps)}")
    finishes = [r for r in found if r.count("vrcp") and not r.count("vmatmul")]
    finish = max((r.bundles for r in finishes), default=0)
    return StepCycles(steps[0].bundles, steps[-1].bundles, finish, steps[0].units)


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
        return step_cycles(directory, kernel)


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


def main(argv=None) -> int:
    """Print `COMPARISONS` (all, or the indices given; static, libtpu's schedule for v5e, no TPU
    needed): ``python -m stellax.testing.attention_schedule [0 1 ...]``."""
    import sys

    args = sys.argv[1:] if argv is None else argv
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
