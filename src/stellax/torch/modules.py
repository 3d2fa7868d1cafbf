"""``nn.Module`` drop-ins running stellax kernels, with ``from_module``
conversion from the matching torch / Hugging Face modules."""

from __future__ import annotations

import torch
from torch import nn

from . import glu as _glu
from . import norm as _norm

__all__ = ["RMSNorm", "LayerNorm", "GatedMLP", "hf_activation_name"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension: ``x / sqrt(mean(x²) + eps) * weight``
    (statistics in float32, output in ``x.dtype``), like `torch.nn.RMSNorm`
    and HF ``LlamaRMSNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, elementwise_affine: bool = True, *,
                 implementation: str | None = None, device=None, dtype=None):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.implementation = implementation
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``y``, or ``(y, x + residual)`` when a residual is given (fused)."""
        return _norm.rms_norm(x, self.weight, eps=self.eps, residual=residual, implementation=self.implementation)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}"

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "RMSNorm":
        """From `torch.nn.RMSNorm` or an HF RMSNorm (``LlamaRMSNorm`` and the
        many models that copy it: a ``weight`` and a ``variance_epsilon``).
        The parameters are shared, not copied."""
        weight = getattr(module, "weight", None)
        if isinstance(module, nn.RMSNorm):
            shape = tuple(module.normalized_shape)
            if len(shape) != 1:
                raise ValueError(f"module: only a 1-D normalized_shape converts, got {shape}")
            eps = module.eps if module.eps is not None else torch.finfo(
                weight.dtype if weight is not None else torch.get_default_dtype()).eps
            hidden = shape[0]
        elif hasattr(module, "variance_epsilon") and isinstance(weight, torch.Tensor) and weight.ndim == 1:
            eps, hidden = module.variance_epsilon, weight.shape[0]
        else:
            raise TypeError(f"module: expected torch.nn.RMSNorm or an HF RMSNorm (weight + variance_epsilon), "
                            f"got {type(module).__name__}")
        new = cls(hidden, eps, elementwise_affine=False, **kwargs)
        new.weight = weight
        return new


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension (statistics in float32), like
    `torch.nn.LayerNorm` with a 1-D ``normalized_shape``."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, *,
                 implementation: str | None = None, device=None, dtype=None):
        super().__init__()
        if isinstance(hidden_size, (tuple, list)):
            if len(hidden_size) != 1:
                raise ValueError(f"hidden_size: only a 1-D normalized shape is supported, got {hidden_size}")
            hidden_size = hidden_size[0]
        self.hidden_size = int(hidden_size)
        self.eps = float(eps)
        self.implementation = implementation
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.hidden_size, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.hidden_size, **factory)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``y``, or ``(y, x + residual)`` when a residual is given (fused)."""
        return _norm.layer_norm(x, self.weight, self.bias, eps=self.eps, residual=residual,
                                implementation=self.implementation)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}, bias={self.bias is not None}"

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "nn.Module":
        """From `torch.nn.LayerNorm` (1-D normalized shape; parameters shared).
        An RMSNorm module (torch or HF) converts to `RMSNorm`."""
        if isinstance(module, nn.LayerNorm):
            shape = tuple(module.normalized_shape)
            if len(shape) != 1:
                raise ValueError(f"module: only a 1-D normalized_shape converts, got {shape}")
            new = cls(shape[0], module.eps, elementwise_affine=False, **kwargs)
            new.weight = module.weight
            new.bias = module.bias
            return new
        return RMSNorm.from_module(module, **kwargs)


#: HF ``hidden_act`` names -> stellax GLU activations.
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                   "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "relu": "relu", "sigmoid": "sigmoid"}


def hf_activation_name(module: nn.Module) -> str:
    """The stellax activation matching an HF MLP's ``act_fn`` (``ValueError`` if none)."""
    config = getattr(module, "config", None)
    names = []
    for attr in ("hidden_act", "hidden_activation"):
        if config is not None and isinstance(getattr(config, attr, None), str):
            names.append(getattr(config, attr))
    act = getattr(module, "act_fn", None)
    if isinstance(act, (nn.SiLU,)) or type(act).__name__ in ("SiLUActivation", "SiLU"):
        names.append("silu")
    elif isinstance(act, nn.ReLU):
        names.append("relu")
    elif isinstance(act, nn.Sigmoid):
        names.append("sigmoid")
    elif isinstance(act, nn.GELU):
        names.append("gelu_pytorch_tanh" if act.approximate == "tanh" else "gelu")
    for name in names:
        if name in _HF_ACTIVATIONS:
            return _HF_ACTIVATIONS[name]
    raise ValueError(f"module: cannot map the activation {names or type(act).__name__} to a stellax GLU activation "
                     f"(supported: {sorted(_HF_ACTIVATIONS)})")


class GatedMLP(nn.Module):
    """The gated MLP of Llama-style models: ``down(act(x W_gate) * (x W_up))``
    with the gate/up projections fused into one stellax kernel.

    Parameters: ``gate_up`` ``[hidden, 2, intermediate]`` (``[:, 0]`` the gate,
    ``[:, 1]`` the up projection, in the ``[in, out]`` layout of
    `stellax.gated_linear_unit`) and ``down_proj`` (an ``nn.Linear``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu", *, bias: bool = False,
                 implementation: str | None = None, device=None, dtype=None):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
        self.activation = activation
        self.implementation = implementation
        w = torch.empty(self.hidden_size, 2, self.intermediate_size, device=device, dtype=dtype)
        nn.init.normal_(w, std=self.hidden_size ** -0.5)
        self.gate_up = nn.Parameter(w)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _glu.gated_linear_unit(x, self.gate_up, activation=self.activation, implementation=self.implementation)
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, activation={self.activation!r}"

    @classmethod
    def from_module(cls, module: nn.Module, **kwargs) -> "GatedMLP":
        """From an HF gated MLP (``LlamaMLP`` and its many copies: ``gate_proj``,
        ``up_proj``, ``down_proj`` linears without gate/up biases and an
        ``act_fn``). The gate/up weights are copied once into the stacked
        ``[in, 2, out]`` layout; ``down_proj`` is shared."""
        try:
            gate, up, down = module.gate_proj, module.up_proj, module.down_proj
        except AttributeError:
            raise TypeError(f"module: expected a gated MLP with gate_proj/up_proj/down_proj, got "
                            f"{type(module).__name__}") from None
        if not all(isinstance(m, nn.Linear) for m in (gate, up, down)):
            raise TypeError("module: gate_proj, up_proj and down_proj must be nn.Linear")
        if gate.bias is not None or up.bias is not None:
            raise ValueError("module: gate_proj/up_proj with a bias cannot use the fused GLU kernel (it has no bias)")
        if gate.weight.shape != up.weight.shape or down.weight.shape != gate.weight.shape[::-1]:
            raise ValueError(f"module: mismatched shapes gate {tuple(gate.weight.shape)}, up {tuple(up.weight.shape)}, "
                             f"down {tuple(down.weight.shape)}")
        intermediate, hidden = gate.weight.shape
        new = cls(hidden, intermediate, hf_activation_name(module), device="meta", **kwargs)
        with torch.no_grad():
            stacked = torch.stack([gate.weight.t(), up.weight.t()], dim=1).contiguous()
        new.gate_up = nn.Parameter(stacked, requires_grad=gate.weight.requires_grad)
        new.down_proj = down
        return new
