"""The recurrence GDN, KDA and SSD share, and its backward op.

Every public op prepares its inputs (float32, l2-norm, gates, grouped heads,
scale; SSD maps ``C, B, dt·x, dt·A`` onto ``q, k, v, g``) and calls
`recurrence` with a backend:

* ``"xla"``: `xla.chunked_scan` (autodiff through a checkpointed scan);
* ``"triton"``: the Pallas kernels behind a ``jax.custom_vjp`` whose backward
  is the op `gated_recurrence_backward` (its own implementations: Triton's
  reverse state-scan kernel plus the per-chunk gradient kernel of
  `triton_backward.py`, or XLA).

The kernels work in a heads-major layout: ``q, k [Bs, HV, Tp, K]``,
``v [Bs, HV, Tp, V]``, ``g, beta [Bs, HV, Tp]`` (``g`` the per-step log
decays), ``h0 [N, HV, K, V]`` and, for packed batches, int32
``first, seq, last [NT]`` per chunk (see `layout.Stream`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Example, Implementation, Op, backward_implementation, register
from . import triton as kernels
from . import xla
from .configs import (TRITON_CHUNK, LinearAttentionConfig, linear_attention_heuristic, linear_attention_requirements,
                      linear_attention_space, padded_dim)
from .layout import Stream, make_stream
from .reference import delta_rule_recurrence
from .triton_backward import intra_backward

F32 = jnp.float32


# -- heads-major layout ---------------------------------------------------------
def _heads_major(stream: Stream, x, dim=None):
    """``[B, T, HV(, D)]`` → ``[Bs, HV, Tp(, D)]`` float32, ``D`` zero-padded to ``dim``."""
    x = stream.pack(x.astype(F32))
    if dim is not None and x.shape[-1] != dim:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, dim - x.shape[-1])])
    return jnp.moveaxis(x, 2, 1)


def _meta(stream: Stream):
    if not stream.varlen:
        return None
    last = jnp.zeros((stream.chunks,), jnp.int32).at[stream.last_chunk].max(
        jnp.where(stream.empty, 0, 1).astype(jnp.int32), mode="drop")
    return (stream.chunk_first.astype(jnp.int32), stream.chunk_seq, last)


def recurrence(backend: str, tokens: dict, prepare, h0, cu_seqlens, *, chunk_size: int, config=None):
    """The gated (delta-rule) recurrence.

    Args:
      tokens: the op's per-token inputs, ``name → [B, T, ...]`` (any dtype).
      prepare: ``prepare(tokens) → (q, k, v, g, beta)`` in float32 — ``q, k
        [..., HV, K]`` (q scaled, heads expanded), ``v [..., HV, V]``, log decays
        ``g [..., HV(, K)]``, ``beta [..., HV]`` or ``None`` — token by token, so
        it may run on whole arrays or on chunks (the XLA scan prepares each chunk
        inside its step, never materializing the prepared copies).
      h0: ``[N, HV, K, V]`` initial states.
    Returns float32 ``(o [B, T, HV, V], final [N, HV, K, V])``.

    ``"triton"`` runs scalar decays (GDN, SSD) on `triton.py`'s kernels and
    per-channel decays (KDA, ``g [..., HV, K]``) on `triton_kda.py`'s
    (`kda_core.kda_recurrence`), both on the chunk-64 heads-major layout.
    """
    if backend == "xla":
        return xla.chunked_scan(tokens, prepare, initial_state=h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    q, k, v, g, beta = prepare(tokens)
    B, T, HV, K = k.shape
    V = v.shape[-1]
    stream = make_stream(B, T, TRITON_CHUNK, cu_seqlens)
    kp, vp = padded_dim(K), padded_dim(V)
    b = None if beta is None else _heads_major(stream, beta)
    h0p = jnp.pad(h0.astype(F32), [(0, 0), (0, 0), (0, kp - K), (0, vp - V)])
    args = (_heads_major(stream, q, kp), _heads_major(stream, k, kp), _heads_major(stream, v, vp))
    if g.ndim == 4:  # KDA's per-channel decays (padded channels decay by exp(0) = 1)
        from .kda_core import kda_recurrence  # imports this module
        o, final = kda_recurrence(*args, _heads_major(stream, g, kp), b, h0p, _meta(stream), config)
    else:
        o, final = _kernel_recurrence(*args, _heads_major(stream, g), b, h0p, _meta(stream), config)
    o = stream.unpack(jnp.moveaxis(o, 1, 2))[..., :V]
    final = final[:, :, :K, :V]
    if stream.varlen:
        final = jnp.where(stream.empty[:, None, None, None], h0.astype(F32), final)
    return o, final


# -- Triton forward with a custom VJP ---------------------------------------------
def _flat(x):
    return None if x is None else x.reshape((-1,) + x.shape[2:])


def _kernel_states(k, v, g, beta, h0, meta, config):
    """The WY kernel (delta rule only) and the state scan on the flattened
    layout: ``(W or None, S_c, Δ, final)``."""
    kf, vf, gf = _flat(k), _flat(v), _flat(g)
    if beta is not None:
        u, w = kernels.wy_forward(kf, vf, gf, _flat(beta), chunk=TRITON_CHUNK, config=config)
    else:
        u, w = vf, None
    states, delta, final = kernels.state_forward(w, u, kf, gf, _flat(h0), meta, chunk=TRITON_CHUNK,
                                                 heads=g.shape[1], config=config)
    return w, states, delta, final


def _kernel_forward(q, k, v, g, beta, h0, meta, config):
    _, states, delta, final = _kernel_states(k, v, g, beta, h0, meta, config)
    o = kernels.output_forward(_flat(q), _flat(k), _flat(g), delta, states, chunk=TRITON_CHUNK, config=config)
    return o.reshape(v.shape), final.reshape(h0.shape)


def kernel_recurrence(forward, backward_op: Op):
    """A differentiable recurrence on the kernels' layout:
    ``run(q, k, v, g, beta, h0, meta, config)`` is ``forward`` (the Triton
    forward kernels) and its VJP is ``backward_op`` — a registered op taking
    ``(q, k, v, g, beta, h0, do, dfinal, first, seq, last)``, run with its
    Triton implementation unless the caller chose another (`backward_implementation`)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
    def run(q, k, v, g, beta, h0, meta, static):
        return forward(q, k, v, g, beta, h0, meta, static[0])

    def run_fwd(q, k, v, g, beta, h0, meta, static):
        return forward(q, k, v, g, beta, h0, meta, static[0]), (q, k, v, g, beta, h0, meta)

    def run_bwd(static, residuals, cotangents):
        q, k, v, g, beta, h0, meta = residuals
        do, dfinal = cotangents
        first, seq, last = meta if meta is not None else (None, None, None)
        grads = backward_op(q, k, v, g, beta, h0, do, dfinal, first, seq, last,
                            implementation=backward_implementation(backward_op, "triton"))
        return tuple(grads) + (None,)

    run.defvjp(run_fwd, run_bwd)
    return lambda q, k, v, g, beta, h0, meta, config: run(q, k, v, g, beta, h0, meta, (config,))


