"""stellax forwards for the norm, MLP and MoE layers of Hugging Face models.

Each ``patch_*`` function rebinds one module's ``forward`` (an instance
attribute, so the class and other models are untouched) to a stellax kernel
over the module's *own* parameters: nothing is copied, so training the patched
model trains the model. Each returns ``None`` when it patched the module, or
the reason it did not (a string). `stellax.torch.apply_kernels` drives them.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from . import glu as _glu
from . import moe as _moe
from . import norm as _norm
from .modules import hf_activation_name

__all__ = ["EXPERTS_NAME", "OFFSET_RMSNORMS", "is_patched", "patch_mlp", "patch_rms_norm", "patch_router",
           "register_experts", "stellax_experts_forward"]

#: RMSNorms that scale by ``1 + weight`` (zero-initialized weight), in float32 before the cast.
OFFSET_RMSNORMS = frozenset({"Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm", "Qwen3_5RMSNorm",
                             "Qwen3_5MoeRMSNorm"})

#: The name stellax's grouped-experts forward is registered under in transformers' ExpertsInterface.
EXPERTS_NAME = "stellax"

_MARK = "_stellax_patched"


def is_patched(module: nn.Module) -> bool:
    """Whether `apply_kernels` already rebound this module's forward."""
    return bool(getattr(module, _MARK, False))


def _bind(module: nn.Module, forward, what: str) -> None:
    module.forward = types.MethodType(forward, module)
    setattr(module, _MARK, what)


# -- RMSNorm -----------------------------------------------------------------------------------
def _rms_norm_forward(self, hidden_states):
    return _norm.rms_norm(hidden_states, self.weight, eps=self.variance_epsilon)


def _offset_rms_norm_forward(self, x):
    # Gemma: x / rms(x) * (1 + w), computed in float32, then cast back.
    y = _norm.rms_norm(x.float(), 1.0 + self.weight.float(), eps=self.eps)
    return y.type_as(x)


def _gated_rms_norm_forward(self, hidden_states, gate):
    # Qwen3-Next: norm first, then the SiLU gate (float32), cast back
    y = _norm.rms_norm(hidden_states, self.weight, eps=self.variance_epsilon)
    return (y * torch.nn.functional.silu(gate.float())).to(hidden_states.dtype)


