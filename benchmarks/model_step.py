"""One training step of a Llama-3-style dense decoder on one chip: stellax's kernels against plain JAX.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/model_step.py --preset 500m --out $OUT/model_step.json

The model (issue 42, dense): token embedding, ``L`` pre-norm decoder blocks
(RMSNorm, grouped-query attention with RoPE, residual; RMSNorm, SwiGLU MLP,
residual), a final RMSNorm and an untied output projection trained with
next-token cross-entropy. One set of parameters, one pytree (plain dicts of
arrays, the blocks stacked on a leading layer axis and run by ``lax.scan``),
two forward functions:

* ``stellax``: the blocks are `stellax.nn` layers (``RMSNorm``, ``Attention``,
  ``GatedMLP``) merged from the parameters inside the scan, so every op is
  `stellax.rms_norm` (the second norm of a block fused with the residual add),
  `stellax.dot_product_attention`, `stellax.gated_linear_unit`, and the loss
  is `stellax.linear_cross_entropy` (no ``[T, V]`` logits) -- each with
  ``implementation=None``, i.e. what stellax picks by itself on the device;
* ``jax``: the same math in plain JAX/XLA written here: ``jnp`` RMSNorm,
  ``jnp`` RoPE, `jax.nn.dot_product_attention` (its XLA implementation on a
  TPU), ``jnp`` SwiGLU, ``[T, V]`` float32 logits and
  `optax.softmax_cross_entropy_with_integer_labels`. No stellax op runs in it
  (the rows' ``stellax_ops`` lists the ops each variant called, from
  `stellax.core.selection.observe_calls`; the plain variant's is empty).

The ``stellax.nn`` layers have no implementation switch, so the plain model is
its own small function over the same pytree; the dry run checks that both give
the same loss on the same weights and batch.

Precision: mixed. Parameters and AdamW moments are float32 (the master
weights, 16 bytes per parameter with the gradient), activations and matmul
operands bfloat16 (each layer casts its float32 parameters to the activations'
dtype), matmuls accumulate in float32, norms/softmax/loss in float32. The
optimizer is ``optax.chain(clip_by_global_norm(1.0), adamw(3e-4, b1=0.9,
b2=0.95, weight_decay=0.1))``; the step is ``jax.jit`` with the parameters and
optimizer state donated. ``--remat full`` (default) wraps each block in
``jax.checkpoint`` (only the residual stream between blocks is kept; the
backward recomputes a block's forward), ``--remat none`` keeps everything (the
dry run's default: interpreted Pallas kernels run through ``io_callback``,
whose effects ``jax.checkpoint`` cannot partially evaluate).

Presets:

* ``500m``: D=1536, 16 layers, 16 query heads over 4 kv heads of 128, SwiGLU
  hidden 4096, vocab 32000, RoPE theta 500000: 526.2M parameters (477.0M in
  matmuls). The vocab is Llama-2/Mistral's 32000, not Llama-3's 128256: at
  D=1536 a 128256 vocab would put 394M of the 500M parameters into the two
  embedding tables, and its ``[T, V]`` float32 logits (8.4 GB at 16384
  tokens) could not sit beside the plain model's optimizer state. Memory: 16
  bytes x 526.6M = 8.4 GB of parameters, gradients and AdamW moments, leaving
  ~7 GB of a v5e's 15.75 GiB for activations. Cases: sequence 4096 at batch 2
  (8192 tokens; the plain model's ``[B, N, T, T]`` float32 attention logits are
  2.1 GB a layer) and sequence 16384 at batch 1 (there the plain model's
  logits alone are 17 GB a layer: it is expected not to fit, which is an
  error row with XLA's message, not a crash).
* ``tiny``: D=64, 2 layers, 4 heads over 2 kv heads of 16, hidden 128, vocab
  256, sequence 32, batch 2 (the CPU dry run).

Measured per variant and case: the first call (compile + one step), then
``--warmup`` steps, then the median of ``--reps`` step times (each ended by
``block_until_ready``), tokens/s = B·S / step time, and MFU::

    model FLOPs per step = 6 · P_matmul · B · S  +  6 · B · S² · N · H · L
    MFU = model FLOPs per step / step time / peak bf16 FLOP/s (197e12 on a v5e)

where ``P_matmul`` counts every parameter that enters a matmul (per block
q, k, v, o, gate_up, down; plus the output projection ``D·V``; not the
embedding table, a gather, nor the norm scales) and the second term is causal
attention as MaxText counts it: ``4 · B · S² · N · H`` per layer forward (QKᵀ
and PV), times 3 for forward plus backward, halved for the causal mask. The
recomputation of ``--remat`` is not counted (model FLOPs, not hardware FLOPs).
``tflops`` is model FLOPs / step time; ``pct_peak`` = ``mfu`` in percent.

Peak HBM (``peak_hbm_bytes``): ``memory_stats()['peak_bytes_in_use']`` of the
device where the backend reports it (a TPU), else the compiled step's
``memory_analysis()`` (arguments + outputs + temporaries - aliased). The peak is
per process, so on a TPU each (case, variant) runs in its own subprocess
(``--in-process`` turns that off). ``compiled_bytes`` is always the compiled
step's own estimate.

The JSON (``--out``) holds ``{"format": "stellax-model-step", "version": 1,
"environment": {...}, "preset": ..., "model": {...}, "rows": [ROW, ...],
"loss_agreement": [...]}`` with rows in the suite's results schema
(benchmarks/README.md: op ``model_step``, case, pass ``train``, contender
``stellax`` / ``jax``, default, peer, ms, tflops, pct_peak, bound, peak_hbm_bytes,
device, date, skipped, error) plus ``tokens_per_s``, ``mfu``, ``batch``,
``seq``, ``params``, ``flops_per_step``, ``loss_first``, ``loss_last``,
``compile_s``, ``compiled_bytes``, ``remat``, ``stellax_ops``. It is rewritten
after every row. ``--budget`` seconds (default 230) stops starting new runs.
On a v5e the whole ``500m`` run (2 cases x 2 variants, each its own process:
~10 s start, ~30-60 s compile, ~10 s of steps) takes about 3-4 minutes.

``--dry-run``: the ``tiny`` preset on the CPU, stellax dispatching as on a v5e
(`stellax.lowering_target`) with its Pallas kernels interpreted, both variants
in one process, and a check that their losses agree (the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from chip_run import elapsed, environment

#: Peak dense bf16 FLOP/s by device kind; the dry run reports against a v5e's.
BF16_PEAK = {"TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12,
             "TPU7x": 2307e12}
V5E_PEAK = 197e12
#: Relative loss difference allowed between the variants (bf16 activations).
LOSS_RTOL = 2e-2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    rope_theta: float = 500000.0
    epsilon: float = 1e-5

    def matmul_params(self) -> int:
        """Parameters that enter a matmul: the blocks' projections and the output projection."""
        d, n, k, h, f = self.d_model, self.heads, self.kv_heads, self.head_dim, self.hidden
        block = d * n * h + 2 * d * k * h + n * h * d + 2 * d * f + f * d
        return self.layers * block + d * self.vocab

    def total_params(self) -> int:
        return self.matmul_params() + self.vocab * self.d_model + (2 * self.layers + 1) * self.d_model

    def flops_per_step(self, batch: int, seq: int) -> float:
        """6·P_matmul·B·S + 6·B·S²·N·H·L (causal attention at half, as MaxText)."""
        dense = 6.0 * self.matmul_params() * batch * seq
        attention = 12.0 * batch * seq * seq * self.heads * self.head_dim * self.layers / 2
        return dense + attention


