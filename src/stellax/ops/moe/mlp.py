"""The MoE MLP: route → permute → grouped gate/up (fused SwiGLU) → grouped
down projection → weighted combine.

    weights, ids = route(router_logits, top_k, ...)
    rows, sizes, perm = permute(x, ids, E)
    h = act(rows @ w_gate_up[e, :, 0]) * (rows @ w_gate_up[e, :, 1])   per expert e
    y = h @ w_down[e]
    out[t] = Σ_j weights[t, j] · y[copy (t, j)]

The golden is a dense per-token loop: every expert's MLP on every token,
masked by the routing (E× the FLOPs, plain and obviously right).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call, checks
from ...core.backends import Backend, Tuning
from ...core.precision import resolve_precision
from .activations import activation_fn, check_activation
from .api import ragged_dot
from .base import BACKENDS
from .dispatch import capacity, permute, unpermute
from .examples import mlp_benchmarks, mlp_examples
from .routing import check_route, compute_route

_HI = jax.lax.Precision.HIGHEST


def check_moe_mlp(x, router_logits, w_gate_up, w_down, *, top_k, scoring="softmax", bias=None, num_groups=None,
                  top_k_groups=None, normalize_weights=True, routed_scaling=1.0, capacity_factor=None,
                  activation="silu", precision=None, num_local_experts=None) -> Call:
    """Checks; ``num_local_experts`` (default: all E experts) lets an
    expert-parallel shard pass its local weights."""
    x = checks.require_float("x", x)
    checks.require_ndim("x", x, 2)
    tokens, d_model = x.shape
    route_call = check_route(router_logits, top_k, scoring=scoring, bias=bias, num_groups=num_groups,
                              top_k_groups=top_k_groups, normalize_weights=normalize_weights,
                              routed_scaling=routed_scaling)
    checks.require_shape("router_logits", router_logits, (tokens, None), "x.shape[0], E")
    experts = router_logits.shape[1]
    w_gate_up = checks.require_float("w_gate_up", w_gate_up)
    checks.require_ndim("w_gate_up", w_gate_up, 4)
    local = experts if num_local_experts is None else num_local_experts
    checks.require_shape("w_gate_up", w_gate_up, (local, d_model, 2, None), "E, x.shape[1], 2, F")
    checks.require_same_dtype("w_gate_up", w_gate_up, "x", x)
    ffn = w_gate_up.shape[-1]
    w_down = checks.require_float("w_down", w_down)
    checks.require_shape("w_down", w_down, (local, ffn, d_model), "E, F (w_gate_up.shape[-1]), x.shape[1]")
    checks.require_same_dtype("w_down", w_down, "x", x)
    if capacity_factor is not None:
        capacity_factor = checks.require_positive_float("capacity_factor", capacity_factor)
    return Call({"x": x, "router_logits": router_logits, "w_gate_up": w_gate_up, "w_down": w_down, "bias": bias},
                {**route_call.options, "capacity_factor": capacity_factor, "activation": check_activation(activation),
                 "precision": resolve_precision(precision)})


def route_call_of(call: Call) -> Call:
    """The `moe_route` call (logits, bias and routing options) inside a `moe_mlp` call."""
    names = ("top_k", "scoring", "num_groups", "top_k_groups", "normalize_weights", "routed_scaling")
    return Call({"logits": call.router_logits, "bias": call.bias}, {n: call.options[n] for n in names})


def moe_mlp_reference(call: Call):
    """Dense per-token loop over experts (float32)."""
    weights, ids = compute_route(route_call_of(call))
    x = call.x.astype(jnp.float32)
    experts = call.router_logits.shape[1]
    tokens, top_k = ids.shape
    act = activation_fn(call.activation)
    # Routing weight of each (token, expert); a copy dropped by the capacity counts 0.
    onehot = jax.nn.one_hot(ids, experts, dtype=jnp.float32)          # [T, k, E]
    if call.capacity_factor is not None:
        cap = capacity(tokens, top_k, experts, call.capacity_factor)
        flat = onehot.reshape(tokens * top_k, experts)
        rank = jnp.cumsum(flat, axis=0) - flat                          # earlier copies per expert
        onehot = (flat * (rank < cap)).reshape(tokens, top_k, experts)
    gate_weight = jnp.einsum("tk,tke->te", weights, onehot)
    out = jnp.zeros_like(x)
    for e in range(experts):
        w = call.w_gate_up[e].astype(jnp.float32)
        h = act(jnp.dot(x, w[:, 0], precision=_HI)) * jnp.dot(x, w[:, 1], precision=_HI)
        y = jnp.dot(h, call.w_down[e].astype(jnp.float32), precision=_HI)
        out = out + gate_weight[:, e:e + 1] * y
    return out.astype(call.x.dtype)


def local_experts(rows, group_sizes, w_gate_up, w_down, *, activation, precision, group_offset=None,
                  implementation=None):
    """The two grouped matmuls of the experts on expert-sorted rows."""
    h = ragged_dot(rows, w_gate_up, group_sizes, precision, None, group_offset, activation=activation,
                   implementation=implementation)
    return ragged_dot(h, w_down, group_sizes, precision, None, group_offset, implementation=implementation)


def _run(backend: Backend, call: Call, config):
    """Route, permute, the experts' grouped matmuls by ``backend``, unpermute."""
    del config
    weights, ids = compute_route(route_call_of(call))
    experts = call.router_logits.shape[1]
    permuted = permute(call.x, ids, experts, capacity_factor=call.capacity_factor)
    rows, sizes, order = permuted[:3]
    y = local_experts(rows, sizes, call.w_gate_up, call.w_down, activation=call.activation,
                      precision=call.precision, implementation=(backend.name,))
    return unpermute(y, order, weights.astype(jnp.float32))


