"""Built-in calls of the attention ops: examples for `stellax check`,
benchmark shapes for `stellax bench attention`, and peer implementations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example, UnsupportedError, tokamax_peer
from .masks import MaskSpec, default_positions
from .reference import attention_forward_reference


def _qkv(seed, b, t, s, n, k, h, hv, dtype):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (b, t, n, h), jnp.float32).astype(dtype)
    key = jax.random.normal(kk, (b, s, k, h), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, k, hv), jnp.float32).astype(dtype)
    return q, key, v


def forward_examples(dtype):
    out = []
    q, k, v = _qkv(0, 2, 128, 128, 4, 2, 64, 64, dtype)
    out.append(Example("B=2 T=S=128 N=4 K=2 H=64 causal", (q, k, v), {"is_causal": True}))
    q, k, v = _qkv(1, 1, 17, 129, 8, 2, 80, 80, dtype)
    out.append(Example("T=17 S=129 GQA4 H=80 causal window(32,0)", (q, k, v),
                       {"is_causal": True, "local_window_size": (32, 0)}))
    q, k, v = _qkv(2, 1, 96, 96, 4, 1, 32, 48, dtype)
    sinks = jax.random.normal(jax.random.PRNGKey(3), (4,), jnp.float32).astype(dtype)
    out.append(Example("T=S=96 MQA H=32 Hv=48 chunk=32 softcap sinks", (q, k, v),
                       {"chunk_size": 32, "logits_soft_cap": 5.0, "sinks": sinks}))
    q, k, v = _qkv(4, 2, 64, 80, 2, 2, 64, 64, dtype)
    bias = jax.random.normal(jax.random.PRNGKey(5), (2, 1, 64, 80), jnp.float32).astype(dtype)
    mask = jax.random.bernoulli(jax.random.PRNGKey(6), 0.8, (1, 2, 64, 80))
    out.append(Example("T=64 S=80 bias[B,1,T,S] mask[1,N,T,S]", (q, k, v, bias, mask), {}))
    q, k, v = _qkv(7, 2, 100, 100, 2, 2, 64, 64, dtype)
    seg = jnp.asarray(np.repeat(np.array([[0, 1, 2, 3], [0, 0, 1, 1]]), 25, axis=1), jnp.int32)
    out.append(Example("T=S=100 segments + kv lengths", (q, k, v),
                       {"q_segment_ids": seg, "kv_segment_ids": seg,
                        "key_value_seq_lengths": jnp.array([90, 70], jnp.int32)}))
    return out


def backward_examples(dtype):
    out = []
    cases = (
        ("T=S=64 GQA2 causal", 0, 1, 64, 64, 4, 2, 64, 64, MaskSpec(causal=True), False, False),
        ("T=33 S=70 window(16,4) bias sinks", 1, 2, 33, 70, 2, 1, 32, 48,
         MaskSpec(window_left=16, window_right=4), True, True),
    )
    for label, seed, b, t, s, n, k, h, hv, spec, with_bias, with_sinks in cases:
        q, key, v = _qkv(seed, b, t, s, n, k, h, hv, dtype)
        bias = (0.5 * jax.random.normal(jax.random.PRNGKey(seed + 10), (b, n, t, s))).astype(dtype) \
            if with_bias else None
        sinks = jax.random.normal(jax.random.PRNGKey(seed + 11), (n,)).astype(dtype) if with_sinks else None
        q_pos, kv_pos = default_positions(t, s)
        statics = dict(spec=spec, scale=float(1.0 / np.sqrt(h)), logits_soft_cap=None)
        # o/lse at float32 precision explicitly: at a TPU's default precision they would be bf16-accurate,
        # inconsistent with q/k/v, and the float32 backward check would fail on the example itself
        o, lse = attention_forward_reference(q, key, v, bias, None, sinks, q_pos, kv_pos, None, None, **statics,
                                             precision=jax.lax.Precision.HIGHEST)
        d_out = jax.random.normal(jax.random.PRNGKey(seed + 12), o.shape).astype(dtype)
        out.append(Example(label, (q, key, v, bias, None, sinks, o, lse, d_out, None, q_pos, kv_pos), statics))
    return out


def benchmarks(platform):
    """Benchmark calls: the CPU reference shape of the issue on a CPU; on a GPU
    bf16 at hd 64/128/256, T = 4k–16k, causal and not."""
    out = []
    if platform.backend == "cpu":
        for t, causal in ((2048, True), (2048, False), (4096, True)):
            q, k, v = _qkv(0, 1, t, t, 8, 8, 64, 64, jnp.float32)
            out.append(Example(f"B=1 T=S={t} N=8 H=64 f32 {'causal' if causal else 'full'}", (q, k, v),
                               {"is_causal": causal}))
        return out
    # The headline (FlashAttention-3 class target: bf16, hd 128, 16k, non-causal) first: the GPU
    # suite times the first few shapes.
    cases = [(128, 16384, False), (128, 16384, True), (64, 8192, False), (256, 8192, False)]
    cases += [(h, t, c) for h in (64, 128, 256) for t in (4096, 8192, 16384) for c in (False, True)
              if (h, t, c) not in cases]
    for h, t, causal in cases:
        n = 2048 // h
        q, k, v = _qkv(0, 1, t, t, n, n, h, h, jnp.bfloat16)
        out.append(Example(f"bf16 B=1 T=S={t} N={n} H={h} {'causal' if causal else 'full'}", (q, k, v),
                           {"is_causal": causal}))
    return out


_JAX_NN_OPTIONS = {"scale", "is_causal", "local_window_size", "query_seq_lengths", "key_value_seq_lengths"}


def _jax_nn_peer(implementation):
    def peer(query, key, value, bias=None, mask=None, **kwargs):
        unsupported = {k for k, v in kwargs.items() if v is not None and v is not False} - _JAX_NN_OPTIONS
        if unsupported:
            raise UnsupportedError(f"jax.nn.dot_product_attention has no {sorted(unsupported)}")
        if (kwargs.get("is_causal") or kwargs.get("local_window_size") is not None) and \
                query.shape[-3] != key.shape[-3]:
            raise UnsupportedError("jax.nn.dot_product_attention aligns causal/window masks top-left when T != S")
        return jax.nn.dot_product_attention(query, key, value, bias, mask, implementation=implementation,
                                            **{k: v for k, v in kwargs.items() if k in _JAX_NN_OPTIONS})
    return peer


def _tokamax_peer():
    try:
        tokamax_peer.load()
    except Exception:  # noqa: BLE001 - tokamax or one of its dependencies: no peer
        return None

    def peer(query, key, value, bias=None, mask=None, is_causal=False, scale=None, **kwargs):
        if any(v is not None and v is not False for v in kwargs.values()):
            raise UnsupportedError("tokamax peer: only bias/mask/is_causal/scale are forwarded")
        tokamax = tokamax_peer.load()
        return tokamax.dot_product_attention(query, key, value, bias=bias, mask=mask, is_causal=is_causal,
                                             scale=scale)
    return peer


def peers():
    table = {"jax.nn (xla)": _jax_nn_peer("xla"), "jax.nn (cudnn)": _jax_nn_peer("cudnn")}
    tokamax_peer = _tokamax_peer()
    if tokamax_peer is not None:
        table["tokamax"] = tokamax_peer
    return table
