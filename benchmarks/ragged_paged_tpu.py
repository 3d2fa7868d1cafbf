"""Ragged paged attention and MLA decode on a TPU: stellax's Mosaic kernels against jax's ragged kernel.

    PYTHONPATH=$PYTHONPATH:src PYTHONUNBUFFERED=1 python3 benchmarks/ragged_paged_tpu.py --out $OUT/ragged_paged.json

Cases (`CASES`; ``--cases`` takes indices into it, the default is the main
set `MAIN`, about 100 s on a v5e; ``--list`` prints them):

* ``ragged``: one serving step mixing prefills (``prefill``: pairs of new
  tokens and cache length, the new tokens being the last of the cache) with
  ``decodes`` one-token decodes at ``decode_ctx``; GQA 64 or 32 query heads
  over 8 kv heads, head dim 128, bfloat16. Contenders: `stellax.ragged_paged_attention`
  on its Mosaic TPU kernel with its own config, then explicit
  ``(pages_per_block, block_q, split_heads)`` (``split_heads``: one kv head per
  matmul instead of a head group's masked 8-times wider one; the prefill
  fix to measure, `configs.TpuRaggedConfig`); jax's ``ragged_paged_attention`` (pages
  interleaved ``[pages, page_size, 2K, H]``) with its tuned block sizes and
  explicit ``num_kv_pages_per_block`` / ``num_queries_per_block``, all with a
  100 MiB VMEM limit.
* ``mla``: `stellax.mla_decode` (DeepSeek-V3 shapes: 128 heads, latent 512 +
  rope 64, pages of 64) with its own config and explicit ``pages_per_block``
  (no jax peer; ``--xla`` adds the op's XLA path).

Rows as `paged_decode_tpu` (the suite's results schema, plus ``config``,
``max_rel_err``, ``rel_l2``, ``compile_s``) and ``tflops`` (the causal
attention FLOPs actually needed: ``2 · N · (H + Hv)`` per visible query-key
pair). ``gbps`` / ``pct_peak`` count the op's byte model (the pages each
sequence reads once, q and the output). The golden (the ops' float32
references) is computed for the checked sequences only — every prefill and
the first two decodes — the prefills in chunks of 256 query tokens (as
multi-token decodes over the cache truncated at the chunk's end: the same
causal rows); the checked decodes' free slots hold NaN.

``--dry-run``: the CPU, interpreted kernels, tiny shapes (jax's ragged kernel
does not interpret on jax 0.10.2: its rows are errors there).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

from stellax.bench import chip_run
import jax
import jax.numpy as jnp
import numpy as np
from stellax.bench.chip_run import elapsed, mark_best
from paged_decode_tpu import (
    REPS,
    WARMUP,
    Timed,
    interleaved,
    jax_ragged_contenders,
    poison_free_slots,
    summary,
)

KV_HEADS, HEAD_DIM = 8, 128
#: Query tokens per golden chunk of a prefill.
GOLDEN_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class Ragged:
    """A mixed step: ``prefill`` ``(new tokens, cache length)`` pairs, then ``decodes`` decodes at
    ``decode_ctx``; ``configs``: explicit stellax ``(keys per block, block_q, split_heads)``;
    ``jax_blocks``: jax's ``(kv tokens per block, queries per block)``."""

    prefill: tuple
    decodes: int
    decode_ctx: int
    page_size: int = 16
    q_heads: int = 64
    configs: tuple = ((256, 8, False), (512, 16, True), (256, 32, True))
    jax_blocks: tuple = ((256, 32), (512, 64))

    def label(self, kv_heads=KV_HEADS, head_dim=HEAD_DIM) -> str:
        pre = "+".join(f"{q}@{kv}" for q, kv in self.prefill)
        return (f"ragged prefill {pre} + {self.decodes} decodes@{self.decode_ctx} K={kv_heads} N={self.q_heads} "
                f"H={head_dim} page={self.page_size}")

    @property
    def q_lens(self):
        return [q for q, _ in self.prefill] + [1] * self.decodes

    @property
    def kv_lens(self):
        return [kv for _, kv in self.prefill] + [self.decode_ctx] * self.decodes


