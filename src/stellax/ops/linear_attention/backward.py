"""The backward of the chunked recurrence, as ops of their own:
``gated_recurrence_backward`` (scalar decays: GDN, SSD) and
``kda_recurrence_backward`` (per-channel decays: KDA).

Each takes the kernels' heads-major layout (`layout`): ``q, k [Bs, HV, Tp, K]``
(q scaled), ``v, do [Bs, HV, Tp, V]``, ``g [Bs, HV, Tp(, K)]``,
``beta [Bs, HV, Tp]`` or ``None``, ``h0`` and optional ``dfinal [N, HV, K, V]``,
optional int32 ``first, seq, last [NT]``; and returns ``(dq, dk, dv, dg, dβ, dh0)``.

The pipeline backwards, mirroring the forward's stages:

* stage 5 reversed: the forward's states are recomputed (`pipeline`), then
  the reverse state scan (`triton_scan.gdn_state_backward` /
  `kda_state_backward`) carries ``dS`` back over the chunks, storing the
  gradient of each chunk's final state, ``dΔ`` and ``dh0``;
* stages 6 → 1 per chunk, in parallel: GDN/SSD recompute ``T`` and pass
  ``dR_v = Tᵀ dΔ`` and the ``[C, C]`` gradients through HBM between five
  kernels (`triton_backward.gdn_intra_backward`); KDA
  first forms the cotangents of its stored factors from the scans
  (`factor_cotangents`, batched matmuls in XLA) and backpropagates them
  through W/U, the solve, the scores and the decay sums
  (`triton_kda_backward.kda_intra_backward`).

The Mosaic TPU implementation (`mosaic_tpu_backward`) recomputes the
forward kernel's chunk-initial states and walks the chunks in reverse in one
kernel, ``dS`` in VMEM, each chunk's gradients the transpose of its forward
function. The XLA implementation is the VJP of the XLA chunked scan on the
same layout; the golden is the VJP of the token-by-token recurrence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core import Call, Implementation, Op, checks, register
from ...core.pallas import F32, HIGHEST, pad_axis
from ...core.precision import resolve_precision
from . import xla
from .configs import (TRITON_CHUNK, LinearAttentionConfig, linear_attention_heuristic, linear_attention_space,
                      triton_requirements)
from .costs import backward_flops
from .examples import backward_examples
from .layout import Stream, flat, kernel_stream, per_chunk
from .pipeline import gdn_states, kda_factors
from .reference import delta_rule_recurrence
from .mosaic_tpu_backward import recurrence_backward
from .tpu_configs import (TpuLinearAttentionConfig, lanes, linear_attention_tpu_backward_heuristic,
                          linear_attention_tpu_backward_space, linear_attention_tpu_requirements)
from .triton_backward import gdn_intra_backward
from .triton_kda_backward import kda_intra_backward
from .triton_scan import gdn_state_backward, kda_state_backward


def _meta(call: Call):
    return None if call.first is None else (call.first, call.seq, call.last)


def stream_of(call: Call) -> Stream:
    """The padded token layout of a backward call (``v [Bs, HV, Tp, V]``,
    packed when ``first, seq, last`` are given)."""
    bs, _, tp = call.v.shape[:3]
    return kernel_stream(bs, tp, TRITON_CHUNK, _meta(call), n_states=call.h0.shape[0])


def _dfinal(call: Call):
    return jnp.zeros(call.h0.shape, F32) if call.dfinal is None else call.dfinal.astype(F32)


def _pass_empty_sequences(call: Call, dh0, dfinal):
    """An empty packed sequence passes its initial state straight through: its ``dh0`` is ``dfinal``."""
    if call.first is None:
        return dh0
    return jnp.where(stream_of(call).empty[:, None, None, None], dfinal, dh0)


# -- Triton: scalar decays ---------------------------------------------------------------
def gdn_triton_backward(call: Call, config: LinearAttentionConfig):
    """The Triton backward of scalar decays: the reverse state scan (``dS`` per
    chunk, ``dΔ``, ``dh0``) and then the per-chunk gradients of q, k, v, g and β
    (recomputing ``T`` per chunk). The forward's W, S_c and
    Δ are recomputed, not stored."""
    q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    meta = _meta(call)
    # The kernels load q, k, v, h0 in any float dtype; the decays go into
    # float32 dots with 0/1 matrices, so g and β are float32 here.
    gf, bf = g.astype(F32), None if beta is None else beta.astype(F32)
    precision = call.precision
    w, states, delta, _ = gdn_states(k, v, gf, bf, h0, meta, config, precision=precision)  # recomputed, not stored
    dfinal = _dfinal(call)
    do = flat(call.do.astype(F32))
    d_states, d_delta, dh0 = gdn_state_backward(flat(q), flat(k), flat(gf), w, do, flat(dfinal), meta,
                                                chunk=TRITON_CHUNK, heads=g.shape[1], config=config,
                                                precision=precision)
    grads = gdn_intra_backward(flat(q), flat(k), flat(v), flat(gf), flat(bf), states, delta, d_states, d_delta, do,
                               chunk=TRITON_CHUNK, config=config, precision=precision)
    grads = [None if d is None else d.reshape(x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta))]
    return tuple(grads) + (_pass_empty_sequences(call, dh0.reshape(h0.shape), dfinal),)


# -- Triton: per-channel decays -------------------------------------------------------------
def factor_cotangents(states, delta, d_delta, d_states, do, precision=HIGHEST):
    """Cotangents of KDA's per-chunk factors (``gamma [.., K, 1]`` per channel)
    from the scans (all ``[..., NT, ...]``): ``O = qg S + P Δ``,
    ``Δ = U − W S``, ``S' = diag(γ) S + kgᵀ Δ`` give ``d qg = dO Sᵀ``,
    ``dP = lower(dO Δᵀ)``, ``dU = dΔ``, ``dW = −dΔ Sᵀ``, ``d kg = Δ dS'ᵀ`` and
    ``dγ = Σ_v S ⊙ dS'`` (``precision`` of the contractions)."""
    ein = functools.partial(jnp.einsum, precision=precision)
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


