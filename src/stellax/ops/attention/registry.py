"""Which implementations the attention ops have, in dispatch order.

Forward kernels: ``fn(canonical, config) -> (out [B, T, N, Hv], lse [B, N, T])``.
Backward kernels: ``fn(canonical, out, lse, d_out, d_lse, config) -> (dq, dk, dv, dbias, dsinks)``.
"""

from __future__ import annotations

from ...core import Implementation

FORWARD_KERNELS: dict = {}
BACKWARD_KERNELS: dict = {}


def forward_implementations(runner):
    return [Implementation("xla", runner("xla"))]


def backward_implementations(runner):
    return [Implementation("xla", runner("xla"))]
