"""The ``ragged_dot_backward`` op: ``(dlhs, drhs)`` of `ragged_dot`.

With ``dz`` the cotangent of the pre-activation (the activation gradient in
XLA, from the forward's saved pre-activation; ``dz = dy`` without one):

    dlhs = dz @ rhs[g]ᵀ        a `ragged_dot` with the transposed weights
    drhs[g] = lhs[rows of g]ᵀ @ dz[rows of g]        a `ragged_dot_tgmm`

each dispatched as an op with its own configs (``transpose_rhs``: the roles
of ``lhs`` and ``dz`` swap for ``drhs``). A gated ``rhs [G, K, 2, N]`` is
differentiated as ``[G, K, 2N]``.
"""

from __future__ import annotations

from ...core import Call, Implementation, Op, register
from .activations import activation_grad
from .base import FAMILY, gmm_bytes, gmm_flops, triton_requirements
from .checks import check_backward
from .examples import backward_examples
from .ragged_dot import ragged_dot_op
from .reference import ragged_dot_backward_reference
from .tgmm import ragged_dot_tgmm_op
from .tpu_configs import gmm_tpu_requirements


def _runner(name: str):
    def run(call: Call, config):
        del config
        lhs, rhs = call.lhs, call.rhs
        gated = rhs.ndim == 4
        m = lhs.shape[0]
        if call.preactivation is None:
            dz = call.dy
        else:
            dz = activation_grad(call.activation, call.dy, call.preactivation, gated).reshape(m, -1)
        dz = dz.astype(lhs.dtype)
        impl = (name,)
        sizes, offset, precision = call.group_sizes, call.group_offset, call.precision
        num_local = rhs.shape[0]
        if call.transpose_rhs:  # y = x @ rhs[g]^T, rhs [G, N, K]
            dlhs = ragged_dot_op(dz, rhs, sizes, precision, lhs.dtype, offset, implementation=impl)
            drhs = ragged_dot_tgmm_op(dz, lhs, sizes, precision, rhs.dtype, offset, num_local_groups=num_local,
                                      transpose_lhs=True, implementation=impl)
            return dlhs, drhs
        weights = rhs.reshape(num_local, rhs.shape[1], -1)  # [G, K, N] (gate/up flattened to 2N)
        dlhs = ragged_dot_op(dz, weights, sizes, precision, lhs.dtype, offset, transpose_rhs=True,
                             implementation=impl)
        drhs = ragged_dot_tgmm_op(lhs, dz, sizes, precision, rhs.dtype, offset, num_local_groups=num_local,
                                  transpose_lhs=True, implementation=impl)
        return dlhs, drhs.reshape(rhs.shape)
    return run


ragged_dot_backward_op = register(Op(
    "ragged_dot_backward", family=FAMILY, check=check_backward, reference=ragged_dot_backward_reference,
    implementations=[Implementation("mosaic_tpu", _runner("mosaic_tpu"), backend="mosaic_tpu",
                                    requirements=gmm_tpu_requirements),
                     Implementation("triton", _runner("triton"), backend="triton", requirements=triton_requirements),
                     Implementation("xla", _runner("xla"))],
    flops=lambda call: 2 * gmm_flops(call), bytes_accessed=lambda call: 2 * gmm_bytes(call),
    examples=backward_examples,
))
