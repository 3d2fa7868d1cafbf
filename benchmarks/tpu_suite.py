#!/usr/bin/env python3
"""The stellax TPU suite: one command for the day a TPU machine is lent.

    PYTHONPATH=src python benchmarks/tpu_suite.py --out $OUT

Run from the repository root, no install needed. For every op with a Mosaic
TPU implementation (``mosaic_tpu``), within a time budget (default 8 min):

1. **environment**: python, jax, libtpu, the devices and their generation
   (`stellax.core.tpu`: VMEM, MXU, dtypes);
2. **check**: numerics of the Mosaic TPU kernels natively on the TPU against
   the golden, on the built-in examples (float32, bfloat16) and the first
   benchmark shapes, forward and gradients;
3. **autotune**: each kernel on its first benchmark shape (the space already
   holds only configs that compile for this generation), exported in the
   shipped-cache format, ready for ``src/stellax/autotune/shipped/``;
4. **bench**: the benchmark shapes with the tuned configs, the Mosaic TPU
   kernel against XLA (``xla`` / ``xla_chunked``) and the kernels that ship
   inside jax: for attention the splash attention (``jax_splash``), for the
   grouped matmuls ``jax.lax.ragged_dot`` and megablox ``gmm`` / ``tgmm``
   (``jax_megablox_gmm``, ``jax_megablox_tgmm``), with roofline numbers;
5. one JSON file ``stellax-tpu-suite-<date>-<device>.json`` rewritten after
   every stage (a crash keeps what was done).

``--dry-run`` runs the same stages on the CPU with the TPU kernels
interpreted, on tiny shapes (the tests run it, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMAT = "stellax-tpu-suite"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"),
                   help="output directory (default: $OUT, else benchmarks/results)")
    p.add_argument("--dry-run", action="store_true", help="CPU, interpreted TPU kernels, tiny shapes")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 480; dry 300)")
    p.add_argument("--ops", default="", help="comma list of op names (default: every op with a TPU kernel)")
    p.add_argument("--skip", default="", help="comma list of stages to skip: check,autotune,bench")
    p.add_argument("--max-configs", type=int, default=16, help="configs per tuned call")
    return p.parse_args(argv)


class Suite:
    """The run's state: options, clock, the result document and its file."""

    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.budget = args.budget if args.budget is not None else (300.0 if args.dry_run else 480.0)
        self.result = {"format": FORMAT, "dry_run": args.dry_run, "stages": {}, "errors": []}
        self.path: Path | None = None

    def remaining(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f}s] {text}", flush=True)

    def save(self) -> None:
        text = json.dumps(self.result, indent=1, default=repr) + "\n"
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def interpreted(self):
        """Interpret mode in a dry run (the TPU kernels on the CPU), else nothing."""
        from stellax.core import interpret_mode

        return interpret_mode(True) if self.args.dry_run else contextlib.nullcontext()


def tpu_ops(suite: Suite) -> list:
    """Ops with a ``mosaic_tpu`` implementation (optionally those named by --ops)."""
    import stellax

    wanted = [n for n in suite.args.ops.split(",") if n]
    ops = stellax.registered_ops()
    unknown = [n for n in wanted if n not in ops]
    if unknown:
        raise SystemExit(f"--ops: unknown op names {unknown}; known: {sorted(ops)}")
    return [op for name, op in sorted(ops.items())
            if "mosaic_tpu" in op.implementations and (not wanted or name in wanted)]


def calls_of(suite: Suite, op, count: int) -> list:
    """Concrete calls to check/tune/time: the first examples in a dry run, the
    first ``count`` benchmark shapes on a TPU."""
    import jax.numpy as jnp

    from stellax.bench.inputs import materialize_example

    if suite.args.dry_run:
        return list(op.examples(jnp.float32)[:1])
    return [materialize_example(e) for e in op.benchmarks()[:count]]


# -- stages ------------------------------------------------------------------------------
def environment_stage(suite: Suite) -> None:
    import importlib.metadata

    import jax

    from stellax.core import current_platform

    platform = current_platform()
    env = {"python": sys.version.split()[0], "jax": jax.__version__,
           "devices": [f"{d.platform}:{d.device_kind}" for d in jax.devices()],
           "platform": platform.describe(), "generation": platform.tpu.describe() if platform.tpu else None}
    try:
        env["libtpu"] = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        env["libtpu"] = None
    suite.result["environment"] = env
    for key, value in env.items():
        suite.log(f"  {key}: {value}")


