"""The STELLAX vLLM backend's attention call for one decode step, timed alone.

    python benchmarks/vllm_attention_step.py     # in the vLLM venv or stellax's own (needs torch)

The throughput run's shapes (benchmarks/vllm_offline.py --throughput): a
64 MiB float32 cache of 2,048 pages of 32 tokens x 2 kv heads x 32 dims,
32 requests decoding at 60 cached tokens, 4 query heads; padded as the
backend pads (`build_metadata`). Prints median milliseconds of: the
`stellax.torch.ragged_paged_attention` custom op (what the backend calls), the
same op jitted in JAX alone, the DLPack imports of its inputs, the in-place
cache write and the metadata build.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import torch

import stellax
import stellax.torch as st
from stellax.integrations.vllm.metadata import build_metadata
from stellax.torch import bridge

PAGES, PAGE, KV_HEADS, DIM, HEADS, REQUESTS, CACHED = 2048, 32, 2, 32, 4, 32, 60


def median_ms(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    torch.manual_seed(0)
    pages = torch.randn(PAGES, PAGE, 2, KV_HEADS, DIM)
    table = torch.arange(REQUESTS * 16, dtype=torch.int32).reshape(REQUESTS, 16)
    meta = lambda: build_metadata(
        query_start_loc=torch.arange(REQUESTS + 1, dtype=torch.int32),
        seq_lens=torch.full((REQUESTS,), CACHED, dtype=torch.int32), block_table=table,
        slot_mapping=torch.arange(REQUESTS), num_reqs=REQUESTS, num_actual_tokens=REQUESTS)
    m = meta()
    q = torch.randn(m.padded_tokens, HEADS, DIM)
    inputs = (q, pages, m.kv_lens, m.block_tables, m.cu_q_lens, m.num_seqs)
    op = lambda: st.ragged_paged_attention(q, pages, None, m.kv_lens, m.block_tables, m.cu_q_lens, m.num_seqs,
                                           scale=DIM ** -0.5)
    arrays = [bridge.to_jax(t) for t in inputs]
    jitted = jax.jit(lambda q, p, kv, bt, cu, ns: stellax.ragged_paged_attention(q, p, None, kv, bt, cu, ns,
                                                                                  scale=DIM ** -0.5))
    new = torch.randn(REQUESTS, KV_HEADS, DIM)
    rows = {
        "stellax::ragged_paged_attention (the backend's call)": op,
        "the same op jitted in JAX alone": lambda: jitted(*arrays).block_until_ready(),
        "DLPack imports of its six inputs": lambda: [bridge.to_jax(t) for t in inputs],
        "update_kv_cache_ (in-place cache write)": lambda: st.update_kv_cache_(
            pages[:, :, 0], pages[:, :, 1], new, new, torch.arange(REQUESTS)),
        "build_metadata": meta,
    }
    for name, fn in rows.items():
        print(f"{name:55s} {median_ms(fn):8.3f} ms")


if __name__ == "__main__":
    main()
