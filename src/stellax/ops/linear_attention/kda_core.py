"""KDA's recurrence on the Triton kernels, its custom VJP and its backward op.

`core.recurrence` sends per-channel decays (``g [..., HV, K]``) here. The
layout is `core.py`'s heads-major one: ``q, k, g [Bs, HV, Tp, K]`` (``K``
padded; padded channels have ``g = 0``), ``v [Bs, HV, Tp, V]``,
``beta [Bs, HV, Tp]``, ``h0 [N, HV, K, V]`` and, for packed batches, int32
``first, seq, last [NT]`` per chunk.

Forward: `triton_kda.intra_forward` (scores, WY, decay factors), the state
scan and the output kernel. Backward (the op `kda_recurrence_backward`):
the forward's per-chunk factors and states are recomputed (plus ``T`` and the
k scores), the reverse state scan runs as a Triton kernel
(`triton_kda.state_backward`), the cotangents of the per-chunk factors follow
from the scans by batched matmuls (`parts_cotangents`, XLA), and the per-chunk
gradients of q, k, v, g and β are the Triton kernel
`triton_kda_backward.intra_backward`, in parallel over all chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Example, Implementation, Op, backward_implementation, register
from . import triton_kda as kernels
from . import xla
from .configs import (TRITON_CHUNK, LinearAttentionConfig, linear_attention_heuristic, linear_attention_requirements,
                      linear_attention_space)
from .core import _differentiate, recurrence_flops
from .layout import Stream
from .reference import delta_rule_recurrence
from .triton_kda_backward import intra_backward

F32 = jnp.float32


def _flat(x):
    return None if x is None else x.reshape((-1,) + x.shape[2:])


def _chunked(x):
    """``[Bs, HV, Tp, ...]`` → ``[Bs, HV, NT, C, ...]``."""
    return x.reshape(x.shape[:2] + (x.shape[2] // TRITON_CHUNK, TRITON_CHUNK) + x.shape[3:])


# -- forward ------------------------------------------------------------------------
def _forward_parts(q, k, v, g, beta, h0, meta, config, with_solve=False):
    """The intra kernel and the state scan on the flattened layout:
    ``(parts dict, S_c, Δ, final)`` (``parts`` has ``T`` and ``Sk`` with ``with_solve``)."""
    out = kernels.intra_forward(_flat(q), _flat(k), _flat(v), _flat(g), _flat(beta), chunk=TRITON_CHUNK,
                                config=config, with_solve=with_solve)
    parts = dict(zip(("U", "W", "P", "qg", "kg", "gamma", "T", "Sk"), out))
    states, delta, final = kernels.state_forward(parts["W"], parts["U"], parts["kg"], parts["gamma"], _flat(h0),
                                                 meta, chunk=TRITON_CHUNK, heads=g.shape[1], config=config)
    return parts, states, delta, final


def _forward(q, k, v, g, beta, h0, meta, config):
    parts, states, delta, final = _forward_parts(q, k, v, g, beta, h0, meta, config)
    o = kernels.output_forward(parts["qg"], parts["P"], delta, states, chunk=TRITON_CHUNK, config=config)
    return o.reshape(v.shape), final.reshape(h0.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _kda_recurrence(q, k, v, g, beta, h0, meta, static):
    return _forward(q, k, v, g, beta, h0, meta, static[0])


def kda_recurrence(q, k, v, g, beta, h0, meta, config):
    """The KDA recurrence on the Triton kernels, differentiable.

    Args: the heads-major float32 layout of the module docstring (``q``
      scaled; ``K``, ``V`` padded to powers of two ≥ 16, ``Tp`` a multiple of
      64); ``meta`` ``None`` or int32 ``(first, seq, last) [NT]``; ``config`` a
      `LinearAttentionConfig` or ``None`` (the heuristic's).
    Returns float32 ``(o [Bs, HV, Tp, V], final [N, HV, K, V])``: per value head
    ``S_t = diag(exp(g_t)) S_{t-1} + β_t k_t (v_t − (diag(exp(g_t)) S_{t-1})ᵀ k_t)ᵀ``,
    ``o_t = S_tᵀ q_t``.
    """
    if config is None:
        config = linear_attention_heuristic(Call({"k": k, "v": v}, {}))
    return _kda_recurrence(q, k, v, g, beta, h0, meta, (config,))


def _kda_recurrence_fwd(q, k, v, g, beta, h0, meta, static):
    return _forward(q, k, v, g, beta, h0, meta, static[0]), (q, k, v, g, beta, h0, meta)


def _kda_recurrence_bwd(static, residuals, cotangents):
    q, k, v, g, beta, h0, meta = residuals
    do, dfinal = cotangents
    first, seq, last = meta if meta is not None else (None, None, None)
    grads = kda_recurrence_backward_op(
        q, k, v, g, beta, h0, do, dfinal, first, seq, last,
        implementation=backward_implementation(kda_recurrence_backward_op, "triton"),
    )
    return tuple(grads) + (None,)


_kda_recurrence.defvjp(_kda_recurrence_fwd, _kda_recurrence_bwd)


# -- backward -------------------------------------------------------------------------
def parts_cotangents(states, delta, d_delta, d_states, do):
    """Cotangents of the per-chunk factors (``gamma [.., K, 1]`` per channel)
    from the scans (all ``[..., NT, ...]``): ``O = qg S + P Δ``,
    ``Δ = U − W S``, ``S' = diag(γ) S + kgᵀ Δ`` give ``d qg = dO Sᵀ``,
    ``dP = lower(dO Δᵀ)``, ``dU = dΔ``, ``dW = −dΔ Sᵀ``, ``d kg = Δ dS'ᵀ`` and
    ``dγ = Σ_v S ⊙ dS'``."""
    ein = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    c = do.shape[-2]
    lower = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
    return {
        "qg": ein("...cv,...kv->...ck", do, states),
        "kg": ein("...cv,...kv->...ck", delta, d_states),
        "gamma": jnp.sum(states * d_states, axis=-1)[..., None],
        "P": jnp.where(lower, ein("...iv,...jv->...ij", do, delta), 0.0),
        "U": d_delta,
        "W": -ein("...cv,...kv->...ck", d_delta, states),
    }


def _triton_backward(call: Call, config):
    q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    meta = None if call.first is None else (call.first, call.seq, call.last)
    bs, hv, tp = beta.shape
    f32 = [x.astype(F32) for x in (q, k, v, g, beta, h0)]
    # The forward's factors and states, recomputed (not stored by the forward).
    parts, states, delta, _ = _forward_parts(*f32, meta, config, with_solve=True)
    dfinal = jnp.zeros(h0.shape, F32) if call.dfinal is None else call.dfinal.astype(F32)
    do = _flat(call.do.astype(F32))
    d_states, d_delta, dh0 = kernels.state_backward(parts["P"], parts["qg"], parts["kg"], parts["W"],
                                                    parts["gamma"], do, _flat(dfinal), meta,
                                                    chunk=TRITON_CHUNK, heads=hv, config=config)
    nt = tp // TRITON_CHUNK
    per_chunk = lambda x: x.reshape((bs * hv, nt, TRITON_CHUNK) + x.shape[2:])
    cot = parts_cotangents(states, per_chunk(delta), per_chunk(d_delta), d_states, per_chunk(do))
    cot = {name: x.reshape((bs * hv, nt, -1) if name == "gamma" else (bs * hv, tp, x.shape[-1]))
           for name, x in cot.items()}
    flat = [_flat(x) for x in f32[:5]]
    grads = intra_backward(*flat, parts["T"], parts["Sk"], parts["U"], parts["W"], cot, chunk=TRITON_CHUNK,
                           config=config)
    grads = [d.reshape(x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta))]
    dh0 = dh0.reshape(h0.shape)
    if meta is not None:
        # An empty packed sequence passes its initial state straight through.
        dh0 = jnp.where(_stream_of(call).empty[:, None, None, None], dfinal, dh0)
    return tuple(grads) + (dh0.astype(h0.dtype),)