def _group_gated_rms_norm_forward(self, hidden_states, gate=None):
    # Mamba2: gate first (float32), then an RMSNorm per group of `group_size` channels, then the weight
    dtype = hidden_states.dtype
    h = hidden_states.float()
    if gate is not None:
        h = h * torch.nn.functional.silu(gate.float())
    *lead, width = h.shape
    h = _norm.rms_norm(h.reshape(*lead, width // self.group_size, self.group_size), None, eps=self.variance_epsilon)
    return self.weight * h.reshape(*lead, width).to(dtype)


#: gated norms (forward(x, gate)) -> their stellax forward
_GATED_NORMS = {"Qwen3NextRMSNormGated": _gated_rms_norm_forward, "MambaRMSNormGated": _group_gated_rms_norm_forward,
                "Mamba2RMSNormGated": _group_gated_rms_norm_forward}  # transformers >= 5.25 names Mamba2's its own


def patch_rms_norm(module: nn.Module) -> str | None:
    """LlamaRMSNorm and its copies (``weight`` + ``variance_epsilon``: ``w · x/rms(x)``),
    the Gemma-style ``(1 + w) · x/rms(x)`` norms (`OFFSET_RMSNORMS`) and the
    gated norms of Qwen3-Next and Mamba2 → `rms_norm`."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 1:
        return f"{name}: expected a 1-D weight"
    if name in _GATED_NORMS and isinstance(getattr(module, "variance_epsilon", None), float):
        if _GATED_NORMS[name] is _group_gated_rms_norm_forward and weight.shape[0] % module.group_size:
            return f"{name}: width {weight.shape[0]} is not a multiple of group_size {module.group_size}"
        _bind(module, _GATED_NORMS[name], "rms_norm (gated)")
        return None
    if name in OFFSET_RMSNORMS and isinstance(getattr(module, "eps", None), float):
        _bind(module, _offset_rms_norm_forward, "rms_norm (1 + weight)")
        return None
    if isinstance(getattr(module, "variance_epsilon", None), float) and not hasattr(module, "group_size") \
            and "Gated" not in name:
        _bind(module, _rms_norm_forward, "rms_norm")
        return None
    return (f"{name}: not a known RMSNorm variant (LlamaRMSNorm-style weight + variance_epsilon, or one of "
            f"{sorted(OFFSET_RMSNORMS)}, or the gated {sorted(_GATED_NORMS)}); it keeps its own forward")


# -- gated MLP ---------------------------------------------------------------------------------
def _mlp_forward(self, x):
    h = _glu.gated_linear_unit(x, self.gate_proj.weight.t(), self.up_proj.weight.t(),
                               activation=self._stellax_activation)
    return self.down_proj(h)


def patch_mlp(module: nn.Module) -> str | None:
    """A Llama-style gated MLP (``down(act(gate(x)) · up(x))``, bias-free
    gate/up ``nn.Linear``) → `gated_linear_unit` on the linears' weights
    (transposed views: the gradients reach the original parameters)."""
    name = type(module).__name__
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts):
        return f"{name}: expected gate_proj, up_proj and down_proj nn.Linear layers"
    gate, up, _ = parts
    if gate.bias is not None or up.bias is not None:
        return f"{name}: gate_proj/up_proj have a bias (the fused GLU kernel has none)"
    if gate.weight.shape != up.weight.shape:
        return f"{name}: gate_proj {tuple(gate.weight.shape)} and up_proj {tuple(up.weight.shape)} differ"
    try:
        module._stellax_activation = hf_activation_name(module)
    except ValueError as e:
        return f"{name}: {e}"
    _bind(module, _mlp_forward, f"gated_linear_unit ({module._stellax_activation})")
    return None


# -- MoE routers -------------------------------------------------------------------------------
def _router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight, getattr(self, "bias", None))
    weights, ids = _moe.route(logits, self.top_k, normalize_weights=self._stellax_normalize)
    return logits, weights.to(self._stellax_weight_dtype or logits.dtype), ids.long()


#: router class -> (normalize the top-k softmax weights?, dtype of the weights HF returns: None = logits')
_ROUTERS = {
    "MixtralTopKRouter": (lambda m: True, torch.float32),
    "Qwen2MoeTopKRouter": (lambda m: bool(m.norm_topk_prob), None),
    "Qwen3MoeTopKRouter": (lambda m: bool(m.norm_topk_prob), None),
    "Qwen3NextTopKRouter": (lambda m: bool(m.norm_topk_prob), None),
    # softmax over the top-k logits = the top-k of the softmax, renormalized
    "GptOssTopKRouter": (lambda m: True, None),
}


def patch_router(module: nn.Module) -> str | None:
    """The softmax top-k routers of Mixtral, Qwen2/3-MoE, Qwen3-Next and
    GPT-OSS → `route` (same logits, weights and expert ids)."""
    name = type(module).__name__
    if name not in _ROUTERS:
        return f"{name}: not a known softmax top-k router ({sorted(_ROUTERS)})"
    normalize, dtype = _ROUTERS[name]
    module._stellax_normalize = normalize(module)
    module._stellax_weight_dtype = dtype
    _bind(module, _router_forward, "route (softmax top-k)")
    return None


# -- grouped experts ---------------------------------------------------------------------------
def _grouped_linear(x, weight, bias, sizes, expert_of_row, transposed: bool):
    """``x [S, in]`` rows sorted by expert times each expert's weight: ``weight
    [E, in, out]`` (``transposed``) or ``[E, out, in]`` (nn.Linear layout)."""
    layout = "forward" if transposed else "transpose_rhs"
    y = _moe.ragged_dot_general(x, weight, sizes, layout)
    if bias is not None:
        y = y + bias[expert_of_row]
    return y


def stellax_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts contract (``hidden_states [T, D]``, ``top_k_index``
    / ``top_k_weights [T, k]`` → ``[T, D]``) as stellax `permute` →
    `ragged_dot_general` (up) → the module's own gate → `ragged_dot_general`
    (down) → `unpermute` (the weighted combine)."""
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(f"{type(self).__name__}: the stellax experts forward does not take expert-parallel "
                                  "sentinel ids; use stellax.torch.moe_mlp_expert_parallel")
    num_experts = self.num_experts
    rows, sizes, perm = _moe.permute(hidden_states, top_k_index, num_experts)
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=rows.device), sizes.long(),
                                            output_size=rows.shape[0]) if self.has_bias else None
    if self.has_gate:
        w, b = self.gate_up_proj, (self.gate_up_proj_bias if self.has_bias else None)
    else:
        w, b = self.up_proj, (self.up_proj_bias if self.has_bias else None)
    h = _grouped_linear(rows, w, b, sizes, expert_of_row, self.is_transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    y = _grouped_linear(h, self.down_proj, self.down_proj_bias if self.has_bias else None, sizes, expert_of_row,
                        self.is_transposed)
    if self.has_post_expert_norm:
        y = self.post_expert_norm(y)
    return _moe.unpermute(y, perm, top_k_weights.float()).to(hidden_states.dtype)


def register_experts(name: str = EXPERTS_NAME) -> str:
    """Register `stellax_experts_forward` in transformers' ``ExpertsInterface``
    (then ``model.set_experts_implementation(name)`` or
    ``from_pretrained(..., experts_implementation=name)`` selects it)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, stellax_experts_forward)
    return name