def check_stage(suite: Suite) -> None:
    """Every Mosaic TPU kernel against the golden: examples in float32 and
    bfloat16, then the first benchmark shape; forward and gradients."""
    import jax.numpy as jnp

    from stellax.testing.validation import safe_check_example

    records = suite.result.setdefault("check", [])
    for op in tpu_ops(suite):
        cases = [(e, jnp.float32) for e in op.examples(jnp.float32)]
        if not suite.args.dry_run:
            cases += [(e, jnp.bfloat16) for e in op.examples(jnp.bfloat16)]
            cases += [(e, e.args[0].dtype) for e in calls_of(suite, op, 1)]
        for example, dtype in cases[:1] if suite.args.dry_run else cases:
            if suite.remaining() < 60:
                records.append({"op": op.name, "example": example.label, "skipped": "time budget"})
                continue
            with suite.interpreted():
                r = safe_check_example(op, "mosaic_tpu", example, jnp.dtype(dtype), gradients=True)
            records.append({"op": op.name, "implementation": "mosaic_tpu", "example": example.label,
                            "dtype": jnp.dtype(dtype).name, "passed": bool(r.passed), "skipped": r.skipped,
                            "detail": r.detail, "rel_l2": None if r.worst is None else r.worst.rel_l2})
            suite.log(f"  check {op.name} {example.label} {jnp.dtype(dtype).name}: "
                      f"{'skip ' + r.skipped if r.skipped else 'ok' if r.passed else 'FAIL ' + r.detail}")


def autotune_stage(suite: Suite):
    """Tune each Mosaic TPU kernel on its first benchmark shape; export the configs."""
    from stellax.autotune import AutotuneResult, autotune, device_slug
    from stellax.autotune.cache import atomic_write_text, dump_cache_text
    from stellax.autotune.cli import tuning_function

    tuned = AutotuneResult(device=device_slug())
    records = suite.result.setdefault("autotune", {"entries": [], "failures": []})
    deadline = time.monotonic() + max(0.0, suite.remaining() * 0.4)
    for op in tpu_ops(suite):
        for example in calls_of(suite, op, 1):
            with suite.interpreted():
                fn = tuning_function(op, "mosaic_tpu", example.args, example.kwargs, backward=False)
                r = autotune(fn, *example.args, max_configs=2 if suite.args.dry_run else suite.args.max_configs,
                             force=True, cache=False, use_shipped=False, deadline=deadline, **example.kwargs)
            tuned.entries.extend(r.entries)
            records["failures"].extend(r.failures)
            for e in r.entries:
                records["entries"].append(e.to_json())
                suite.log(f"  tuned {e.entry.op}/{e.entry.implementation}: {e.entry.config} {e.entry.time_ms:.4g} ms")
    if tuned.entries:
        path = suite.path.parent / f"autotune-{device_slug()}.json"
        atomic_write_text(path, dump_cache_text({e.entry.key_string: e.entry for e in tuned.entries},
                                                device=device_slug()))
        records["exported_to"] = path.name
    return tuned


