"""Per-call overhead of the stellax.torch wrapper.

    python -m stellax.torch.benchmark [--device cpu|cuda] [--iters N]

Times tiny calls (where the kernel itself costs almost nothing) so the
numbers are the price of crossing: the DLPack exchange, the compiled-function
cache lookup, the torch custom-op dispatcher and autograd. Each row is the
best of 7 repeats of the mean time of ``--iters`` calls, after a
warm-up; every call is synchronized (``block_until_ready`` /
``torch.cuda.synchronize``) so asynchronous dispatch cannot hide time. The
CPU column is the process CPU time per call (all threads): on a loaded,
shared machine it is the steadier measure of the wrapper's own cost.
"""

from __future__ import annotations

import argparse
import time

import jax
import torch
import torch.nn.functional as F

import stellax
import stellax.torch as st
from stellax.torch import bridge


def _time(fn, sync, iters: int, repeats: int = 7) -> tuple[float, float]:
    """(wall µs, process CPU µs) per call, each the best of ``repeats``."""
    for _ in range(max(3, iters // 10)):
        sync(fn())
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(iters):
            sync(fn())
        wall.append((time.perf_counter() - t0) / iters)
        cpu.append((time.process_time() - c0) / iters)
    return min(wall) * 1e6, min(cpu) * 1e6


def run(device: str = "cpu", iters: int = 300) -> list[tuple[str, float]]:
    cuda = device == "cuda"

    def sync(out):
        if isinstance(out, jax.Array):
            out.block_until_ready()
        elif isinstance(out, (tuple, list)):
            for o in out:
                sync(o)
        elif cuda:
            torch.cuda.synchronize()
        return out

    torch.manual_seed(0)
    x = torch.randn(8, 64, device=device)
    w = torch.randn(64, device=device)
    q = torch.randn(1, 8, 2, 16, device=device)
    xj, wj = st.to_jax(x), st.to_jax(w)
    jitted = jax.jit(lambda a, b: stellax.rms_norm(a, b))
    rows = []
    rows.append(("torch -> jax, one tensor (stellax fast path)", _time(lambda: st.to_jax(x), sync, iters)))
    rows.append(("torch -> jax, one tensor (jax.dlpack.from_dlpack)",
                 _time(lambda: jax.dlpack.from_dlpack(x), sync, iters)))
    rows.append(("jax -> torch, one array (torch.from_dlpack)", _time(lambda: bridge.to_torch(xj), sync, iters)))
    base = _time(lambda: jitted(xj, wj), sync, iters)
    rows.append(("rms_norm [8,64]: jitted JAX call alone (baseline)", base))
    fwd = _time(lambda: st.rms_norm(x, w), sync, iters)
    rows.append(("rms_norm [8,64]: stellax.torch forward", fwd))
    rows.append(("  -> wrapper overhead (forward - baseline)", tuple(a - b for a, b in zip(fwd, base))))
    direct = _time(lambda: st.norm.layer_norm_op._forward_impl(x, w, None, 1e-6, False, None), sync, iters)
    rows.append(("rms_norm [8,64]: wrapper body without the torch dispatcher", direct))
    with torch.no_grad():
        rows.append(("rms_norm [8,64]: stellax.torch forward under no_grad", _time(lambda: st.rms_norm(x, w), sync, iters)))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    rows.append(("rms_norm [8,64]: forward with autograd", _time(lambda: st.rms_norm(xg, wg), sync, iters)))

    def fwd_bwd():
        y = st.rms_norm(xg, wg)
        return torch.autograd.grad(y.sum(), (xg, wg))
    rows.append(("rms_norm [8,64]: forward + backward", _time(fwd_bwd, sync, max(iters // 3, 10))))
    rows.append(("rms_norm [8,64]: torch F.rms_norm (reference)", _time(lambda: F.rms_norm(x, (64,), w), sync, iters)))
    qj = st.to_jax(q)
    attn = jax.jit(lambda a: stellax.dot_product_attention(a, a, a, is_causal=True))
    abase = _time(lambda: attn(qj), sync, iters)
    rows.append(("attention [1,8,2,16]: jitted JAX call alone", abase))
    afwd = _time(lambda: st.dot_product_attention(q, q, q, is_causal=True), sync, iters)
    rows.append(("attention [1,8,2,16]: stellax.torch forward", afwd))
    rows.append(("  -> wrapper overhead (forward - baseline)", tuple(a - b for a, b in zip(afwd, abase))))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args(argv)
    rows = run(args.device, args.iters)
    print(f"| call ({args.device}, torch {torch.__version__}, jax {jax.__version__}) | wall µs/call | CPU µs/call |")
    print("|---|---:|---:|")
    for name, (wall, cpu) in rows:
        print(f"| {name} | {wall:.1f} | {cpu:.1f} |")


if __name__ == "__main__":
    main()