PRESETS = {
    "500m": (ModelConfig(vocab=32000, d_model=1536, layers=16, heads=16, kv_heads=4, head_dim=128, hidden=4096),
             [(4096, 2), (16384, 1)]),
    "tiny": (ModelConfig(vocab=256, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, hidden=128,
                         rope_theta=10000.0),
             [(32, 2)]),
}
VARIANTS = ("stellax", "jax")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--preset", choices=sorted(PRESETS), default="500m")
    p.add_argument("--dry-run", action="store_true", help="tiny preset on the CPU, interpreted kernels")
    p.add_argument("--cases", default="", help="comma-separated seq:batch pairs (default: the preset's)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of stellax,jax")
    p.add_argument("--reps", type=int, default=None, help="timed steps (default 8, dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 2, dry run 1)")
    p.add_argument("--remat", choices=("full", "none"), default=None,
                   help="jax.checkpoint per block (default full; none in the dry run)")
    p.add_argument("--budget", type=float, default=230.0, help="seconds; no new run starts past it")
    p.add_argument("--in-process", action="store_true", help="no subprocess per run (peak HBM then cumulative)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # "seq:batch:variant", internal
    args = p.parse_args(argv)
    if args.dry_run:
        args.preset = "tiny"
    if args.remat is None:
        # Interpreted Mosaic kernels run through io_callback, whose effects jax.checkpoint cannot partial-eval.
        args.remat = "none" if args.dry_run else "full"
    return args


# -- the model --------------------------------------------------------------------------------
def make_block_cls():
    from flax import nnx

    from stellax.nn import Attention, GatedMLP, RMSNorm

    class Block(nnx.Module):
        """``h = x + attn(norm(x)); y = h + mlp(norm(h))`` with stellax.nn layers."""

        def __init__(self, cfg: ModelConfig, *, rngs):
            d = cfg.d_model
            self.attn_norm = RMSNorm(d, epsilon=cfg.epsilon, rngs=rngs)
            self.attn = Attention(d, cfg.heads, cfg.kv_heads, cfg.head_dim, rope_theta=cfg.rope_theta, rngs=rngs)
            self.mlp_norm = RMSNorm(d, epsilon=cfg.epsilon, rngs=rngs)
            self.mlp = GatedMLP(d, cfg.hidden, activation="silu", rngs=rngs)

        def __call__(self, x, positions):
            a = self.attn(self.attn_norm(x), positions=positions)
            m, h = self.mlp_norm(a, residual=x)          # fused: norm(a + x), a + x
            return h + self.mlp(m)

    return Block


def init_params(cfg: ModelConfig, seed: int):
    """The one parameter pytree (float32): ``embed [V, D]``, ``layers`` (the
    `stellax.nn` blocks' pure state dicts stacked on a leading ``L`` axis),
    ``final_norm [D]``, ``unembed [D, V]``. Deterministic in ``seed``."""
    from flax import nnx

    Block = make_block_cls()

    def init(key):
        k_embed, k_out, k_layers = jax.random.split(key, 3)
        one = lambda k: nnx.split(Block(cfg, rngs=nnx.Rngs(k)))[1].to_pure_dict()
        layers = jax.vmap(one)(jax.random.split(k_layers, cfg.layers))
        embed = jax.random.normal(k_embed, (cfg.vocab, cfg.d_model), jnp.float32)
        unembed = jax.random.normal(k_out, (cfg.d_model, cfg.vocab), jnp.float32) / math.sqrt(cfg.d_model)
        return {"embed": embed, "layers": layers, "final_norm": jnp.ones((cfg.d_model,), jnp.float32),
                "unembed": unembed}

    return jax.jit(init)(jax.random.key(seed))


def _scan_blocks(block_fn, params, x, positions, remat: str):
    body = (lambda h, p: (block_fn(p, h, positions), None))
    if remat == "full":
        body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, x, params["layers"])
    return x


