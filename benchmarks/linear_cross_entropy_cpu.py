"""Fused linear cross-entropy against the naive log_softmax loss on this machine.

    python benchmarks/linear_cross_entropy_cpu.py [--tokens 4096 --hidden 1024 --vocab 32768] [--repeats 3]

For ``x [T, D]``, ``w [D, V]`` float32 and integer labels, it compiles
``jax.value_and_grad`` (forward + backward, gradients for x and w) of

* naive: ``-mean(take_along_axis(log_softmax(x @ w), labels))`` (the logits materialized);
* stellax: ``stellax.linear_cross_entropy(x, w, labels)`` (``xla_chunked``, the CPU default);

and reports the peak temporaries of each compiled program
(``memory_analysis().temp_size_in_bytes``), the forward + backward wall time (median of
``--repeats`` runs after a warm-up, the two programs interleaved so load on a shared
machine hits both alike) and the agreement of the values and gradients. Writes
``benchmarks/results/linear_cross_entropy_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import stellax

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "linear_cross_entropy_cpu.json"


def naive_loss(x, w, labels):
    logp = jax.nn.log_softmax(x @ w, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def stellax_loss(x, w, labels):
    return stellax.linear_cross_entropy(x, w, labels)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    t, d, v = args.tokens, args.hidden, args.vocab
    kx, kw, ky = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (t, d), jnp.float32)
    w = jax.random.normal(kw, (d, v), jnp.float32) / np.sqrt(d)
    labels = jax.random.randint(ky, (t,), 0, v)

    programs = {}
    for name, loss in (("naive", naive_loss), ("stellax", stellax_loss)):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w, labels).compile()
        programs[name] = compiled
    temps = {name: int(p.memory_analysis().temp_size_in_bytes) for name, p in programs.items()}

    results = {name: jax.block_until_ready(p(x, w, labels)) for name, p in programs.items()}  # warm-up
    times = {name: [] for name in programs}
    for _ in range(args.repeats):
        for name, p in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(p(x, w, labels))
            times[name].append(time.perf_counter() - start)
    (ln, (dxn, dwn)), (ls, (dxs, dws)) = results["naive"], results["stellax"]
    report = {
        "shape": {"tokens": t, "hidden": d, "vocab": v, "dtype": "float32"},
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared), {platform.platform()}",
        "versions": {"jax": jax.__version__, "stellax": stellax.__version__},
        "temp_bytes": temps,
        "temp_ratio_naive_over_stellax": temps["naive"] / max(temps["stellax"], 1),
        "forward_backward_seconds": {name: sorted(ts) for name, ts in times.items()},
        "median_seconds": {name: statistics.median(ts) for name, ts in times.items()},
        "agreement": {"loss_rel": abs(float(ls) - float(ln)) / abs(float(ln)), "dx_rel_l2": _rel(dxs, dxn),
                      "dw_rel_l2": _rel(dws, dwn)},
        "stellax_config": str(stellax.ops.loss.linear_cross_entropy_op.implementations["xla_chunked"]
                              .default_config(stellax.ops.loss.linear_cross_entropy_op.check(x, w, labels))),
    }
    print(json.dumps(report, indent=2))
    if not args.no_write:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
