"""`GatedMLP` (SwiGLU and friends) and `MoE` (router + grouped experts)."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import stellax

from ._params import check_sharding, dense, param, positive

_default_kernel = nnx.initializers.lecun_normal()


def _on_mesh(a, mesh, axis_name):
    """``a`` sharded over ``axis_name`` along its first axis (what the
    expert-parallel ``shard_map`` expects): ``reshard`` on explicit mesh axes,
    a sharding constraint otherwise."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))
    if jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


class GatedMLP(nnx.Module):
    """``y = (act(x @ W_gate) * (x @ W_up)) @ W_down`` with the gate and up
    projections fused (`stellax.gated_linear_unit`).

    Args:
      features: ``D``; hidden: ``F``.
      activation: ``"silu"`` (SwiGLU), ``"gelu"``, ``"gelu_tanh"``, ``"relu"``, ``"sigmoid"``.
      kernel_init: flax initializer of ``gate_up [D, 2, F]`` and ``down [F, D]``.
      sharding: logical axes for ``"gate_up"`` (3 axes) and ``"down"`` (2 axes).
    """

    def __init__(self, features: int, hidden: int, *, activation: str = "silu", dtype=None,
                 param_dtype=jnp.float32, kernel_init=_default_kernel,
                 sharding: Mapping[str, Sequence[str | None]] | None = None, rngs: nnx.Rngs):
        positive("GatedMLP", features=features, hidden=hidden)
        shard = check_sharding("GatedMLP", sharding, ["gate_up", "down"])
        self.features, self.hidden, self.activation, self.dtype = features, hidden, activation, dtype
        self.gate_up = param("GatedMLP", rngs, "gate_up", kernel_init, (features, 2, hidden), param_dtype, shard)
        self.down = param("GatedMLP", rngs, "down", kernel_init, (hidden, features), param_dtype, shard)

    def __call__(self, x):
        """``x [..., D] -> [..., D]``."""
        if x.shape[-1] != self.features:
            raise ValueError(f"GatedMLP: x has last dim {x.shape[-1]}, expected features={self.features}")
        h = stellax.gated_linear_unit(x, self.gate_up[...].astype(x.dtype), activation=self.activation)
        return dense(h, self.down[...], self.dtype)


class MoE(nnx.Module):
    """A mixture-of-experts MLP: a linear router (``router [D, E]``), top-k
    routing, SwiGLU experts as grouped matmuls (`stellax.moe_mlp`); with
    ``mesh`` and ``axis_name``, experts are sharded over that mesh axis
    (`stellax.ops.moe.parallel.moe_mlp_expert_parallel`: tokens all-to-all).

    Args:
      features: ``D``; hidden: ``F`` per expert; num_experts: ``E``; top_k.
      scoring: ``"softmax"`` or ``"sigmoid"``; normalize_weights: renormalize
        the top-k weights to sum to one.
      mesh, axis_name: expert parallelism (``E`` divisible by the axis size).
      sharding: logical axes for ``"router"`` (2), ``"w_gate_up"`` (4: ``[E, D, 2, F]``),
        ``"w_down"`` (3: ``[E, F, D]``).

    Returns ``[..., D]``; `router_logits` gives the logits for auxiliary losses.
    """

    def __init__(self, features: int, hidden: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 normalize_weights: bool = True, activation: str = "silu", mesh: jax.sharding.Mesh | None = None,
                 axis_name: str | None = None, dtype=None, param_dtype=jnp.float32, kernel_init=_default_kernel,
                 router_init=_default_kernel, sharding: Mapping[str, Sequence[str | None]] | None = None,
                 rngs: nnx.Rngs):
        positive("MoE", features=features, hidden=hidden, num_experts=num_experts, top_k=top_k)
        if top_k > num_experts:
            raise ValueError(f"MoE: top_k ({top_k}) must be <= num_experts ({num_experts})")
        if (mesh is None) != (axis_name is None):
            raise ValueError("MoE: give both mesh and axis_name (expert parallelism) or neither")
        if mesh is not None:
            if axis_name not in mesh.shape:
                raise ValueError(f"MoE: axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
            if num_experts % mesh.shape[axis_name]:
                raise ValueError(f"MoE: num_experts ({num_experts}) must be divisible by the size of mesh axis "
                                 f"{axis_name!r} ({mesh.shape[axis_name]})")
        shard = check_sharding("MoE", sharding, ["router", "w_gate_up", "w_down"])
        self.features, self.hidden, self.num_experts, self.top_k = features, hidden, num_experts, top_k
        self.scoring, self.normalize_weights, self.activation = scoring, bool(normalize_weights), activation
        self.mesh, self.axis_name, self.dtype = mesh, axis_name, dtype
        self.router = param("MoE", rngs, "router", router_init, (features, num_experts), param_dtype, shard)
        self.w_gate_up = param("MoE", rngs, "w_gate_up", kernel_init, (num_experts, features, 2, hidden),
                               param_dtype, shard)
        self.w_down = param("MoE", rngs, "w_down", kernel_init, (num_experts, hidden, features), param_dtype, shard)

    def router_logits(self, x):
        """``x [..., D] -> [..., E]``."""
        return dense(x, self.router[...])

    def __call__(self, x):
        """``x [..., D] -> [..., D]`` (tokens flattened to ``[T, D]`` for routing)."""
        if x.shape[-1] != self.features:
            raise ValueError(f"MoE: x has last dim {x.shape[-1]}, expected features={self.features}")
        tokens = x.reshape(-1, self.features)
        logits = self.router_logits(tokens)
        w_gu, w_down = self.w_gate_up[...].astype(x.dtype), self.w_down[...].astype(x.dtype)
        kw = dict(top_k=self.top_k, scoring=self.scoring, normalize_weights=self.normalize_weights,
                  activation=self.activation)
        if self.mesh is None:
            y = stellax.moe_mlp(tokens, logits, w_gu, w_down, **kw)
        else:
            from stellax.ops.moe.parallel import moe_mlp_expert_parallel
            if tokens.shape[0] % self.mesh.shape[self.axis_name]:
                raise ValueError(f"MoE: {tokens.shape[0]} tokens do not split evenly over mesh axis "
                                 f"{self.axis_name!r} ({self.mesh.shape[self.axis_name]} devices)")
            parts = [_on_mesh(a, self.mesh, self.axis_name) for a in (tokens, logits, w_gu, w_down)]
            y = moe_mlp_expert_parallel(*parts, mesh=self.mesh, axis_name=self.axis_name, **kw)
            if jax.sharding.AxisType.Explicit in tuple(self.mesh.axis_types):  # back to replicated tokens
                y = jax.sharding.reshard(y, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
        y = y.reshape(x.shape)
        return y if self.dtype is None else y.astype(self.dtype)
