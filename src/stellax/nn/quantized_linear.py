"""`QuantizedLinear`: a Flax NNX linear layer trained with a low-precision
recipe (`stellax.quantized_linear`: NVFP4 / MXFP8 in the forward, the
data-gradient and the weight-gradient GEMM)."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import stellax
from stellax.ops.quant.recipes import get_recipe

from ._params import check_sharding, param, positive, zeros

_default_kernel = nnx.initializers.lecun_normal()


class QuantizedLinear(nnx.Module):
    """``y = x @ kernel + bias`` whose three training GEMMs run on quantized
    operands (`stellax.quantized_linear`).

    Args:
      in_features: ``K``; out_features: ``N``.
      recipe: ``"nvfp4"``, ``"mxfp8"``, a `stellax.QuantRecipe`, or ``None`` /
        ``"bf16"`` (the per-layer opt-out; ``QuantRecipe.for_layer(i, n)``
        gives ``None`` for the layers a recipe keeps in bf16).
      use_bias: add a ``bias [N]`` (in float, after the GEMM).
      dtype: the compute dtype of ``x`` (``None``: as given); param_dtype:
        the master weights' dtype (float32).
      kernel_init: flax initializer of ``kernel [K, N]``.
      sharding: logical axes for ``"kernel"`` (2) and ``"bias"`` (1).
      rngs: ``nnx.Rngs`` for the initialization; its ``"quant"`` stream (or
        ``default``) draws the stochastic-rounding / Hadamard key of every call
        that does not pass ``key``.
    """

    def __init__(self, in_features: int, out_features: int, *, recipe="nvfp4", use_bias: bool = False,
                 dtype=None, param_dtype=jnp.float32, kernel_init=_default_kernel,
                 sharding: Mapping[str, Sequence[str | None]] | None = None, rngs: nnx.Rngs):
        positive("QuantizedLinear", in_features=in_features, out_features=out_features)
        shard = check_sharding("QuantizedLinear", sharding, ["kernel", "bias"])
        self.recipe = get_recipe(recipe)
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.kernel = param("QuantizedLinear", rngs, "kernel", kernel_init, (in_features, out_features),
                            param_dtype, shard)
        self.bias = param("QuantizedLinear", rngs, "bias", zeros, (out_features,), param_dtype,
                          shard) if use_bias else None
        self.rngs = rngs

    def __call__(self, x, *, key: jax.Array | None = None):
        """``x [..., K] -> [..., N]`` (in ``dtype`` or ``x.dtype``)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantizedLinear: x has last dim {x.shape[-1]}, expected in_features={self.in_features}")
        if self.dtype is not None:
            x = x.astype(self.dtype)
        if key is None and self.recipe is not None and self.recipe.needs_key:
            key = self.rngs.quant() if "quant" in self.rngs else self.rngs.default()
        y = stellax.quantized_linear(x, self.kernel[...], self.recipe, key=key)
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y