def stellax_loss(cfg: ModelConfig, remat: str, params, tokens, labels):
    """Mean next-token cross-entropy with the `stellax.nn` blocks and stellax's fused loss."""
    from flax import nnx

    import stellax

    Block = make_block_cls()

    def block_fn(p, h, positions):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
        nnx.replace_by_pure_dict(state, p)
        return nnx.merge(graphdef, state)(h, positions)

    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params["embed"].astype(jnp.bfloat16)[tokens]
    x = _scan_blocks(block_fn, params, x, positions, remat)
    x = stellax.rms_norm(x, params["final_norm"].astype(x.dtype), epsilon=cfg.epsilon)
    return stellax.linear_cross_entropy(x.reshape(b * t, -1), params["unembed"].astype(x.dtype),
                                        labels.reshape(-1))


def _rms(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def _rope(x, positions, theta):
    h = x.shape[-1]
    inv = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    ang = positions.astype(jnp.float32)[..., None] * inv
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def plain_loss(cfg: ModelConfig, remat: str, params, tokens, labels):
    """The same model and loss in plain JAX/XLA (no stellax op)."""
    import optax

    def block_fn(p, x, positions):
        dt = x.dtype
        a, m = p["attn"], p["mlp"]
        h = _rms(x, p["attn_norm"]["scale"], cfg.epsilon)
        q = jnp.einsum("btd,dnh->btnh", h, a["q"].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", h, a["k"].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", h, a["v"].astype(dt))
        q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        h = x + jnp.einsum("btnh,nhd->btd", o, a["o"].astype(dt))
        u = jnp.einsum("btd,dgf->btgf", _rms(h, p["mlp_norm"]["scale"], cfg.epsilon), m["gate_up"].astype(dt),
                       preferred_element_type=jnp.float32)
        g = (jax.nn.silu(u[..., 0, :]) * u[..., 1, :]).astype(dt)
        return h + jnp.einsum("btf,fd->btd", g, m["down"].astype(dt))

    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = params["embed"].astype(jnp.bfloat16)[tokens]
    x = _scan_blocks(block_fn, params, x, positions, remat)
    x = _rms(x, params["final_norm"], cfg.epsilon)
    logits = jnp.einsum("btd,dv->btv", x, params["unembed"].astype(x.dtype), preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


LOSSES = {"stellax": stellax_loss, "jax": plain_loss}


def make_optimizer():
    import optax

    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1))


