"""Golden grouped matmuls: one dense matmul per group, masked to the group's rows.

``ragged_dot`` (rows of ``lhs [M, K]`` sorted by group, ``group_sizes [G]``):

    out[r] = act(lhs[r] @ rhs[g])                 for r in the rows of group g
    out[r] = act(lhs[r] @ gate[g]) * (lhs[r] @ up[g])   gated rhs [G, K, 2, N]
    out[r] = 0                                    rows of no local group

``ragged_dot_tgmm`` (the ragged dimension is contracted):

    out[g] = lhs[:, rows of g] @ rhs[rows of g, :]     lhs [K, M], rhs [M, N]

Group rows follow the clamping of `schedule.group_bounds`; a traced offset out
of range gives NaN everywhere (`schedule.poison_bad_offset`). Math in float32 at
``Precision.HIGHEST``; results in the output dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call
from .activations import activation_fn
from .schedule import group_bounds, poison_bad_offset

_HI = jax.lax.Precision.HIGHEST


def _row_masks(call: Call, m: int, num_local: int):
    """``[L, M]`` booleans: row r belongs to local group l."""
    bounds = group_bounds(call.group_sizes, call.group_offset, num_local, m)
    rows = jnp.arange(m)[None, :]
    return (rows >= bounds.starts[:, None]) & (rows < (bounds.starts + bounds.sizes)[:, None])


def ragged_dot_reference(call: Call):
    """Golden `ragged_dot`: per local group ``act(lhs @ rhs[g])`` (gated: ``act(lhs @ gate) · (lhs @ up)``)
    in float32 HIGHEST precision on that group's rows, zeros elsewhere; ``[M, N]`` in ``out_dtype``."""
    lhs = call.lhs.astype(jnp.float32)
    rhs = call.rhs.astype(jnp.float32)
    if call.transpose_rhs:
        rhs = jnp.swapaxes(rhs, 1, 2)
    m = lhs.shape[0]
    masks = _row_masks(call, m, rhs.shape[0])
    act = activation_fn(call.activation)
    out = None
    for g in range(rhs.shape[0]):
        if rhs.ndim == 4:
            gate = jnp.dot(lhs, rhs[g, :, 0], precision=_HI)
            up = jnp.dot(lhs, rhs[g, :, 1], precision=_HI)
            y = act(gate) * up
        else:
            y = act(jnp.dot(lhs, rhs[g], precision=_HI))
        y = jnp.where(masks[g][:, None], y, 0.0)
        out = y if out is None else out + y
    out = poison_bad_offset(out, call.group_sizes, call.group_offset, rhs.shape[0])
    return out.astype(call.out_dtype)


def ragged_dot_tgmm_reference(call: Call):
    """Golden `ragged_dot_tgmm`: ``out[g] = lhs[rows of g]ᵀ @ rhs[rows of g]`` (``lhs`` as ``[M, K]``)
    in float32 HIGHEST precision; ``[G_local, K, N]`` in ``out_dtype``."""
    lhs = call.lhs.astype(jnp.float32)
    if not call.transpose_lhs:
        lhs = lhs.T  # [M, K]
    rhs = call.rhs.astype(jnp.float32)
    masks = _row_masks(call, lhs.shape[0], call.num_local_groups)
    outs = [jnp.dot(jnp.where(masks[g][:, None], lhs, 0.0).T, rhs, precision=_HI)
            for g in range(call.num_local_groups)]
    out = poison_bad_offset(jnp.stack(outs), call.group_sizes, call.group_offset, call.num_local_groups)
    return out.astype(call.out_dtype)


def ragged_dot_backward_reference(call: Call):
    """The VJP of the float32 forward golden: ``(dlhs, drhs)``."""
    forward_call = Call(
        {"lhs": call.lhs.astype(jnp.float32), "rhs": call.rhs.astype(jnp.float32),
         "group_sizes": call.group_sizes, "group_offset": call.group_offset},
        {**call.options, "out_dtype": jnp.float32},
    )

    def forward(lhs, rhs):
        return ragged_dot_reference(forward_call.replace_arrays(lhs=lhs, rhs=rhs))

    _, vjp = jax.vjp(forward, forward_call.lhs, forward_call.rhs)
    dlhs, drhs = vjp(call.dy.astype(jnp.float32))
    return dlhs.astype(call.lhs.dtype), drhs.astype(call.rhs.dtype)
