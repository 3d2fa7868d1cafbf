"""Torch front ends of the MoE family: `ragged_dot` (grouped matmul), `route`
(top-k routing), `moe_mlp` (router + experts), and the `MoE` module."""

from __future__ import annotations

import torch
from torch import nn

from .registry import define_op


def _moe():
    import stellax
    if hasattr(stellax, "moe_mlp"):
        return stellax
    from stellax.ops import moe
    return moe


# -- ragged_dot ---------------------------------------------------------------------------
def _ragged_dot(lhs, rhs, group_sizes, *, activation, implementation):
    return _moe().ragged_dot(lhs, rhs, group_sizes, activation=activation, implementation=implementation)


def _ragged_dot_fake(lhs, rhs, group_sizes, **_):
    return lhs.new_empty((lhs.shape[0], rhs.shape[-1]))


ragged_dot_op = define_op("ragged_dot", _ragged_dot, tensors=("lhs", "rhs", "group_sizes!"),
                          options={"activation": "str?", "implementation": "str?"}, fake=_ragged_dot_fake)


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, activation: str | None = None,
               implementation: str | None = None) -> torch.Tensor:
    """Grouped matmul (the ``jax.lax.ragged_dot`` contract): ``lhs [M, K]``
    with rows sorted by group, ``rhs [G, K, N]`` (or ``[G, K, 2, N]`` for a
    fused gate/up projection, giving ``act(lhs @ gate) * (lhs @ up)``),
    ``group_sizes [G]`` integers. Returns ``[M, N]``; rows past
    ``sum(group_sizes)`` are zero. Differentiable in ``lhs`` and ``rhs``."""
    return ragged_dot_op(lhs, rhs, group_sizes.to(torch.int32), activation, implementation)


# -- routing ---------------------------------------------------------------------------------
def _route(logits, bias, *, top_k, scoring, num_groups, top_k_groups, normalize_weights, routed_scaling):
    return tuple(_moe().route(logits, top_k, scoring=scoring, bias=bias, num_groups=num_groups,
                              top_k_groups=top_k_groups, normalize_weights=normalize_weights,
                              routed_scaling=routed_scaling))


def _route_fake(logits, bias, *, top_k, **_):
    t = logits.shape[0]
    return logits.new_empty((t, top_k), dtype=torch.float32), logits.new_empty((t, top_k), dtype=torch.int32)


_ROUTE_OPTIONS = {"top_k": "int", "scoring": "str", "num_groups": "int?", "top_k_groups": "int?",
                  "normalize_weights": "bool", "routed_scaling": "float"}

route_op = define_op("route", _route, tensors=("logits", "bias?!"), options=_ROUTE_OPTIONS, outputs=2,
                     fake=_route_fake)


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", bias: torch.Tensor | None = None,
          num_groups: int | None = None, top_k_groups: int | None = None, normalize_weights: bool = True,
          routed_scaling: float = 1.0):
    """Top-k routing: ``(weights [T, k] float32, expert_ids [T, k] int32)``;
    see `stellax.ops.moe.route`. The weights are differentiable in ``logits``."""
    return route_op(logits, bias, int(top_k), scoring, num_groups, top_k_groups, bool(normalize_weights),
                    float(routed_scaling))


# -- MoE MLP ----------------------------------------------------------------------------------
def _moe_mlp(x, router_logits, w_gate_up, w_down, bias, *, top_k, scoring, num_groups, top_k_groups,
             normalize_weights, routed_scaling, capacity_factor, activation, implementation):
    return _moe().moe_mlp(x, router_logits, w_gate_up, w_down, top_k=top_k, scoring=scoring, bias=bias,
                          num_groups=num_groups, top_k_groups=top_k_groups, normalize_weights=normalize_weights,
                          routed_scaling=routed_scaling, capacity_factor=capacity_factor, activation=activation,
                          implementation=implementation)


moe_mlp_op = define_op(
    "moe_mlp", _moe_mlp, tensors=("x", "router_logits", "w_gate_up", "w_down", "bias?!"),
    options={**_ROUTE_OPTIONS, "capacity_factor": "float?", "activation": "str", "implementation": "str?"},
    fake=lambda x, *rest, **_: torch.empty_like(x))