def _stream_of(call: Call) -> Stream:
    bs, hv, tp = call.beta.shape
    if call.first is None:
        return Stream(bs, tp, bs, tp, TRITON_CHUNK)
    n = call.h0.shape[0]
    first = call.first != 0
    c = jnp.arange(tp // TRITON_CHUNK)
    last_chunk = jnp.zeros((n,), jnp.int32).at[call.seq].max(jnp.where(call.last != 0, c, 0))
    seen = jnp.zeros((n,), bool).at[call.seq].max(first)
    return Stream(1, tp, 1, tp, TRITON_CHUNK, dest=jnp.arange(tp), chunk_seq=call.seq, chunk_first=first,
                  last_chunk=last_chunk, empty=~seen)


def _forward_xla(call: Call, q, k, v, g, beta, h0):
    """The forward on the core layout in XLA (`xla.scan_chunks`, chunk 64)."""
    # [Bs, HV, NT, C, ...] → [NT, Bs, C, HV, ...]
    to_scan = lambda x: jnp.moveaxis(jnp.moveaxis(_chunked(x), 2, 0), 2, 3)
    o, final = xla.scan_chunks({"q": to_scan(q), "k": to_scan(k), "v": to_scan(v), "g": to_scan(g),
                                "beta": to_scan(beta)}, h0, _stream_of(call))
    return jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 2).reshape(v.shape), final


def _xla_backward(call: Call, config):
    del config
    return _differentiate(call, _forward_xla)


