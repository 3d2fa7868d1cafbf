"""Flash attention: `dot_product_attention` (forward and backward) with the full
mask family, its varlen form, and the mask description shared with other
attention families (paged attention, context parallelism)."""

from .api import attention_op, dot_product_attention
from .backward import attention_backward_op, backward_kernels
from .base import Canonical, canonicalize
from .fp8 import attention_fp8_op, quantize_for_attention
from .masks import MaskSpec, classify_blocks, default_positions, mask_fn, visit_schedule
from .varlen import dot_product_attention_varlen

__all__ = [
    "Canonical", "MaskSpec", "attention_backward_op", "attention_fp8_op", "attention_op", "backward_kernels",
    "canonicalize", "classify_blocks", "default_positions", "dot_product_attention", "dot_product_attention_varlen",
    "mask_fn", "quantize_for_attention", "visit_schedule",
]