# -- the backward op ------------------------------------------------------------
def _chunked(x, chunk):
    """``[Bs, HV, Tp, ...]`` → ``[Bs, HV, NT, C, ...]``."""
    return None if x is None else x.reshape(x.shape[:2] + (x.shape[2] // chunk, chunk) + x.shape[3:])


def _triton_backward(call: Call, config):
    """The Triton backward: the reverse state scan (`triton.state_backward`:
    ``dS`` per chunk, ``dΔ``, ``dh0``) and then the per-chunk gradients of q, k,
    v, g and β (`triton_backward.intra_backward`, recomputing ``P``, ``T``,
    ``U``, ``W`` per chunk). The forward's W, S_c and Δ are recomputed, not stored."""
    q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    meta = None if call.first is None else (call.first, call.seq, call.last)
    hv = g.shape[1]
    chunk = TRITON_CHUNK
    # The kernels load q, k, v, h0 in any float dtype; the decays go into
    # float32 dots with 0/1 matrices, so g and β are float32 here.
    gf, bf = g.astype(F32), None if beta is None else beta.astype(F32)
    w, states, delta, _ = _kernel_states(k, v, gf, bf, h0, meta, config)  # recomputed, not stored
    dfinal = jnp.zeros(h0.shape, F32) if call.dfinal is None else call.dfinal.astype(F32)
    do = _flat(call.do.astype(F32))
    d_states, d_delta, dh0 = kernels.state_backward(_flat(q), _flat(k), _flat(gf), w, do, _flat(dfinal), meta,
                                                    chunk=chunk, heads=hv, config=config)
    grads = intra_backward(_flat(q), _flat(k), _flat(v), _flat(gf), _flat(bf), states, delta, d_states, d_delta,
                           do, chunk=chunk, config=config)
    grads = [None if d is None else d.reshape(x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta))]
    dh0 = dh0.reshape(h0.shape)
    if meta is not None:
        # An empty packed sequence passes its initial state straight through.
        dh0 = jnp.where(_stream_of(call).empty[:, None, None, None], dfinal, dh0)
    return tuple(grads) + (dh0,)


def _stream_of(call: Call) -> Stream:
    """The padded token layout of a backward call (``v [Bs, HV, Tp, V]``,
    packed when ``first, seq, last`` are given)."""
    bs, hv, tp = call.v.shape[:3]
    if call.first is None:
        return Stream(bs, tp, bs, tp, TRITON_CHUNK)
    n = call.h0.shape[0]
    first = call.first != 0
    nt = tp // TRITON_CHUNK
    c = jnp.arange(nt)
    last_chunk = jnp.zeros((n,), jnp.int32).at[call.seq].max(jnp.where(call.last != 0, c, 0))
    seen = jnp.zeros((n,), bool).at[call.seq].max(first)
    return Stream(1, tp, 1, tp, TRITON_CHUNK, dest=jnp.arange(tp), chunk_seq=call.seq, chunk_first=first,
                  last_chunk=last_chunk, empty=~seen)


def _core_forward_xla(call: Call, q, k, v, g, beta, h0):
    """The forward on the core layout, in XLA (`xla.scan_chunks`)."""
    stream = _stream_of(call)
    # [Bs, HV, NT, C, ...] → [NT, Bs, C, HV, ...]
    to_scan = lambda x: None if x is None else jnp.moveaxis(jnp.moveaxis(_chunked(x, TRITON_CHUNK), 2, 0), 2, 3)
    o, final = xla.scan_chunks({"q": to_scan(q), "k": to_scan(k), "v": to_scan(v), "g": to_scan(g),
                                "beta": to_scan(beta)}, h0, stream)
    return jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 2).reshape(v.shape), final


