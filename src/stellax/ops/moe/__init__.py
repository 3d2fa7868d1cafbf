"""Mixture-of-experts: grouped matmuls, routing, token permutation, the MoE MLP
and expert parallelism."""

from .api import (ragged_dot, ragged_dot_backward_op, ragged_dot_general, ragged_dot_op, ragged_dot_tgmm,
                  ragged_dot_tgmm_op)
from .configs import GroupedMatmulConfig, XlaGroupedMatmulConfig
from .dispatch import permute, unpermute
from .mlp import moe_mlp, moe_mlp_op
from .quantized import ragged_dot_quantized, ragged_dot_quantized_op
from .parallel import moe_mlp_expert_parallel, moe_mlp_shard, ragged_all_to_all_padded
from .routing import load_balancing_loss, route, route_op, router_z_loss

__all__ = [
    "GroupedMatmulConfig", "XlaGroupedMatmulConfig", "load_balancing_loss", "moe_mlp", "moe_mlp_expert_parallel",
    "moe_mlp_op", "moe_mlp_shard", "permute", "ragged_all_to_all_padded", "ragged_dot", "ragged_dot_backward_op",
    "ragged_dot_general", "ragged_dot_op", "ragged_dot_quantized", "ragged_dot_quantized_op", "ragged_dot_tgmm",
    "ragged_dot_tgmm_op", "route", "route_op", "router_z_loss", "unpermute",
]