def splash_peer(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, **options):
    """jax's bundled splash attention on the op's ``[B, T, H, D]`` arguments:
    full or causal mask, as many KV heads as query heads, T = S. Anything
    else is not its contract here: `UnsupportedError` (recorded as skipped)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    from stellax.core import UnsupportedError, interpret_enabled

    extra = sorted(k for k, v in options.items() if v not in (None, False))
    if bias is not None or mask is not None or extra or key.shape[2] != query.shape[2] \
            or key.shape[1] != query.shape[1]:
        raise UnsupportedError(f"jax_splash peer: only full/causal MHA with T = S (got options {extra}, "
                               f"{query.shape[2]} query / {key.shape[2]} KV heads)")
    _, t, heads, d = query.shape
    kind = masks.CausalMask if is_causal else masks.FullMask
    kernel = splash.make_splash_mha(masks.MultiHeadMask([kind((t, t)) for _ in range(heads)]),
                                    head_shards=1, q_seq_shards=1, interpret=interpret_enabled())
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    q_scale = (1.0 / d ** 0.5) if scale is None else scale
    out = jax.vmap(kernel)(heads_first(query) * jnp.asarray(q_scale, query.dtype), heads_first(key),
                           heads_first(value))
    return jnp.swapaxes(out, 1, 2)


def _megablox():
    import importlib

    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _megablox_tile(dim: int) -> int:
    """512 when it divides ``dim`` (transformer sizes), else 128."""
    return 512 if dim % 512 == 0 else 128


def _rows_padded(x, axis: int, tm: int):
    """``x`` zero-padded along ``axis`` to a multiple of megablox's row tile ``tm``."""
    import jax.numpy as jnp

    extra = -x.shape[axis] % tm
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def megablox_gmm_peer(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                      activation=None, transpose_rhs=False):
    """jax's bundled megablox ``gmm`` on a `ragged_dot` call: ``lhs [M, K]``, ``rhs [G, K, N]``
    (``[G, N, K]`` transposed), local groups from ``group_offset``. M is padded to its
    row tile (128); rows outside the local groups are set to zeros (megablox leaves
    them unspecified), so the result is the op's. Gated weights and fused
    activations are not megablox's contract: `UnsupportedError`."""
    import jax.numpy as jnp

    from stellax.core import UnsupportedError, interpret_enabled

    if rhs.ndim != 3 or activation is not None:
        raise UnsupportedError(f"jax_megablox_gmm peer: plain rhs [G, K, N] without activation only (got rhs "
                               f"{tuple(rhs.shape)}, activation {activation!r})")
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = preferred_element_type or lhs.dtype
    offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32).reshape(())
    out = _megablox().gmm(_rows_padded(lhs, 0, 128), rhs, group_sizes.astype(jnp.int32),
                          preferred_element_type=out_dtype, tiling=(128, _megablox_tile(k), _megablox_tile(n)),
                          group_offset=offset, transpose_rhs=transpose_rhs, interpret=interpret_enabled())[:m]
    ends = jnp.cumsum(group_sizes)
    first = 0 if offset is None else offset
    begin = jnp.where(first > 0, ends[jnp.maximum(first - 1, 0)], 0)
    end = ends[first + rhs.shape[0] - 1]
    rows = jnp.arange(m)[:, None]
    return jnp.where((rows >= begin) & (rows < end), out, jnp.zeros((), out.dtype))


def megablox_tgmm_peer(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                       num_local_groups=None, transpose_lhs=False):
    """jax's bundled megablox ``tgmm`` on a `ragged_dot_tgmm` call: ``lhs [K, M]``
    (``[M, K]`` with ``transpose_lhs``: transposed by XLA first), ``rhs [M, N]`` →
    ``[G_local, K, N]``. M is zero-padded to its row tile (128)."""
    import jax.numpy as jnp

    from stellax.core import interpret_enabled

    a = lhs.T if transpose_lhs else lhs
    k, n = a.shape[0], rhs.shape[1]
    offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32).reshape(())
    return _megablox().tgmm(_rows_padded(a, 1, 128), _rows_padded(rhs, 0, 128), group_sizes.astype(jnp.int32),
                            preferred_element_type=preferred_element_type or lhs.dtype,
                            tiling=(128, _megablox_tile(k), _megablox_tile(n)), group_offset=offset,
                            num_actual_groups=num_local_groups, interpret=interpret_enabled())


def ragged_dot_peer(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                    activation=None, transpose_rhs=False):
    """``jax.lax.ragged_dot`` on a plain `ragged_dot` call (all groups local)."""
    import jax
    import jax.numpy as jnp

    from stellax.core import UnsupportedError

    if rhs.ndim != 3 or activation is not None or group_offset is not None:
        raise UnsupportedError("jax.lax.ragged_dot peer: plain rhs [G, K, N], no activation or group offset")
    weights = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    return jax.lax.ragged_dot(lhs, weights, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)


