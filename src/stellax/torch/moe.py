"""Torch front ends of the MoE family: `ragged_dot` (grouped matmul, dense or
quantized experts), `ragged_dot_general`, `ragged_dot_tgmm`, `route` (top-k
routing), `permute` / `unpermute` (token movement), the router losses
`load_balancing_loss` and `router_z_loss`, `moe_mlp` (router + experts), and
the `MoE` module. The expert-parallel MoE is in `stellax.torch.parallel`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import Array
from torch import nn

import stellax
from stellax import QArray

from .options import check_group_sizes, dtype_name, int32, precision_name, registered_name, strict_int
from .quant import QTensor
from .registry import define_op


def _group_offset(group_offset, device) -> torch.Tensor | None:
    """``None`` / int / integer tensor of shape ``()`` or ``(1,)`` → int32 ``[1]``."""
    if group_offset is None:
        return None
    if isinstance(group_offset, torch.Tensor):
        if group_offset.is_floating_point() or group_offset.dtype == torch.bool:
            raise TypeError(f"group_offset: expected an int or an integer tensor, got {group_offset.dtype}")
        if group_offset.numel() != 1:
            raise ValueError(f"group_offset: expected an int or an integer tensor of shape () or (1,), got "
                             f"{group_offset.dtype} {tuple(group_offset.shape)}")
        return group_offset.reshape(1).to(torch.int32)
    if isinstance(group_offset, bool) or not isinstance(group_offset, int):
        raise TypeError(f"group_offset: expected an int or an integer tensor, got {type(group_offset).__name__}")
    return torch.tensor([group_offset], dtype=torch.int32, device=device)


def _jax_offset(group_offset):
    return None if group_offset is None else group_offset.reshape(())


def _element_type(dtype) -> str | None:
    return dtype_name("preferred_element_type", dtype)


# -- ragged_dot ---------------------------------------------------------------------------
def _ragged_dot(lhs: Array, rhs: Array, group_sizes: Array, group_offset: Array | None, *, activation: str | None,
                precision: str | None, preferred_element_type: str | None, implementation: str | None) -> Array:
    return stellax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type, _jax_offset(group_offset),
                              activation=activation, implementation=implementation)


ragged_dot_op = define_op("ragged_dot", _ragged_dot)


def _ragged_dot_quantized(lhs: Array, rhs: QArray, group_sizes: Array, group_offset: Array | None, *,
                          activation: str | None, precision: str | None, preferred_element_type: str | None,
                          implementation: str | None) -> Array:
    return stellax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type, _jax_offset(group_offset),
                              activation=activation, implementation=implementation)


#: Frozen quantized experts: no gradient reaches their float32 scales.
ragged_dot_quantized_op = define_op("ragged_dot_quantized", _ragged_dot_quantized,
                                    no_grad=("rhs_scales", "rhs_tensor_scale"))


def ragged_dot(lhs: torch.Tensor, rhs, group_sizes: torch.Tensor, *, group_offset=None,
               activation: str | None = None, precision=None, preferred_element_type: torch.dtype | None = None,
               implementation: str | None = None) -> torch.Tensor:
    """Grouped matmul (the ``jax.lax.ragged_dot`` contract, `stellax.ragged_dot`).

    Args:
      lhs: ``[M, K]`` float32/bfloat16/float16, rows sorted by group.
      rhs: ``[G, K, N]`` (or ``[G, K, 2, N]`` for a fused gate/up projection,
        giving ``act(lhs @ gate) * (lhs @ up)``), same dtype as ``lhs``; or a
        `QTensor` ``[G, K, N]`` quantized along axis 1 (frozen quantized
        expert weights: no gated layout, gradients flow to ``lhs`` only).
      group_sizes: ``[G_total]`` integers; rows past ``sum(group_sizes)`` are zero.
      group_offset: ``None`` or an int (or integer tensor of shape ``()``/``(1,)``)
        for expert-sharded weights: ``rhs`` holds groups ``[offset, offset + G)``.
      activation: ``None``, ``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"relu"``, ``"sigmoid"``.
      precision: ``None`` or a `jax.lax.Precision` (name).
      preferred_element_type: output torch dtype (default ``lhs.dtype``).

    Returns ``[M, N]``. Differentiable in ``lhs`` and (dense) ``rhs``."""
    offset = _group_offset(group_offset, lhs.device)
    opts = (activation, precision_name(precision), _element_type(preferred_element_type), implementation)
    op = ragged_dot_quantized_op if isinstance(rhs, QTensor) else ragged_dot_op
    group_sizes = int32(group_sizes, "group_sizes")
    check_group_sizes(group_sizes, lhs.shape[0], "lhs.shape[0]")
    return op(lhs, rhs, group_sizes, offset, *opts)


# -- ragged_dot_general / ragged_dot_tgmm ------------------------------------------------------
#: layout -> ((lhs contracting, rhs contracting), lhs ragged, rhs group); no batch dimensions.
_LAYOUTS = {
    "forward": (((1,), (1,)), (0,), (0,)),
    "transpose_rhs": (((1,), (2,)), (0,), (0,)),
    "tgmm": (((1,), (0,)), (1,), ()),
    "tgmm_transpose_lhs": (((0,), (0,)), (0,), ()),
}


def _dimension_numbers(layout: str):
    (lc, rc), ragged, group = _LAYOUTS[layout]
    return jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=((list(lc), list(rc)), ([], [])),
                                             lhs_ragged_dimensions=list(ragged), rhs_group_dimensions=list(group))


def _layout_of(dims) -> str:
    """A layout name, or `jax.lax.RaggedDotDimensionNumbers` → its layout name."""
    return registered_name("ragged_dot_dimension_numbers", dims, _LAYOUTS, _layout_of_numbers,
                           "expected one of {registered} or a jax.lax.RaggedDotDimensionNumbers, got {value!r}")


def _layout_of_numbers(dims) -> str:
    """The layout name of a `jax.lax.RaggedDotDimensionNumbers` (one of `_LAYOUTS`)."""
    try:
        (lc, rc), (lb, rb) = dims.dot_dimension_numbers
        key = (((tuple(lc), tuple(rc)), tuple(dims.lhs_ragged_dimensions), tuple(dims.rhs_group_dimensions)))
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"ragged_dot_dimension_numbers: expected a layout name or a "
                        f"jax.lax.RaggedDotDimensionNumbers, got {type(dims).__name__}") from None
    for name, value in _LAYOUTS.items():
        if not tuple(lb) and not tuple(rb) and key == value:
            return name
    raise ValueError(f"ragged_dot_dimension_numbers: expected one of the layouts {sorted(_LAYOUTS)} "
                     f"(see stellax.ragged_dot_general), got {dims}")


def _ragged_dot_general(lhs: Array, rhs: Array, group_sizes: Array, group_offset: Array | None, *, layout: str,
                        precision: str | None, preferred_element_type: str | None, num_local_groups: int | None,
                        implementation: str | None) -> Array:
    return stellax.ragged_dot_general(lhs, rhs, group_sizes, _dimension_numbers(layout), precision,
                                      preferred_element_type, _jax_offset(group_offset),
                                      num_local_groups=num_local_groups, implementation=implementation)


ragged_dot_general_op = define_op("ragged_dot_general", _ragged_dot_general)


def ragged_dot_general(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, ragged_dot_dimension_numbers,
                       *, precision=None, preferred_element_type: torch.dtype | None = None, group_offset=None,
                       num_local_groups: int | None = None, implementation: str | None = None) -> torch.Tensor:
    """`stellax.ragged_dot_general` (the ``jax.lax.ragged_dot_general`` contract
    for the layouts training needs) on torch tensors.

    ``ragged_dot_dimension_numbers`` is a `jax.lax.RaggedDotDimensionNumbers`
    or one of the layout names:

    * ``"forward"``: ``lhs [M, K]``, ``rhs [G, K, N]`` → ``[M, N]``;
    * ``"transpose_rhs"``: ``rhs [G, N, K]`` → ``[M, N]`` (the dlhs layout);
    * ``"tgmm"``: ``lhs [K, M]``, ``rhs [M, N]`` → ``[G, K, N]`` (ragged contraction);
    * ``"tgmm_transpose_lhs"``: ``lhs [M, K]``, ``rhs [M, N]`` → ``[G, K, N]``.

    ``group_sizes [G_total]`` integers; ``group_offset`` / ``num_local_groups``
    select the local groups of expert-sharded weights (as in JAX); float32/
    bfloat16/float16 operands of one dtype. Differentiable in ``lhs`` and ``rhs``.
    """
    layout = _layout_of(ragged_dot_dimension_numbers)
    group_sizes = int32(group_sizes, "group_sizes")
    if layout.startswith("tgmm"):
        check_group_sizes(group_sizes, rhs.shape[0], "rhs.shape[0]")
    else:
        check_group_sizes(group_sizes, lhs.shape[0], "lhs.shape[0]")
    return ragged_dot_general_op(lhs, rhs, group_sizes, _group_offset(group_offset, lhs.device),
                                 layout, precision_name(precision), _element_type(preferred_element_type),
                                 strict_int("num_local_groups", num_local_groups), implementation)


def _ragged_dot_tgmm(lhs: Array, rhs: Array, group_sizes: Array, group_offset: Array | None, *,
                     precision: str | None, preferred_element_type: str | None, num_local_groups: int | None,
                     transpose_lhs: bool, implementation: str | None) -> Array:
    return stellax.ragged_dot_tgmm(lhs, rhs, group_sizes, precision, preferred_element_type,
                                   _jax_offset(group_offset), num_local_groups=num_local_groups,
                                   transpose_lhs=transpose_lhs, implementation=implementation)


ragged_dot_tgmm_op = define_op("ragged_dot_tgmm", _ragged_dot_tgmm)


def ragged_dot_tgmm(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *, precision=None,
                    preferred_element_type: torch.dtype | None = None, group_offset=None,
                    num_local_groups: int | None = None, transpose_lhs: bool = False,
                    implementation: str | None = None) -> torch.Tensor:
    """Ragged contraction (`stellax.ragged_dot_tgmm`, the weight gradient of
    `ragged_dot`): ``out[g] = lhs[:, rows of g] @ rhs[rows of g, :]``.

    ``lhs [K, M]`` (or ``[M, K]`` with ``transpose_lhs``), ``rhs [M, N]``
    (same float dtype), ``group_sizes [G]`` integers → ``[G, K, N]`` (or
    ``[num_local_groups, K, N]`` with ``group_offset``); an empty group gives
    zeros. Differentiable in ``lhs`` and ``rhs``."""
    group_sizes = int32(group_sizes, "group_sizes")
    check_group_sizes(group_sizes, rhs.shape[0], "rhs.shape[0]")
    return ragged_dot_tgmm_op(lhs, rhs, group_sizes, _group_offset(group_offset, lhs.device),
                              precision_name(precision), _element_type(preferred_element_type),
                              strict_int("num_local_groups", num_local_groups), bool(transpose_lhs), implementation)


# -- routing ---------------------------------------------------------------------------------
def _route(logits: Array, bias: Array | None, *, top_k: int, scoring: str, num_groups: int | None,
           top_k_groups: int | None, normalize_weights: bool, routed_scaling: float) -> tuple[Array, Array]:
    return tuple(stellax.route(logits, top_k, scoring=scoring, bias=bias, num_groups=num_groups,
                               top_k_groups=top_k_groups, normalize_weights=normalize_weights,
                               routed_scaling=routed_scaling))


#: The bias only selects experts (DeepSeek-V3 style): it gets no gradient.
route_op = define_op("route", _route, no_grad=("bias",))


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", bias: torch.Tensor | None = None,
          num_groups: int | None = None, top_k_groups: int | None = None, normalize_weights: bool = True,
          routed_scaling: float = 1.0):
    """Top-k routing: ``(weights [T, k] float32, expert_ids [T, k] int32)``;
    see `stellax.ops.moe.route`. The weights are differentiable in ``logits``."""
    return route_op(logits, bias, int(top_k), scoring, num_groups, top_k_groups, bool(normalize_weights),
                    float(routed_scaling))


# -- token permutation ---------------------------------------------------------------------
def _permute(x: Array, expert_ids: Array, *, num_experts: int,
             capacity_factor: float | None) -> tuple[Array, Array, Array, Array]:
    out = stellax.permute(x, expert_ids, num_experts, capacity_factor=capacity_factor)
    if capacity_factor is None:
        rows, sizes, order = out
        return rows, sizes, order, jnp.zeros_like(sizes)
    return tuple(out)


permute_op = define_op("permute", _permute)


def permute(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *, capacity_factor: float | None = None):
    """Expert-sorted copies of the tokens (`stellax.permute`).

    Args:
      x: ``[T, D]`` tokens (float32/bfloat16/float16).
      expert_ids: ``[T, k]`` integer expert of each copy (from `route`).
      num_experts: ``E``.
      capacity_factor: ``None`` (dropless) or a positive float: each expert
        keeps at most ``ceil(capacity_factor · T·k / E)`` copies (the first in
        token order); dropped copies go behind the kept rows as zeros.

    Returns ``(rows [T·k, D], group_sizes [E] int32, permutation [T·k] int32)``,
    plus ``dropped [E] int32`` (copies each expert dropped) when
    ``capacity_factor`` is given. ``rows[p] = x[permutation[p] // k]``.
    Differentiable in ``x``."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    cf = None if capacity_factor is None else float(capacity_factor)
    rows, sizes, order, dropped = permute_op(x, int32(expert_ids, "expert_ids"), int(num_experts), cf)
    return (rows, sizes, order) if cf is None else (rows, sizes, order, dropped)


def _unpermute(y: Array, permutation: Array, weights: Array) -> Array:
    return stellax.unpermute(y, permutation, weights)


unpermute_op = define_op("unpermute", _unpermute)


def unpermute(y: torch.Tensor, permutation: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted combine of expert outputs back to tokens (`stellax.unpermute`):
    ``y [T·k, D]`` in `permute`'s row order, ``permutation [T·k]`` from
    `permute`, ``weights [T, k]`` float (from `route`) →
    ``out[t] = Σ_j weights[t, j] · y[p(t, j)]``, ``[T, D]`` in ``y.dtype``
    (float32 math). Differentiable in ``y`` and ``weights``."""
    return unpermute_op(y, int32(permutation, "permutation"), weights)


# -- auxiliary router losses ------------------------------------------------------------------
def _load_balancing_loss(router_logits: Array, expert_ids: Array, *, scoring: str) -> Array:
    return stellax.load_balancing_loss(router_logits, expert_ids, scoring=scoring)


load_balancing_loss_op = define_op("load_balancing_loss", _load_balancing_loss)


def load_balancing_loss(router_logits: torch.Tensor, expert_ids: torch.Tensor, *,
                        scoring: str = "softmax") -> torch.Tensor:
    """The auxiliary load-balancing loss (`stellax.load_balancing_loss`,
    Switch / GShard / Mixtral): ``E · Σ_e f_e · P_e`` with ``f_e`` the fraction
    of the ``T·k`` copies routed to ``e`` and ``P_e`` the mean router
    probability (softmax, or per-token-normalized sigmoid scores with
    ``scoring="sigmoid"``). ``router_logits [T, E]`` float, ``expert_ids
    [T, k]`` integers → a float32 scalar. Differentiable in ``router_logits``
    (through ``P``; the counts are constants)."""
    return load_balancing_loss_op(router_logits, int32(expert_ids, "expert_ids"), scoring)


def _router_z_loss(router_logits: Array) -> Array:
    return stellax.router_z_loss(router_logits)


router_z_loss_op = define_op("router_z_loss", _router_z_loss)


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss (`stellax.router_z_loss`): ``mean_t logsumexp(logits[t])²``
    of ``router_logits [T, E]`` → a float32 scalar. Differentiable."""
    return router_z_loss_op(router_logits)


# -- MoE MLP ----------------------------------------------------------------------------------
def _moe_mlp(x: Array, router_logits: Array, w_gate_up: Array, w_down: Array, bias: Array | None, *, top_k: int,
             scoring: str, num_groups: int | None, top_k_groups: int | None, normalize_weights: bool,
             routed_scaling: float, capacity_factor: float | None, activation: str,
             implementation: str | None) -> Array:
    return stellax.moe_mlp(x, router_logits, w_gate_up, w_down, top_k=top_k, scoring=scoring, bias=bias,
                           num_groups=num_groups, top_k_groups=top_k_groups, normalize_weights=normalize_weights,
                           routed_scaling=routed_scaling, capacity_factor=capacity_factor, activation=activation,
                           implementation=implementation)


moe_mlp_op = define_op("moe_mlp", _moe_mlp, no_grad=("bias",))


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
