from .api import linear_cross_entropy, linear_cross_entropy_backward_op, linear_cross_entropy_op
from .configs import ChunkedConfig, LinearCrossEntropyConfig

__all__ = ["ChunkedConfig", "LinearCrossEntropyConfig", "linear_cross_entropy", "linear_cross_entropy_backward_op",
           "linear_cross_entropy_op"]
