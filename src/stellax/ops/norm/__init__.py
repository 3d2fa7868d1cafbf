from .api import layer_norm, layer_norm_backward_op, layer_norm_op, rms_norm
from .configs import NormConfig

__all__ = ["NormConfig", "layer_norm", "layer_norm_backward_op", "layer_norm_op", "rms_norm"]