def kda_triton_backward(call: Call, config: LinearAttentionConfig):
    """The Triton backward of per-channel decays: the forward's factors and
    states recomputed (with ``T`` and the k scores), the reverse state scan,
    the factors' cotangents (`factor_cotangents`) and the per-chunk gradients."""
    q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    meta = _meta(call)
    bs, hv, tp = beta.shape
    f32 = [x.astype(F32) for x in (q, k, v, g, beta, h0)]
    # The forward's factors and states, recomputed (not stored by the forward).
    precision = call.precision
    factors, states, delta, _ = kda_factors(*f32, meta, config, with_solve=True, precision=precision)
    dfinal = _dfinal(call)
    do = flat(call.do.astype(F32))
    d_states, d_delta, dh0 = kda_state_backward(factors["P"], factors["qg"], factors["kg"], factors["W"],
                                                factors["gamma"], do, flat(dfinal), meta,
                                                chunk=TRITON_CHUNK, heads=hv, config=config, precision=precision)
    nt = tp // TRITON_CHUNK
    chunked = lambda x: x.reshape((bs * hv, nt, TRITON_CHUNK) + x.shape[2:])
    cot = factor_cotangents(states, chunked(delta), chunked(d_delta), d_states, chunked(do), precision)
    cot = {name: x.reshape((bs * hv, nt, -1) if name == "gamma" else (bs * hv, tp, x.shape[-1]))
           for name, x in cot.items()}
    grads = kda_intra_backward(*(flat(x) for x in f32[:5]), factors["T"], factors["Sk"], factors["U"],
                               factors["W"], cot, chunk=TRITON_CHUNK, config=config, precision=precision)
    grads = [d.reshape(x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta))]
    dh0 = _pass_empty_sequences(call, dh0.reshape(h0.shape), dfinal)
    return tuple(grads) + (dh0.astype(h0.dtype),)


