"""Linear and hybrid attention: Gated DeltaNet, Kimi Delta Attention and Mamba2 SSD."""

from .api import (
    chunk_gated_delta_rule, chunk_gated_delta_rule_op, chunk_kda, chunk_kda_op, fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_op, fused_recurrent_kda, fused_recurrent_kda_op,
)
from .chunk import chunk_intra, state_step, state_transition
from .configs import LinearAttentionConfig
from .core import gated_recurrence_backward_op
from .kda_core import kda_recurrence_backward_op
from .reference import kda_gate, l2norm
from .ssd import ssd, ssd_op, ssd_step, ssd_step_op

__all__ = [
    "LinearAttentionConfig", "chunk_gated_delta_rule", "chunk_gated_delta_rule_op", "chunk_intra", "chunk_kda",
    "chunk_kda_op", "fused_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule_op",
    "fused_recurrent_kda", "fused_recurrent_kda_op", "gated_recurrence_backward_op", "kda_gate",
    "kda_recurrence_backward_op", "l2norm", "ssd",
    "ssd_op", "ssd_step", "ssd_step_op", "state_step", "state_transition",
]
