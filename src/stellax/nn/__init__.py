"""Flax NNX layers over stellax's kernels (``pip install 'stellax[nn]'``).

``Attention`` (GQA, masks, soft cap, sinks, RoPE, a paged KV cache for
decode), ``RMSNorm``, ``LayerNorm``, ``GatedMLP``, ``MoE`` (with optional
expert parallelism over a mesh axis), ``GatedDeltaNet``,
``KimiDeltaAttention`` and ``Mamba2``. Each follows flax's conventions:
``rngs=nnx.Rngs(...)``, flax initializers (``kernel_init=...``),
``dtype`` / ``param_dtype``, and logical sharding annotations
(``sharding={"q": ("embed", "heads", None)}`` → ``nnx.with_partitioning``).
See docs/integrations.md.
"""

from __future__ import annotations

try:
    import flax.nnx  # noqa: F401
except ImportError as e:  # pragma: no cover
    raise ImportError("stellax.nn needs flax: pip install 'stellax[nn]'") from e

from .attention import Attention, PagedKVCache, rotary
from .linear_attention import GatedDeltaNet, KimiDeltaAttention, Mamba2
from .mlp import MoE, GatedMLP
from .norm import LayerNorm, RMSNorm
from .quantized_linear import QuantizedLinear

__all__ = ["Attention", "GatedDeltaNet", "GatedMLP", "KimiDeltaAttention", "LayerNorm", "Mamba2", "MoE",
           "PagedKVCache", "QuantizedLinear", "RMSNorm", "rotary"]
