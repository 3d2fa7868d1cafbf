"""Serving the dense model on one chip: prefill and greedy decode with stellax's paged KV cache
against plain JAX with a dense KV cache.

    stellax bench model serve --out model_serve.json          # installed (pip install "stellax[nn]")
    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/model_serve.py --out $OUT/model_serve.json

The model is `stellax.bench.model_train`'s dense one (`model_zoo.DenseConfig`, 526M parameters), its weights
cast once to bfloat16, random (the timing does not depend on them). Two variants over the same
weights:

* ``stellax``: `stellax.rms_norm`, `stellax.gated_linear_unit`, and for attention
  `stellax.dot_product_attention` over the prompt (prefill) and `stellax.paged_attention` against a
  paged KV cache (decode): pages of 64 tokens, every layer's pages in one pool
  ``[L·B·pages, 64, K, H]`` (layer ``l`` reads its sequences' block tables offset by ``l·B·pages``, so
  the kernel reads the pool in place, no per-layer slice), new keys/values scattered into their slots;
* ``jax``: ``jnp`` norms and SwiGLU, `jax.nn.dot_product_attention` over the prompt, and a dense KV
  cache ``[L, B, C, K, H]`` read by a masked ``jnp`` softmax attention over all ``C`` slots (what a
  plain-JAX decoder without a kernel does).

Both run the layers in a ``lax.scan`` with the cache in the carry (updated in place; the cache is
donated), and greedy decoding is a ``lax.fori_loop`` of ``--gen`` steps inside one jit (no host round
trip per token). The logits are the last position's, ``x W_out`` in float32.

Cases (``--cases`` picks ``batch:context``; main set ``1:4096,32:4096,128:2048``): ``B`` sequences
whose prompts fill ``context - gen`` tokens, prefilled ``--prefill-batch`` (default 2) sequences per
call (the plain prefill's float32 ``[2, 16, 4064, 4064]`` attention logits are 2.1 GB beside the
cache), then ``gen`` (default 32) tokens decoded. Batch 128 runs at context 2048, not 4096: its bf16 KV
cache would be ``2·L·B·C·K·H·2 B`` = 17.2 GB at 4096 (8.6 GB at 2048), more than a v5e's 15.75 GiB.

Rows (suite's results schema, benchmarks/README.md), op ``model_decode``, pass ``fwd``, contender
``stellax`` / ``jax`` (the peer):

* case ``"dense prefill batch=Bp prompt=P"``: ``ms`` per prefill call of ``Bp`` prompts,
  ``tokens_per_s = Bp·P / s``, model FLOPs ``2·P_matmul·Bp·P + 2·Bp·P²·N·H·L`` (causal attention
  at half), ``pct_peak`` = MFU, ``bound`` compute;
* case ``"dense decode batch=B context=C"``: ``ms`` per decode step (the loop's time / gen),
  ``tokens_per_s = B / s``, model FLOPs ``2·P_matmul·B + 4·B·N·H·L·c`` (``c`` the mean cached
  length), ``pct_peak`` = MFU, ``bound`` memory, ``hbm_gbps`` the weights (bf16) plus the keys and
  values of ``c`` tokens per sequence read per step, over the step time.

Each pair also records ``same_tokens``: how many of the first generated tokens of sequence 0 the two
variants agree on (greedy, bf16: a near tie can flip one, so the chip rows report it, not check it).
``--dry-run`` (the test suite): the tiny dense model on the CPU, stellax dispatching as on a v5e
with its kernels interpreted, float32 activations, and a check that greedy decoding of both
variants gives the same first 64 tokens (float32 there: random tiny weights give bf16 near ties).

Chip time (v5e; not measured on a chip). Compiled for a v5e with libtpu on a compile-only device
(the dev box's loaded 2-core CPU): stellax prefill 25-33 s and decode loop 5-7 s, plain prefill
12 s and decode 4 s per case; ``memory_analysis`` 9.1 GiB (stellax) / 9.8 GiB (jax) at batch 128,
context 2048, the caches aliased (updated in place). On the chip's host expect about half those
compiles: ~40 s of compiles per case for both variants, plus the cache fills (batch 128: 64
prefill calls of 2 x 2016 tokens) and timed loops, ~10 s: the main set ~150 s.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from stellax.bench import chip_run
from stellax.bench.chip_run import elapsed, environment
from stellax.bench.model_train import BF16_PEAK, CHIP, TINY, V5E_PEAK, OpObserver
from stellax.bench.model_zoo import glu, init_params, rms, rope

PAGE = 64
MAIN_CASES = "1:4096,32:4096,128:2048"
DRY_CASES = "2:96"
VARIANTS = ("stellax", "jax")
HBM_BW = {"TPU v5 lite": 819e9, "TPU v5e": 819e9}


def parse_args(argv=None, prog: str | None = None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, interpreted kernels")
    p.add_argument("--cases", default="", help=f"comma-separated batch:context (default {MAIN_CASES}; dry run "
                   f"{DRY_CASES})")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of stellax,jax")
    p.add_argument("--gen", type=int, default=None, help="tokens decoded per timed loop (default 32, dry run 64)")
    p.add_argument("--prefill-batch", type=int, default=2, help="prompts per prefill call (default 2)")
    p.add_argument("--reps", type=int, default=None, help="timed calls after the first (default 3; dry run 0: "
                   "the first decode loop's time, compile included, is the row's)")
    p.add_argument("--budget", type=float, default=200.0, help="seconds; no new case starts past it")
    args = p.parse_args(argv)
    args.gen = args.gen if args.gen is not None else (64 if args.dry_run else 32)
    args.reps = args.reps if args.reps is not None else (0 if args.dry_run else 3)
    return args


def parse_cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in (c for c in text.split(",") if c):
        parts = item.split(":")
        if len(parts) != 2 or not all(v.isdigit() and int(v) > 0 for v in parts):
            raise SystemExit(f"--cases: expected batch:context (positive ints), got {item!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out


# -- the two decoders ------------------------------------------------------------------------------
def _norm(variant, x, scale, eps):
    import stellax

    return stellax.rms_norm(x, scale, epsilon=eps) if variant == "stellax" else rms(x, scale, eps)


def _mlp(variant, x, m):
    import stellax

    if variant == "stellax":
        h = stellax.gated_linear_unit(x, m["gate_up"], activation="silu")
        return jnp.tensordot(h, m["down"], axes=1)
    return glu(x, m["gate_up"], m["down"])


def _qkv(cfg, a, x, positions):
    q, k, v = (jnp.tensordot(x, a[n], axes=1) for n in ("q", "k", "v"))
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def _logits(cfg, variant, params, x):
    x = _norm(variant, x, params["final_norm"], cfg.epsilon)
    return jnp.einsum("bd,dv->bv", x, params["unembed"], preferred_element_type=jnp.float32)


class Cache:
    """The KV cache layout of a variant for ``batch`` sequences of up to ``context`` tokens:
    stellax ``k, v [L·B·pages, PAGE, K, H]`` + ``tables [B, pages]``; jax ``k, v [L, B, C, K, H]``."""

    def __init__(self, cfg, variant: str, batch: int, context: int, dtype):
        self.variant, self.batch, self.context = variant, batch, context
        self.pages = -(-context // PAGE)
        self.per_layer = batch * self.pages
        if variant == "stellax":
            shape = (cfg.layers * self.per_layer, PAGE, cfg.kv_heads, cfg.head_dim)
        else:
            shape = (cfg.layers, batch, self.pages * PAGE, cfg.kv_heads, cfg.head_dim)
        self.shape, self.dtype = shape, dtype
        self.tables = jnp.arange(self.per_layer, dtype=jnp.int32).reshape(batch, self.pages)

    def empty(self):
        return jnp.zeros(self.shape, self.dtype), jnp.zeros(self.shape, self.dtype)


def write_kv(cache: Cache, kv, layer, k, v, rows, positions):
    """``k, v [b, T, K, H]`` of sequences ``rows [b]`` at ``positions [b, T]`` written into layer ``layer``."""
    kc, vc = kv
    if cache.variant == "stellax":
        page = jnp.take_along_axis(cache.tables[rows], positions // PAGE, axis=1) + layer * cache.per_layer
        slots = (page * PAGE + positions % PAGE).reshape(-1)
        flat = (kc.shape[0] * PAGE, *kc.shape[2:])
        kc = kc.reshape(flat).at[slots].set(k.reshape(-1, *k.shape[2:])).reshape(kc.shape)
        vc = vc.reshape(flat).at[slots].set(v.reshape(-1, *v.shape[2:])).reshape(vc.shape)
        return kc, vc
    b_idx = jnp.broadcast_to(rows[:, None], positions.shape)
    return kc.at[layer, b_idx, positions].set(k), vc.at[layer, b_idx, positions].set(v)


def _decoder(cfg, cache: Cache, params, kv, x, positions, rows, attend):
    """The blocks over ``x [b, t, D]`` at ``positions [b, t]`` (cache rows ``rows [b]``): each
    block's keys and values are written into ``kv``, then ``attend(q, k, v, kv, layer) ->
    [b, t, N, H]`` reads them; returns ``(x, kv)``."""
    variant = cache.variant

    def layer(carry, xs):
        x, kv = carry
        lp, i = xs
        h = _norm(variant, x, lp["attn_norm"]["scale"], cfg.epsilon)
        q, k, v = _qkv(cfg, lp["attn"], h, positions)
        kv = write_kv(cache, kv, i, k, v, rows, positions)
        o = attend(q, k, v, kv, i)
        x = x + jnp.einsum("btnh,nhd->btd", o.astype(x.dtype), lp["attn"]["o"])
        return (x + _mlp(variant, _norm(variant, x, lp["mlp_norm"]["scale"], cfg.epsilon), lp["mlp"]), kv), None

    (x, kv), _ = jax.lax.scan(layer, (x, kv), (params["layers"], jnp.arange(cfg.layers)))
    return x, kv


def prefill(cfg, cache: Cache, params, kv, tokens, first_row):
    """``tokens [b, P]`` (sequences ``first_row .. first_row + b``) through the model, their keys
    and values written into ``kv``; returns ``(last-position logits [b, V] float32, kv)``."""
    import stellax

    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    rows = first_row + jnp.arange(b, dtype=jnp.int32)
    attention = stellax.dot_product_attention if cache.variant == "stellax" else jax.nn.dot_product_attention

    def attend(q, k, v, kv, i):
        return attention(q, k, v, is_causal=True)

    x, kv = _decoder(cfg, cache, params, kv, params["embed"][tokens], positions, rows, attend)
    return _logits(cfg, cache.variant, params, x[:, -1]), kv


def decode_step(cfg, cache: Cache, params, kv, tokens, lengths):
    """One token per sequence: ``tokens [B]`` at positions ``lengths [B]``; returns ``(logits [B, V], kv)``."""
    import stellax

    b = tokens.shape[0]
    n, kvh = cfg.heads, cfg.kv_heads

    def attend(q, k, v, kv, i):
        if cache.variant == "stellax":
            o = stellax.paged_attention(q[:, 0], kv[0], kv[1], cache.tables + i * cache.per_layer, lengths + 1)
        else:
            kc, vc = kv[0][i], kv[1][i]                                      # [B, C, K, H]
            qg = q[:, 0].reshape(b, kvh, n // kvh, -1)
            s = jnp.einsum("bkgh,bckh->bkgc", qg, kc, preferred_element_type=jnp.float32) / np.sqrt(cfg.head_dim)
            valid = jnp.arange(kc.shape[1])[None, :] <= lengths[:, None]
            s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
            w = jax.nn.softmax(s, axis=-1).astype(vc.dtype)
            o = jnp.einsum("bkgc,bckh->bkgh", w, vc).reshape(b, n, -1)
        return o[:, None]

    x, kv = _decoder(cfg, cache, params, kv, params["embed"][tokens][:, None], lengths[:, None],
                     jnp.arange(b, dtype=jnp.int32), attend)
    return _logits(cfg, cache.variant, params, x[:, 0]), kv


def generate(cfg, cache: Cache, gen: int, params, kv, first, lengths):
    """Greedy decoding of ``gen`` tokens from ``first [B]`` at ``lengths [B]``: ``(tokens [B, gen], kv)``."""
    def body(i, state):
        kv, tok, out = state
        logits, kv = decode_step(cfg, cache, params, kv, tok, lengths + i)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return kv, nxt, out.at[:, i].set(nxt)

    out = jnp.zeros((first.shape[0], gen), jnp.int32)
    kv, _, out = jax.lax.fori_loop(0, gen, body, (kv, first, out))
    return out, kv


# -- measuring ---------------------------------------------------------------------------------------
def serve_variant(cfg, variant, params, batch, context, *, gen, prefill_batch, reps, seed=0) -> dict:
    """Fill a cache of ``batch`` prompts of ``context - gen`` tokens and decode ``gen`` greedily."""
    from stellax.core.selection import observe_calls

    prompt = context - gen
    pb = min(prefill_batch, batch)
    if batch % pb:
        raise ValueError(f"--prefill-batch: batch {batch} is not a multiple of {pb}")
    dtype = params["embed"].dtype
    cache = Cache(cfg, variant, batch, context, dtype)
    prompts = jax.random.randint(jax.random.key(seed + 3), (batch, prompt), 0, cfg.vocab, jnp.int32)
    seen = OpObserver()
    pre = jax.jit(functools.partial(prefill, cfg, cache), donate_argnums=(1,))
    run = jax.jit(functools.partial(generate, cfg, cache, gen), donate_argnums=(1,))
    kv = cache.empty()
    t0 = time.perf_counter()
    with observe_calls(seen):
        pre_c = pre.lower(params, kv, prompts[:pb], jnp.int32(0)).compile()
    prefill_compile = time.perf_counter() - t0
    firsts, times = [], []
    for r in range(batch // pb):
        t = time.perf_counter()
        logits, kv = pre_c(params, kv, prompts[r * pb:(r + 1) * pb], jnp.int32(r * pb))
        firsts.append(jnp.argmax(jax.block_until_ready(logits), axis=-1).astype(jnp.int32))
        times.append(time.perf_counter() - t)
    for _ in range(max(1, reps) - len(times) + 1):      # at least max(1, reps) timed calls after the first
        t = time.perf_counter()
        logits, kv = pre_c(params, kv, prompts[:pb], jnp.int32(0))
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t)
    prefill_ms = float(np.median(times[1:])) * 1e3
    first = jnp.concatenate(firsts)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    t0 = time.perf_counter()
    with observe_calls(seen):
        run_c = run.lower(params, kv, first, lengths).compile()
    t1 = time.perf_counter()
    tokens, kv = run_c(params, kv, first, lengths)
    tokens = np.asarray(jax.block_until_ready(tokens))
    decode_compile = time.perf_counter() - t0
    loop = [] if reps else [time.perf_counter() - t1]   # reps 0: the first loop (dry run: interpreted, slow)
    for _ in range(reps):
        t = time.perf_counter()
        out, kv = run_c(params, kv, first, lengths)
        jax.block_until_ready(out)
        loop.append(time.perf_counter() - t)
    return {"prefill_ms": prefill_ms, "prefill_batch": pb, "prompt": prompt, "decode_ms": float(np.median(loop))
            * 1e3 / gen, "gen": gen, "prefill_compile_s": round(prefill_compile, 2),
            "decode_compile_s": round(decode_compile, 2), "tokens": np.concatenate(
                [np.asarray(first)[:, None], tokens], axis=1)[:4].tolist(),
            "stellax_ops": dict(sorted(seen.seen.items()))}


class Run:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.cfg = (TINY if self.dry else CHIP)["dense"]
        self.cases = parse_cases(args.cases or (DRY_CASES if self.dry else MAIN_CASES))
        self.variants = [v for v in args.variants.split(",") if v]
        if set(self.variants) - set(VARIANTS):
            raise SystemExit(f"--variants: expected a subset of {VARIANTS}, got {self.variants}")
        for batch, context in self.cases:
            if context <= args.gen:
                raise SystemExit(f"--cases: context {context} must exceed --gen {args.gen}")
        self.env = environment(self.dry)
        self.device = self.env["device_kind"]
        self.peak = V5E_PEAK if self.dry else BF16_PEAK.get(self.device)
        self.bw = HBM_BW.get(self.device, 819e9 if self.dry else None)
        self.date = datetime.date.today().isoformat()
        self.rows: list[dict] = []
        self.greedy: list[dict] = []
        self.out = Path(args.out)

    def save(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"format": "stellax-model-serve", "version": 1, "environment": self.env,
               "model": {"family": "dense", "params": self.cfg.total_params(),
                         "matmul_params": self.cfg.matmul_params(), "dtype": self.dtype_name, "page_size": PAGE},
               "seconds": round(elapsed(), 1), "rows": self.rows, "greedy": self.greedy}
        self.out.write_text(json.dumps(doc, indent=1))

    @property
    def dtype_name(self):
        return "float32" if self.dry else "bfloat16"

    def base(self, case, variant, **extra):
        return {"op": "model_decode", "case": case, "pass": "fwd", "contender": variant,
                "default": variant == "stellax", "peer": variant != "stellax", "ms": None, "tflops": None,
                "pct_peak": None, "device": self.device, "date": self.date, "skipped": None, "error": None, **extra}

    def rows_of(self, batch, context, variant, m: dict | None, error=None, skipped=None):
        c = self.cfg
        p, gen = context - self.args.gen, self.args.gen
        pb = min(self.args.prefill_batch, batch)
        bytes_el = 4 if self.dry else 2
        mean_ctx = p + (gen - 1) / 2
        pre = self.base(f"dense prefill batch={pb} prompt={p}", variant, bound="compute", batch=pb, seq=p)
        dec = self.base(f"dense decode batch={batch} context={context}", variant, bound="memory", batch=batch,
                        seq=context)
        pre["flops"] = 2.0 * c.matmul_params() * pb * p + 2.0 * pb * p * p * c.heads * c.head_dim * c.layers
        dec["flops"] = 2.0 * c.matmul_params() * batch + 4.0 * batch * c.heads * c.head_dim * c.layers * mean_ctx
        dec["bytes"] = bytes_el * (c.matmul_params() + 2 * batch * mean_ctx * c.kv_heads * c.head_dim * c.layers)
        for r, key, tokens in ((pre, "prefill_ms", pb * p), (dec, "decode_ms", batch)):
            r["error"], r["skipped"] = error, skipped
            if m is None:
                continue
            r["ms"] = m[key]
            s = r["ms"] * 1e-3
            r["tokens_per_s"] = tokens / s
            r["tflops"] = r["flops"] / s / 1e12
            r["pct_peak"] = None if not self.peak else 100.0 * r["flops"] / s / self.peak
            r["mfu"] = None if r["pct_peak"] is None else r["pct_peak"] / 100
            r.update({k: m[k] for k in ("prefill_compile_s", "decode_compile_s", "stellax_ops")})
            if "bytes" in r:
                r["hbm_gbps"] = r["bytes"] / s / 1e9
                r["pct_hbm"] = None if not self.bw else 100.0 * r["bytes"] / s / self.bw
        self.rows += [pre, dec]
        if error or skipped:
            print(f"  {variant:8s} {'ERROR ' + error[:300] if error else 'skipped: ' + skipped}", flush=True)
        else:
            print(f"  {variant:8s} prefill {pre['ms']:9.2f} ms {pre['tokens_per_s']:9.0f} tok/s MFU "
                  f"{pre['pct_peak'] or 0:5.1f}% | decode {dec['ms']:8.3f} ms/step {dec['tokens_per_s']:9.0f} tok/s "
                  f"{dec['hbm_gbps']:6.1f} GB/s | compiles {m['prefill_compile_s']:.1f} + {m['decode_compile_s']:.1f} s"
                  f" | ops {m['stellax_ops']}", flush=True)

    def main(self):
        c = self.cfg
        print(f"model serve on {self.device} ({'dry run, interpreted' if self.dry else 'native'}): dense "
              f"{c.total_params() / 1e6:.1f}M params in {self.dtype_name}, cases {self.cases} (batch:context), "
              f"gen {self.args.gen}, prefill batch {self.args.prefill_batch}, page {PAGE}", flush=True)
        dtype = jnp.float32 if self.dry else jnp.bfloat16
        params = jax.tree.map(lambda a: a.astype(dtype), init_params(c, 0))
        for batch, context in self.cases:
            print(f"== batch {batch} context {context}", flush=True)
            got = {}
            for variant in self.variants:
                if elapsed() > self.args.budget:
                    print(f"budget of {self.args.budget:.0f} s spent: {variant} batch {batch} not run", flush=True)
                    self.rows_of(batch, context, variant, None, skipped="budget")
                    continue
                try:
                    got[variant] = serve_variant(c, variant, params, batch, context, gen=self.args.gen,
                                                 prefill_batch=self.args.prefill_batch, reps=self.args.reps)
                    self.rows_of(batch, context, variant, got[variant])
                except Exception as e:  # noqa: BLE001 - a variant that does not fit or compile is a row
                    self.rows_of(batch, context, variant, None, error=f"{type(e).__name__}: {e}".replace("\n", " ")[:600])
                self.save()
            if set(got) == set(VARIANTS):
                a, b = np.asarray(got["stellax"]["tokens"][0]), np.asarray(got["jax"]["tokens"][0])
                same = int(np.argmin(a == b)) if not np.all(a == b) else len(a)
                self.greedy.append({"case": f"batch={batch} context={context}", "compared": len(a),
                                    "same_tokens": same, "stellax": a.tolist(), "jax": b.tolist(),
                                    "ok": same == len(a) if self.dry else None})
                print(f"  greedy tokens of sequence 0: the first {same} of {len(a)} agree", flush=True)
        self.save()
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 1 if any(g["ok"] is False for g in self.greedy) else 0


def main(argv=None, prog: str | None = None) -> int:
    """The command line (module docstring); ``prog`` names it in help and errors."""
    # A dry run dispatches as on a v5e (implementation=None picks the TPU kernels), interpreted on the CPU.
    return chip_run.run(Run, parse_args(argv, prog), target="v5e")


if __name__ == "__main__":
    sys.exit(main())
