"""Flash attention: `dot_product_attention` (forward and backward) with the full
mask family, its varlen form, and the mask description shared with other
attention families (paged attention, context parallelism)."""

from .api import (
    Canonical, attention_backward_op, attention_op, attention_with_vjp, canonicalize, dot_product_attention,
)
from .masks import MaskSpec, classify_blocks, default_positions, mask_fn, visit_schedule
from .varlen import dot_product_attention_varlen
from .fp8 import attention_fp8_op, quantize_for_attention

__all__ = [
    "Canonical", "MaskSpec", "attention_backward_op", "attention_fp8_op", "attention_op", "attention_with_vjp",
    "canonicalize", "classify_blocks", "default_positions", "dot_product_attention", "dot_product_attention_varlen",
    "mask_fn", "quantize_for_attention", "visit_schedule",
]
