"""Where float32 accuracy is lost on a TPU: the chip's transcendental functions,
and the float32 checks that depend on them, with and without stellax's remedies.

Run on a TPU host (one process holds the chip)::

    PYTHONPATH=$PYTHONPATH:$PWD/src python3 benchmarks/tpu_float32_diagnosis.py --out diag.json

It measures and writes to one JSON file (``--sections`` picks some):

1. ``host_memory``: the process's resident memory after ``import jax`` and after
   ``jax.devices()``, and the largest mappings then (``/proc/self/smaps``);
2. ``functions``: the relative error of the chip's float32 ``exp``, ``log``,
   ``tanh``, ``softplus`` and division, and of stellax's float32 ones
   (`stellax.core.precision`), through XLA and inside a Mosaic TPU kernel, against
   float64 on the host; and a float32 matmul at each precision;
3. ``checks``: the float32 examples of the ops whose checks failed on a v5e, each
   implementation's worst relative-L2 error at ``precision="highest"`` under three
   arrangements: the golden on the host CPU with stellax's float32 functions (what
   stellax does), the golden on the host with the chip's functions swapped back
   in, and the golden on the chip;
4. ``cost``: float32 soft-capped attention (forward and forward+backward, ms)
   with ``float32_tanh`` and with the chip's ``tanh``.

On a CPU it runs the same (``--dry-run`` picks the first example only), so the
script is tested where there is no TPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import time


def _rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def _largest_mappings(count: int = 8) -> list[dict]:
    """The ``count`` mappings of this process with the most resident memory."""
    rows, current = [], None
    header = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
    with open("/proc/self/smaps") as f:
        for line in f:
            if header.match(line):
                parts = line.split()
                current = {"name": parts[5] if len(parts) > 5 else "[anonymous]", "perms": parts[1]}
                rows.append(current)
            elif current is not None and line.startswith(("Size:", "Rss:")):
                key, value = line.split()[:2]
                current[key[:-1].lower() + "_mb"] = round(int(value) / 1024, 1)
    return sorted(rows, key=lambda r: -r.get("rss_mb", 0))[:count]


def host_memory() -> dict:
    """Resident memory around the TPU runtime's start (measured before anything else runs)."""
    before = _rss_gb()
    import jax

    after_import = _rss_gb()
    devices = jax.devices()
    return {"rss_gb_start": round(before, 2), "rss_gb_after_import_jax": round(after_import, 2),
            "rss_gb_after_devices": round(_rss_gb(), 2), "devices": [d.device_kind for d in devices],
            "largest_mappings": _largest_mappings(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("TPU_", "XLA_", "LIBTPU"))}}


def _relative_error(got, want) -> dict:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want) & (np.abs(want) > 1e-30)
    rel = np.abs(got[finite] - want[finite]) / np.abs(want[finite])
    return {"max": float(rel.max()), "rms": float(np.sqrt(np.mean(rel ** 2)))}