def make_step(loss_fn, tx):
    def step(params, opt_state, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        import optax
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_batch(cfg: ModelConfig, seed: int, batch: int, seq: int):
    """``(tokens, labels) [B, S]`` int32: a synthetic stream shifted by one."""
    stream = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, cfg.vocab, jnp.int32)
    return stream[:, :-1], stream[:, 1:]


# -- measuring ----------------------------------------------------------------------------------
def compiled_bytes(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def device_peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
        return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
    except Exception:  # noqa: BLE001
        return None


def run_variant(cfg: ModelConfig, variant: str, seq: int, batch: int, *, reps: int, warmup: int, remat: str,
                seed: int = 0) -> dict:
    """Build, compile and time one variant's train step; returns the measured fields of its row."""
    from stellax.core.selection import observe_calls

    seen: dict[str, str] = {}

    def observer(op, implementation, call, config):
        name = getattr(op, "name", str(op))
        impl = getattr(implementation, "name", str(implementation))
        seen.setdefault(name, impl)

    tx = make_optimizer()
    params = init_params(cfg, seed)
    opt_state = jax.jit(tx.init)(params)
    tokens, labels = make_batch(cfg, seed, batch, seq)
    step = make_step(functools.partial(LOSSES[variant], cfg, remat), tx)
    t0 = time.perf_counter()
    with observe_calls(observer):
        compiled = step.lower(params, opt_state, tokens, labels).compile()
    est = compiled_bytes(compiled)
    params, opt_state, loss = compiled(params, opt_state, tokens, labels)
    loss_first = float(loss)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        params, opt_state, loss = compiled(params, opt_state, tokens, labels)
    jax.block_until_ready(loss)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, tokens, labels)
        jax.block_until_ready(loss)
        times.append((time.perf_counter() - t) * 1e3)
    loss_last = float(loss)
    peak = device_peak_bytes()
    del params, opt_state
    return {"ms": float(np.median(times)), "loss_first": loss_first, "loss_last": loss_last,
            "compile_s": round(compile_s, 2), "compiled_bytes": est,
            "peak_hbm_bytes": peak if peak is not None else est,
            "peak_hbm_source": "memory_stats" if peak is not None else "memory_analysis",
            "stellax_ops": dict(sorted(seen.items())), "step_ms_all": [round(x, 3) for x in times]}


def forward_losses(cfg: ModelConfig, seq: int, batch: int, seed: int = 0) -> dict:
    """Both variants' loss on the same initial parameters and batch (no step taken)."""
    params = init_params(cfg, seed)
    tokens, labels = make_batch(cfg, seed, batch, seq)
    out = {v: float(jax.jit(functools.partial(LOSSES[v], cfg, "none"))(params, tokens, labels)) for v in VARIANTS}
    out["rel_diff"] = abs(out["stellax"] - out["jax"]) / abs(out["jax"])
    out["case"], out["ok"] = f"seq={seq} batch={batch}", out["rel_diff"] <= LOSS_RTOL
    return out


