"""What the grouped-matmul ops share: cost models, the backend tables and the
Triton requirements.

The three dense ops (`api.py`) call each other in their backward passes:
``ragged_dot`` → ``ragged_dot_backward`` → ``ragged_dot`` (dlhs) and
``ragged_dot_tgmm`` (drhs); ``ragged_dot_tgmm`` → ``ragged_dot``.

`BACKENDS` holds one row per backend (``mosaic_tpu``, ``triton``, ``xla``): the
kernel module (`mosaic_tpu.py`, `triton.py`, `xla.py`, each with ``gmm`` and
``tgmm`` of one contract) and the tuning of ``ragged_dot`` (forward) and
``ragged_dot_backward`` (backward: no configs, the row's requirements). The
other ops over the same kernels take the rows with their own tuning
(`BackendTable.retuned`): ``ragged_dot_tgmm``, ``moe_mlp``, and ``moe_route`` its ``xla`` row alone,
untuned (`routing.py`). `QUANTIZED_BACKENDS` holds the
quantized ``ragged_dot``'s kernel modules (`mosaic_tpu_quantized.py`,
`triton_quantized.py`, `xla_quantized.py`: ``gmm`` and ``gmm_transposed``).
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np

from ...core import Call
from ...core.backends import UNTUNED, Backend, BackendTable, Tuning
from . import mosaic_tpu, mosaic_tpu_quantized, triton, triton_quantized, xla, xla_quantized
from .checks import concrete
from .configs import (GroupedMatmulConfig, TpuGroupedMatmulConfig, XlaGroupedMatmulConfig, gmm_dims, gmm_heuristic,
                      gmm_space, gmm_tpu_heuristic, gmm_tpu_requirements, gmm_tpu_space, gmm_xla_heuristic,
                      quantized_heuristic, quantized_k_block, quantized_space, quantized_tpu_heuristic,
                      quantized_tpu_requirements, quantized_tpu_space, quantized_xla_heuristic, tgmm_dims,
                      tgmm_heuristic, tgmm_space, tgmm_tpu_heuristic, tgmm_tpu_space, tgmm_xla_heuristic, xla_space)

FAMILY = "moe"


# -- cost models -----------------------------------------------------------------------
def local_rows(call: Call, m: int, num_local: int) -> int:
    """Rows the call computes: exact for concrete group sizes, else ``m``."""
    sizes = concrete(call.group_sizes)
    if sizes is None:
        return m
    ends = np.minimum(np.cumsum(np.maximum(sizes.astype(np.int64), 0)), m)
    starts = np.concatenate([[0], ends[:-1]])
    offset = concrete(call.group_offset)
    lo = 0 if offset is None else int(offset)
    return int((ends[lo:lo + num_local] - starts[lo:lo + num_local]).sum())


def gmm_flops(call: Call) -> float:
    """``2·rows·K·N`` (+ the activation) of a `ragged_dot` call."""
    m, k, n_total, g, gated = gmm_dims(call)
    rows = local_rows(call, m, g)
    return 2.0 * rows * k * n_total + (rows * n_total if call.activation is not None or gated else 0)


def gmm_bytes(call: Call) -> float:
    """``lhs`` + every local group's weights + the output of a `ragged_dot` call."""
    m, k, n_total, g, gated = gmm_dims(call)
    size = np.dtype(call.lhs.dtype).itemsize
    return float(m * k * size + g * k * n_total * size + m * (n_total // 2 if gated else n_total)
                 * np.dtype(call.out_dtype).itemsize)


def tgmm_flops(call: Call) -> float:
    """``2·rows·K·N`` of a `ragged_dot_tgmm` call."""
    m, k, n, g = tgmm_dims(call)
    return 2.0 * local_rows(call, m, g) * k * n


def tgmm_bytes(call: Call) -> float:
    """Both ``[M, ·]`` operands and the ``[G, K, N]`` output of a `ragged_dot_tgmm` call."""
    m, k, n, g = tgmm_dims(call)
    size = np.dtype(call.lhs.dtype).itemsize
    return float(m * (k + n) * size + g * k * n * np.dtype(call.out_dtype).itemsize)


# -- implementations -----------------------------------------------------------------------
def triton_requirements(call: Call) -> str | None:
    """Why the Triton grouped matmul cannot run ``call`` (None when it can)."""
    if np.dtype(call.lhs.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"the Triton grouped matmul needs float32/bfloat16/float16 operands, got {np.dtype(call.lhs.dtype).name}"
    return None


def quantized_triton_requirements(call: Call) -> str | None:
    """Why the Triton quantized grouped matmul cannot run ``call`` (None when it can)."""
    if np.dtype(call.lhs.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"the Triton kernel needs float32/bfloat16/float16 lhs, got {np.dtype(call.lhs.dtype).name}"
    kb = quantized_k_block(call)
    if kb is not None and (kb < 16 or kb & (kb - 1)):
        return (f"the Triton kernel needs per-channel scales or K blocks that are powers of two >= 16 "
                f"(block_k is capped at the K block); rhs has K blocks of {kb}")
    return None


# -- backend tables ---------------------------------------------------------------------------
BACKENDS = BackendTable(FAMILY, [
    Backend("mosaic_tpu", mosaic_tpu, "mosaic_tpu",
            Tuning(TpuGroupedMatmulConfig, gmm_tpu_heuristic, gmm_tpu_space, gmm_tpu_requirements),
            backward_tuning=Tuning(requirements=gmm_tpu_requirements)),
    Backend("triton", triton, "triton", Tuning(GroupedMatmulConfig, gmm_heuristic, gmm_space, triton_requirements),
            backward_tuning=Tuning(requirements=triton_requirements)),
    Backend("xla", xla, tuning=Tuning(XlaGroupedMatmulConfig, gmm_xla_heuristic, xla_space),
            backward_tuning=UNTUNED),
])


TGMM_BACKENDS = BACKENDS.retuned({
    "mosaic_tpu": Tuning(TpuGroupedMatmulConfig, tgmm_tpu_heuristic, tgmm_tpu_space, gmm_tpu_requirements),
    "triton": Tuning(GroupedMatmulConfig, tgmm_heuristic, tgmm_space, triton_requirements),
    "xla": Tuning(XlaGroupedMatmulConfig, tgmm_xla_heuristic, xla_space),
})

QUANTIZED_BACKENDS = BackendTable(FAMILY, [
    Backend("mosaic_tpu", mosaic_tpu_quantized, "mosaic_tpu",
            Tuning(TpuGroupedMatmulConfig, quantized_tpu_heuristic, quantized_tpu_space, quantized_tpu_requirements)),
    Backend("triton", triton_quantized, "triton",
            Tuning(GroupedMatmulConfig, quantized_heuristic, quantized_space, quantized_triton_requirements)),
    Backend("xla", xla_quantized, tuning=Tuning(XlaGroupedMatmulConfig, quantized_xla_heuristic, xla_space)),
])
