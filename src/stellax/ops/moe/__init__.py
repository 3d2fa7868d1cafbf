"""Mixture-of-experts: grouped matmuls, routing, token permutation, the MoE MLP
and expert parallelism."""

from .api import (ragged_dot, ragged_dot_backward_op, ragged_dot_general, ragged_dot_op, ragged_dot_tgmm,
                  ragged_dot_tgmm_op)
from .configs import GroupedMatmulConfig, XlaGroupedMatmulConfig

__all__ = [
    "GroupedMatmulConfig", "XlaGroupedMatmulConfig", "ragged_dot", "ragged_dot_backward_op", "ragged_dot_general",
    "ragged_dot_op", "ragged_dot_tgmm", "ragged_dot_tgmm_op",
]
