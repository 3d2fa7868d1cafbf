"""What the grouped-matmul ops share: cost models, the Triton requirements,
the (triton, xla) implementation pair and the kernel module of each.

The three dense ops call each other in their backward passes:
``ragged_dot`` → ``ragged_dot_backward`` → ``ragged_dot`` (dlhs) and
``ragged_dot_tgmm`` (drhs); ``ragged_dot_tgmm`` → ``ragged_dot``. The modules
import in that order (`ragged_dot` ← `tgmm` ← `backward`), and `ragged_dot`
finds its backward op by name (`registered_op`) when its VJP is traced.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from ...core import Call, Implementation, Op, registered_ops
from . import mosaic_tpu as tpu_kernels
from . import triton as triton_kernels
from . import xla as xla_kernels
from .checks import concrete
from .configs import GroupedMatmulConfig, XlaGroupedMatmulConfig, gmm_dims, tgmm_dims, xla_space
from .tpu_configs import TpuGroupedMatmulConfig, gmm_tpu_heuristic, gmm_tpu_requirements, gmm_tpu_space

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


def kernels(name: str):
    """The kernel module of implementation ``name`` (`xla`, `triton` or `mosaic_tpu`, same contract)."""
    return {"xla": xla_kernels, "mosaic_tpu": tpu_kernels}.get(name, triton_kernels)


def kernel_options(name: str, config) -> dict:
    """The config keywords of that module's kernels."""
    return {"block_m": config.block_m} if name == "xla" else {"config": config}


def implementations(runner: Callable[[str], Callable], heuristic, space, xla_heuristic, *,
                    tpu: bool = False, tpu_heuristic=gmm_tpu_heuristic, tpu_space=gmm_tpu_space
                    ) -> list[Implementation]:
    """The ``triton`` and ``xla`` implementations of a grouped-matmul op, after
    ``mosaic_tpu`` when ``tpu`` (the op has a Mosaic TPU kernel; its heuristic
    and space default to the forward's, `ragged_dot_tgmm` passes its own)."""
    on_tpu = [Implementation("mosaic_tpu", runner("mosaic_tpu"), backend="mosaic_tpu",
                             config_type=TpuGroupedMatmulConfig, heuristic=tpu_heuristic, space=tpu_space,
                             requirements=gmm_tpu_requirements)] if tpu else []
    return on_tpu + [
        Implementation("triton", runner("triton"), backend="triton", config_type=GroupedMatmulConfig,
                       heuristic=heuristic, space=space, requirements=triton_requirements),
        Implementation("xla", runner("xla"), config_type=XlaGroupedMatmulConfig, heuristic=xla_heuristic,
                       space=xla_space),
    ]


def registered_op(name: str) -> Op:
    """The registered op ``name``, looked up when a VJP is traced (see the module doc)."""
    return registered_ops()[name]
