"""The Triton backend of the chunked recurrence (the ``kernels`` of its row in
`base.BACKENDS`): each stage's kernel chained on the kernels' heads-major
layout (``[Bs, HV, Tp, ...]``, flattened per launch; `layout`), chunks of
`TRITON_CHUNK`. `forward` runs the forward pipeline, `backward` the backward
ops' Triton implementation.

Scalar decays (GDN, and SSD without the delta rule):

    gdn_wy_forward (stages 1–4: U, W)  →  gdn_state_forward (5: S_c, Δ)  →  gdn_output_forward (6: O)

the decay sums and scores recomputed from ``g`` inside each kernel.
Per-channel decays (KDA):

    kda_intra_forward (1–4: U, W, P, Q⊙Γ, K̃, Γ_C)  →  kda_state_forward (5)  →  kda_output_forward (6)

the per-channel factors stored once. The backward pipelines recompute these
states instead of storing them:

* stage 5 reversed: the reverse state scan (`triton_scan.gdn_state_backward` /
  `kda_state_backward`) carries ``dS`` back over the chunks, storing the
  gradient of each chunk's final state, ``dΔ`` and ``dh0``;
* stages 6 → 1 per chunk, in parallel: GDN/SSD recompute ``T`` and pass
  ``dR_v = Tᵀ dΔ`` and the ``[C, C]`` gradients through HBM between five
  kernels (`triton_backward.gdn_intra_backward`); KDA first forms the
  cotangents of its stored factors from the scans (`factor_cotangents`,
  batched matmuls in XLA) and backpropagates them through W/U, the solve, the
  scores and the decay sums (`triton_kda_backward.kda_intra_backward`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from ...core import Call
from ...core.pallas import F32, HIGHEST
from .configs import TRITON_CHUNK, LinearAttentionConfig
from .layout import call_meta, dfinal_of, flat, pass_empty_sequences
from .triton_backward import gdn_intra_backward
from .triton_intra import gdn_wy_forward, kda_intra_forward
from .triton_kda_backward import kda_intra_backward
from .triton_output import gdn_output_forward, kda_output_forward
from .triton_scan import gdn_state_backward, gdn_state_forward, kda_state_backward, kda_state_forward

#: The names of `kda_factors`' per-chunk factors, in `kda_intra_forward`'s order.
KDA_FACTORS = ("U", "W", "P", "qg", "kg", "gamma", "T", "Sk")


def gdn_states(k, v, g, beta, h0, meta, config: LinearAttentionConfig, *, precision=HIGHEST):
    """Stages 1–5 for scalar decays: ``(W or None, S_c [BH, NT, K, V], Δ [BH, Tp, V], final [N·HV, K, V])``.

    Args: ``k [Bs, HV, Tp, K]``, ``v [Bs, HV, Tp, V]``, float32 ``g, beta [Bs, HV, Tp]``
    (``beta`` ``None``: no delta rule, ``U = V``), ``h0 [N, HV, K, V]``, ``meta``
    ``None`` or int32 ``(first, seq, last) [NT]``; ``precision`` (a resolved
    `jax.lax.Precision`) of every kernel's matmuls (`core.pallas.triton_precision`).
    """
    kf, vf, gf = flat(k), flat(v), flat(g)
    if beta is not None:
        u, w = gdn_wy_forward(kf, vf, gf, flat(beta), chunk=TRITON_CHUNK, config=config, precision=precision)
    else:
        u, w = vf, None
    states, delta, final = gdn_state_forward(w, u, kf, gf, flat(h0), meta, chunk=TRITON_CHUNK, heads=g.shape[1],
                                             config=config, precision=precision)
    return w, states, delta, final


def gdn_forward(q, k, v, g, beta, h0, meta, config: LinearAttentionConfig, *, precision=HIGHEST):
    """The scalar-decay recurrence: float32 ``(o [Bs, HV, Tp, V], final [N, HV, K, V])``
    (``q`` scaled; arguments as in `gdn_states`)."""
    _, states, delta, final = gdn_states(k, v, g, beta, h0, meta, config, precision=precision)
    o = gdn_output_forward(flat(q), flat(k), flat(g), delta, states, chunk=TRITON_CHUNK, config=config,
                           precision=precision)
    return o.reshape(v.shape), final.reshape(h0.shape)


def kda_factors(q, k, v, g, beta, h0, meta, config: LinearAttentionConfig, with_solve: bool = False, *,
                precision=HIGHEST):
    """Stages 1–5 for per-channel decays: ``(factors, S_c, Δ, final)``.

    Args: ``q, k, g [Bs, HV, Tp, K]`` float32, ``v [Bs, HV, Tp, V]``, ``beta
    [Bs, HV, Tp]``, ``h0``, ``meta`` as in `gdn_states`. ``factors`` maps the
    names of `KDA_FACTORS` to `kda_intra_forward`'s outputs (``T`` and ``Sk``
    only ``with_solve``).
    """
    out = kda_intra_forward(flat(q), flat(k), flat(v), flat(g), flat(beta), chunk=TRITON_CHUNK, config=config,
                            with_solve=with_solve, precision=precision)
    factors = dict(zip(KDA_FACTORS, out))
    states, delta, final = kda_state_forward(factors["W"], factors["U"], factors["kg"], factors["gamma"], flat(h0),
                                             meta, chunk=TRITON_CHUNK, heads=g.shape[1], config=config,
                                             precision=precision)
    return factors, states, delta, final


def kda_forward(q, k, v, g, beta, h0, meta, config: LinearAttentionConfig, *, precision=HIGHEST):
    """The per-channel recurrence: float32 ``(o [Bs, HV, Tp, V], final [N, HV, K, V])``
    (``q`` scaled; arguments as in `kda_factors`)."""
    factors, states, delta, final = kda_factors(q, k, v, g, beta, h0, meta, config, precision=precision)
    o = kda_output_forward(factors["qg"], factors["P"], delta, states, chunk=TRITON_CHUNK, config=config,
                           precision=precision)
    return o.reshape(v.shape), final.reshape(h0.shape)


def layout_chunk(config: LinearAttentionConfig) -> int:
    """Tokens per chunk of the layout: always `TRITON_CHUNK`."""
    del config
    return TRITON_CHUNK


def forward(q, k, v, g, beta, h0, meta, config: LinearAttentionConfig, *, per_channel: bool, precision=HIGHEST):
    """The recurrence of scalar (`gdn_forward`) or per-channel (`kda_forward`, ``per_channel``) decays."""
    run = kda_forward if per_channel else gdn_forward
    return run(q, k, v, g, beta, h0, meta, config, precision=precision)


# -- backward ----------------------------------------------------------------------------
def gdn_triton_backward(call: Call, config: LinearAttentionConfig):
    """The Triton backward of scalar decays: the reverse state scan (``dS`` per
    chunk, ``dΔ``, ``dh0``) and then the per-chunk gradients of q, k, v, g and β
    (recomputing ``T`` per chunk). The forward's W, S_c and
    Δ are recomputed, not stored."""
    q, k, v, g, beta, h0 = (call.arrays[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    meta = call_meta(call)
    # The kernels load q, k, v, h0 in any float dtype; the decays go into
    # float32 dots with 0/1 matrices, so g and β are float32 here.
    gf, bf = g.astype(F32), None if beta is None else beta.astype(F32)
    precision = call.precision
    w, states, delta, _ = gdn_states(k, v, gf, bf, h0, meta, config, precision=precision)  # recomputed, not stored
    dfinal = dfinal_of(call)
    do = flat(call.do.astype(F32))
    d_states, d_delta, dh0 = gdn_state_backward(flat(q), flat(k), flat(gf), w, do, flat(dfinal), meta,
                                                chunk=TRITON_CHUNK, heads=g.shape[1], config=config,
                                                precision=precision)
    grads = gdn_intra_backward(flat(q), flat(k), flat(v), flat(gf), flat(bf), states, delta, d_states, d_delta, do,
                               chunk=TRITON_CHUNK, config=config, precision=precision)
    grads = [None if d is None else d.reshape(x.shape).astype(x.dtype) for d, x in zip(grads, (q, k, v, g, beta))]
    return tuple(grads) + (pass_empty_sequences(call, dh0.reshape(h0.shape), dfinal),)


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
    meta = call_meta(call)
    bs, hv, tp = beta.shape
    f32 = [x.astype(F32) for x in (q, k, v, g, beta, h0)]
    # The forward's factors and states, recomputed (not stored by the forward).
    precision = call.precision
    factors, states, delta, _ = kda_factors(*f32, meta, config, with_solve=True, precision=precision)
    dfinal = dfinal_of(call)
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
    dh0 = pass_empty_sequences(call, dh0.reshape(h0.shape), dfinal)
    return tuple(grads) + (dh0.astype(h0.dtype),)


def backward(call: Call, config: LinearAttentionConfig, *, per_channel: bool):
    """The backward ops' Triton implementation: `kda_triton_backward` (``per_channel``) or `gdn_triton_backward`."""
    return (kda_triton_backward if per_channel else gdn_triton_backward)(call, config)