# -- Mosaic TPU ----------------------------------------------------------------------------
def tpu_backward(per_channel: bool):
    """The Mosaic TPU backward (`mosaic_tpu_backward.recurrence_backward`) of
    scalar or per-channel decays: head sizes padded to 128 lanes (a no-op when
    the forward's kernels padded them already), gradients sliced back."""

    def run(call: Call, config):
        q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
        kdim, vdim = k.shape[-1], v.shape[-1]
        kp, vp = lanes(kdim), lanes(vdim)
        pad = lambda x, d: None if x is None else pad_axis(x.astype(F32), x.ndim - 1, d)
        state = lambda x: None if x is None else pad(pad_axis(x.astype(F32), x.ndim - 2, kp), vp)
        gp = pad(g, kp) if per_channel else g.astype(F32)
        grads = recurrence_backward(flat(pad(q, kp)), flat(pad(k, kp)), flat(pad(v, vp)), flat(gp),
                                    flat(None if beta is None else beta.astype(F32)), flat(state(h0)),
                                    flat(pad(call.do, vp)), flat(state(call.dfinal)), _meta(call),
                                    heads=v.shape[1], per_channel=per_channel, config=config,
                                    precision=call.precision)
        dq, dk, dv, dg, dbeta, dh0 = grads
        out = [dq.reshape(q.shape[:3] + (kp,))[..., :kdim], dk.reshape(k.shape[:3] + (kp,))[..., :kdim],
               dv.reshape(v.shape[:3] + (vp,))[..., :vdim],
               dg.reshape(g.shape[:3] + (kp,))[..., :kdim] if per_channel else dg.reshape(g.shape),
               None if dbeta is None else dbeta.reshape(beta.shape)]
        out = [None if d is None else d.astype(x.dtype) for d, x in zip(out, (q, k, v, g, beta))]
        dh0 = dh0.reshape(h0.shape[:2] + (kp, vp))[..., :kdim, :vdim]
        dh0 = _pass_empty_sequences(call, dh0, _dfinal(call))
        return tuple(out) + (dh0.astype(h0.dtype),)
    return run


# -- XLA and the golden ----------------------------------------------------------------------
def _forward_xla(call: Call, q, k, v, g, beta, h0):
    """The forward on the kernels' layout, in XLA (`xla.scan_chunks`)."""
    stream = stream_of(call)
    # [Bs, HV, NT, C, ...] → [NT, Bs, C, HV, ...]
    to_scan = lambda x: None if x is None else jnp.moveaxis(jnp.moveaxis(per_chunk(x, TRITON_CHUNK), 2, 0), 2, 3)
    o, final = xla.scan_chunks({"q": to_scan(q), "k": to_scan(k), "v": to_scan(v), "g": to_scan(g),
                                "beta": to_scan(beta)}, h0, stream, precision=call.precision)
    return jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 2).reshape(v.shape), final


def _differentiate(call: Call, forward):
    """``(dq, dk, dv, dg, dβ or None, dh0)``: the VJP of ``forward(call, q, k, v, g, beta, h0)``
    for the call's cotangents ``do`` and ``dfinal``, in float32."""
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
    return _differentiate(call, _forward_xla)


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
        final = jnp.where(stream_of(call).empty[:, None, None, None], h0, final)
    return jnp.moveaxis(o, 2, 1), final


def recurrence_backward_reference(call: Call):
    """Golden backward: the VJP of the token-by-token recurrence, ``(dq, dk, dv, dg, dβ, dh0)``."""
    return _differentiate(call, _reference_forward)


# -- the ops -------------------------------------------------------------------------------------
def backward_checker(per_channel: bool):
    """The argument check of a recurrence backward op: ``q, k [Bs, HV, Tp, K]``,
    ``v, do [Bs, HV, Tp, V]``, ``g [Bs, HV, Tp]`` (``[Bs, HV, Tp, K]`` with
    ``per_channel``), ``beta [Bs, HV, Tp]`` (required with ``per_channel``,
    else optional), ``h0`` and optional ``dfinal [N, HV, K, V]``, optional int
    ``first, seq, last [NT]`` (``Tp`` a multiple of the chunk, 64), and the
    forward's ``precision`` (`stellax.core.precision`; ``None``: ``"highest"``)."""
    return functools.partial(_check_backward, per_channel=per_channel)


def _check_backward(q, k, v, g, beta, h0, do, dfinal=None, first=None, seq=None, last=None, *,
                    per_channel: bool, precision=None) -> Call:
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
                 "first": first, "seq": seq, "last": last}, {"precision": resolve_precision(precision)})


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
            Implementation("mosaic_tpu", tpu_backward(per_channel), backend="mosaic_tpu",
                           config_type=TpuLinearAttentionConfig, heuristic=linear_attention_tpu_backward_heuristic,
                           space=linear_attention_tpu_backward_space, requirements=linear_attention_tpu_requirements),
            Implementation("triton", triton_backward, backend="triton", config_type=LinearAttentionConfig,
                           heuristic=linear_attention_heuristic, space=linear_attention_space,
                           requirements=triton_requirements(per_channel)),
            Implementation("xla", _xla_backward),
        ],
        flops=backward_flops,
        examples=backward_examples(per_channel=per_channel),
    ))


gated_recurrence_backward_op = recurrence_backward_op("gated_recurrence_backward", gdn_triton_backward,
                                                      per_channel=False)
kda_recurrence_backward_op = recurrence_backward_op("kda_recurrence_backward", kda_triton_backward, per_channel=True)