@dataclasses.dataclass(frozen=True)
class Mla:
    """MLA decode: ``batch`` rows at ``context``; ``tokens``: explicit keys per block."""

    batch: int
    context: int
    page_size: int = 64
    heads: int = 128
    latent: int = 512
    rope: int = 64
    tokens: tuple = (512, 2048)

    def label(self, *_) -> str:
        return (f"mla B={self.batch} ctx={self.context} N={self.heads} R={self.latent} P={self.rope} "
                f"page={self.page_size}")


CASES = [
    # 0 the suite's mixed batch (issue 41: 93.5 ms; 52 ms with the shipped v5e config, 16 pages x
    #   block_q 8 unsplit, the first explicit config here; its pool size differs from the suite's, so
    #   the default row is the heuristic's, split)
    Ragged(((512, 512), (1024, 4096), (2048, 8192)), 60, 8192),
    Mla(64, 4096),                                                       # 1 MLA at batch 64
    Ragged(((2048, 2048),) * 4, 16, 4096),                               # 2 prefill-heavy
    Ragged(((512, 8192), (1024, 8192)), 62, 8192, q_heads=32),           # 3 decode-heavy, long caches, 32q/8kv
    Mla(8, 32768),                                                       # 4
    Ragged(((512, 512), (1024, 2048), (2048, 4096)), 60, 4096),          # 5 the same, smaller caches (heuristic)
    Mla(64, 32768, tokens=(1024,)),                                      # 6 MLA at batch 64, 32k (2.4 GB latent)
]
MAIN = (0, 1, 2)                      # in this order; ``--budget`` stops starting cases past 90 s
DRY_CASES = [Ragged(((40, 64), (8, 24)), 3, 40, q_heads=16, configs=((32, 8, True),), jax_blocks=((32, 8),)),
             Mla(2, 64, page_size=16, heads=16, latent=128, rope=32, tokens=(32,))]
DRY_SHAPE = (8, 128)                  # kv heads, head dim of the dry run (8: split_heads applies)


def parse_args(argv=None):
    p = chip_run.parser(__doc__.splitlines()[0], reps=REPS, warmup=WARMUP, budget=90.0)
    p.add_argument("--no-peers", action="store_true", help="only stellax's contenders")
    p.add_argument("--xla", action="store_true", help="time the ops' XLA paths too")
    p.add_argument("--list", action="store_true", help="print the cases (index, label, main set) and exit")
    return p.parse_args(argv)


