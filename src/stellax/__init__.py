"""stellax: fast, verified kernels for AI accelerators on JAX and Pallas.

Every public op and helper is importable from here; context parallelism lives
in `stellax.parallel`, the PyTorch front ends in `stellax.torch`.
"""

import importlib as _importlib
import threading as _threading

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
from .core.runtime_checks import checked
from .core.selection import register_config_source as _register_config_source

# Op families (one line each; keep alphabetical).
from .ops.attention import MaskSpec, dot_product_attention, dot_product_attention_varlen
from .ops.glu import GluConfig, gated_linear_unit
from .ops.linear_attention import (LinearAttentionConfig, chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule, fused_recurrent_kda, ssd, ssd_step)
from .ops.loss import ChunkedConfig, LinearCrossEntropyConfig, linear_cross_entropy
from .ops.moe import (GroupedMatmulConfig, XlaGroupedMatmulConfig, load_balancing_loss, moe_mlp, moe_mlp_expert_parallel, moe_mlp_shard, permute, ragged_dot, ragged_dot_general, ragged_dot_tgmm, route, router_z_loss, unpermute)
from .ops.norm import NormConfig, layer_norm, rms_norm
from .ops.paged_attention import (KVQuant, MlaConfig, PagedConfig, QuantizedPages, RaggedConfig, init_kv_cache, mla_decode, paged_attention, ragged_paged_attention, update_kv_cache)
from .ops.paged_attention.rotation import (
    KVClip, KVRotation, calibrate_kv_clip, calibrate_kv_rotation, load_kv_rotation, save_kv_rotation,
)
from .ops.quant import HadamardConfig, QArray, QMatmulConfig, dequantize, hadamard_transform, quantize, quantized_matmul
from .ops.quant import QuantRecipe, quantized_linear

# The upper layers (autotuning, benchmarking, the kernel lab, context parallelism, the test harness) load on
# first use: `stellax.autotune(fn, *args)` (the module is callable), `stellax.benchmark`, `stellax.parallel.*`,
# `stellax.lab`, `stellax.testing`. Name -> (module, attribute or None for the module itself).
_LAZY = {
    "autotune": ("stellax.autotune", None),
    "bench": ("stellax.bench", None),
    "benchmark": ("stellax.bench", "benchmark"),
    "lab": ("stellax.lab", None),
    "parallel": ("stellax.parallel", None),
    "testing": ("stellax.testing", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = _importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _AutotuneSources:
    """Config lookups consult the autotuning caches (user cache, shipped cache, the session's and the
    cache-miss policy, `stellax.autotune.sources`) without `import stellax` importing the autotuner: this
    stands first in the config-source list; its first lookup imports `stellax.autotune`, which registers
    those sources right after it, and it answers nothing itself."""

    label = "autotune"

    def __init__(self):
        self._lock = _threading.Lock()
        self._loaded = False

    def __call__(self, op_name, implementation, call):
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    _importlib.import_module("stellax.autotune")
                    self._loaded = True
        return None


_register_config_source(_AutotuneSources())

# Implementations from plugins (entry points `stellax.implementations`, STELLAX_PLUGIN_PATH): a broken plugin is
# reported by `stellax info`, never breaks this import. `stellax.lab.plugins` needs only the op registry.
from .lab.plugins import load_plugins as _load_plugins  # noqa: E402

_load_plugins()