def _tpu_requirements(call: Call) -> str | None:
    """The Mosaic TPU grouped matmuls take float32/bfloat16 tokens and weights."""
    name = jnp.dtype(call.x.dtype).name
    if name not in ("float32", "bfloat16"):
        return f"the Mosaic TPU grouped matmuls need float32/bfloat16 x, got {name}"
    return None


def _flops(call: Call) -> float:
    tokens, d = call.x.shape
    f = call.w_gate_up.shape[-1]
    return 2.0 * tokens * call.top_k * d * 3 * f


moe_mlp_op = BACKENDS.retuned({"mosaic_tpu": Tuning(requirements=_tpu_requirements)}).op(
    "moe_mlp", _run, check=check_moe_mlp, reference=moe_mlp_reference, flops=_flops, examples=mlp_examples,
    benchmarks=mlp_benchmarks, differentiable=("x", "router_logits", "w_gate_up", "w_down"))


def moe_mlp(x, router_logits, w_gate_up, w_down, *, top_k, scoring="softmax", bias=None, num_groups=None,
            top_k_groups=None, normalize_weights=True, routed_scaling=1.0, capacity_factor=None, activation="silu",
            precision=None, implementation=None):
    """A mixture-of-experts MLP layer (differentiable end to end).

    Args:
      x: ``[T, D]`` tokens.
      router_logits: ``[T, E]``.
      w_gate_up: ``[E, D, 2, F]`` gate and up projections of every expert.
      w_down: ``[E, F, D]`` down projections.
      top_k, scoring, bias, num_groups, top_k_groups, normalize_weights,
        routed_scaling: routing, see `route`.
      capacity_factor: ``None`` (dropless) or the per-expert capacity factor
        of `permute` (dropped copies contribute nothing).
      activation: of the gate (``"silu"``: SwiGLU).
      precision: of the float32 grouped matmuls, forward and backward
        (``None``: float32-accurate unless `jax.default_matmul_precision` is
        set; ``"default"``/``"high"``/``"highest"``): see `stellax.core.precision`.
      implementation: of the grouped matmuls (``None``, ``"mosaic_tpu"``,
        ``"triton"``, ``"xla"``): on a TPU the fused gate/up (``act(gate) · up``
        in the kernel's epilogue) and the down projection are the Mosaic TPU
        grouped matmul, with its backward kernels. No config of its own: each
        grouped matmul picks its own (`TpuGroupedMatmulConfig`,
        `GroupedMatmulConfig` or `XlaGroupedMatmulConfig`).

    Returns:
      ``[T, D]`` in ``x.dtype``.
    """
    return moe_mlp_op(x, router_logits, w_gate_up, w_down, top_k=top_k, scoring=scoring, bias=bias,
                      num_groups=num_groups, top_k_groups=top_k_groups, normalize_weights=normalize_weights,
                      routed_scaling=routed_scaling, capacity_factor=capacity_factor, activation=activation,
                      precision=precision, implementation=implementation)
