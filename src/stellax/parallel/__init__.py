"""Context parallelism over ``jax.shard_map``: all-gather, Ulysses, ring and
USP attention, load-balancing layouts, linear-attention state passing and
communication/memory accounting. See ``docs/parallel.md``."""

from .accounting import attention_traffic_model, collective_traffic, memory_report
from .attention import STRATEGIES, context_parallel_attention, context_parallel_attention_shard
from .layout import (load_balance_permutation, reorder_for_load_balance, restore_from_load_balance,
                     shard_positions)
from .linear import context_parallel_gated_delta_rule, context_parallel_kda
from .local import LocalAttention, add_sinks, merge_partials
from .ring import ring_attention_shard

__all__ = [
    "STRATEGIES", "LocalAttention", "add_sinks", "attention_traffic_model", "collective_traffic",
    "context_parallel_attention", "context_parallel_attention_shard", "context_parallel_gated_delta_rule", "context_parallel_kda",
    "load_balance_permutation", "memory_report", "merge_partials", "reorder_for_load_balance",
    "restore_from_load_balance", "ring_attention_shard", "shard_positions",
]
