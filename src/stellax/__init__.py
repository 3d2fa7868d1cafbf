"""stellax: fast, verified kernels for AI accelerators on JAX and Pallas."""

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
from .ops.norm import NormConfig, layer_norm, rms_norm

__all__ = [
    "KernelConfig", "NormConfig", "Op", "UnsupportedError", "__version__", "current_platform",
    "interpret_enabled", "interpret_mode", "layer_norm", "lowering_target", "registered_ops",
    "rms_norm", "use_configs",
]