class Run:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.cfg, cases = PRESETS[args.preset]
        if args.cases:
            cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",") if c]
        self.cases = cases
        self.variants = [v for v in args.variants.split(",") if v]
        unknown = set(self.variants) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; expected a subset of {VARIANTS}")
        self.reps = args.reps if args.reps is not None else (2 if self.dry else 8)
        self.warmup = args.warmup if args.warmup is not None else (1 if self.dry else 2)
        self.env = environment(self.dry)
        self.device = self.env["device_kind"]
        self.peak = V5E_PEAK if self.dry else BF16_PEAK.get(self.device)
        self.date = datetime.date.today().isoformat()
        self.rows: list[dict] = []
        self.agreement: list[dict] = []
        self.out = Path(args.out)
        self.isolate = not (args.in_process or self.dry or self.env["platform"] == "cpu")

    def save(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        c = self.cfg
        model = dict(dataclasses.asdict(c), params=c.total_params(), matmul_params=c.matmul_params(),
                     precision="mixed: float32 params and AdamW moments, bfloat16 activations",
                     optimizer="clip_by_global_norm(1.0) + adamw(3e-4, b1=0.9, b2=0.95, wd=0.1)",
                     remat=self.args.remat)
        doc = {"format": "stellax-model-step", "version": 1, "environment": self.env, "preset": self.args.preset,
               "model": model, "seconds": round(elapsed(), 1), "rows": self.rows,
               "loss_agreement": self.agreement}
        self.out.write_text(json.dumps(doc, indent=1))

    def row(self, seq, batch, variant, measured: dict | None, error: str | None = None) -> dict:
        c = self.cfg
        flops = c.flops_per_step(batch, seq)
        r = {"op": "model_step", "case": f"dense {self.args.preset} seq={seq} batch={batch}", "pass": "train",
             "contender": variant, "default": variant == "stellax", "peer": variant != "stellax",
             "ms": None, "tflops": None, "pct_peak": None, "bound": "compute", "peak_hbm_bytes": None,
             "tokens_per_s": None, "mfu": None, "device": self.device, "date": self.date, "skipped": None,
             "error": error, "batch": batch, "seq": seq, "params": c.total_params(), "flops_per_step": flops,
             "remat": self.args.remat}
        if measured:
            r.update(measured)
            s = measured["ms"] * 1e-3
            r["tflops"] = flops / s / 1e12
            r["tokens_per_s"] = batch * seq / s
            if self.peak:
                r["mfu"] = flops / s / self.peak
                r["pct_peak"] = 100.0 * r["mfu"]
        self.rows.append(r)
        if error:
            print(f"  {variant:8s} ERROR {error[:300]}", flush=True)
        else:
            hbm = r["peak_hbm_bytes"]
            print(f"  {variant:8s} {r['ms']:10.2f} ms  {r['tokens_per_s']:10.0f} tok/s  {r['tflops']:7.2f} TFLOP/s  "
                  f"MFU {100 * (r['mfu'] or 0):5.1f}%  peak HBM {(hbm or 0) / 2**30:6.2f} GiB  "
                  f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}  (first call {r['compile_s']:.1f} s)  "
                  f"ops {r['stellax_ops']}", flush=True)
        return r

    def measure(self, seq, batch, variant):
        if self.isolate:
            return self.measure_child(seq, batch, variant)
        try:
            return self.row(seq, batch, variant, run_variant(self.cfg, variant, seq, batch, reps=self.reps,
                                                              warmup=self.warmup, remat=self.args.remat))
        except Exception as e:  # noqa: BLE001 - a variant that does not fit or compile is a row
            return self.row(seq, batch, variant, None, error=f"{type(e).__name__}: {e}".replace("\n", " ")[:600])

    def measure_child(self, seq, batch, variant):
        """The run in a fresh process, so the device's peak memory is this run's own."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "child.json"
            argv = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--preset", self.args.preset,
                    "--child", f"{seq}:{batch}:{variant}", "--reps", str(self.reps), "--warmup", str(self.warmup),
                    "--remat", self.args.remat]
            left = max(30.0, self.args.budget + 90 - elapsed())
            try:
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=left)
                tail = (proc.stdout + proc.stderr)[-600:].replace("\n", " ")
            except subprocess.TimeoutExpired:
                return self.row(seq, batch, variant, None, error=f"timed out after {left:.0f} s")
            if proc.returncode != 0 or not out.exists():
                return self.row(seq, batch, variant, None, error=f"child exited {proc.returncode}: {tail}")
            doc = json.loads(out.read_text())
        if doc.get("error"):
            return self.row(seq, batch, variant, None, error=doc["error"])
        return self.row(seq, batch, variant, doc["measured"])

    def main(self):
        c = self.cfg
        print(f"model step on {self.device} ({'dry run, interpreted' if self.dry else 'native'}): preset "
              f"{self.args.preset}, {c.total_params() / 1e6:.1f}M params ({c.matmul_params() / 1e6:.1f}M in matmuls), "
              f"cases {self.cases}, variants {self.variants}, reps {self.reps}, warmup {self.warmup}, "
              f"remat {self.args.remat}, {'a process per run' if self.isolate else 'in process'}", flush=True)
        if self.dry:
            for seq, batch in self.cases:
                a = forward_losses(c, seq, batch)
                self.agreement.append(a)
                print(f"  loss agreement {a['case']}: stellax {a['stellax']:.5f} jax {a['jax']:.5f} "
                      f"rel diff {a['rel_diff']:.2e} ({'ok' if a['ok'] else 'MISMATCH'})", flush=True)
        for seq, batch in self.cases:
            print(f"== seq {seq} batch {batch} ({c.flops_per_step(batch, seq) / 1e12:.2f} TFLOP per step)",
                  flush=True)
            for variant in self.variants:
                if elapsed() > self.args.budget:
                    print(f"budget of {self.args.budget:.0f} s spent: {variant} at seq {seq} not run", flush=True)
                    self.row(seq, batch, variant, None)["skipped"] = "budget"
                    continue
                self.measure(seq, batch, variant)
                self.save()
        self.step_agreement()
        self.save()
        summary(self.rows)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 1 if any(not a["ok"] for a in self.agreement) else 0

    def step_agreement(self):
        """The first step's loss (same init, same batch) of the two variants, per case."""
        for case in dict.fromkeys(r["case"] for r in self.rows):
            got = {r["contender"]: r.get("loss_first") for r in self.rows if r["case"] == case}
            if got.get("stellax") is not None and got.get("jax") is not None:
                d = abs(got["stellax"] - got["jax"]) / abs(got["jax"])
                self.agreement.append({"case": case, "stellax": got["stellax"], "jax": got["jax"], "rel_diff": d,
                                       "ok": d <= LOSS_RTOL, "what": "first train step"})


