"""The backward of the chunked recurrence, as ops of their own:
``gated_recurrence_backward`` (scalar decays: GDN, SSD) and
``kda_recurrence_backward`` (per-channel decays: KDA).

Each takes the kernels' heads-major layout (`layout`): ``q, k [Bs, HV, Tp, K]``
(q scaled), ``v, do [Bs, HV, Tp, V]``, ``g [Bs, HV, Tp(, K)]``,
``beta [Bs, HV, Tp]`` or ``None``, ``h0`` and optional ``dfinal [N, HV, K, V]``,
optional int32 ``first, seq, last [NT]``; and returns ``(dq, dk, dv, dg, dβ, dh0)``.

Their implementations are generated from `base.BACKENDS`, each row's
``Kernels.backward``:

* ``mosaic_tpu`` (`mosaic_tpu_backward.backward`): recomputes the forward
  kernel's chunk-initial states and walks the chunks in reverse in one kernel,
  ``dS`` in VMEM, each chunk's gradients the transpose of its forward function;
* ``triton`` (`pipeline.backward`): the pipeline backwards, mirroring the
  forward's stages (the reverse state scan, then every chunk's gradients in
  parallel);
* ``xla`` (`xla.backward`): the VJP of the XLA chunked scan on the same layout.

The golden is the VJP of the token-by-token recurrence.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from ...core import Call, Op, checks
from ...core.backends import Backend
from ...core.precision import resolve_precision
from .base import BACKENDS
from .configs import TRITON_CHUNK
from .costs import backward_flops
from .examples import backward_examples
from .layout import differentiate, stream_of
from .reference import delta_rule_recurrence


# -- the golden ------------------------------------------------------------------------------
def _reference_forward(call: Call, q, k, v, g, beta, h0):
    """The token recurrence over the padded stream (per-token resets at chunk starts)."""
    tp = v.shape[2]
    chunk = TRITON_CHUNK
    token_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 2)
    tokens = None
    if call.first is not None:
        pos = jnp.arange(tp)
        tokens = (jnp.repeat(call.seq, chunk), jnp.repeat(call.first != 0, chunk) & (pos % chunk == 0),
                  jnp.repeat(call.last != 0, chunk) & (pos % chunk == chunk - 1))
    o, final = delta_rule_recurrence(token_major(q), token_major(k), token_major(v), token_major(g),
                                     token_major(beta), scale=1.0, initial_state=h0, tokens=tokens)
    if tokens is not None:
        final = jnp.where(stream_of(call).empty[:, None, None, None], h0, final)
    return jnp.moveaxis(o, 2, 1), final


def recurrence_backward_reference(call: Call):
    """Golden backward: the VJP of the token-by-token recurrence, ``(dq, dk, dv, dg, dβ, dh0)``."""
    return differentiate(call, _reference_forward)


# -- the ops -------------------------------------------------------------------------------------
def backward_checker(per_channel: bool):
    """The argument check of a recurrence backward op: ``q, k [Bs, HV, Tp, K]``,
    ``v, do [Bs, HV, Tp, V]``, ``g [Bs, HV, Tp]`` (``[Bs, HV, Tp, K]`` with
    ``per_channel``), ``beta [Bs, HV, Tp]`` (required with ``per_channel``,
    else optional), ``h0`` and optional ``dfinal [N, HV, K, V]``, optional int
    ``first, seq, last [NT]`` (``Tp`` a multiple of the chunk, 64), and the
    forward's ``precision`` (`stellax.core.precision`; ``None``: ``"highest"``)."""
    return functools.partial(_check_backward, per_channel=per_channel)


def _check_backward(q, k, v, g, beta, h0, do, dfinal=None, first=None, seq=None, last=None, *,
                    per_channel: bool, precision=None) -> Call:
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("h0", h0), ("do", do)):
        checks.require_float(name, x)
    if per_channel and beta is None:
        raise ValueError("beta: expected [Bs, HV, Tp] (the per-channel recurrence is a delta rule), got None")
    checks.require_ndim("v", v, 4)
    bs, hv, tp = v.shape[:3]
    if tp % TRITON_CHUNK:
        raise ValueError(f"v: expected a padded length that is a multiple of {TRITON_CHUNK}, got {tp}")
    checks.require_shape("q", q, (bs, hv, tp, None), "v.shape[:3] + (K,)")
    checks.require_shape("k", k, q.shape, "q.shape")
    if per_channel:
        checks.require_shape("g", g, q.shape, "q.shape (per-channel decays [Bs, HV, Tp, K])")
    else:
        checks.require_shape("g", g, (bs, hv, tp), "v.shape[:3] (a decay per token and head)")
    checks.require_shape("do", do, v.shape, "v.shape")
    if beta is not None:
        checks.require_float("beta", beta)
        checks.require_shape("beta", beta, (bs, hv, tp), "v.shape[:3]")
    checks.require_shape("h0", h0, (None, hv, k.shape[-1], v.shape[-1]), "N, HV, K, V")
    if dfinal is not None:
        checks.require_shape("dfinal", dfinal, h0.shape, "h0.shape")
    if (first is None) != (seq is None) or (first is None) != (last is None):
        raise ValueError("first, seq, last: give all three (a packed batch) or none")
    if first is not None:
        for name, x in (("first", first), ("seq", seq), ("last", last)):
            checks.require_int(name, x)
            checks.require_shape(name, x, (tp // TRITON_CHUNK,), "the number of chunks")
    return Call({"q": q, "k": k, "v": v, "g": g, "beta": beta, "h0": h0, "do": do, "dfinal": dfinal,
                 "first": first, "seq": seq, "last": last}, {"precision": resolve_precision(precision)})


def _run_backward(row: Backend, call: Call, config, *, per_channel: bool):
    return row.kernels.backward(call, config, per_channel=per_channel)


def recurrence_backward_op(name: str, *, per_channel: bool) -> Op:
    """Register the backward op of a recurrence of ``per_channel`` decays
    (``g [Bs, HV, Tp, K]``) or one per token (``[Bs, HV, Tp]``): one
    implementation per row of `base.BACKENDS`, the VJP of the token recurrence
    as the golden. Returns ``(dq, dk, dv, dg, dβ, dh0)``."""
    return BACKENDS.op(name, functools.partial(_run_backward, per_channel=per_channel), backward=True,
                       check=backward_checker(per_channel=per_channel), reference=recurrence_backward_reference,
                       flops=backward_flops, examples=backward_examples(per_channel=per_channel))


gated_recurrence_backward_op = recurrence_backward_op("gated_recurrence_backward", per_channel=False)
kda_recurrence_backward_op = recurrence_backward_op("kda_recurrence_backward", per_channel=True)

#: The backward op of scalar (``False``) and per-channel (``True``) decays.
RECURRENCE_BACKWARD = {False: gated_recurrence_backward_op, True: kda_recurrence_backward_op}
