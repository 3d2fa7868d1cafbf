"""Context-parallel gated delta rule (GDN) and KDA: pass recurrent state, not K/V.

Per value head the recurrence over one shard's tokens maps the state it
starts from, ``S [K, V]``, affinely to the state it ends with, column by
column (each column of ``S`` evolves independently):

    S_out = M S_in + C,      M [K, K],  C [K, V]

and every output token is affine in ``S_in`` too:
``o_t = o⁰_t + S_inᵀ q̃_t`` with ``o⁰`` the output from a zero state and
``q̃_t = scale · M_tᵀ q_t`` (``M_t`` the map from the shard start to ``t``).

One local run of the chunked kernel (`stellax.chunk_gated_delta_rule` /
`stellax.chunk_kda`, so every implementation and its backward apply) with
the value dim extended by ``K`` identity columns computes all of it at once:

    v' = [v | 0],   S'_0 = [0 | I]   ⇒   final' = [C | M],   o' = [o⁰ | q̃]

The ``(M, C)`` summaries (``K·(K+V)`` floats per head, independent of ``T``)
are all-gathered over the axis; each device folds the shards before it,
``S_in(i) = M_{i−1}(… (M_0 S_0 + C_0) …) + C_{i−1}`` from the user's
``initial_state`` ``S_0``, and corrects its outputs with one
``[L, K] × [K, V]`` product. The final state is the last shard's
``M S_in + C``. Everything is plain differentiable JAX around the op, so
gradients flow back through the gathered summaries to every shard.

Cost: the local kernel runs on ``V + K`` value columns instead of ``V``;
communication is ``(P−1)·K·(K+V)`` floats per head per device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..core import checks
from ..core.precision import resolve_precision
from ..ops.linear_attention import chunk_gated_delta_rule, chunk_kda
from .attention import _check_axis, place

F32 = jnp.float32


def _summarized_run(op, q, k, v, g, beta, op_kwargs):
    """``(o⁰ [B, L, HV, V], q̃ [B, L, HV, K], M [B, HV, K, K], C [B, HV, K, V])`` float32."""
    b, _, hv, vdim = v.shape
    kdim = q.shape[-1]
    v_ext = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (kdim,), v.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(kdim, dtype=F32), (b, hv, kdim, kdim))
    h0 = jnp.concatenate([jnp.zeros((b, hv, kdim, vdim), F32), eye], axis=-1)
    o_ext, final = op(q, k, v_ext, g, beta, initial_state=h0, output_final_state=True, **op_kwargs)
    o_ext, final = o_ext.astype(F32), final.astype(F32)
    return o_ext[..., :vdim], o_ext[..., vdim:], final[..., vdim:], final[..., :vdim]


def _body(op, axis, axis_size, op_kwargs, param_names):
    precision = op_kwargs["precision"]  # resolved: the local op's and the shard combination's

    def body(q, k, v, g, beta, s0, params):
        kwargs = dict(op_kwargs)
        kwargs.update({name: p[0] for name, p in zip(param_names, params)})
        o0, qt, m, c = _summarized_run(op, q, k, v, g, beta, kwargs)
        ms = lax.all_gather(m, axis, axis=0, tiled=False)  # [P, B, HV, K, K]
        cs = lax.all_gather(c, axis, axis=0, tiled=False)  # [P, B, HV, K, V]
        state = s0[0].astype(F32)
        starts = [state]
        for j in range(axis_size - 1):
            state = jnp.einsum("bhij,bhjv->bhiv", ms[j], state, precision=precision) + cs[j]
            starts.append(state)
        s_in = jnp.stack(starts)[lax.axis_index(axis)]  # this shard's incoming state
        o = o0 + jnp.einsum("bthk,bhkv->bthv", qt, s_in, precision=precision)
        s_out = jnp.einsum("bhij,bhjv->bhiv", m, s_in, precision=precision) + c
        return o.astype(v.dtype), s_out[None]

    return body


def _context_parallel(op, per_channel, q, k, v, g, beta, *, mesh, axis_name, initial_state, output_final_state,
                      params, op_kwargs):
    _check_axis(mesh, axis_name, "axis_name")
    if isinstance(axis_name, (tuple, list)):
        raise ValueError(f"axis_name: expected one mesh axis name, got {axis_name!r}")
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, 4)
    v = checks.require_float("v", v)
    checks.require_ndim("v", v, 4)
    b, t, _, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    p_size = dict(mesh.shape)[axis_name]
    if t % p_size:
        raise ValueError(f"q: sequence length T ({t}) must be divisible by the size of mesh axis "
                         f"{axis_name!r} ({p_size})")
    if op_kwargs.get("cu_seqlens") is not None:
        raise ValueError("cu_seqlens: packed sequences are not supported by context parallel linear attention "
                         "(shard each sequence on its own, batch dim B)")
    op_kwargs = {key: val for key, val in op_kwargs.items() if key != "cu_seqlens"}
    op_kwargs["precision"] = resolve_precision(op_kwargs.get("precision"))
    if initial_state is None:
        s0 = jnp.zeros((b, hv, kdim, vdim), F32)
    else:
        s0 = checks.require_float("initial_state", initial_state)
        checks.require_shape("initial_state", s0, (b, hv, kdim, vdim), "[B, HV, K, V]")
    names = tuple(name for name, val in params.items() if val is not None)
    tiled = lambda x: jnp.broadcast_to(x[None], (p_size,) + x.shape)
    param_arrays = tuple(tiled(params[name]) for name in names)
    seq = P(None, axis_name)
    rep = P(axis_name)
    specs = (seq, seq, seq, seq, seq, rep, tuple(rep for _ in names))
    fn = jax.shard_map(_body(op, axis_name, p_size, op_kwargs, names), mesh=mesh, in_specs=specs,
                       out_specs=(seq, rep), check_vma=False)
    args = (q, k, v, g, beta, tiled(s0), param_arrays)
    placed = place(mesh, args[:6], specs[:6]) + (place(mesh, param_arrays, specs[6]),)
    o, states = fn(*placed)
    return o, (states[-1] if output_final_state else None)


def context_parallel_gated_delta_rule(q, k, v, g, beta, *, mesh, axis_name, scale=None, initial_state=None,
                                      output_final_state=False, use_qk_l2norm=False, chunk_size=64,
                                      implementation=None, cu_seqlens=None, precision=None):
    """Gated DeltaNet (`stellax.chunk_gated_delta_rule`) with the sequence split over ``axis_name``.

    Args: as `stellax.chunk_gated_delta_rule` (``q, k [B, T, H, K]``,
    ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``, ``initial_state [B, HV, K, V]``),
    global arrays whose sequence axis is sharded over ``axis_name`` of
    ``mesh`` (contiguous: no load balancing is needed, the work is even).
    ``T`` must be divisible by the axis size; ``cu_seqlens`` is not supported.
    ``precision`` (`stellax.core.precision`) applies to the local op and to the
    combination of the shards' state maps.

    Returns ``(o [B, T, HV, V] sharded like v, final_state [B, HV, K, V] float32 or None)``,
    differentiable in every float input.
    """
    kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, implementation=implementation,
                  cu_seqlens=cu_seqlens, precision=precision)
    return _context_parallel(chunk_gated_delta_rule, False, q, k, v, g, beta, mesh=mesh, axis_name=axis_name,
                             initial_state=initial_state, output_final_state=output_final_state, params={},
                             op_kwargs=kwargs)


def context_parallel_kda(q, k, v, g, beta, *, mesh, axis_name, scale=None, initial_state=None,
                         output_final_state=False, use_qk_l2norm=False, chunk_size=64, A_log=None, dt_bias=None,
                         lower_bound=None, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                         implementation=None, cu_seqlens=None, precision=None):
    """Kimi Delta Attention (`stellax.chunk_kda`, per-channel decay ``g [B, T, HV, K]``)
    with the sequence split over ``axis_name``; see `context_parallel_gated_delta_rule`.
    ``A_log``/``dt_bias`` (the fused gate's parameters) are replicated and differentiable."""
    kwargs = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, implementation=implementation,
                  cu_seqlens=cu_seqlens, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, precision=precision)
    return _context_parallel(chunk_kda, True, q, k, v, g, beta, mesh=mesh, axis_name=axis_name,
                             initial_state=initial_state, output_final_state=output_final_state,
                             params={"A_log": A_log, "dt_bias": dt_bias}, op_kwargs=kwargs)