def ragged_paged_peer(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale=None,
                      logits_soft_cap=None, local_window_size=None, sinks=None):
    """jax's bundled ragged paged attention on the op's arguments: dense
    ``k_pages`` / ``v_pages [NP, PS, K, H]`` interleaved into its combined
    ``[NP, PS, 2K, H]`` pool (k0 v0 k1 v1 ...; the copy is part of its time),
    soft cap and left window. Quantized pools and sinks are not its contract,
    and it does not run interpreted on jax 0.10.2: `UnsupportedError`."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as bundled

    from stellax.core import UnsupportedError, interpret_enabled
    from stellax.ops.paged_attention import QuantizedPages

    if interpret_enabled():
        raise UnsupportedError("jax_ragged_paged_attention peer: jax 0.10.2's kernel does not run interpreted")
    if sinks is not None or v_pages is None or isinstance(k_pages, QuantizedPages) \
            or isinstance(v_pages, QuantizedPages) or k_pages.shape != v_pages.shape:
        raise UnsupportedError("jax_ragged_paged_attention peer: dense k/v pools of one shape, no sinks")
    if isinstance(local_window_size, (tuple, list)):
        local_window_size = local_window_size[0]
    num_pages, page_size, kv_heads, h = k_pages.shape
    kv = jnp.stack([k_pages, v_pages], axis=3).reshape(num_pages, page_size, 2 * kv_heads, h)
    try:
        return bundled.ragged_paged_attention(
            q, kv, kv_lens, block_tables, cu_q_lens, jnp.asarray(num_seqs, jnp.int32).reshape(1),
            sm_scale=(1.0 / h ** 0.5) if scale is None else scale, soft_cap=logits_soft_cap,
            sliding_window=None if local_window_size is None else local_window_size + 1)
    except (ValueError, NotImplementedError) as e:  # its static checks (head counts it cannot tile, ...)
        raise UnsupportedError(f"jax_ragged_paged_attention peer: {e}") from e


#: The MoE ops' peers on a TPU (op name → {peer name: function}).
MOE_PEERS = {"ragged_dot": {"jax.lax.ragged_dot": ragged_dot_peer, "jax_megablox_gmm": megablox_gmm_peer},
             "ragged_dot_tgmm": {"jax_megablox_tgmm": megablox_tgmm_peer}}


def bench_stage(suite: Suite, tuned) -> None:
    from stellax.bench import report
    from stellax.bench.suites import SuiteOptions, run_suites

    ops = tpu_ops(suite)
    for op in ops:
        if op.family == "attention" and op.name == "dot_product_attention":
            op.peers.setdefault("jax_splash", splash_peer)
        for name, fn in MOE_PEERS.get(op.name, {}).items():
            op.peers[name] = fn
        if op.name == "ragged_paged_attention":
            op.peers.setdefault("jax_ragged_paged_attention", ragged_paged_peer)
    options = SuiteOptions(
        interpret=suite.args.dry_run, max_cases=1 if suite.args.dry_run else 3,
        budget_s=max(1.0, suite.remaining() - 20), use_examples=suite.args.dry_run,
        modes=("forward",) if suite.args.dry_run else None, min_time=0.005 if suite.args.dry_run else None,
        input_sets=2 if suite.args.dry_run else None,
        implementations=("mosaic_tpu", "xla_chunked", "xla"))
    families = sorted({op.family for op in ops})
    with tuned if tuned is not None and len(tuned) else contextlib.nullcontext():
        records = run_suites(families, options, progress=lambda text: suite.log("  " + text))
    suite.result["bench"] = report.to_json(records, env=suite.result.get("environment"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["STELLAX_INTERPRET"] = "1"  # every stage runs the TPU kernels interpreted
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("STELLAX_AUTOTUNE_WARN", "0")
    suite = Suite(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from stellax.core import current_platform

    platform = current_platform()
    if not args.dry_run and platform.tpu is None:
        print(f"tpu_suite: this device is {platform.describe()}, not a TPU (use --dry-run on a CPU)")
        return 2
    device = "dry-run" if args.dry_run else platform.tpu.name
    suite.path = out / f"{FORMAT}-{datetime.date.today().isoformat()}-{device}.json"
    suite.log(f"stellax TPU suite{' (dry run)' if args.dry_run else ''}: budget {suite.budget:.0f} s -> {suite.path}")
    skip = set(filter(None, args.skip.split(",")))
    tuned = None
    stages = [("environment", environment_stage), ("check", check_stage),
              ("autotune", autotune_stage), ("bench", lambda s: bench_stage(s, tuned))]
    for name, stage in stages:
        if name in skip:
            continue
        began = time.monotonic()
        suite.log(f"stage {name}")
        try:
            value = stage(suite)
            if name == "autotune":
                tuned = value
        except Exception as e:  # noqa: BLE001 - a failed stage is recorded; the others still run
            suite.result["errors"].append({"stage": name, "error": f"{type(e).__name__}: {e}"[:600]})
            suite.log(f"  stage {name} FAILED: {type(e).__name__}: {e}"[:400])
        suite.result["stages"][name] = round(time.monotonic() - began, 2)
        suite.save()
    failed = [c for c in suite.result.get("check", []) if c.get("passed") is False]
    suite.log(f"done: {len(failed)} numerics failures, {len(suite.result['errors'])} stage errors")
    return 1 if failed or suite.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
