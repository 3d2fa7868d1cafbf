"""The Triton forward pipelines: each stage's kernel chained on the kernels'
heads-major layout (``[Bs, HV, Tp, ...]``, flattened per launch; `layout`).

Scalar decays (GDN, and SSD without the delta rule):

    gdn_wy_forward (stages 1–4: U, W)  →  gdn_state_forward (5: S_c, Δ)  →  gdn_output_forward (6: O)

the decay sums and scores recomputed from ``g`` inside each kernel.
Per-channel decays (KDA):

    kda_intra_forward (1–4: U, W, P, Q⊙Γ, K̃, Γ_C)  →  kda_state_forward (5)  →  kda_output_forward (6)

the per-channel factors stored once. The backward ops (`backward`)
recompute these pipelines' states instead of storing them.
"""

from __future__ import annotations

from ...core.pallas import HIGHEST
from .configs import TRITON_CHUNK, LinearAttentionConfig
from .layout import flat
from .triton_intra import gdn_wy_forward, kda_intra_forward
from .triton_output import gdn_output_forward, kda_output_forward
from .triton_scan import gdn_state_forward, kda_state_forward

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
