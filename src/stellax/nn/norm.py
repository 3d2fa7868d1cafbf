"""`RMSNorm` and `LayerNorm` over stellax's fused norm kernels."""

from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
from flax import nnx

import stellax

from ._params import check_sharding, ones, param, positive, zeros


class RMSNorm(nnx.Module):
    """``y = x / sqrt(mean(x², -1) + epsilon) * scale`` (`stellax.rms_norm`).

    Args:
      num_features: ``D``, the last axis of ``x``.
      epsilon: added to the mean square.
      dtype: output dtype (default ``x.dtype``); param_dtype: of ``scale [D]``.
      scale_init: flax initializer (ones).
      sharding: ``{"scale": (axis,)}`` logical axes (``nnx.with_partitioning``).
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 scale_init=ones, sharding: Mapping[str, Sequence[str | None]] | None = None, rngs: nnx.Rngs):
        positive("RMSNorm", num_features=num_features)
        shard = check_sharding("RMSNorm", sharding, ["scale"])
        self.num_features, self.epsilon, self.dtype = num_features, float(epsilon), dtype
        self.scale = param("RMSNorm", rngs, "scale", scale_init, (num_features,), param_dtype, shard)

    def __call__(self, x, residual=None):
        """``x [..., D]`` (and an optional ``residual`` added first: returns
        ``(norm(x + residual), x + residual)``)."""
        if x.shape[-1] != self.num_features:
            raise ValueError(f"RMSNorm: x has last dim {x.shape[-1]}, expected num_features={self.num_features}")
        out = stellax.rms_norm(x, self.scale[...].astype(x.dtype), epsilon=self.epsilon, residual=residual)
        if self.dtype is None:
            return out
        return tuple(o.astype(self.dtype) for o in out) if isinstance(out, tuple) else out.astype(self.dtype)


class LayerNorm(nnx.Module):
    """``y = (x - mean) / sqrt(var + epsilon) * scale + bias`` (`stellax.layer_norm`).

    Args as `RMSNorm`, plus ``use_bias`` / ``bias_init`` (zeros) and
    ``use_scale``; sharding keys ``"scale"``, ``"bias"``.
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, use_bias: bool = True, use_scale: bool = True,
                 dtype=None, param_dtype=jnp.float32, scale_init=ones, bias_init=zeros,
                 sharding: Mapping[str, Sequence[str | None]] | None = None, rngs: nnx.Rngs):
        positive("LayerNorm", num_features=num_features)
        shard = check_sharding("LayerNorm", sharding, ["scale", "bias"])
        self.num_features, self.epsilon, self.dtype = num_features, float(epsilon), dtype
        self.scale = param("LayerNorm", rngs, "scale", scale_init, (num_features,), param_dtype, shard) \
            if use_scale else None
        self.bias = param("LayerNorm", rngs, "bias", bias_init, (num_features,), param_dtype, shard) \
            if use_bias else None

    def __call__(self, x):
        """``x [..., D] -> [..., D]``."""
        if x.shape[-1] != self.num_features:
            raise ValueError(f"LayerNorm: x has last dim {x.shape[-1]}, expected num_features={self.num_features}")
        scale = None if self.scale is None else self.scale[...].astype(x.dtype)
        bias = None if self.bias is None else self.bias[...].astype(x.dtype)
        out = stellax.layer_norm(x, scale, bias, epsilon=self.epsilon)
        return out if self.dtype is None else out.astype(self.dtype)