def child(args) -> int:
    seq, batch, variant = args.child.split(":")
    cfg = PRESETS[args.preset][0]
    doc = {}
    try:
        doc["measured"] = run_variant(cfg, variant, int(seq), int(batch), reps=args.reps, warmup=args.warmup,
                                      remat=args.remat)
    except Exception as e:  # noqa: BLE001 - reported by the parent as an error row
        doc["error"] = f"{type(e).__name__}: {e}".replace("\n", " ")[:600]
    Path(args.out).write_text(json.dumps(doc))
    return 0


def summary(rows):
    print("\nsummary (step ms, tokens/s, MFU; x = stellax tokens/s over plain JAX's)", flush=True)
    for case in dict.fromkeys(r["case"] for r in rows):
        by = {r["contender"]: r for r in rows if r["case"] == case}
        cells = []
        for v in VARIANTS:
            r = by.get(v)
            if r is None:
                continue
            cells.append(f"{v} " + (f"{r['ms']:.1f} ms {r['tokens_per_s']:.0f} tok/s {100 * (r['mfu'] or 0):.1f}%"
                                    if r.get("ms") else (r.get("skipped") or "error")))
        s, j = by.get("stellax"), by.get("jax")
        if s and j and s.get("ms") and j.get("ms"):
            cells.append(f"x {j['ms'] / s['ms']:.2f}")
        print(f"  {case}: " + ", ".join(cells), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    if args.dry_run:
        import stellax

        # Dispatch as on a v5e (implementation=None picks the TPU kernels), run them interpreted on the CPU.
        with stellax.lowering_target("v5e"), stellax.interpret_mode():
            return Run(args).main()
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
