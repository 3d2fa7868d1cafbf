"""``TpuRaggedConfig.split_heads``: the ragged Mosaic TPU kernel taking one kv head at a
time (its ``[T, H]`` rows read out of the slot) instead of a head group's keys as one
matrix with the logits masked to each row's head — for prefill programs, where that
group's 8-times wider softmax and matmuls dominate (issue 41's mixed batch).

Interpreted numerics against the golden (mixed decodes / prefills / chunked prefills,
GQA, soft cap, window, sinks, bf16 and float32, every slot past a length holding NaN),
the configs' eligibility and space, Mosaic ``tpu`` lowering, and (tpu tier) the largest
split block of the v5e space compiling with the real compiler."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import lowering_target
from stellax.ops.paged_attention import KVQuant, ragged_inputs, ragged_paged_attention, ragged_paged_attention_op
from stellax.ops.paged_attention import configs
from stellax.ops.paged_attention.configs import TpuRaggedConfig
from stellax.testing import assert_close

MIXED = dict(q_lens=[1, 7, 1, 12, 3], kv_lens=[9, 7, 40, 30, 3])


def _poisoned(pages, tables, lengths):
    """``pages`` with every slot past each sequence's length (and every unreferenced page) NaN."""
    x = np.array(pages, dtype=np.float32)
    live = np.zeros(x.shape[:2], bool)
    ps = x.shape[1]
    for row, n in zip(np.asarray(tables), np.asarray(lengths)):
        for j, page in enumerate(row):
            live[page, :max(0, min(ps, int(n) - j * ps))] = True
    x[~live] = np.nan
    return jnp.asarray(x, pages.dtype)


def _mixed(dtype, kv_heads=8, q_heads=16, head_dim=128, page_size=8):
    q, k, v, kv_lens, t, cu, n = ragged_inputs(3, **MIXED, page_size=page_size, kv_heads=kv_heads, q_heads=q_heads,
                                               head_dim=head_dim, dtype=dtype, padding_seqs=1, padding_tokens=2)
    return q, _poisoned(k, t, kv_lens), _poisoned(v, t, kv_lens), kv_lens, t, cu, n


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_heads_matches_golden_and_grouped(dtype):
    args = _mixed(dtype)
    kw = dict(local_window_size=12, logits_soft_cap=5.0, sinks=jnp.linspace(-1, 1, 16))
    ref = jax.jit(functools.partial(ragged_paged_attention_op.reference, **kw))(*args)
    with stellax.interpret_mode():
        split = ragged_paged_attention(*args, implementation="mosaic_tpu",
                                       config=TpuRaggedConfig(pages_per_block=2, block_q=8, split_heads=True), **kw)
        grouped = ragged_paged_attention(*args, implementation="mosaic_tpu",
                                         config=TpuRaggedConfig(pages_per_block=2, block_q=8), **kw)
    assert np.all(np.isfinite(np.asarray(split, np.float32))), "a NaN slot leaked"
    assert_close(split, ref)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(split, np.float32), np.asarray(grouped, np.float32), rtol=tol, atol=tol)
    total = int(args[5][int(args[6][0])])
    assert np.all(np.asarray(split[total:]) == 0), "tokens past cu_q_lens[num_seqs] must be zeros"


def test_split_heads_eligibility_and_space():
    args = _mixed(jnp.bfloat16)
    call = ragged_paged_attention_op.check(*args)
    assert configs.can_split_heads(call)
    assert configs.kernel_head_group(8, True) == 1 and configs.kernel_head_group(8) == 8
    assert configs.kernel_head_group(4, True) == 4          # token-major pools have no head axis to index
    # The VMEM model charges the split's per-head rows, not the group's hg-times wider logits.
    wide = configs.paged_tpu_vmem(call, "ragged", TpuRaggedConfig(pages_per_block=2, block_q=8))
    split = configs.paged_tpu_vmem(call, "ragged", TpuRaggedConfig(pages_per_block=2, block_q=8, split_heads=True))
    assert split != wide
    # A small call (decodes) does not try it; a prefill-sized one does.
    assert not any(c.split_heads for c in configs.ragged_tpu_space(call))
    big = ragged_inputs(0, q_lens=[1, 300], kv_lens=[40, 300], page_size=16, kv_heads=8, q_heads=32, head_dim=128,
                        dtype=jnp.bfloat16)
    with lowering_target("v5e"):
        space = configs.ragged_tpu_space(ragged_paged_attention_op.check(*big))
    assert any(c.split_heads for c in space) and any(not c.split_heads for c in space)
    # The heuristic splits prefill-sized calls with >= 32 rows per kv head, not
    # the small (decode-sized) call.
    with lowering_target("v5e"):
        picked = configs.ragged_tpu_heuristic(ragged_paged_attention_op.check(*big))
        assert picked.split_heads and picked.block_q == 16          # 64 rows per kv head (G = 4)
        assert configs.paged_tpu_vmem(ragged_paged_attention_op.check(*big), "ragged", picked) <= 16 * 2**20
        assert not configs.ragged_tpu_heuristic(call).split_heads
    # Quantized or small-head pools cannot split.
    q8 = ragged_inputs(0, **MIXED, page_size=16, kv_heads=8, q_heads=16, head_dim=128, dtype=jnp.bfloat16,
                       quant=KVQuant("int8"))
    assert not configs.can_split_heads(ragged_paged_attention_op.check(*q8))
    two = ragged_inputs(0, **MIXED, page_size=16, kv_heads=2, q_heads=4, head_dim=128, dtype=jnp.bfloat16)
    assert not configs.can_split_heads(ragged_paged_attention_op.check(*two))
    with pytest.raises(ValueError, match="split_heads"):
        TpuRaggedConfig(split_heads=2)


def test_split_heads_lowers_for_tpu():
    from stellax.testing.lowering import lower_config

    args = ragged_inputs(1, q_lens=[1, 64, 200], kv_lens=[300, 64, 400], page_size=16, kv_heads=8, q_heads=64,
                         head_dim=128, dtype=jnp.bfloat16)
    for cfg in (TpuRaggedConfig(pages_per_block=16, block_q=8, split_heads=True),
                TpuRaggedConfig(pages_per_block=8, block_q=32, split_heads=True)):
        (lowered,) = lower_config(ragged_paged_attention_op, "mosaic_tpu", args, config=cfg, platform="tpu",
                                  target="v5e")
        assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.tpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_largest_split_block_compiles(generation):
    """The VMEM model's edge for split heads: the largest split config of the space on a
    prefill-heavy bf16 call (64q/8kv, head dim 128) compiles with the real compiler."""
    from stellax.testing.tpu_compile import compile_config, libtpu_available

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    args = ragged_inputs(2, q_lens=[1, 512, 1], kv_lens=[2048, 1024, 700], page_size=16, kv_heads=8, q_heads=64,
                         head_dim=128, dtype=jnp.bfloat16)
    with lowering_target(generation):
        space = [c for c in configs.ragged_tpu_space(ragged_paged_attention_op.check(*args)) if c.split_heads]
    assert space
    cfg = max(space, key=lambda c: (c.pages_per_block * c.block_q, c.pages_per_block))
    result = compile_config(ragged_paged_attention_op, "mosaic_tpu", args, generation=generation, config=cfg)
    assert result.ok, result.describe()
