"""Torch front ends of stellax's SPMD ops: expert-parallel MoE
(`moe_mlp_expert_parallel`) and context-parallel attention
(`context_parallel_attention`, `context_parallel_gated_delta_rule`,
`context_parallel_kda`) over a JAX mesh.

How a call runs: the torch tensors hold the *global* arrays on one device
(``cpu`` or ``cuda:i``). They cross to JAX over DLPack (zero-copy), are
placed on the mesh with the sharding the SPMD function expects (tokens /
experts / the sequence axis split over the mesh axis: each device receives
only its shard), the jitted ``jax.shard_map`` program runs on all the mesh's
devices, and the output is gathered back onto the input tensor's device and
crosses back to torch. Gradients: the JAX VJP of the whole placement + SPMD
program (so the backward is SPMD too), through the same custom-op machinery
as every other front end (`torch.compile(fullgraph=True)` traces them; fake
implementations give the shapes).

Scope: one process driving every device of the mesh (a single host: 8 GPUs,
or CPU devices simulated with ``--xla_force_host_platform_device_count``).
A multi-process (multi-host) mesh cannot be fed from one torch tensor: there,
call the JAX functions (`stellax.moe_mlp_expert_parallel`,
`stellax.parallel.context_parallel_attention`) from JAX, or inside each
process use `stellax.torch.moe_mlp` / `dot_product_attention` on the local
shard with torch's own collectives.

Meshes are static options: pass a `jax.sharding.Mesh` (registered on first
use under a name derived from its axes and devices) or the name returned by
`register_mesh` — the name form is what `torch.compile` should see.
"""

from __future__ import annotations

import jax
import numpy as np
import torch
from jax import Array
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import stellax
from stellax import parallel

from .options import decode_window, encode_window, int32, opt_float, opt_int, precision_name, registered_name
from .registry import _cached, define_op

_MESHES: dict = {}