def moe_mlp(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
            top_k: int, scoring: str = "softmax", bias: torch.Tensor | None = None, num_groups: int | None = None,
            top_k_groups: int | None = None, normalize_weights: bool = True, routed_scaling: float = 1.0,
            capacity_factor: float | None = None, activation: str = "silu",
            implementation: str | None = None) -> torch.Tensor:
    """A mixture-of-experts MLP: ``x [T, D]``, ``router_logits [T, E]``,
    ``w_gate_up [E, D, 2, F]``, ``w_down [E, F, D]`` -> ``[T, D]``. Routing
    options as in `route`. Differentiable in x, the router logits and both
    weights."""
    return moe_mlp_op(x, router_logits, w_gate_up, w_down, bias, int(top_k), scoring, num_groups, top_k_groups,
                      bool(normalize_weights), float(routed_scaling),
                      None if capacity_factor is None else float(capacity_factor), activation, implementation)


class MoE(nn.Module):
    """A sparse MoE layer: a linear router (``[E, D]`` weight, no bias),
    top-k routing and SwiGLU experts run as stellax grouped matmuls.

    Parameters: ``router`` (``nn.Linear(D, E, bias=False)``), ``w_gate_up``
    ``[E, D, 2, F]``, ``w_down`` ``[E, F, D]``. Input ``[..., D]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 activation: str = "silu", scoring: str = "softmax", normalize_weights: bool = True,
                 implementation: str | None = None, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.intermediate_size = int(hidden_size), int(intermediate_size)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        self.activation, self.scoring, self.normalize_weights = activation, scoring, normalize_weights
        self.implementation = implementation
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w_gate_up = nn.Parameter(torch.randn(num_experts, hidden_size, 2, intermediate_size, **factory)
                                      * hidden_size ** -0.5)
        self.w_down = nn.Parameter(torch.randn(num_experts, intermediate_size, hidden_size, **factory)
                                   * intermediate_size ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        logits = self.router(tokens)
        y = moe_mlp(tokens, logits, self.w_gate_up, self.w_down, top_k=self.top_k, scoring=self.scoring,
                    normalize_weights=self.normalize_weights, activation=self.activation,
                    implementation=self.implementation)
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, experts={self.num_experts}, "
                f"top_k={self.top_k}, activation={self.activation!r}")

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "MoE":
        """From an HF Mixtral-style sparse MoE block (``MixtralSparseMoeBlock``:
        a ``gate`` router with a ``[E, D]`` weight, softmax top-k with
        normalized weights, and ``experts`` holding ``gate_up_proj [E, 2F, D]``
        and ``down_proj [E, D, F]``). Weights are copied once into stellax's
        layout; the router weight is shared."""
        from .modules import hf_activation_name

        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if gate is None or experts is None or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
            raise TypeError(f"module: expected a Mixtral-style MoE block (gate + experts.gate_up_proj/down_proj), "
                            f"got {type(module).__name__}")
        if getattr(module, "shared_expert", None) is not None or getattr(module, "shared_experts", None) is not None:
            raise ValueError("module: MoE blocks with shared experts are not supported by from_module")
        gu, down = experts.gate_up_proj, experts.down_proj
        if not isinstance(gu, torch.Tensor) or gu.ndim != 3 or getattr(experts, "has_bias", False):
            raise ValueError("module: expected bias-free fused expert weights gate_up_proj [E, 2F, D]")
        e, two_f, d = gu.shape
        f = two_f // 2
        if tuple(down.shape) != (e, d, f):
            raise ValueError(f"module: down_proj shape {tuple(down.shape)} does not match [E, D, F] = {(e, d, f)}")
        top_k = getattr(module, "top_k", None) or getattr(gate, "top_k")
        normalize = bool(getattr(getattr(module, "config", None), "norm_topk_prob", True))
        new = cls(d, f, e, top_k, activation=hf_activation_name(experts), normalize_weights=normalize,
                  device="meta", **kwargs)
        with torch.no_grad():
            w_gate_up = gu.reshape(e, 2, f, d).permute(0, 3, 1, 2).contiguous()
            w_down = down.transpose(1, 2).contiguous()
        new.w_gate_up = nn.Parameter(w_gate_up, requires_grad=gu.requires_grad)
        new.w_down = nn.Parameter(w_down, requires_grad=down.requires_grad)
        router = nn.Linear(d, e, bias=False, device="meta")
        router.weight = gate.weight
        new.router = router
        return new
