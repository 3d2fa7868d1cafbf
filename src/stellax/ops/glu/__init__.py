from .activations import ACTIVATIONS
from .api import gated_linear_unit, gated_linear_unit_backward_op, gated_linear_unit_op
from .configs import GluConfig

__all__ = ["ACTIVATIONS", "GluConfig", "gated_linear_unit", "gated_linear_unit_backward_op",
           "gated_linear_unit_op"]