def _reference_forward(call: Call, q, k, v, g, beta, h0):
    """The token recurrence over the padded stream (resets at the chunks that start a sequence)."""
    bs, hv, tp = beta.shape
    token_major = lambda x: jnp.moveaxis(x, 1, 2)
    tokens = None
    if call.first is not None:
        pos = jnp.arange(tp)
        tokens = (jnp.repeat(call.seq, TRITON_CHUNK), jnp.repeat(call.first != 0, TRITON_CHUNK) & (pos % TRITON_CHUNK == 0),
                  jnp.repeat(call.last != 0, TRITON_CHUNK) & (pos % TRITON_CHUNK == TRITON_CHUNK - 1))
    o, final = delta_rule_recurrence(token_major(q), token_major(k), token_major(v), token_major(g),
                                     token_major(beta), scale=1.0, initial_state=h0, tokens=tokens)
    if tokens is not None:
        final = jnp.where(_stream_of(call).empty[:, None, None, None], h0, final)
    return jnp.moveaxis(o, 2, 1), final


def kda_recurrence_backward_reference(call: Call):
    """Golden backward: the VJP of the token-by-token recurrence, ``(dq, dk, dv, dg, dβ, dh0)``."""
    return _differentiate(call, _reference_forward)


def _check_backward(q, k, v, g, beta, h0, do, dfinal=None, first=None, seq=None, last=None) -> Call:
    """Arguments of `kda_recurrence_backward`: ``q, k, g [Bs, HV, Tp, K]``,
    ``v, do [Bs, HV, Tp, V]``, ``beta [Bs, HV, Tp]`` (``Tp`` a multiple of 64),
    ``h0`` and optional ``dfinal [N, HV, K, V]``, optional int ``first, seq, last [NT]``."""
    from ...core import checks
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("h0", h0), ("do", do)):
        checks.require_float(name, x)
    checks.require_ndim("beta", beta, 3)
    bs, hv, tp = beta.shape
    if tp % TRITON_CHUNK:
        raise ValueError(f"beta: expected a padded length that is a multiple of {TRITON_CHUNK}, got {tp}")
    checks.require_shape("q", q, (bs, hv, tp, None), "beta.shape + (K,)")
    checks.require_shape("k", k, q.shape, "q.shape")
    checks.require_shape("g", g, q.shape, "q.shape (per-channel decays [Bs, HV, Tp, K])")
    checks.require_shape("v", v, (bs, hv, tp, None), "beta.shape + (V,)")
    checks.require_shape("do", do, v.shape, "v.shape")
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


def _backward_flops(call: Call) -> float:
    bs, hv, tp = call.beta.shape
    return 2.5 * recurrence_flops(bs * tp, hv, call.k.shape[-1], call.v.shape[-1], TRITON_CHUNK, True)


def _backward_examples(dtype):
    out = []
    for bs, hv, nt, kdim, vdim, packed in ((1, 2, 2, 32, 16, False), (1, 2, 3, 16, 32, True)):
        keys = jax.random.split(jax.random.PRNGKey(nt * kdim), 8)
        tp = nt * TRITON_CHUNK
        q = (0.3 * jax.random.normal(keys[0], (bs, hv, tp, kdim))).astype(dtype)
        k = (jax.random.normal(keys[1], (bs, hv, tp, kdim)) / np.sqrt(kdim)).astype(dtype)
        v = jax.random.normal(keys[2], (bs, hv, tp, vdim)).astype(dtype)
        g = (-jax.nn.softplus(jax.random.normal(keys[3], (bs, hv, tp, kdim)))).astype(dtype)
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (bs, hv, tp))).astype(dtype)
        n = 2 if packed else bs
        h0 = jax.random.normal(keys[5], (n, hv, kdim, vdim)).astype(dtype)
        do = jax.random.normal(keys[6], v.shape).astype(dtype)
        dfinal = jax.random.normal(keys[7], h0.shape).astype(dtype)
        meta = (None, None, None)
        if packed:
            meta = (jnp.array([1, 0, 1], jnp.int32), jnp.array([0, 0, 1], jnp.int32), jnp.array([0, 1, 1], jnp.int32))
        out.append(Example(f"HV={hv} NT={nt} K={kdim} V={vdim} packed={packed}",
                           (q, k, v, g, beta, h0, do, dfinal) + meta))
    return out


kda_recurrence_backward_op = register(Op(
    "kda_recurrence_backward",
    family="linear_attention",
    check=_check_backward,
    reference=kda_recurrence_backward_reference,
    implementations=[
        Implementation("triton", _triton_backward, backend="triton", config_type=LinearAttentionConfig,
                       heuristic=linear_attention_heuristic, space=linear_attention_space,
                       requirements=linear_attention_requirements),
        Implementation("xla", _xla_backward),
    ],
    flops=_backward_flops,
    examples=_backward_examples,
))
