"""Which implementations the attention ops have, in dispatch order.

Forward kernels: ``fn(canonical, config) -> (out [B, T, N, Hv], lse [B, N, T])``.
Backward kernels: ``fn(canonical, out, lse, d_out, d_lse, config) -> (dq, dk, dv, dbias, dsinks)``.
"""

from __future__ import annotations

from ...core import Implementation
from . import configs
from . import xla_chunked

from . import triton as triton_kernels
from . import triton_backward as triton_backward_kernels

FORWARD_KERNELS: dict = {"triton": triton_kernels.forward, "xla_chunked": xla_chunked.forward}
BACKWARD_KERNELS: dict = {"triton": triton_backward_kernels.backward, "xla_chunked": xla_chunked.backward}


def _chunked(runner):
    return Implementation("xla_chunked", runner("xla_chunked"), config_type=configs.ChunkedConfig,
                          heuristic=configs.chunked_heuristic, space=configs.chunked_space)


def forward_implementations(runner):
    impls = []
    if "triton" in FORWARD_KERNELS:
        impls.append(Implementation("triton", runner("triton"), backend="triton", config_type=configs.FlashConfig,
                                    heuristic=configs.flash_heuristic, space=configs.flash_space,
                                    requirements=configs.flash_requirements))
    return impls + [_chunked(runner), Implementation("xla", runner("xla"))]


def backward_implementations(runner):
    impls = []
    if "triton" in BACKWARD_KERNELS:
        impls.append(Implementation("triton", runner("triton"), backend="triton",
                                    config_type=configs.FlashBackwardConfig,
                                    heuristic=configs.flash_backward_heuristic,
                                    space=configs.flash_backward_space, requirements=configs.flash_requirements))
    return impls + [_chunked(runner), Implementation("xla", runner("xla"))]