def _differentiate(call: Call, forward):
    names = ("q", "k", "v", "g", "beta", "h0")
    has_beta = call.beta is not None
    args = [call.arrays[n].astype(F32) for n in names if n != "beta" or has_beta]

    def f(*a):
        a = list(a)
        if not has_beta:
            a.insert(4, None)
        return forward(call, *a)

    out, vjp = jax.vjp(f, *args)
    dfinal = jnp.zeros(out[1].shape, F32) if call.dfinal is None else call.dfinal.astype(F32)
    grads = list(vjp((call.do.astype(F32), dfinal)))
    if not has_beta:
        grads.insert(4, None)
    return tuple(grads)


def _xla_backward(call: Call, config):
    del config
    return _differentiate(call, _core_forward_xla)


def _reference_forward(call: Call, q, k, v, g, beta, h0):
    """The token recurrence over the padded stream (per-token resets at chunk starts)."""
    tp = v.shape[2]
    chunk = TRITON_CHUNK
    token_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 2)
    tokens = None
    if call.first is not None:
        pos = jnp.arange(tp)
        tokens = (jnp.repeat(call.seq, chunk), jnp.repeat(call.first != 0, chunk) & (pos % chunk == 0),
                  jnp.repeat(call.last != 0, chunk) & (pos % chunk == chunk - 1))
    o, final = delta_rule_recurrence(token_major(q), token_major(k), token_major(v), token_major(g),
                                     token_major(beta), scale=1.0, initial_state=h0, tokens=tokens)
    if tokens is not None:
        final = jnp.where(_stream_of(call).empty[:, None, None, None], h0, final)
    return jnp.moveaxis(o, 2, 1), final


