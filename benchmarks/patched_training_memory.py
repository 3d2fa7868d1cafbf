"""Peak memory of one training step of a Llama-shaped model, with and without
stellax's fused linear cross-entropy (`stellax.torch.apply_kernels`).

Each variant runs in its own process: build the model, run two warm-up steps
(compiles), then sample the process's resident set every millisecond during a
third step; the number reported is the step's peak RSS above the RSS before
it (the step's transient memory: activations, logits, gradients, XLA buffers).

    python benchmarks/patched_training_memory.py            # prints a Markdown table
    python benchmarks/patched_training_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

VARIANTS = {
    "transformers (sdpa, logits + cross_entropy)": {},
    "stellax kernels, transformers loss": {"loss": False},
    "stellax kernels + fused linear_cross_entropy": {"loss": True},
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(variant: str, batch: int, seq: int, vocab: int, hidden: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=seq, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    options = VARIANTS[variant]
    if options:
        import stellax.torch as st

        st.apply_kernels(model, loss=options["loss"])
    ids = torch.randint(0, vocab, (batch, seq))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=False)  # gradient buffers stay allocated: not part of the transient
        return loss.item()

    step()
    step()
    before, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak[0] = max(peak[0], _rss())
    return {"variant": variant, "peak_step_mib": (peak[0] - before) / 2**20, "step_s": seconds, "loss": loss,
            "logits_mib": batch * seq * vocab * 4 / 2**20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.child, args.batch, args.seq, args.vocab, args.hidden)))
        return 0
    rows = []
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--child", variant, "--batch", str(args.batch), "--seq", str(args.seq),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                             env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"Llama, 2 layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq {args.seq} "
          f"(float32 logits would be {rows[0]['logits_mib']:.0f} MiB)\n")
    print("| variant | peak step memory (MiB above the step's start) | step time (s) | loss |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_step_mib']:.0f} | {r['step_s']:.2f} | {r['loss']:.4f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
