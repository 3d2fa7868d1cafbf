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

from ...core import Call
from . import triton_kda as kernels
from .configs import TRITON_CHUNK, linear_attention_heuristic
from .core import _stream_of, kernel_recurrence, recurrence_backward_op
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
    return _kda_recurrence(q, k, v, g, beta, h0, meta, config)


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


kda_recurrence_backward_op = recurrence_backward_op("kda_recurrence_backward", _triton_backward, per_channel=True)
_kda_recurrence = kernel_recurrence(_forward, kda_recurrence_backward_op)
