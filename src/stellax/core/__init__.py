"""The op framework: ops, implementations, configs, dispatch and platforms."""

from .call import Call
from .config import KernelConfig, MatmulTileConfig, TritonConfig, is_power_of_two, next_power_of_two, product_space
from .op import (
    Example,
    Implementation,
    Op,
    Support,
    UnsupportedError,
    backend_support,
    backward_implementation,
    register,
    registered_ops,
)
from .platform import (
    LOWERING_TARGETS,
    Platform,
    current_platform,
    host_platform,
    interpret_enabled,
    interpret_mode,
    lowering_target,
)
from .selection import observe_calls, register_config_source, resolve_config, use_configs

__all__ = [
    "Call", "Example", "Implementation", "KernelConfig", "LOWERING_TARGETS", "MatmulTileConfig", "Op",
    "Platform", "Support", "TritonConfig", "UnsupportedError", "backend_support", "backward_implementation",
    "current_platform", "host_platform", "interpret_enabled", "interpret_mode", "is_power_of_two",
    "lowering_target", "next_power_of_two", "observe_calls", "product_space", "register",
    "register_config_source", "registered_ops", "resolve_config", "use_configs",
]