# -- inputs ----------------------------------------------------------------------------------
def shuffled_tables(rng, lengths, page_size: int):
    """``(tables [S, width], num_pages)``: each sequence's pages shuffled over the pool, the
    table's full width allocated per sequence."""
    width = max(1, -(-int(max(lengths)) // page_size))
    num_pages = len(lengths) * width
    return jnp.asarray(rng.permutation(num_pages).reshape(len(lengths), width).astype(np.int32)), num_pages


def ragged_inputs(seed: int, case: Ragged, kv_heads: int, head_dim: int, dtype):
    """``(q [T, N, H], k_pages, v_pages, kv_lens, tables, cu_q_lens, num_seqs)`` (made on the
    device); the checked decodes' free slots hold NaN."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.asarray(case.q_lens, np.int32), np.asarray(case.kv_lens, np.int32)
    tables, num_pages = shuffled_tables(rng, kv_lens, case.page_size)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (num_pages, case.page_size, kv_heads, head_dim)
    make = jax.jit(lambda key: jax.random.normal(key, shape, dtype))
    q = jax.random.normal(kq, (int(q_lens.sum()), case.q_heads, head_dim), dtype)
    lens = jnp.asarray(kv_lens)
    n_pre = len(case.prefill)
    rows = slice(n_pre, n_pre + 2)
    k = poison_free_slots(make(kk), tables[rows], lens[rows], 2)
    v = poison_free_slots(make(kv), tables[rows], lens[rows], 2)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    return q, k, v, lens, tables, cu, jnp.asarray([len(q_lens)], jnp.int32)


def checked_sequences(case: Ragged) -> list[int]:
    """Every prefill and the first two decodes."""
    n = len(case.prefill)
    return list(range(min(len(case.q_lens), n + 2)))


def ragged_golden(args, seqs):
    """``(token indices, float32 reference rows)`` of sequences ``seqs``: each prefill in
    chunks of `GOLDEN_CHUNK` query tokens, a chunk being a multi-token decode over the cache
    truncated at its last token (`paged_attention`'s reference, the same causal rows)."""
    from stellax.ops.paged_attention import paged_attention_op

    q, k, v, kv_lens, tables, cu, _ = args
    ref = jax.jit(paged_attention_op.reference)
    cu_h, kv_h = np.asarray(cu), np.asarray(kv_lens)
    idx, outs = [], []
    for s in seqs:
        start, q_len, kv_len = int(cu_h[s]), int(cu_h[s + 1] - cu_h[s]), int(kv_h[s])
        for a in range(0, q_len, GOLDEN_CHUNK):
            n = min(GOLDEN_CHUNK, q_len - a)
            end = kv_len - q_len + a + n                     # the chunk's last token's cache length
            qc = q[start + a:start + a + n][None]           # [1, n, N, H]
            out = ref(qc, k, v, tables[s:s + 1], jnp.asarray([end], jnp.int32))
            outs.append(out[0].astype(jnp.float32))
            idx.extend(range(start + a, start + a + n))
    return np.asarray(idx), jnp.concatenate(outs, axis=0)


def causal_flops(case: Ragged, head_dim: int) -> float:
    """``2 · N · (H + Hv)`` FLOPs per visible (query, key) pair of the step."""
    pairs = 0
    for q_len, kv_len in zip(case.q_lens, case.kv_lens):
        first = kv_len - q_len + 1                            # keys the first new token sees
        pairs += q_len * first + q_len * (q_len - 1) // 2
    return 2.0 * case.q_heads * 2 * head_dim * pairs


def mla_inputs(seed: int, case: Mla, dtype):
    """``(q_nope [B, N, R], q_pe [B, N, P], latent [pages, PS, R], pe [pages, PS, P], tables, lengths)``;
    the first two rows are one page short of the context with NaN in the free slots."""
    rng = np.random.default_rng(seed)
    lengths = np.full((case.batch,), case.context, np.int32)
    lengths[:2] = max(1, case.context - case.page_size // 2 - case.page_size)
    tables, num_pages = shuffled_tables(rng, [case.context] * case.batch, case.page_size)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    lens = jnp.asarray(lengths)

    def pool(key, dim):
        x = jax.jit(lambda key: jax.random.normal(key, (num_pages, case.page_size, 1, dim), dtype))(key)
        return poison_free_slots(x, tables, lens, 2)[:, :, 0]

    q_nope = jax.random.normal(k1, (case.batch, case.heads, case.latent), dtype)
    q_pe = jax.random.normal(k2, (case.batch, case.heads, case.rope), dtype)
    return q_nope, q_pe, pool(k3, case.latent), pool(k4, case.rope), tables, lens


# -- the run ---------------------------------------------------------------------------------------
class Run(Timed):
    op = "ragged_paged_attention"

    def __init__(self, args):
        super().__init__(args, "stellax-ragged-paged-tpu")

    def run_ragged(self, seed, case: Ragged, kv_heads, head_dim):
        from stellax.ops.paged_attention import (
            TpuRaggedConfig,
            ragged_paged_attention,
            ragged_paged_attention_op,
        )

        label = case.label(kv_heads, head_dim)
        print(f"== {label}", flush=True)
        args = ragged_inputs(seed, case, kv_heads, head_dim, jnp.bfloat16)
        call = ragged_paged_attention_op.check(*args)
        nbytes = float(ragged_paged_attention_op.bytes_accessed(call))
        flops = causal_flops(case, head_dim)
        picked = self.default_implementation(ragged_paged_attention_op, call)
        idx, ref = ragged_golden(args, checked_sequences(case))
        pick = lambda out: out[idx]
        mosaic = functools.partial(ragged_paged_attention, implementation="mosaic_tpu")
        contenders = [("default", jax.jit(mosaic), True)]
        for tokens, bq, split in case.configs:
            cfg = TpuRaggedConfig(pages_per_block=max(1, tokens // case.page_size), block_q=bq, split_heads=split)
            contenders.append((f"pages_per_block={cfg.pages_per_block},block_q={bq}"
                               + (",split_heads" if split else ""),
                               jax.jit(functools.partial(mosaic, config=cfg)), False))
        if self.args.xla:
            contenders.append(("xla", jax.jit(functools.partial(ragged_paged_attention, implementation="xla")),
                               True))
        for config, fn, is_default in contenders:
            impl = "xla" if config == "xla" else "mosaic_tpu"
            self.measure(label, f"stellax:{impl}", "default" if config == "xla" else config, fn, args, ref, nbytes,
                         default=bool(is_default and picked == impl), peer=False, pick=pick, flops=flops)
        if not self.args.no_peers:
            q, k, v, kv_lens, tables, cu, num = args
            try:
                kv = interleaved(k, v)
            except Exception as e:  # noqa: BLE001
                self.row(label, "jax:ragged_paged_attention", "layout", default=False, peer=True,
                         error=str(e)[:400])
                return
            timed = [self.measure(label, c, cfg, fn, (q, kv, kv_lens, tables, cu, num), ref, nbytes, default=False,
                                  peer=True, pick=pick, flops=flops)
                     for c, cfg, fn in jax_ragged_contenders(tables.shape[1], case.page_size, head_dim,
                                                             case.jax_blocks, self.dry)]
            mark_best(timed)
            del kv

    def run_mla(self, seed, case: Mla):
        from stellax.ops.paged_attention import TpuMlaConfig, mla_decode, mla_decode_op

        label = case.label()
        print(f"== {label}", flush=True)
        args = mla_inputs(seed, case, jnp.bfloat16)
        scale = float((case.latent + case.rope) ** -0.5)
        call = mla_decode_op.check(*args, scale=scale)
        nbytes = float(mla_decode_op.bytes_accessed(call))
        flops = float(mla_decode_op.flops(call))
        picked = self.default_implementation(mla_decode_op, call)
        q_nope, q_pe, latent, pe, tables, lengths = args
        ref = jax.jit(functools.partial(mla_decode_op.reference, scale=scale))(
            q_nope[:2], q_pe[:2], latent, pe, tables[:2], lengths[:2]).astype(jnp.float32)
        mosaic = functools.partial(mla_decode, scale=scale, implementation="mosaic_tpu")
        contenders = [("stellax:mosaic_tpu", "default", jax.jit(mosaic), True)]
        for tokens in case.tokens:
            ppb = max(1, tokens // case.page_size)
            if ppb <= tables.shape[1]:
                contenders.append(("stellax:mosaic_tpu", f"pages_per_block={ppb}",
                                   jax.jit(functools.partial(mosaic, config=TpuMlaConfig(pages_per_block=ppb))),
                                   False))
        if self.args.xla:
            contenders.append(("stellax:xla", "default",
                               jax.jit(functools.partial(mla_decode, scale=scale, implementation="xla")), True))
        for contender, config, fn, is_default in contenders:
            self.measure(label, contender, config, fn, args, ref, nbytes, op="mla_decode", flops=flops,
                         default=bool(is_default and picked == contender.split(":", 1)[1]), peer=False)

    def main(self):
        cases = DRY_CASES if self.dry else CASES
        kv_heads, head_dim = DRY_SHAPE if self.dry else (KV_HEADS, HEAD_DIM)
        picked = self.picked_cases(len(cases), MAIN)
        print(f"ragged paged / MLA on {self.device} ({'dry run, interpreted' if self.dry else 'native'}), "
              f"cases {picked}, reps {self.reps}, warmup {self.warmup}", flush=True)
        def run_one(i):
            if isinstance(cases[i], Mla):
                self.run_mla(i, cases[i])
            else:
                self.run_ragged(i, cases[i], kv_heads, head_dim)

        self.run_cases(picked, run_one)
        summary(self.rows)
        for r in self.rows:
            if r.get("tflops") is not None and r["error"] is None:
                print(f"  {r['case'][:60]:60s} {r['contender']:28s} {r['config']:44s} {r['tflops']:6.1f} TFLOP/s",
                      flush=True)
        print(f"done in {elapsed():.0f} s: {len(self.rows)} rows in {self.out}", flush=True)
        return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        return chip_run.list_cases(CASES, MAIN)
    return chip_run.run(Run, args, tpu_interpret=True)


if __name__ == "__main__":
    sys.exit(main())
