"""stellax: fast, verified kernels for AI accelerators on JAX and Pallas.

Every public op and helper is importable from here; context parallelism lives
in `stellax.parallel`, the PyTorch front ends in `stellax.torch`.
"""

from ._version import __version__
from .core import (
    KernelConfig,
    Op,
    UnsupportedError,
    current_platform,
    interpret_enabled,
    interpret_mode,
    lowering_target,
    registered_ops,
    use_configs,
)

# Op families (one line each; keep alphabetical).
from .ops.attention import MaskSpec, dot_product_attention, dot_product_attention_varlen
from .ops.glu import GluConfig, gated_linear_unit
from .ops.linear_attention import (LinearAttentionConfig, chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda, ssd, ssd_step)
from .ops.loss import ChunkedConfig, LinearCrossEntropyConfig, linear_cross_entropy
from .ops.moe import (GroupedMatmulConfig, XlaGroupedMatmulConfig, load_balancing_loss, moe_mlp, moe_mlp_expert_parallel, moe_mlp_shard, permute, ragged_dot, ragged_dot_general, ragged_dot_tgmm, route, router_z_loss, unpermute)
from .ops.norm import NormConfig, layer_norm, rms_norm
from .paged import (KVQuant, MlaConfig, PagedConfig, QuantizedPages, RaggedConfig, init_kv_cache, mla_decode, paged_attention, ragged_paged_attention, update_kv_cache)
from .ops.paged_attention.rotation import (
    KVClip, KVRotation, calibrate_kv_clip, calibrate_kv_rotation, load_kv_rotation, save_kv_rotation,
)
from .ops.quant import HadamardConfig, QArray, QMatmulConfig, dequantize, hadamard_transform, quantize, quantized_matmul
from .ops.quant import QuantRecipe, quantized_linear

# Autotuning and benchmarking (`stellax.autotune(fn, *args)` is callable).
from . import autotune
from .bench import benchmark

# Context parallelism over jax.shard_map (stellax.parallel.context_parallel_attention, ...).
from . import parallel

# The kernel lab (stellax.lab) and implementations from plugins (entry points `stellax.implementations`,
# STELLAX_PLUGIN_PATH): a broken plugin is reported by `stellax info`, never breaks this import.
from .lab.plugins import load_plugins as _load_plugins

_load_plugins()