def recurrence_backward_reference(call: Call):
    """Golden backward: the VJP of the token-by-token recurrence, ``(dq, dk, dv, dg, dβ, dh0)``."""
    return _differentiate(call, _reference_forward)


def backward_checker(per_channel: bool):
    """The argument check of a recurrence backward op: ``q, k [Bs, HV, Tp, K]``,
    ``v, do [Bs, HV, Tp, V]``, ``g [Bs, HV, Tp]`` (``[Bs, HV, Tp, K]`` with
    ``per_channel``), ``beta [Bs, HV, Tp]`` (required with ``per_channel``,
    else optional), ``h0`` and optional ``dfinal [N, HV, K, V]``, optional int
    ``first, seq, last [NT]`` (``Tp`` a multiple of the chunk, 64)."""
    return functools.partial(_check_backward, per_channel=per_channel)


def _check_backward(q, k, v, g, beta, h0, do, dfinal=None, first=None, seq=None, last=None, *,
                    per_channel: bool) -> Call:
    from ...core import checks
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("h0", h0), ("do", do)):
        checks.require_float(name, x)
    if per_channel and beta is None:
        raise ValueError("beta: expected [Bs, HV, Tp] (the per-channel recurrence is a delta rule), got None")
    checks.require_ndim("v", v, 4)
    bs, hv, tp = v.shape[:3]
    if tp % TRITON_CHUNK:
        raise ValueError(f"v: expected a padded length that is a multiple of {TRITON_CHUNK}, got {tp}")
    checks.require_shape("q", q, (bs, hv, tp, None), "v.shape[:3] + (K,)")
    checks.require_shape("k", k, q.shape, "q.shape")
    if per_channel:
        checks.require_shape("g", g, q.shape, "q.shape (per-channel decays [Bs, HV, Tp, K])")
    else:
        checks.require_shape("g", g, (bs, hv, tp), "v.shape[:3] (a decay per token and head)")
    checks.require_shape("do", do, v.shape, "v.shape")
    if beta is not None:
        checks.require_float("beta", beta)
        checks.require_shape("beta", beta, (bs, hv, tp), "v.shape[:3]")
    checks.require_shape("h0", h0, (None, hv, k.shape[-1], v.shape[-1]), "N, HV, K, V")
    if dfinal is not None:
        checks.require_shape("dfinal", dfinal, h0.shape, "h0.shape")
    if (first is None) != (seq is None) or (first is None) != (last is None):
        raise ValueError("first, seq, last: give all three (a packed batch) or none")
    if first is not None:
        for name, x in (("first", first), ("seq", seq), ("last", last)):
            checks.require_int(name, x)
            checks.require_shape(name, x, (tp // TRITON_CHUNK,), "the number of chunks")
    return Call({"q": q, "k": k, "v": v, "g": g, "beta": beta, "h0": h0, "do": do, "dfinal": dfinal,
                 "first": first, "seq": seq, "last": last}, {})


def backward_flops(call: Call) -> float:
    """FLOPs of a recurrence backward call: about 2.5 forwards."""
    bs, hv, tp = call.v.shape[:3]
    kdim, vdim = call.k.shape[-1], call.v.shape[-1]
    return 2.5 * recurrence_flops(bs * tp, hv, kdim, vdim, TRITON_CHUNK, call.beta is not None)


def recurrence_flops(tokens: int, heads: int, kdim: int, vdim: int, chunk: int, delta: bool) -> float:
    """Matmul FLOPs of the chunked forward: per token and head, the decayed
    scores ``2C(K)`` (twice with the delta rule), the triangular solve
    ``C(K+V)``, ``W S`` / ``Q S`` / ``K̃ᵀΔ`` (``2KV`` each) and ``PΔ`` (``2CV``)."""
    per = 2 * chunk * kdim + 2 * kdim * vdim * 2 + 2 * chunk * vdim
    if delta:
        per += 2 * chunk * kdim + chunk * (kdim + vdim) + 2 * kdim * vdim
    return float(tokens) * heads * per


def backward_examples(per_channel: bool):
    """Examples of a recurrence backward op: a dense and a packed batch (the
    per-channel ones always with the delta rule)."""
    return functools.partial(_backward_examples, per_channel=per_channel)


def _backward_examples(dtype, *, per_channel: bool):
    out = []
    for bs, hv, nt, kdim, vdim, delta, packed in ((1, 2, 2, 32, 16, True, False),
                                                  (1, 2, 3, 16, 32, per_channel, True)):
        keys = jax.random.split(jax.random.PRNGKey(nt * kdim), 8)
        tp = nt * TRITON_CHUNK
        q = (0.3 * jax.random.normal(keys[0], (bs, hv, tp, kdim))).astype(dtype)
        k = (jax.random.normal(keys[1], (bs, hv, tp, kdim)) / np.sqrt(kdim)).astype(dtype)
        v = jax.random.normal(keys[2], (bs, hv, tp, vdim)).astype(dtype)
        g = -jax.nn.softplus(jax.random.normal(keys[3], (bs, hv, tp) + ((kdim,) if per_channel else ())))
        g = g.astype(dtype)
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (bs, hv, tp))).astype(dtype) if delta else None
        n = 2 if packed else bs
        h0 = jax.random.normal(keys[5], (n, hv, kdim, vdim)).astype(dtype)
        do = jax.random.normal(keys[6], v.shape).astype(dtype)
        dfinal = jax.random.normal(keys[7], h0.shape).astype(dtype)
        meta = (None, None, None)
        if packed:
            meta = (jnp.array([1, 0, 1], jnp.int32), jnp.array([0, 0, 1], jnp.int32), jnp.array([0, 1, 1], jnp.int32))
        out.append(Example(f"HV={hv} NT={nt} K={kdim} V={vdim} delta={delta} packed={packed}",
                           (q, k, v, g, beta, h0, do, dfinal) + meta))
    return out


def recurrence_backward_op(name: str, triton_backward, *, per_channel: bool) -> Op:
    """Register the backward op of a recurrence: ``triton_backward(call, config)``
    (its kernels), the VJP of the XLA chunked scan, and the VJP of the token
    recurrence as the golden; ``per_channel`` decays ``g [Bs, HV, Tp, K]`` or
    one per token ``[Bs, HV, Tp]``. Returns ``(dq, dk, dv, dg, dβ, dh0)``."""
    return register(Op(
        name,
        family="linear_attention",
        check=backward_checker(per_channel=per_channel),
        reference=recurrence_backward_reference,
        implementations=[
            Implementation("triton", triton_backward, backend="triton", config_type=LinearAttentionConfig,
                           heuristic=linear_attention_heuristic, space=linear_attention_space,
                           requirements=linear_attention_requirements),
            Implementation("xla", _xla_backward),
        ],
        flops=backward_flops,
        examples=backward_examples(per_channel=per_channel),
    ))


gated_recurrence_backward_op = recurrence_backward_op("gated_recurrence_backward", _triton_backward, per_channel=False)
_kernel_recurrence = kernel_recurrence(_kernel_forward, gated_recurrence_backward_op)
