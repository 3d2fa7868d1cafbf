from .api import layer_norm, layer_norm_backward_op, layer_norm_op, rms_norm
from .configs import NormConfig, NormTpuConfig

__all__ = ["NormConfig", "NormTpuConfig", "layer_norm", "layer_norm_backward_op", "layer_norm_op", "rms_norm"]
