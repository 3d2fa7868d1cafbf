"""The ``ragged_dot`` op: a grouped matmul with the contract of ``jax.lax.ragged_dot``.

``lhs [M, K]`` (rows sorted by group) times one of ``rhs [G, K, N]`` per group
(or ``[G, N, K]`` with ``transpose_rhs``, the dlhs layout), optional fused
activation and fused gate/up (``rhs [G, K, 2, N]`` → ``act(gate) * up``):

    out[rows of g] = act(lhs[rows of g] @ rhs[g])        (zeros outside the local groups)

Its VJP saves the pre-activation and calls the ``ragged_dot_backward`` op.
"""

from __future__ import annotations

import jax

from ...core import Call, Op, backward_implementation, register
from .base import FAMILY, gmm_bytes, gmm_flops, implementations, kernel_options, kernels, registered_op
from .checks import check_ragged_dot
from .configs import gmm_heuristic, gmm_space, gmm_xla_heuristic
from .examples import FORWARD_PEERS, forward_benchmarks, forward_examples
from .reference import ragged_dot_reference


def _runner(name: str):
    def run(call: Call, config):
        options = dict(transpose_rhs=call.transpose_rhs, activation=call.activation, precision=call.precision,
                       out_dtype=call.out_dtype, **kernel_options(name, config))
        gmm = kernels(name).gmm
        save = call.rhs.ndim == 4 or call.activation is not None

        @jax.custom_vjp
        def grouped(lhs, rhs, group_sizes, group_offset):
            return gmm(lhs, rhs, group_sizes, group_offset, save_preactivation=False, **options)[0]

        def forward(lhs, rhs, group_sizes, group_offset):
            out, pre = gmm(lhs, rhs, group_sizes, group_offset, save_preactivation=save, **options)
            return out, (lhs, rhs, group_sizes, group_offset, pre)

        def backward(residuals, dy):
            lhs, rhs, group_sizes, group_offset, pre = residuals
            backward_op = registered_op("ragged_dot_backward")
            dlhs, drhs = backward_op(
                dy, lhs, rhs, group_sizes, group_offset, pre, activation=call.activation,
                transpose_rhs=call.transpose_rhs, precision=call.precision,
                implementation=backward_implementation(backward_op, name))
            return dlhs, drhs, None, None

        grouped.defvjp(forward, backward)
        return grouped(call.lhs, call.rhs, call.group_sizes, call.group_offset)
    return run


ragged_dot_op = register(Op(
    "ragged_dot", family=FAMILY, check=check_ragged_dot, reference=ragged_dot_reference,
    implementations=implementations(_runner, gmm_heuristic, gmm_space, gmm_xla_heuristic, tpu=True),
    flops=gmm_flops, bytes_accessed=gmm_bytes, examples=forward_examples, benchmarks=forward_benchmarks,
    peers=FORWARD_PEERS, differentiable=("lhs", "rhs"),
))
