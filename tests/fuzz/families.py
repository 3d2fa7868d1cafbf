"""Hypothesis strategies of bad and edge-case calls, one per family.

Each draws a base call (small shapes from a fixed pool, so compiled programs
are reused), then either keeps it good (judged against a NumPy reference in
float64, or a documented contract) or applies one mutation whose error must
name the argument it breaks.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .harness import Case


def _rng(seed):
    return np.random.default_rng(seed)


def _jnp():
    import jax.numpy as jnp
    return jnp


# -- NumPy references ---------------------------------------------------------------
def np_norm(x, scale, offset, eps, subtract_mean):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True) if subtract_mean else 0.0
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) if x.shape[-1] else x
    if scale is not None:
        y = y * scale
    if offset is not None:
        y = y + offset
    return y


def np_attention(q, k, v, causal, scale=None):
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = h ** -0.5 if scale is None else scale
    out = np.zeros((b, t, n, v.shape[-1]))
    for bi in range(b):
        for ni in range(n):
            s = q[bi, :, ni] @ k[bi, :, ni // g].T * scale
            if causal:
                qi = np.arange(t)[:, None] + (s_len - t)
                s = np.where(np.arange(s_len)[None, :] <= qi, s, -np.inf)
            m = np.max(s, axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            den = p.sum(-1, keepdims=True)
            out[bi, :, ni] = np.where(den > 0, (p @ v[bi, :, ni // g]) / np.where(den > 0, den, 1), 0.0)
    return out


def np_ragged_dot(lhs, rhs, sizes):
    out = np.zeros((lhs.shape[0], rhs.shape[-1]))
    start = 0
    for gi, n in enumerate(sizes):
        out[start:start + n] = lhs[start:start + n].astype(np.float64) @ rhs[gi].astype(np.float64)
        start += n
    return out


def np_paged(q, kp, vp, tables, lengths):
    b, n, h = q.shape
    kh = kp.shape[2]
    ps = kp.shape[1]
    out = np.zeros((b, n, vp.shape[-1]))
    for bi in range(b):
        L = int(lengths[bi])
        if L == 0:
            continue
        pos = np.arange(L)
        keys = kp[tables[bi, pos // ps], pos % ps].astype(np.float64)       # [L, K, H]
        vals = vp[tables[bi, pos // ps], pos % ps].astype(np.float64)
        for ni in range(n):
            s = keys[:, ni // (n // kh)] @ q[bi, ni].astype(np.float64) * h ** -0.5
            p = np.exp(s - s.max())
            out[bi, ni] = p @ vals[:, ni // (n // kh)] / p.sum()
    return out


def np_gated_delta(q, k, v, g, beta, scale):
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    o = np.zeros((b, t, h, vd))
    for bi in range(b):
        for hi in range(h):
            S = np.zeros((kd, vd))
            for ti in range(t):
                S = np.exp(g[bi, ti, hi]) * S
                kk, vv = k[bi, ti, hi].astype(np.float64), v[bi, ti, hi].astype(np.float64)
                S = S + np.outer(kk, beta[bi, ti, hi] * (vv - S.T @ kk))
                o[bi, ti, hi] = S.T @ (scale * q[bi, ti, hi].astype(np.float64))
    return o


# -- norm --------------------------------------------------------------------------------
NORM_SHAPES = [(3, 8), (2, 3, 16), (0, 8), (3, 0), (1, 1)]


@st.composite
def norm_cases(draw):
    import stellax
    jnp = _jnp()
    shape = draw(st.sampled_from(NORM_SHAPES))
    mag = draw(st.sampled_from([1.0, 1e-30, 1e30, 3e38]))
    rms = draw(st.booleans())
    rng = _rng(draw(st.integers(0, 2**16)))
    x = np.clip(rng.standard_normal(shape) * mag, -3.4e38, 3.4e38).astype(np.float32)
    d = shape[-1]
    scale = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    offset = None if rms else (0.1 * rng.standard_normal(d)).astype(np.float32)
    as_np = draw(st.booleans())
    xa = x if as_np else jnp.asarray(x)
    mutation = draw(st.sampled_from(["good", "good", "good", "x_dtype", "scale_shape", "axis", "residual_shape",
                                     "scale_dtype", "x_list"]))
    fn = stellax.rms_norm if rms else stellax.layer_norm
    kw = {} if rms else {"offset": offset}
    kind = "rms" if rms else "layer"
    label = f"{kind}_norm {mutation} shape={shape} mag={mag} numpy={as_np}"
    if mutation == "good":
        want = np_norm(x, scale.astype(np.float64), None if rms else offset.astype(np.float64), 1e-6, not rms)
        return Case(label, lambda: fn(xa, scale, **kw), expect=want, rtol=3e-5, atol=3e-5)
    if mutation == "x_dtype":
        return Case(label, lambda: fn(x.astype(np.int32), scale, **kw), bad="x")
    if mutation == "x_list":
        return Case(label, lambda: fn(x.tolist(), scale, **kw), bad="x")
    if mutation == "scale_shape":
        return Case(label, lambda: fn(xa, np.ones(d + 1, np.float32), **kw), bad="scale")
    if mutation == "scale_dtype":
        return Case(label, lambda: fn(xa, scale.astype(np.int32), **kw), bad="scale")
    if mutation == "axis":
        return Case(label, lambda: fn(xa, scale, axis=len(shape), **kw), bad="axis")
    return Case(label, lambda: fn(xa, scale, residual=np.ones((*shape[:-1], d + 1), np.float32), **kw),
                bad="residual")


# -- glu ---------------------------------------------------------------------------------
@st.composite
def glu_cases(draw):
    import stellax
    m, k, n = draw(st.sampled_from([(4, 8, 16), (0, 8, 16), (3, 0, 8), (5, 16, 8)]))
    rng = _rng(draw(st.integers(0, 2**16)))
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, 2, n)) / 4).astype(np.float32)
    mutation = draw(st.sampled_from(["good", "good", "x_dtype", "weights_shape", "activation", "weights_dtype"]))
    label = f"glu {mutation} m,k,n={m, k, n}"
    if mutation == "good":
        gate, up = x.astype(np.float64) @ w[:, 0], x.astype(np.float64) @ w[:, 1]
        want = gate / (1 + np.exp(-gate)) * up
        return Case(label, lambda: stellax.gated_linear_unit(x, w), expect=want, rtol=1e-4, atol=1e-4)
    if mutation == "x_dtype":
        return Case(label, lambda: stellax.gated_linear_unit(x.astype(np.int32), w), bad="x")
    if mutation == "weights_shape":
        return Case(label, lambda: stellax.gated_linear_unit(x, np.ones((k + 1, 2, n), np.float32)), bad="weights")
    if mutation == "weights_dtype":
        return Case(label, lambda: stellax.gated_linear_unit(x, w.astype(np.float16)), bad="weights")
    return Case(label, lambda: stellax.gated_linear_unit(x, w, activation="nope"), bad="activation")


# -- attention ---------------------------------------------------------------------------
@st.composite
def attention_cases(draw):
    import stellax
    jnp = _jnp()
    b, t, s, n, kh, h = draw(st.sampled_from([(1, 4, 4, 2, 1, 8), (2, 3, 5, 4, 2, 16), (1, 1, 6, 2, 2, 8)]))
    rng = _rng(draw(st.integers(0, 2**16)))
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((b, s, kh, h)).astype(np.float32)
    v = rng.standard_normal((b, s, kh, h)).astype(np.float32)
    causal = draw(st.booleans())
    mutation = draw(st.sampled_from(["good", "good", "good", "varlen", "q_dtype", "k_heads", "scale",
                                     "implementation", "varlen_cu_start", "varlen_cu_order", "varlen_cu_end",
                                     "v_shape"]))
    label = f"attention {mutation} {(b, t, s, n, kh, h)} causal={causal}"
    f = stellax.dot_product_attention
    if mutation == "good":
        as_np = draw(st.booleans())
        args = (q, k, v) if as_np else tuple(jnp.asarray(a) for a in (q, k, v))
        return Case(label, lambda: f(*args, is_causal=causal), expect=np_attention(q, k, v, causal),
                    rtol=1e-4, atol=1e-4)
    if mutation == "q_dtype":
        return Case(label, lambda: f(q.astype(np.int32), k, v), bad="query")
    if mutation == "k_heads":
        k3 = np.ones((b, s, 3, h), np.float32)
        return Case(label, lambda: f(q, k3, k3), bad="key")
    if mutation == "v_shape":
        return Case(label, lambda: f(q, k, v[:, :-1]), bad="value")
    if mutation == "scale":
        return Case(label, lambda: f(q, k, v, scale="0.5"), bad="scale")
    if mutation == "implementation":
        return Case(label, lambda: f(q, k, v, implementation=5), bad="implementation")
    # varlen: two sequences packed
    tq = 6
    qv = rng.standard_normal((tq, 2, 8)).astype(np.float32)
    kv = rng.standard_normal((tq, 2, 8)).astype(np.float32)
    cu = np.array([0, 2, 6], np.int32)
    fv = stellax.dot_product_attention_varlen
    if mutation == "varlen":
        want = np.concatenate([np_attention(qv[None, a:e], kv[None, a:e], kv[None, a:e], causal)[0]
                               for a, e in ((0, 2), (2, 6))])
        return Case(label, lambda: fv(qv, kv, kv, cu, cu, 4, 4, is_causal=causal), expect=want,
                    rtol=1e-4, atol=1e-4)
    bad_cu = {"varlen_cu_start": np.array([1, 2, 6], np.int32), "varlen_cu_order": np.array([0, 4, 2, 6], np.int32),
              "varlen_cu_end": np.array([0, 2, 7], np.int32)}[mutation]
    return Case(label, lambda: fv(qv, kv, kv, bad_cu, bad_cu, 4, 4), bad="cu_seqlens_q")


# -- paged attention ------------------------------------------------------------------------
@st.composite
def paged_cases(draw):
    import stellax
    jnp = _jnp()
    from stellax.ops.paged_attention import random_block_tables
    rng = _rng(draw(st.integers(0, 2**16)))
    lengths = np.array(draw(st.sampled_from([[3, 20], [0, 16], [1], [33, 5, 0]])), np.int32)
    ps, kh, n, h = 16, 1, 2, 16
    tables, num_pages = random_block_tables(rng, lengths, ps, 3)
    tables = np.asarray(tables)
    kp = rng.standard_normal((num_pages, ps, kh, h)).astype(np.float32)
    vp = rng.standard_normal((num_pages, ps, kh, h)).astype(np.float32)
    q = rng.standard_normal((len(lengths), n, h)).astype(np.float32)
    as_np = draw(st.booleans())
    wrap = (lambda a: a) if as_np else jnp.asarray
    mutation = draw(st.sampled_from(["good", "good", "good", "lengths_float", "tables_float", "tables_shape",
                                     "init_page_size", "init_huge", "init_dtype", "init_quant", "update_numpy",
                                     "update_slots_float", "k_dtype", "implementation"]))
    label = f"paged {mutation} lengths={lengths.tolist()} numpy={as_np}"
    f = stellax.paged_attention
    if mutation == "good":
        return Case(label, lambda: f(wrap(q), wrap(kp), wrap(vp), wrap(tables), wrap(lengths)),
                    expect=np_paged(q, kp, vp, tables, lengths), rtol=1e-4, atol=1e-4)
    if mutation == "lengths_float":
        return Case(label, lambda: f(q, kp, vp, tables, lengths.astype(np.float32)), bad="lengths")
    if mutation == "tables_float":
        return Case(label, lambda: f(q, kp, vp, tables.astype(np.float32), lengths), bad="block_tables")
    if mutation == "tables_shape":
        return Case(label, lambda: f(q, kp, vp, tables[:, None], lengths), bad="block_tables")
    if mutation == "k_dtype":
        return Case(label, lambda: f(q, kp.astype(np.float16), vp, tables, lengths), bad="k_pages")
    if mutation == "implementation":
        return Case(label, lambda: f(q, kp, vp, tables, lengths, implementation=["xla", 3]), bad="implementation")
    if mutation == "init_page_size":
        size = draw(st.sampled_from([0, -1]))
        return Case(label, lambda: stellax.init_kv_cache(4, size, 1, 8), bad="page_size")
    if mutation == "init_huge":
        pages = draw(st.sampled_from([2**62, 2**45, 2**63 - 1]))
        return Case(label, lambda: stellax.init_kv_cache(pages, 16, 8, 128), bad="init_kv_cache")
    if mutation == "init_dtype":
        return Case(label, lambda: stellax.init_kv_cache(4, 4, 1, 8, dtype=np.int8), bad="dtype")
    if mutation == "init_quant":
        return Case(label, lambda: stellax.init_kv_cache(4, 4, 1, 8, quant=object()), bad="quant")
    new = rng.standard_normal((2, kh, h)).astype(np.float32)
    slots = np.array([5, num_pages * ps - 1], np.int32)
    if mutation == "update_numpy":
        def update():
            k2, _ = stellax.update_kv_cache(kp, vp, new, new, slots)
            return np.asarray(k2).reshape(-1, kh, h)[slots]
        return Case(label, update, expect=new)
    return Case(label, lambda: stellax.update_kv_cache(kp, vp, new, new, slots.astype(np.float32)),
                bad="slot_mapping")


# -- moe -----------------------------------------------------------------------------------
@st.composite
def moe_cases(draw):
    import jax
    import stellax
    m, k, n, g = draw(st.sampled_from([(6, 8, 4, 2), (0, 8, 4, 3), (5, 16, 8, 3)]))
    rng = _rng(draw(st.integers(0, 2**16)))
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((g, k, n)).astype(np.float32)
    cuts = np.sort(rng.integers(0, m + 1, g - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [draw(st.integers(0, m))]])).clip(0).astype(np.int32)
    sizes[-1] = max(0, min(sizes[-1], m - sizes[:-1].sum()))
    mutation = draw(st.sampled_from(["good", "good", "jit_offset", "sizes_sum", "sizes_neg", "sizes_float",
                                     "sizes_overflow", "dims_none", "permute_ids", "unpermute_perm",
                                     "permute_good", "jit_overflow"]))
    label = f"moe {mutation} m,k,n,g={m, k, n, g} sizes={sizes.tolist()}"
    rd = stellax.ragged_dot
    if mutation == "good":
        return Case(label, lambda: rd(lhs, rhs, sizes), expect=np_ragged_dot(lhs, rhs, sizes), rtol=1e-4, atol=1e-4)
    if mutation == "jit_offset":
        off = draw(st.sampled_from([-3, g, g + 5]))
        full = np.concatenate([sizes, sizes]).astype(np.int32)
        fn = jax.jit(lambda s, o: rd(lhs, rhs, s, group_offset=o))
        # an offset naming no groups poisons the whole result (issue 43), never a plausible zero
        return Case(label, lambda: fn(full, np.int32(off)),
                    expect=lambda r: None if np.shape(r) == (m, n) and np.isnan(np.asarray(r)).all()
                    else f"expected NaN everywhere, shape {(m, n)}, got {np.asarray(r)!r}")
    if mutation == "jit_overflow":
        big = np.full(g, 2**31 - 1, np.int32)
        fn = jax.jit(lambda s: rd(lhs, rhs, s))
        # clamped: the first group takes every row
        return Case(label, lambda: fn(big), expect=np_ragged_dot(lhs, rhs, [m] + [0] * (g - 1)), rtol=1e-4,
                    atol=1e-4)
    if mutation == "sizes_sum":
        return Case(label, lambda: rd(lhs, rhs, sizes + np.int32(m + 1)), bad="group_sizes")
    if mutation == "sizes_neg":
        bad = sizes.copy()
        bad[0] = -1
        return Case(label, lambda: rd(lhs, rhs, bad), bad="group_sizes")
    if mutation == "sizes_float":
        return Case(label, lambda: rd(lhs, rhs, sizes.astype(np.float32)), bad="group_sizes")
    if mutation == "sizes_overflow":
        return Case(label, lambda: rd(lhs, rhs, np.full(g, 2**31 - 1, np.int32)), bad="group_sizes")
    if mutation == "dims_none":
        return Case(label, lambda: stellax.ragged_dot_general(lhs, rhs, sizes, None), bad="ragged_dot_dimension_numbers")
    x = rng.standard_normal((4, 8)).astype(np.float32)
    if mutation == "permute_ids":
        ids = np.array([[0], [1], [draw(st.sampled_from([-1, 4, 99]))], [2]], np.int32)
        return Case(label, lambda: stellax.permute(x, ids, 4), bad="expert_ids")
    if mutation == "unpermute_perm":
        perm = np.array([0, 1, 2, draw(st.sampled_from([-1, 4, 1]))], np.int32)
        return Case(label, lambda: stellax.unpermute(x, perm, np.ones((4, 1), np.float32)), bad="permutation")
    ids = rng.integers(0, 3, (4, 2)).astype(np.int32)
    w = rng.random((4, 2)).astype(np.float32)

    def round_trip():
        rows, gs, perm = stellax.permute(x, ids, 3)
        return stellax.unpermute(rows, perm, w)
    return Case(label, round_trip, expect=x.astype(np.float64) * w.sum(1, keepdims=True), rtol=1e-5, atol=1e-5)


# -- linear attention ---------------------------------------------------------------------
@st.composite
def linear_attention_cases(draw):
    import jax
    import stellax
    b, t, h, kd = draw(st.sampled_from([(1, 5, 2, 8), (2, 3, 1, 8), (1, 0, 2, 8), (0, 4, 1, 8)]))
    rng = _rng(draw(st.integers(0, 2**16)))
    q = rng.standard_normal((b, t, h, kd)).astype(np.float32)
    k = (rng.standard_normal((b, t, h, kd)) / np.sqrt(kd)).astype(np.float32)
    v = rng.standard_normal((b, t, h, kd)).astype(np.float32)
    g = -rng.random((b, t, h)).astype(np.float32)
    beta = rng.random((b, t, h)).astype(np.float32)
    fused = draw(st.booleans())
    f = stellax.fused_recurrent_gated_delta_rule if fused else stellax.chunk_gated_delta_rule
    mutation = draw(st.sampled_from(["good", "good", "positive_g", "jit_positive_g", "g_shape", "beta_dtype",
                                     "cu_bad", "cu_numpy_jit", "scale"]))
    label = f"linear_attention {mutation} {(b, t, h, kd)} fused={fused}"
    if mutation == "good":
        return Case(label, lambda: f(q, k, v, g, beta)[0], expect=np_gated_delta(q, k, v, g, beta, kd ** -0.5),
                    rtol=1e-4, atol=1e-4)
    if mutation == "positive_g":
        if g.size == 0:
            return Case(label, lambda: f(q, k, v, g, beta)[0], expect=np.zeros(v.shape))
        gp = g.copy()
        gp.flat[draw(st.integers(0, g.size - 1))] = 0.5
        return Case(label, lambda: f(q, k, v, gp, beta), bad="g")
    if mutation == "jit_positive_g":
        gp = np.abs(g) + 2.0
        fn = jax.jit(lambda *a: f(*a)[0])
        return Case(label, lambda: fn(q, k, v, gp, beta), expect=np_gated_delta(q, k, v, np.minimum(gp, 0), beta,
                                                                                kd ** -0.5), rtol=1e-4, atol=1e-4)
    if mutation == "g_shape":
        return Case(label, lambda: f(q, k, v, g[..., None], beta), bad="g")
    if mutation == "beta_dtype":
        return Case(label, lambda: f(q, k, v, g, beta.astype(np.int32)), bad="beta")
    if mutation == "scale":
        return Case(label, lambda: f(q, k, v, g, beta, scale=0.0), bad="scale")
    # packed: one batch row
    tp = 6
    qp, kp, vp = (rng.standard_normal((1, tp, 1, 8)).astype(np.float32) for _ in range(3))
    kp = (kp / np.sqrt(8)).astype(np.float32)
    gp, bp = -rng.random((1, tp, 1)).astype(np.float32), rng.random((1, tp, 1)).astype(np.float32)
    if mutation == "cu_bad":
        cu = draw(st.sampled_from([[1, 3, 6], [0, 4, 2, 6], [0, 3, 7]]))
        return Case(label, lambda: f(qp, kp, vp, gp, bp, cu_seqlens=np.array(cu, np.int32)), bad="cu_seqlens")
    cu = np.array([0, 2, 6], np.int32)
    fn = jax.jit(lambda *a: f(*a, cu_seqlens=cu)[0])
    want = np.concatenate([np_gated_delta(qp[:, a:e], kp[:, a:e], vp[:, a:e], gp[:, a:e], bp[:, a:e], 8 ** -0.5)
                           for a, e in ((0, 2), (2, 6))], axis=1)
    return Case(label, lambda: fn(qp, kp, vp, gp, bp), expect=want, rtol=1e-4, atol=1e-4)


# -- quant --------------------------------------------------------------------------------
@st.composite
def quant_cases(draw):
    import stellax
    fmt = draw(st.sampled_from(["int8", "mxfp8", "mxfp4", "nvfp4"]))
    shape = draw(st.sampled_from([(4, 64), (2, 32), (4, 0), (0, 32)]))
    rng = _rng(draw(st.integers(0, 2**16)))
    x = rng.standard_normal(shape).astype(np.float32)
    mutation = draw(st.sampled_from(["good", "good", "x_dtype", "format", "axis", "x_list"]))
    label = f"quant {mutation} {fmt} {shape}"
    if mutation == "good":
        if 0 in shape:
            return Case(label, lambda: stellax.quantize(x, fmt), bad="x")
        bound = {"int8": 0.02, "mxfp8": 0.1, "mxfp4": 0.35, "nvfp4": 0.35}[fmt]

        def contract(result):
            back = np.asarray(stellax.dequantize(result), np.float64)
            err = np.linalg.norm(back - x) / np.linalg.norm(x)
            return None if back.shape == x.shape and err < bound else f"round trip rel error {err:.3g} > {bound}"
        return Case(label, lambda: stellax.quantize(x, fmt), expect=contract)
    if mutation == "x_dtype":
        return Case(label, lambda: stellax.quantize(x.astype(np.int32), fmt), bad="x")
    if mutation == "x_list":
        return Case(label, lambda: stellax.quantize(x.tolist(), fmt), bad="x")
    if mutation == "format":
        return Case(label, lambda: stellax.quantize(x, "int3"), bad="format")
    return Case(label, lambda: stellax.quantize(x, fmt, axis=5), bad="axis")


# -- torch front end -------------------------------------------------------------------------
@st.composite
def torch_cases(draw):
    import torch
    import stellax.torch as st_torch
    rng = _rng(draw(st.integers(0, 2**16)))
    m, k, n, g = 6, 8, 4, 2
    lhs = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    rhs = torch.from_numpy(rng.standard_normal((g, k, n)).astype(np.float32))
    sizes = np.array([2, 3], np.int32)
    x = torch.from_numpy(rng.standard_normal((3, 8)).astype(np.float32))
    scale = torch.ones(8)
    mutation = draw(st.sampled_from(["good_ragged", "good_norm", "sizes_float", "sizes_sum", "meta_mix",
                                     "paged_lengths_float", "paged_tables_float", "sizes_neg"]))
    label = f"torch {mutation}"
    if mutation == "good_ragged":
        return Case(label, lambda: st_torch.ragged_dot(lhs, rhs, torch.from_numpy(sizes)),
                    expect=np_ragged_dot(lhs.numpy(), rhs.numpy(), sizes), rtol=1e-4, atol=1e-4)
    if mutation == "good_norm":
        return Case(label, lambda: st_torch.rms_norm(x, scale),
                    expect=np_norm(x.numpy(), None, None, 1e-6, False), rtol=1e-4, atol=1e-4)
    if mutation == "sizes_float":
        return Case(label, lambda: st_torch.ragged_dot(lhs, rhs, torch.tensor([2.0, 3.0])), bad="group_sizes")
    if mutation == "sizes_sum":
        return Case(label, lambda: st_torch.ragged_dot(lhs, rhs, torch.tensor([4, 5])), bad="group_sizes")
    if mutation == "sizes_neg":
        return Case(label, lambda: st_torch.ragged_dot(lhs, rhs, torch.tensor([-1, 5])), bad="group_sizes")
    if mutation == "meta_mix":
        return Case(label, lambda: st_torch.rms_norm(x.to("meta"), scale), bad="scale")
    q = torch.ones(2, 2, 16)
    kp = torch.ones(4, 16, 1, 16)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    if mutation == "paged_lengths_float":
        return Case(label, lambda: st_torch.paged_attention(q, kp, kp, tables, lengths.float()), bad="lengths")
    return Case(label, lambda: st_torch.paged_attention(q, kp, kp, tables.float(), lengths), bad="block_tables")


FAMILIES = {
    "norm": norm_cases, "glu": glu_cases, "attention": attention_cases, "paged_attention": paged_cases,
    "moe": moe_cases, "linear_attention": linear_attention_cases, "quant": quant_cases, "torch": torch_cases,
}
