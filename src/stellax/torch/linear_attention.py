"""Torch front ends of Gated DeltaNet (`chunk_gated_delta_rule`,
`fused_recurrent_gated_delta_rule`) and the `GatedDeltaNet` mixer module.

The flash-linear-attention contract: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``,
g (log-space decay) and beta ``[B, T, HV]``, states ``[N, HV, K, V]`` (float32),
``cu_seqlens [N+1]`` for packed batches (B = 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jax import Array
from torch import nn

import stellax

from . import norm as _norm
from .options import int32, opt_float, precision_name
from .registry import define_op


def _gdn(fn_name):
    fn = getattr(stellax, fn_name)

    def run(q: Array, k: Array, v: Array, g: Array, beta: Array, initial_state: Array | None,
            cu_seqlens: Array | None, *, scale: float | None, use_qk_l2norm: bool, chunk_size: int,
            implementation: str | None, precision: str | None) -> tuple[Array, Array]:
        return tuple(fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                        use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                        implementation=implementation, precision=precision))
    return run


chunk_gated_delta_rule_op = define_op("chunk_gated_delta_rule", _gdn("chunk_gated_delta_rule"))
fused_recurrent_gated_delta_rule_op = define_op("fused_recurrent_gated_delta_rule",
                                                _gdn("fused_recurrent_gated_delta_rule"))


def _call(op, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens, chunk_size,
          implementation, precision=None):
    o, state = op(q, k, v, g, beta, initial_state, int32(cu_seqlens, "cu_seqlens"), opt_float(scale), bool(use_qk_l2norm),
                  int(chunk_size), implementation, precision_name(precision))
    return o, (state if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm=False, cu_seqlens=None, chunk_size=64, implementation=None,
                           use_qk_l2norm_in_kernel=None, precision=None):
    """Gated DeltaNet, chunked (training / prefill): per value head, with state
    ``S [K, V]``: ``S ← exp(g_t)·S``, ``S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)``,
    ``o_t = Sᵀ(scale·q_t)``. Returns ``(o [B, T, HV, V], final_state or None)``.
    Differentiable in q, k, v, g, beta and initial_state. ``precision``: ``None``
    or a `jax.lax.Precision` (name) of the float32 contractions (`stellax.core.precision`)."""
    if use_qk_l2norm_in_kernel is not None:
        use_qk_l2norm = use_qk_l2norm_in_kernel
    return _call(chunk_gated_delta_rule_op, q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm, cu_seqlens, chunk_size, implementation, precision)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm=False, cu_seqlens=None, implementation=None,
                                     use_qk_l2norm_in_kernel=None, precision=None):
    """Gated DeltaNet token by token (decode); as `chunk_gated_delta_rule`."""
    if use_qk_l2norm_in_kernel is not None:
        use_qk_l2norm = use_qk_l2norm_in_kernel
    return _call(fused_recurrent_gated_delta_rule_op, q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm, cu_seqlens, 64, implementation, precision)


# -- Kimi Delta Attention (per-channel decay) -------------------------------------------------
def _kda(fn_name):
    fn = getattr(stellax, fn_name)

    def run(q: Array, k: Array, v: Array, g: Array, beta: Array, initial_state: Array | None,
            cu_seqlens: Array | None, A_log: Array | None, dt_bias: Array | None, *, scale: float | None,
            use_qk_l2norm: bool, chunk_size: int, implementation: str | None, lower_bound: float | None,
            use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, precision: str | None) -> tuple[Array, Array]:
        return tuple(fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                        use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, chunk_size=chunk_size, A_log=A_log,
                        dt_bias=dt_bias, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, implementation=implementation,
                        precision=precision))
    return run


chunk_kda_op = define_op("chunk_kda", _kda("chunk_kda"))
fused_recurrent_kda_op = define_op("fused_recurrent_kda", _kda("fused_recurrent_kda"))


def _kda_call(op, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm, cu_seqlens, chunk_size,
              A_log, dt_bias, lower_bound, use_gate_in_kernel, use_beta_sigmoid_in_kernel, implementation,
              precision=None):
    o, state = op(q, k, v, g, beta, initial_state, int32(cu_seqlens, "cu_seqlens"), A_log, dt_bias, opt_float(scale),
                  bool(use_qk_l2norm), int(chunk_size), implementation, opt_float(lower_bound),
                  bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel), precision_name(precision))
    return o, (state if output_final_state else None)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False,
              cu_seqlens=None, chunk_size=64, A_log=None, dt_bias=None, lower_bound=None, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, implementation=None, use_qk_l2norm_in_kernel=None, precision=None):
    """Kimi Delta Attention, chunked: `chunk_gated_delta_rule` with a
    per-channel decay ``g [B, T, HV, K]`` (``S ← diag(exp(g_t))·S``); with
    ``use_gate_in_kernel`` the decay is computed from raw ``g`` with ``A_log``
    / ``dt_bias`` as in Kimi Linear. Returns ``(o, final_state or None)``.
    ``precision`` as in `chunk_gated_delta_rule`."""
    if use_qk_l2norm_in_kernel is not None:
        use_qk_l2norm = use_qk_l2norm_in_kernel
    return _kda_call(chunk_kda_op, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                     cu_seqlens, chunk_size, A_log, dt_bias, lower_bound, use_gate_in_kernel,
                     use_beta_sigmoid_in_kernel, implementation, precision)


def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm=False, cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None,
                        use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, implementation=None,
                        use_qk_l2norm_in_kernel=None, precision=None):
    """Kimi Delta Attention token by token (decode); as `chunk_kda`."""
    if use_qk_l2norm_in_kernel is not None:
        use_qk_l2norm = use_qk_l2norm_in_kernel
    return _kda_call(fused_recurrent_kda_op, q, k, v, g, beta, scale, initial_state, output_final_state,
                     use_qk_l2norm, cu_seqlens, 64, A_log, dt_bias, lower_bound, use_gate_in_kernel,
                     use_beta_sigmoid_in_kernel, implementation, precision)


# -- Mamba2 SSD --------------------------------------------------------------------------------
def _ssd(x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, z: Array | None,
         dt_bias: Array | None, initial_states: Array | None, cu_seqlens: Array | None, *, chunk_size: int,
         dt_softplus: bool, dt_limit: list[float], implementation: str | None,
         precision: str | None) -> tuple[Array, Array]:
    return tuple(stellax.ssd(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                             dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), initial_states=initial_states,
                             cu_seqlens=cu_seqlens, return_final_states=True, implementation=implementation,
                             precision=precision))


ssd_op = define_op("ssd", _ssd)


def ssd(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=False,
        dt_limit=(0.0, float("inf")), initial_states=None, cu_seqlens=None, return_final_states=False,
        implementation=None, precision=None):
    """Mamba2 SSD scan (``mamba_chunk_scan_combined``): ``x [B, T, H, P]``,
    ``dt [B, T, H]``, ``A [H]``, ``B``/``C [B, T, G, N]``; returns ``y`` or
    ``(y, final_states [N_seq, H, P, N])``. Differentiable in every float input.
    ``precision``: ``None`` or a `jax.lax.Precision` (name) of the float32
    contractions (`stellax.core.precision`)."""
    y, state = ssd_op(x, dt, A, B, C, D, z, dt_bias, initial_states, int32(cu_seqlens, "cu_seqlens"), int(chunk_size),
                      bool(dt_softplus), [float(dt_limit[0]), float(dt_limit[1])], implementation,
                      precision_name(precision))
    return (y, state) if return_final_states else y


def _ssd_step(state: Array, x: Array, dt: Array, A: Array, B: Array, C: Array, D: Array | None, z: Array | None,
              dt_bias: Array | None, *, dt_softplus: bool, dt_limit: list[float],
              implementation: str | None, precision: str | None) -> tuple[Array, Array]:
    return tuple(stellax.ssd_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                  dt_limit=tuple(dt_limit), implementation=implementation, precision=precision))


ssd_step_op = define_op("ssd_step", _ssd_step)


def ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=(0.0, float("inf")), implementation=None, precision=None):
    """One Mamba2 decode step (``selective_state_update``): ``state [B, H, P, N]``,
    ``x [B, H, P]``, ``dt [B, H]``, ``B``/``C [B, G, N]``; returns
    ``(y [B, H, P], new_state)``; ``precision`` as in `ssd`."""
    return ssd_step_op(state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus),
                       [float(dt_limit[0]), float(dt_limit[1])], implementation, precision_name(precision))


class _ShortConv(nn.Module):
    """Causal depthwise conv1d over time followed by SiLU, ``[B, T, C]`` in and out."""

    def __init__(self, channels: int, kernel_size: int, **factory):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel_size, **factory) * kernel_size ** -0.5)

    def forward(self, x):
        y = F.conv1d(F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0)), self.weight, groups=x.shape[-1])
        return F.silu(y).transpose(1, 2)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer (as in Qwen3-Next / fla's ``GatedDeltaNet``):

        q, k, v = SiLU(causal short conv(x W_q | x W_k | x W_v))
        g = −exp(A_log) · softplus(x W_a + dt_bias),   β = sigmoid(x W_b)
        o = chunk_gated_delta_rule(q, k, v, g, β, use_qk_l2norm=True)
        y = (RMSNorm(o) · SiLU(x W_z)) W_o

    ``num_heads`` query/key heads of size ``head_k_dim``, ``num_v_heads``
    (default ``num_heads``, a multiple of it) value heads of size
    ``head_v_dim``. ``forward(x, initial_state=None, output_final_state=False)``
    returns ``y`` or ``(y, state [B, HV, K, V])``.

    For a Hugging Face model's own mixers (``Qwen3NextGatedDeltaNet``, with its
    cache and padding mask) use `stellax.torch.apply_kernels`, which runs them
    on stellax kernels in place (the former ``GatedDeltaNet.from_module`` copied
    the projections and was not a drop-in replacement).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_k_dim: int, head_v_dim: int | None = None,
                 num_v_heads: int | None = None, *, conv_size: int = 4, norm_eps: float = 1e-6,
                 implementation: str | None = None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_heads, self.head_k_dim = hidden_size, num_heads, head_k_dim
        self.head_v_dim = head_v_dim or head_k_dim
        self.num_v_heads = num_v_heads or num_heads
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads: expected a multiple of num_heads = {num_heads}, got {self.num_v_heads}")
        self.norm_eps, self.implementation = norm_eps, implementation
        key_dim, value_dim = num_heads * head_k_dim, self.num_v_heads * self.head_v_dim
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False, **factory)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False, **factory)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False, **factory)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **factory)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False, **factory)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False, **factory)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False, **factory)
        self.q_conv = _ShortConv(key_dim, conv_size, **factory)
        self.k_conv = _ShortConv(key_dim, conv_size, **factory)
        self.v_conv = _ShortConv(value_dim, conv_size, **factory)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads, **factory).uniform_(1, 16)))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, **factory).uniform_(-4, -1))
        self.o_norm_weight = nn.Parameter(torch.ones(self.head_v_dim, **factory))

    def project(self, x):
        """``(q, k, v, g, beta)`` of the recurrence for ``x [B, T, D]``."""
        b, t, _ = x.shape
        q = self.q_conv(self.q_proj(x)).view(b, t, self.num_heads, self.head_k_dim)
        k = self.k_conv(self.k_proj(x)).view(b, t, self.num_heads, self.head_k_dim)
        v = self.v_conv(self.v_proj(x)).view(b, t, self.num_v_heads, self.head_v_dim)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.b_proj(x))
        return q, k, v, g.to(x.dtype), beta

    def output(self, o, x):
        """Gated RMSNorm of the recurrence output and the output projection."""
        b, t = x.shape[:2]
        gate = self.g_proj(x).view(b, t, self.num_v_heads, self.head_v_dim)
        o = _norm.rms_norm(o, self.o_norm_weight, eps=self.norm_eps) * F.silu(gate)
        return self.o_proj(o.reshape(b, t, -1))

    def forward(self, x: torch.Tensor, initial_state: torch.Tensor | None = None, output_final_state: bool = False):
        q, k, v, g, beta = self.project(x)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                          output_final_state=output_final_state, use_qk_l2norm=True,
                                          implementation=self.implementation)
        y = self.output(o, x)
        return (y, state) if output_final_state else y