def functions() -> dict:
    """Relative errors of the chip's float32 functions (XLA and Mosaic) and of stellax's
    float32 ones (`stellax.core.precision`) against float64 numpy."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    from stellax.core import interpret_enabled
    from stellax.core import precision as P

    rows, cols = 512, 1024
    softplus64 = lambda x: np.logaddexp(x, 0.0)
    cases = {  # name: (function, domain, float64 truth)
        "exp": (jnp.exp, (-30.0, 0.0), np.exp), "float32_exp": (P.float32_exp, (-30.0, 0.0), np.exp),
        "log": (jnp.log, (1e-3, 1e3), np.log), "float32_log": (P.float32_log, (1e-3, 1e3), np.log),
        "tanh": (jnp.tanh, (-5.0, 5.0), np.tanh), "float32_tanh": (P.float32_tanh, (-5.0, 5.0), np.tanh),
        "softplus": (jax.nn.softplus, (-20.0, 20.0), softplus64),
        "float32_softplus": (P.float32_softplus, (-20.0, 20.0), softplus64),
        "reciprocal": (lambda x: 1.0 / x, (0.5, 1e3), lambda x: 1.0 / x),
    }
    out = {}
    for name, (fn, (lo, hi), exact) in cases.items():
        x = np.linspace(lo, hi, rows * cols, dtype=np.float32).reshape(rows, cols)
        want = exact(x.astype(np.float64))

        def kernel(x_ref, y_ref, fn=fn):
            y_ref[...] = fn(x_ref[...])

        spec = pl.BlockSpec((128, cols), lambda i: (i, 0))
        mosaic = pl.pallas_call(kernel, grid=(rows // 128,), in_specs=[spec], out_specs=spec,
                                out_shape=jax.ShapeDtypeStruct((rows, cols), jnp.float32),
                                interpret=jax.default_backend() == "cpu" or interpret_enabled())
        row = {"domain": [lo, hi], "xla": _relative_error(jax.jit(fn)(x), want)}
        try:
            row["mosaic"] = _relative_error(jax.jit(mosaic)(x), want)
        except Exception as e:  # a function Mosaic cannot lower is reported, not fatal
            row["mosaic"] = f"{type(e).__name__}: {e}"[:200]
        out[name] = row
    a, b = (np.asarray(jax.random.normal(k, (256, 256), jnp.float32)) for k in jax.random.split(jax.random.PRNGKey(1), 2))
    exact = a.astype(np.float64) @ b.astype(np.float64)
    for level in ("default", "high", "highest"):
        got = np.asarray(jax.jit(lambda a, b, p=level: jnp.dot(a, b, precision=p))(a, b), np.float64)
        out[f"matmul_{level}"] = {"rel_l2": float(np.linalg.norm(got - exact) / np.linalg.norm(exact))}
    return out


@contextlib.contextmanager
def _arrangement(golden_on_host: bool, float32_functions: bool):
    """One arrangement: the golden's device, and stellax's float32 functions or the chip's own
    (swapped in every stellax module that imported them)."""
    import sys

    import jax
    import jax.numpy as jnp

    from stellax.testing import numerics, validation

    chip = {"float32_exp": jnp.exp, "float32_exp_raw": jnp.exp, "float32_log": jnp.log,
            "float32_log_raw": jnp.log, "float32_tanh": jnp.tanh, "float32_tanh_raw": jnp.tanh,
            "float32_softplus": jax.nn.softplus, "float32_logsumexp": jax.nn.logsumexp}
    saved = []
    if not float32_functions:
        for name, module in list(sys.modules.items()):
            # core.precision too: its soft_cap_tanh looks float32_tanh up there at call time
            if (name.startswith("stellax.ops") or name == "stellax.core.precision") and module is not None:
                for attr, replacement in chip.items():
                    if attr in vars(module):
                        saved.append((module, attr, vars(module)[attr]))
                        setattr(module, attr, replacement)

    def golden_on_chip(fn, *args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*numerics.upcast(args), **numerics.upcast(kwargs))

    saved.append((validation, "golden", validation.golden))
    if not golden_on_host:
        validation.golden = golden_on_chip
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


ARRANGEMENTS = {
    "golden on host, stellax float32 functions": (True, True),
    "golden on host, chip functions": (True, False),
    "golden on chip, stellax float32 functions": (False, True),
}
OPS = {"attention": ("mosaic_tpu", "xla_chunked"), "attention_backward": ("mosaic_tpu", "xla_chunked"),
       "linear_cross_entropy_backward": ("xla", "xla_chunked"), "linear_cross_entropy": ("xla", "xla_chunked"),
       "ssd": ("mosaic_tpu", "xla"), "ssd_step": ("mosaic_tpu", "xla")}


def checks(*, examples: int | None, threads: int) -> list[dict]:
    """Each (op, implementation, float32 example)'s worst error under each arrangement."""
    import jax.numpy as jnp

    import stellax
    from stellax.testing.validation import examples_of, safe_check_example

    ops = stellax.registered_ops()
    jobs = [(name, impl, i, example) for name, impls in OPS.items() for impl in impls
            if impl in ops[name].implementations
            for i, example in enumerate(examples_of(ops[name], jnp.float32)[:examples])]
    rows = []
    for arrangement, (on_host, accurate) in ARRANGEMENTS.items():
        with _arrangement(on_host, accurate):
            def run(job):
                name, impl, i, example = job
                r = safe_check_example(ops[name], impl, example, jnp.float32)
                worst = r.worst
                return {"arrangement": arrangement, "op": name, "implementation": impl, "example": example.label,
                        "passed": r.passed, "skipped": r.skipped, "detail": r.detail,
                        "rel_l2": None if worst is None else worst.rel_l2,
                        "tolerance": None if worst is None else worst.tolerance}

            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                for row in pool.map(run, jobs):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def _median_ms(fn, *args, repeats: int = 10) -> float:
    import jax
    import numpy as np

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return round(float(np.median(times)) * 1e3, 3)


def cost(*, small: bool) -> list[dict]:
    """Float32 causal soft-capped attention (``precision="highest"``) with stellax's float32
    functions and with the chip's."""
    import jax
    import jax.numpy as jnp

    import stellax

    impl = "mosaic_tpu" if jax.default_backend() == "tpu" else "xla_chunked"
    t = 256 if small else 4096
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, t, 8, 128), jnp.float32) for key in keys)

    def forward(q, k, v):
        return stellax.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=30.0, implementation=impl,
                                             precision="highest")

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v) ** 2)

    rows = []
    for accurate in (True, False):
        with _arrangement(True, accurate):
            fwd = jax.jit(forward)
            both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            rows.append({"implementation": impl, "shape": [1, t, 8, 128], "logits_soft_cap": 30.0,
                         "float32_functions": accurate,
                         "forward_ms": _median_ms(fwd, q, k, v), "forward_backward_ms": _median_ms(both, q, k, v)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tpu_float32_diagnosis.json")
    parser.add_argument("--dry-run", action="store_true", help="first example of each op only")
    parser.add_argument("--threads", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)))
    parser.add_argument("--sections", default="functions,checks,cost",
                        help="comma-separated: functions, checks, cost (host_memory always runs)")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    start = time.perf_counter()
    result = {"host_memory": host_memory()}
    print(json.dumps(result["host_memory"], indent=1), flush=True)
    if "functions" in sections:
        result["functions"] = functions()
        print(json.dumps(result["functions"], indent=1), flush=True)
    if "checks" in sections:
        result["checks"] = checks(examples=1 if args.dry_run else None, threads=args.threads)
    if "cost" in sections:
        result["cost"] = cost(small=args.dry_run)
    result["seconds"] = round(time.perf_counter() - start, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} in {result['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
