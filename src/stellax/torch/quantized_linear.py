"""Torch front end of `stellax.quantized_linear` (NVFP4 / MXFP8 training
recipes): the ``stellax::quantized_linear`` custom op and the
`QuantizedLinear` ``nn.Module``.

The forward, data-gradient and weight-gradient GEMMs all run on quantized
operands (see `stellax.ops.quant.training`); torch autograd calls the JAX
custom VJP. The PRNG key of the stochastic rounding and the Hadamard signs
is an int32 seed tensor (``jax.random.key(seed)``), so a fresh seed per step
does not recompile.
"""

from __future__ import annotations

import math

import jax
import torch
from jax import Array
from torch import nn

import stellax
from stellax.ops.quant.recipes import QuantRecipe, get_recipe

from .registry import define_op

__all__ = ["QuantizedLinear", "quantized_linear"]


def _recipe(recipe: str, hadamard: bool, stochastic_rounding: bool) -> QuantRecipe | None:
    r = get_recipe(recipe)
    if r is None:
        return None
    changes = {}
    if not hadamard and r.hadamard is not None:
        changes["hadamard"] = None
    if not stochastic_rounding and r.stochastic_rounding:
        changes["stochastic_rounding"] = False
    return r.replace(**changes) if changes else r


def _quantized_linear(x: Array, w: Array, seed: Array | None, *, recipe: str, hadamard: bool,
                      stochastic_rounding: bool, implementation: str | None) -> Array:
    key = None if seed is None else jax.random.key(seed.reshape(()))
    return stellax.quantized_linear(x, w, _recipe(recipe, hadamard, stochastic_rounding), key=key,
                                    implementation=implementation)


quantized_linear_op = define_op("quantized_linear", _quantized_linear)


def quantized_linear(x: torch.Tensor, w: torch.Tensor, recipe: str | None = "nvfp4", *,
                     seed: int | torch.Tensor | None = None, hadamard: bool = True,
                     stochastic_rounding: bool = True, implementation: str | None = None) -> torch.Tensor:
    """`stellax.quantized_linear` on torch tensors: ``x [..., K] @ w [K, N]``.

    Args:
      x: float32/bfloat16/float16 ``[..., K]``; ``w``: ``[K, N]`` (the
        transpose of ``nn.Linear.weight``).
      recipe: ``"nvfp4"``, ``"mxfp8"`` or ``None`` / ``"bf16"``.
      seed: an int or an int32 scalar tensor: the PRNG key of the stochastic
        rounding and the Hadamard signs (needed for gradients of ``"nvfp4"``).
      hadamard, stochastic_rounding: ``False`` switches the recipe's random
        Hadamard transform / stochastic rounding off (ablations).
      implementation: ``None``, ``"xla"`` or ``"triton"``.

    Returns ``[..., N]`` in ``x.dtype``; differentiable in ``x`` and ``w``.
    """
    if seed is not None and not isinstance(seed, torch.Tensor):
        seed = torch.tensor(int(seed), dtype=torch.int32, device=x.device)
    elif seed is not None:
        seed = seed.to(device=x.device, dtype=torch.int32).reshape(())
    name = "bf16" if recipe is None else str(recipe)
    get_recipe(name)  # a clear error for an unknown recipe, before the op
    return quantized_linear_op(x, w, seed, name, bool(hadamard), bool(stochastic_rounding), implementation)


class QuantizedLinear(nn.Module):
    """``y = x Wᵀ + b`` with the GEMMs of forward and backward on quantized
    operands (`quantized_linear`); a drop-in for `torch.nn.Linear`
    (``weight [out, in]``, ``bias [out]``).

    Args:
      in_features, out_features, bias: as `torch.nn.Linear`.
      recipe: ``"nvfp4"``, ``"mxfp8"`` or ``None``/``"bf16"`` (the per-layer
        opt-out: the recipe keeps the first and last layers in bf16; build
        those with ``recipe=None`` or use ``QuantRecipe.for_layer``).
      hadamard, stochastic_rounding: ablation switches.

    Each training-mode forward draws a fresh seed from torch's generator
    (``torch.randint``), so ``torch.manual_seed`` makes runs reproducible; in
    eval mode no seed is drawn (the forward uses none).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: str | None = "nvfp4",
                 hadamard: bool = True, stochastic_rounding: bool = True, implementation: str | None = None,
                 device=None, dtype=None):
        super().__init__()
        get_recipe(recipe)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.recipe, self.hadamard, self.stochastic_rounding = recipe, bool(hadamard), bool(stochastic_rounding)
        self.implementation = implementation
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, **factory))
        self.bias = nn.Parameter(torch.empty(self.out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """`torch.nn.Linear`'s initialization."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seed = None
        if self.training and torch.is_grad_enabled():
            seed = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int32).to(x.device)
        y = quantized_linear(x, self.weight.t(), self.recipe, seed=seed, hadamard=self.hadamard,
                             stochastic_rounding=self.stochastic_rounding, implementation=self.implementation)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe!r}")

    @classmethod
    def from_module(cls, module: nn.Linear, **kwargs) -> "QuantizedLinear":
        """From a `torch.nn.Linear`; the parameters are shared, not copied."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module: expected torch.nn.Linear, got {type(module).__name__}")
        new = cls(module.in_features, module.out_features, bias=False, device="meta", **kwargs)
        new.weight = module.weight
        new.bias = module.bias
        return new
