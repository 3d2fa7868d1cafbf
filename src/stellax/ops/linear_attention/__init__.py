"""Linear and hybrid attention: Gated DeltaNet, Kimi Delta Attention and Mamba2 SSD.

The chunked algorithm is the flash-linear-attention pipeline, one module per
stage, shared by GDN, KDA and SSD and by the XLA and Triton paths:

    decay      (1) span sums of the log decays
    scores     (2) the decayed q·kᵀ / k·kᵀ scores
    solve      (3) the triangular solve T = (I + A)⁻¹
    wy         (4) W and U (the UT/WY form of the delta rule)
    scan       (5) the state scan over chunks
    output     (6) the output O = (Γ⊙Q) S + P Δ

`base` holds the backend tables (one row per backend: ``mosaic_tpu``,
``triton``, ``xla``) the ops' implementations are generated from, and the
shared argument checks; `recurrence` runs a row (the XLA scan `xla`, the
Triton kernels `triton_intra`, `triton_scan`, `triton_output` chained by
`pipeline`, or the fused Mosaic TPU kernel `mosaic_tpu`) behind a `core.vjp`
rule; `backward` holds the backward ops (`pipeline.backward` over
`triton_backward`, `triton_kda_backward`; `mosaic_tpu_backward`); the decode
kernels are `mosaic_tpu_decode`; `api` and `ssd` the public functions;
`configs` every backend's configs; `examples` the examples and benchmark shapes.
"""

from .api import (
    chunk_gated_delta_rule, chunk_gated_delta_rule_op, chunk_kda, chunk_kda_op, fused_recurrent_gated_delta_rule,
    fused_recurrent_gated_delta_rule_op, fused_recurrent_kda, fused_recurrent_kda_op,
)
from .backward import gated_recurrence_backward_op, kda_recurrence_backward_op
from .configs import LinearAttentionConfig
from .reference import kda_gate, l2norm
from .scan import state_step, state_transition
from .ssd import ssd, ssd_op, ssd_step, ssd_step_op
from .wy import chunk_intra

__all__ = [
    "LinearAttentionConfig", "chunk_gated_delta_rule", "chunk_gated_delta_rule_op", "chunk_intra", "chunk_kda",
    "chunk_kda_op", "fused_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule_op",
    "fused_recurrent_kda", "fused_recurrent_kda_op", "gated_recurrence_backward_op", "kda_gate",
    "kda_recurrence_backward_op", "l2norm", "ssd",
    "ssd_op", "ssd_step", "ssd_step_op", "state_step", "state_transition",
]