def register_mesh(mesh) -> str:
    """Register a `jax.sharding.Mesh` for the torch SPMD front ends and return
    its name (``"axis=size,...@platform:device ids[axis types]"``); the
    functions here accept either the mesh or the name (pass the name inside
    `torch.compile`d code)."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    axes = ",".join(f"{name}={size}" for name, size in mesh.shape.items())
    ids = ",".join(str(d.id) for d in np.asarray(mesh.devices).reshape(-1))
    types = ",".join(str(t).split(".")[-1] for t in getattr(mesh, "axis_types", ()))
    name = f"{axes}@{mesh.devices.flat[0].platform}:{ids}" + (f"[{types}]" if types else "")
    _MESHES.setdefault(name, mesh)
    return name


def _mesh_name(mesh) -> str:
    return registered_name("mesh", mesh, _MESHES, register_mesh,
                           "no mesh registered under {value!r}; pass a jax.sharding.Mesh or the name "
                           "register_mesh returned (registered: {registered})")


def _device_name(t: torch.Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index or 0}"


def _jax_device(name: str):
    if name == "cpu":
        return jax.devices("cpu")[0]
    return jax.devices("gpu")[int(name.split(":")[1])]


def _place(arrays, mesh, specs):
    """Put each array (or None) on ``mesh`` with its `PartitionSpec`."""
    return [None if a is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]


def _gather(outs, device):
    return tuple(jax.device_put(o, device) for o in outs)


# -- expert parallelism ------------------------------------------------------------------
def _ep(x: Array, router_logits: Array, w_gate_up: Array, w_down: Array, bias: Array | None, *, mesh: str,
        axis_name: str, device: str, top_k: int, scoring: str, num_groups: int | None, top_k_groups: int | None,
        normalize_weights: bool, routed_scaling: float, capacity_factor: float | None, activation: str,
        dispatch: str, collective: str, implementation: str | None) -> Array:
    m = _MESHES[mesh]
    kwargs = dict(top_k=top_k, scoring=scoring, num_groups=num_groups, top_k_groups=top_k_groups,
                  normalize_weights=normalize_weights, routed_scaling=routed_scaling,
                  capacity_factor=capacity_factor, activation=activation, dispatch=dispatch, collective=collective,
                  implementation=implementation)
    cache_key = ("moe_mlp_expert_parallel", "spmd", mesh, axis_name, tuple(sorted(kwargs.items())), bias is None)
    spmd = _cached(cache_key, lambda: jax.jit(lambda x, lg, wgu, wd, b: stellax.moe_mlp_expert_parallel(
        x, lg, wgu, wd, mesh=m, axis_name=axis_name, bias=b, **kwargs)))
    shard = P(axis_name)
    placed = _place([x, router_logits, w_gate_up, w_down, bias], m, [shard, shard, shard, shard, P()])
    return _gather((spmd(*placed),), _jax_device(device))[0]


moe_mlp_expert_parallel_op = define_op("moe_mlp_expert_parallel", _ep, no_grad=("bias",), jit=False)


def moe_mlp_expert_parallel(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor, *, mesh, axis_name: str, top_k: int, scoring: str = "softmax",
                            bias: torch.Tensor | None = None, num_groups: int | None = None,
                            top_k_groups: int | None = None, normalize_weights: bool = True,
                            routed_scaling: float = 1.0, capacity_factor: float | None = None,
                            activation: str = "silu", dispatch: str = "all_to_all", collective: str = "auto",
                            implementation: str | None = None) -> torch.Tensor:
    """`stellax.moe_mlp_expert_parallel` on torch tensors: the MoE MLP with
    tokens and experts sharded over ``axis_name`` of ``mesh``.

    Args:
      x: ``[T, D]`` global tokens; router_logits: ``[T, E]``;
        w_gate_up: ``[E, D, 2, F]``; w_down: ``[E, F, D]`` (float32/bfloat16/
        float16; ``T`` and ``E`` divisible by the axis size).
      mesh: a `jax.sharding.Mesh` or a `register_mesh` name.
      axis_name: the mesh axis experts (and tokens) are split over.
      top_k, scoring, bias (``[E]``, selection only), num_groups, top_k_groups,
        normalize_weights, routed_scaling, capacity_factor, activation: as in
        `moe_mlp`; dispatch ``"all_to_all"``/``"all_gather"``, collective
        ``"auto"``/``"ragged"``/``"padded"``: as in JAX.

    Returns ``[T, D]`` on ``x``'s device, equal to the single-device `moe_mlp`.
    Differentiable in x, the router logits and both expert weights."""
    return moe_mlp_expert_parallel_op(
        x, router_logits, w_gate_up, w_down, bias, _mesh_name(mesh), str(axis_name), _device_name(x), int(top_k),
        scoring, num_groups, top_k_groups, bool(normalize_weights), float(routed_scaling), opt_float(capacity_factor),
        activation, dispatch, collective, implementation)


# -- context-parallel attention -----------------------------------------------------------------
def _seq_spec(strategy, axis_name, ulysses_axis, ring_axis):
    seq = (ring_axis, ulysses_axis) if strategy == "usp" else axis_name
    return P(None, seq), P(None, seq, None, None)


def _cp_attention(query: Array, key: Array, value: Array, q_segment_ids: Array | None,
                  kv_segment_ids: Array | None, sinks: Array | None, *, mesh: str, device: str,
                  axis_name: str | None, strategy: str, ulysses_axis: str | None, ring_axis: str | None,
                  load_balance: str | None, is_causal: bool, local_window_size: list[int] | None,
                  chunk_size: int | None, scale: float | None, logits_soft_cap: float | None,
                  precision: str | None, implementation: str | None) -> tuple[Array, Array]:
    m = _MESHES[mesh]
    kwargs = dict(axis_name=axis_name, strategy=strategy, ulysses_axis=ulysses_axis, ring_axis=ring_axis,
                  load_balance=load_balance, is_causal=is_causal, local_window_size=decode_window(local_window_size),
                  chunk_size=chunk_size, scale=scale, logits_soft_cap=logits_soft_cap, precision=precision,
                  implementation=implementation)
    cache_key = ("context_parallel_attention", "spmd", mesh, tuple(sorted(kwargs.items())), q_segment_ids is None,
                 sinks is None)
    spmd = _cached(cache_key, lambda: jax.jit(lambda q, k, v, qs, ks, s: parallel.context_parallel_attention(
        q, k, v, mesh=m, q_segment_ids=qs, kv_segment_ids=ks, sinks=s, return_residuals=True, **kwargs)))
    s_spec, x_spec = _seq_spec(strategy, axis_name, ulysses_axis, ring_axis)
    placed = _place([query, key, value, q_segment_ids, kv_segment_ids, sinks], m,
                    [x_spec, x_spec, x_spec, s_spec, s_spec, P()])
    return _gather(spmd(*placed), _jax_device(device))


context_parallel_attention_op = define_op("context_parallel_attention", _cp_attention, jit=False)


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, mesh,
                               axis_name: str | None = None, strategy: str = "all_gather",
                               ulysses_axis: str | None = None, ring_axis: str | None = None,
                               load_balance: str | None = None, is_causal: bool = False, local_window_size=None,
                               chunk_size: int | None = None, segment_ids: torch.Tensor | None = None,
                               q_segment_ids: torch.Tensor | None = None,
                               kv_segment_ids: torch.Tensor | None = None, scale: float | None = None,
                               logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                               precision: str | None = None, return_residuals: bool = False,
                               implementation: str | None = None):
    """`stellax.parallel.context_parallel_attention` on torch tensors: self-attention
    with the sequence split over mesh axes.

    Args:
      query: ``[B, T, N, H]``; key, value: ``[B, T, K, H]`` / ``[B, T, K, Hv]``
        (GQA), global tensors in float32/bfloat16/float16.
      mesh: a `jax.sharding.Mesh` or a `register_mesh` name.
      axis_name, strategy (``"all_gather"``, ``"ulysses"``, ``"ring"``,
        ``"usp"``), ulysses_axis, ring_axis, load_balance (``None``,
        ``"zigzag"``, ``"striped"``: the layout the inputs are already in),
        is_causal, local_window_size (``left`` or ``(left, right)``; ``None``
        for an unbounded side), chunk_size, scale, logits_soft_cap, precision,
        implementation: as in JAX.
      segment_ids / q_segment_ids, kv_segment_ids: ``[B, T]`` integers.
      sinks: ``[N]`` per-head sink logits.
      return_residuals: also return ``lse [B, N, T]`` float32.

    Returns ``out [B, T, N, Hv]`` (or ``(out, lse)``) on ``query``'s device.
    Differentiable in query, key, value and sinks."""
    if segment_ids is not None:
        if q_segment_ids is not None or kv_segment_ids is not None:
            raise ValueError("segment_ids: pass either segment_ids or q_segment_ids/kv_segment_ids, not both")
        q_segment_ids = kv_segment_ids = segment_ids
    window = encode_window(local_window_size, int_means="left")  # an int w: (w, 0), w past keys
    out, lse = context_parallel_attention_op(
        query, key, value, int32(q_segment_ids, "q_segment_ids"), int32(kv_segment_ids, "kv_segment_ids"), sinks, _mesh_name(mesh), _device_name(query),
        axis_name, strategy, ulysses_axis, ring_axis, load_balance, bool(is_causal), window, opt_int(chunk_size),
        opt_float(scale), opt_float(logits_soft_cap), precision, implementation)
    return (out, lse) if return_residuals else out


# -- context-parallel linear attention ----------------------------------------------------------
def _cp_linear(fn_name: str):
    fn = getattr(parallel, fn_name)

    def spmd_call(q, k, v, g, beta, initial_state, A_log, dt_bias, mesh, device, axis_name, kwargs):
        m = _MESHES[mesh]
        params = {} if fn_name.endswith("gated_delta_rule") else {"A_log": A_log, "dt_bias": dt_bias}
        present = tuple(name for name, value in params.items() if value is not None)
        cache_key = (fn_name, "spmd", mesh, tuple(sorted(kwargs.items())), initial_state is None, present)

        def build():
            def spmd(q, k, v, g, beta, s0, *param_values):
                o, state = fn(q, k, v, g, beta, mesh=m, initial_state=s0, output_final_state=True,
                              **dict(zip(present, param_values)), **kwargs)
                return o, state
            return jax.jit(spmd)
        seq = P(None, axis_name)
        placed = _place([q, k, v, g, beta, initial_state, *[params[n] for n in present]], m,
                        [seq] * 5 + [P()] * (1 + len(present)))
        return _gather(_cached(cache_key, build)(*placed), _jax_device(device))

    if fn_name.endswith("gated_delta_rule"):
        def run(q: Array, k: Array, v: Array, g: Array, beta: Array, initial_state: Array | None,
                A_log: Array | None, dt_bias: Array | None, *, mesh: str, device: str, axis_name: str,
                scale: float | None, use_qk_l2norm: bool, chunk_size: int,
                implementation: str | None, precision: str | None) -> tuple[Array, Array]:
            kwargs = dict(axis_name=axis_name, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                          implementation=implementation, precision=precision)
            return spmd_call(q, k, v, g, beta, initial_state, A_log, dt_bias, mesh, device, axis_name, kwargs)
    else:
        def run(q: Array, k: Array, v: Array, g: Array, beta: Array, initial_state: Array | None,
                A_log: Array | None, dt_bias: Array | None, *, mesh: str, device: str, axis_name: str,
                scale: float | None, use_qk_l2norm: bool, chunk_size: int, implementation: str | None,
                lower_bound: float | None, use_gate_in_kernel: bool,
                use_beta_sigmoid_in_kernel: bool, precision: str | None) -> tuple[Array, Array]:
            kwargs = dict(axis_name=axis_name, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                          implementation=implementation, lower_bound=lower_bound,
                          use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          precision=precision)
            return spmd_call(q, k, v, g, beta, initial_state, A_log, dt_bias, mesh, device, axis_name, kwargs)
    return run


context_parallel_gated_delta_rule_op = define_op(
    "context_parallel_gated_delta_rule", _cp_linear("context_parallel_gated_delta_rule"), jit=False)
context_parallel_kda_op = define_op("context_parallel_kda", _cp_linear("context_parallel_kda"), jit=False)


def _linear_common(mesh, q, axis_name, scale, use_qk_l2norm, chunk_size, implementation):
    return (_mesh_name(mesh), _device_name(q), str(axis_name), opt_float(scale), bool(use_qk_l2norm),
            int(chunk_size), implementation)


def context_parallel_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, *, mesh, axis_name: str, scale: float | None = None,
                                      initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                                      use_qk_l2norm: bool = False, chunk_size: int = 64,
                                      implementation: str | None = None, precision=None):
    """`stellax.parallel.context_parallel_gated_delta_rule` on torch tensors:
    Gated DeltaNet with the sequence split over ``axis_name`` of ``mesh``.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``,
    ``initial_state [B, HV, K, V]`` (float32) — global tensors, ``T``
    divisible by the axis size (packed ``cu_seqlens`` are not supported).
    Returns ``(o [B, T, HV, V], final_state [B, HV, K, V] float32 or None)`` on
    ``q``'s device. Differentiable in every float input. ``precision``: ``None``
    or a `jax.lax.Precision` (name) of the float32 contractions (`stellax.core.precision`)."""
    o, state = context_parallel_gated_delta_rule_op(
        q, k, v, g, beta, initial_state, None, None,
        *_linear_common(mesh, q, axis_name, scale, use_qk_l2norm, chunk_size, implementation),
        precision_name(precision))
    return o, (state if output_final_state else None)


def context_parallel_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                         mesh, axis_name: str, scale: float | None = None, initial_state: torch.Tensor | None = None,
                         output_final_state: bool = False, use_qk_l2norm: bool = False, chunk_size: int = 64,
                         A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                         lower_bound: float | None = None, use_gate_in_kernel: bool = False,
                         use_beta_sigmoid_in_kernel: bool = False, implementation: str | None = None,
                         precision=None):
    """`stellax.parallel.context_parallel_kda` on torch tensors: Kimi Delta
    Attention (per-channel decay ``g [B, T, HV, K]``) with the sequence split
    over ``axis_name``; ``A_log``/``dt_bias`` (the fused gate's parameters) are
    replicated. Shapes and returns as `context_parallel_gated_delta_rule`.
    Differentiable in every float input; ``precision`` as in `context_parallel_gated_delta_rule`."""
    o, state = context_parallel_kda_op(
        q, k, v, g, beta, initial_state, A_log, dt_bias,
        *_linear_common(mesh, q, axis_name, scale, use_qk_l2norm, chunk_size, implementation),
        opt_float(lower_bound), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel), precision_name(precision))
    return o, (state if output_final_state else None)


# -- load-balancing layouts (pure torch) ----------------------------------------------------------
def _layout_index(length: int, axis_size: int, strategy, device, inverse: bool) -> torch.Tensor:
    perm = parallel.load_balance_permutation(int(length), int(axis_size), strategy)
    if inverse:
        perm = np.argsort(perm)
    return torch.as_tensor(np.asarray(perm, np.int64), device=device)


def reorder_for_load_balance(x: torch.Tensor, axis_size: int, strategy: str | None = "zigzag", *,
                             axis: int = 1) -> torch.Tensor:
    """Lay out a global tensor's sequence axis for ``axis_size`` shards
    (`stellax.parallel.reorder_for_load_balance`): ``out[..., g, ...] =
    x[..., perm[g], ...]`` with ``strategy`` ``"zigzag"``, ``"striped"`` or
    ``None`` (identity). Any dtype; ``axis`` is the sequence axis (``[B, T,
    ...]`` by default). Pure torch (an index_select): differentiable and
    compilable."""
    if strategy is None:
        return x
    axis = axis % x.ndim
    return x.index_select(axis, _layout_index(x.shape[axis], axis_size, strategy, x.device, False))


def restore_from_load_balance(x: torch.Tensor, axis_size: int, strategy: str | None = "zigzag", *,
                              axis: int = 1) -> torch.Tensor:
    """The inverse of `reorder_for_load_balance` (same arguments)."""
    if strategy is None:
        return x
    axis = axis % x.ndim
    return x.index_select(axis, _layout_index(x.shape[axis], axis_size, strategy, x.device, True))
