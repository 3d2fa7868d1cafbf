"""The ``ragged_dot_tgmm`` op: the ragged dimension contracted (the weight
gradient of `ragged_dot`).

``lhs [K, M]`` (or ``[M, K]`` with ``transpose_lhs``), ``rhs [M, N]`` →
``[G, K, N]`` over the ``num_local_groups`` groups from ``group_offset``:

    out[g] = lhs[:, rows of g] @ rhs[rows of g, :]        (zeros for an empty group)

Its VJP is two `ragged_dot` calls: with ``A [M, K]`` (``lhs`` or ``lhsᵀ``) and
``B = rhs``, ``dA = B @ dout[g]ᵀ`` (transposed rhs) and ``dB = A @ dout[g]``.
"""

from __future__ import annotations

import jax

from ...core import Call, Op, backward_implementation, register
from .base import FAMILY, implementations, kernel_options, kernels, tgmm_bytes, tgmm_flops
from .checks import check_tgmm
from .configs import tgmm_heuristic, tgmm_space, tgmm_xla_heuristic
from .examples import TGMM_PEERS, tgmm_benchmarks, tgmm_examples
from .ragged_dot import ragged_dot_op
from .reference import ragged_dot_tgmm_reference
from .tpu_configs import tgmm_tpu_heuristic, tgmm_tpu_space


def _runner(name: str):
    def run(call: Call, config):
        transpose_lhs = call.transpose_lhs
        options = dict(num_local=call.num_local_groups, transpose_lhs=transpose_lhs, precision=call.precision,
                       out_dtype=call.out_dtype, **kernel_options(name, config))
        kernel = kernels(name).tgmm

        @jax.custom_vjp
        def tgmm(lhs, rhs, group_sizes, group_offset):
            return kernel(lhs, rhs, group_sizes, group_offset, **options)

        def forward(lhs, rhs, group_sizes, group_offset):
            return tgmm(lhs, rhs, group_sizes, group_offset), (lhs, rhs, group_sizes, group_offset)

        def backward(residuals, dout):
            lhs, rhs, group_sizes, group_offset = residuals
            rows_lhs = lhs if transpose_lhs else lhs.T
            dout = dout.astype(lhs.dtype)
            impl = backward_implementation(ragged_dot_op, name)
            da = ragged_dot_op(rhs, dout, group_sizes, call.precision, lhs.dtype, group_offset,
                               transpose_rhs=True, implementation=impl)
            db = ragged_dot_op(rows_lhs, dout, group_sizes, call.precision, rhs.dtype, group_offset,
                               implementation=impl)
            return (da if transpose_lhs else da.T), db, None, None

        tgmm.defvjp(forward, backward)
        return tgmm(call.lhs, call.rhs, call.group_sizes, call.group_offset)
    return run


ragged_dot_tgmm_op = register(Op(
    "ragged_dot_tgmm", family=FAMILY, check=check_tgmm, reference=ragged_dot_tgmm_reference,
    implementations=implementations(_runner, tgmm_heuristic, tgmm_space, tgmm_xla_heuristic, tpu=True,
                                    tpu_heuristic=tgmm_tpu_heuristic, tpu_space=tgmm_tpu_space),
    flops=tgmm_flops, bytes_accessed=tgmm_bytes, examples=tgmm_examples, benchmarks=tgmm_benchmarks,
    peers=TGMM_PEERS, differentiable=("lhs", "rhs"),
))
