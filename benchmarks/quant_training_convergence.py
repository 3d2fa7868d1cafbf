"""Convergence of low-precision training recipes on a tiny causal LM (CPU, XLA path).

A ~1M-parameter decoder-only transformer (pre-norm, learned positions, GELU
MLP) learns a synthetic second-order Markov chain: every pair of previous
tokens ``(a, b)`` has a few possible successors with random probabilities,
so the best achievable loss is the chain's entropy rate (printed). Every
linear layer (qkv, out, mlp up/down, lm head) goes through
`stellax.quantized_linear`; the recipe's opt-out keeps the first and the last
transformer block and the lm head in bf16. The same data, initialization and
schedule are used for every variant:

  bf16, mxfp8, nvfp4 (Hadamard + stochastic rounding: the recipe),
  nvfp4 without the Hadamard, nvfp4 without stochastic rounding, nvfp4 without both.

Writes ``benchmarks/results/quant_training_convergence.json``: per variant the
loss curve, the final train loss (mean of the last 20 steps), the held-out
loss at the end, the gap to bf16 in percent, and seconds per step.

    python benchmarks/quant_training_convergence.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import stellax
from stellax.ops.quant.recipes import NVFP4, MXFP8

VARIANTS = {
    "bf16": None,
    "mxfp8": MXFP8.replace(bf16_first=1, bf16_last=1),
    "nvfp4": NVFP4,
    "nvfp4_no_hadamard": NVFP4.replace(name="nvfp4_no_hadamard", hadamard=None),
    "nvfp4_no_sr": NVFP4.replace(name="nvfp4_no_sr", stochastic_rounding=False),
    "nvfp4_no_hadamard_no_sr": NVFP4.replace(name="nvfp4_no_hadamard_no_sr", hadamard=None,
                                             stochastic_rounding=False),
}


# -- data ----------------------------------------------------------------------------------


def make_chain(vocab: int, successors: int, seed: int):
    """A second-order Markov chain: ``P[a, b]`` (``[V, V, V]``) is a
    distribution over ``vocab`` with ``successors`` non-zero entries
    (Dirichlet(1) weights)."""
    rng = np.random.default_rng(seed)
    probs = np.zeros((vocab, vocab, vocab))
    for a in range(vocab):
        for b in range(vocab):
            idx = rng.choice(vocab, successors, replace=False)
            probs[a, b, idx] = rng.dirichlet(np.ones(successors))
    return probs


def sample(probs, batch: int, length: int, rng):
    """``[batch, length]`` int32 token sequences of the chain."""
    vocab = probs.shape[0]
    cdf = np.cumsum(probs, axis=-1)
    out = np.zeros((batch, length), np.int32)
    out[:, :2] = rng.integers(0, vocab, (batch, 2))
    for t in range(2, length):
        u = rng.random(batch)[:, None]
        c = cdf[out[:, t - 2], out[:, t - 1]]
        out[:, t] = np.minimum((u > c).sum(-1), vocab - 1)
    return out


def entropy_rate(probs, rng, n: int = 200_000):
    seq = sample(probs, 64, n // 64 + 2, rng)
    p = probs[seq[:, :-2], seq[:, 1:-1]]
    h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)
    return float(h.mean())


# -- model ---------------------------------------------------------------------------------


def init_params(key, *, vocab, d, layers, seq, ff):
    ks = iter(jax.random.split(key, 4 + 4 * layers))
    normal = lambda k, shape, scale: (jax.random.normal(k, shape, jnp.float32) * scale)
    params = {"embed": normal(next(ks), (vocab, d), 0.02), "pos": normal(next(ks), (seq, d), 0.02),
              "head": normal(next(ks), (d, vocab), 1 / math.sqrt(d)), "blocks": []}
    for _ in range(layers):
        params["blocks"].append({
            "qkv": normal(next(ks), (d, 3 * d), 1 / math.sqrt(d)),
            "out": normal(next(ks), (d, d), 1 / math.sqrt(d) / math.sqrt(2 * layers)),
            "up": normal(next(ks), (d, ff), 1 / math.sqrt(d)),
            "down": normal(next(ks), (ff, d), 1 / math.sqrt(ff) / math.sqrt(2 * layers)),
            "ln1": jnp.ones((d,)), "ln2": jnp.ones((d,)),
        })
    params["ln_f"] = jnp.ones((d,))
    return params


def rms_norm(x, g):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * g).astype(x.dtype)


def forward(params, tokens, key, recipe, *, heads):
    """Logits ``[B, T, V]``; every linear through `stellax.quantized_linear`."""
    nl = len(params["blocks"])
    b, t = tokens.shape
    x = (params["embed"][tokens] + params["pos"][:t]).astype(jnp.bfloat16)
    mask = jnp.tril(jnp.ones((t, t), bool))

    def linear(h, w, layer, idx):
        r = None if recipe is None else recipe.for_layer(layer, nl)
        k = None if (r is None or key is None) else jax.random.fold_in(key, layer * 16 + idx)
        return stellax.quantized_linear(h, w, r, key=k)

    for i, blk in enumerate(params["blocks"]):
        h = rms_norm(x, blk["ln1"])
        qkv = linear(h, blk["qkv"], i, 0).reshape(b, t, 3, heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
        p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1).astype(jnp.bfloat16)
        a = jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, -1)
        x = x + linear(a, blk["out"], i, 1)
        h = rms_norm(x, blk["ln2"])
        x = x + linear(jax.nn.gelu(linear(h, blk["up"], i, 2)), blk["down"], i, 3)
    x = rms_norm(x, params["ln_f"])
    return stellax.quantized_linear(x, params["head"], None).astype(jnp.float32)  # lm head: bf16 (opt-out)


def loss_fn(params, tokens, key, recipe, heads):
    logits = forward(params, tokens[:, :-1], key, recipe, heads=heads)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def adam_update(params, grads, state, step, lr):
    b1, b2, eps = 0.9, 0.95, 1e-8
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    t = step + 1
    upd = jax.tree.map(lambda m, v: (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + eps), m, v)
    params = jax.tree.map(lambda p, u: p - lr * (u + 0.01 * p * (p.ndim > 1)), params, upd)
    return params, {"m": m, "v": v}


def lr_at(step, steps, peak):
    warm = max(1, steps // 10)
    return jnp.where(step < warm, peak * (step + 1) / warm,
                     peak * 0.5 * (1 + jnp.cos(jnp.pi * (step - warm) / max(1, steps - warm))))


def make_step(recipe, heads, steps, peak_lr):
    @jax.jit
    def step_fn(params, state, tokens, key, step):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, key, recipe, heads)
        params, state = adam_update(params, grads, state, step, lr_at(step, steps, peak_lr))
        return params, state, loss

    @jax.jit
    def eval_fn(params, tokens):
        return loss_fn(params, tokens, None, recipe, heads)

    return step_fn, eval_fn


def train(recipe, *, data, eval_data, steps, seed, heads, peak_lr, model_kw, log_every=25, name=""):
    params = init_params(jax.random.key(seed), **model_kw)
    state = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}
    step_fn, eval_fn = make_step(recipe, heads, steps, peak_lr)
    base = jax.random.key(seed + 1)
    losses, times = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        params, state, loss = step_fn(params, state, data[s], jax.random.fold_in(base, s), s)
        loss = float(loss)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if log_every and (s % log_every == 0 or s == steps - 1):
            print(f"  {name:26s} step {s:4d} loss {loss:.4f} ({times[-1]:.2f} s)", flush=True)
    eval_loss = float(np.mean([float(eval_fn(params, e)) for e in eval_data]))
    return {"losses": losses, "eval_loss": eval_loss, "final_train_loss": float(np.mean(losses[-20:])),
            "s_per_step": float(np.median(times[1:])) if len(times) > 1 else times[0],
            "compile_s": times[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--successors", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "quant_training_convergence.json"))
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    probs = make_chain(a.vocab, a.successors, a.seed)
    floor = entropy_rate(probs, np.random.default_rng(a.seed + 7))
    length = a.seq + 1
    data = jnp.asarray(sample(probs, a.steps * a.batch, length, rng).reshape(a.steps, a.batch, length))
    eval_data = [jnp.asarray(sample(probs, a.batch, length, rng)) for _ in range(8)]
    model_kw = dict(vocab=a.vocab, d=a.d, layers=a.layers, seq=a.seq, ff=4 * a.d)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(init_params(jax.random.key(0), **model_kw)))
    print(f"model: {n_params / 1e6:.2f}M parameters, {a.layers} blocks, d={a.d}; tokens/step {a.batch * a.seq}; "
          f"chain entropy rate {floor:.4f} nats (the best achievable loss)", flush=True)
    results = {}
    for name in a.variants.split(","):
        results[name] = train(VARIANTS[name], data=data, eval_data=eval_data, steps=a.steps, seed=a.seed,
                              heads=a.heads, peak_lr=a.lr, model_kw=model_kw, name=name)
        print(f"{name}: final train {results[name]['final_train_loss']:.4f} eval {results[name]['eval_loss']:.4f} "
              f"({results[name]['s_per_step']:.2f} s/step)", flush=True)
    if "bf16" in results:
        ref_t, ref_e = results["bf16"]["final_train_loss"], results["bf16"]["eval_loss"]
        for r in results.values():
            r["train_gap_pct"] = 100 * (r["final_train_loss"] - ref_t) / ref_t
            r["eval_gap_pct"] = 100 * (r["eval_loss"] - ref_e) / ref_e
    out = {"config": vars(a), "n_params": n_params, "entropy_rate": floor,
           "platform": {"jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
                        "cpu_count": os.cpu_count()},
           "variants": {k: {kk: vv for kk, vv in v.items()} for k, v in results.items()}}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'variant':26s} {'train':>8s} {'eval':>8s} {'gap train %':>12s} {'gap eval %':>11s}")
    for k, r in results.items():
        print(f"{k:26s} {r['final_train_loss']:8.4f} {r['eval_loss']:8.4f} {r.get('train_gap_pct', 0):12.2f} "
              f"{r.get('eval_gap_pct', 0):11.2f}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
