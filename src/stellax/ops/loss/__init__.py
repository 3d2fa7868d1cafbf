from .api import linear_cross_entropy, linear_cross_entropy_backward_op, linear_cross_entropy_op
from .configs import ChunkedConfig, LinearCrossEntropyConfig, LossTpuConfig

__all__ = ["ChunkedConfig", "LinearCrossEntropyConfig", "LossTpuConfig", "linear_cross_entropy", "linear_cross_entropy_backward_op",
           "linear_cross_entropy_op"]
