from .activations import ACTIVATIONS
from .api import gated_linear_unit, gated_linear_unit_backward_op, gated_linear_unit_op
from .configs import GluConfig, GluTpuConfig

__all__ = ["ACTIVATIONS", "GluConfig", "GluTpuConfig", "gated_linear_unit", "gated_linear_unit_backward_op",
           "gated_linear_unit_op"]
