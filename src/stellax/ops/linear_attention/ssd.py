"""Mamba2's state-space duality (SSD) scan with the mamba_ssm contract:
`ssd` (``mamba_chunk_scan_combined``) and `ssd_step` (``selective_state_update``
for one decode token).

SSD is gated linear attention without the delta rule, so it runs on the same
chunked recurrence as GDN (`recurrence.recurrence`, scalar decays) with
``q = C``, ``k = B`` (groups expanded to heads), ``v = dt·x``, ``g = dt·A`` and
the state transposed from mamba's ``[P, N]`` to ``[N, P]``: mamba's
chunk-state, state-passing and chunk-scan stages are the pipeline's
`wy.chunk_intra` (``U = V``, no solve), `scan` and `output`. Examples and
benchmark shapes are in `examples.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.backends import Backend
from ...core.pallas import F32
from ...core.precision import resolve_precision
from ...core.runtime_checks import require
from . import bad_data, base
from .base import BACKENDS, STEP_BACKENDS
from .costs import ssd_bytes, ssd_flops
from .examples import naive_ssd, ssd_benchmarks, ssd_examples, ssd_step_benchmarks, ssd_step_examples
from .recurrence import recurrence
from .reference import ssd_dt, ssd_epilogue, ssd_reference, ssd_step_reference

_INF = float("inf")


def _check_dt_limit(dt_limit):
    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2:
        raise ValueError(f"dt_limit: expected a pair (low, high), got {dt_limit!r}")
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if not 0.0 <= lo < hi:
        raise ValueError(f"dt_limit: expected 0 <= low < high, got {dt_limit!r}")
    return (lo, hi)


def _check_negative_A(A) -> None:
    """``A`` is the per-step log decay per unit of ``dt`` (``dt·A ≤ 0``): every
    value must be ``<= 0`` and finite. Checked when concrete and in checked mode;
    unchecked under ``jit`` a positive ``A`` grows the state exponentially, as in
    mamba_ssm (SSD has no delta rule: the chunked form matches the recurrence
    wherever both are finite, and may overflow to inf/NaN a token earlier)."""
    require(lambda: jnp.all(A <= 0), "A: expected a decay rate <= 0 everywhere (Mamba2's A = -exp(A_log)), "
            "got a largest value of {largest}", largest=lambda: jnp.max(A))
    values = checks.concrete_values(A)
    if values is None:
        return
    bad = np.argwhere(~(values <= 0))
    if bad.size:
        idx = [int(i) for i in bad[0]]
        raise ValueError(f"A{idx}: expected a decay rate <= 0 (finite; Mamba2's A = -exp(A_log)), "
                         f"got {float(values[tuple(idx)])}")


def _check_head_params(H, P, D, dt_bias, A):
    A = checks.require_float("A", A)
    checks.require_shape("A", A, (H,), "[H]")
    _check_negative_A(A)
    if D is not None:
        D = checks.require_float("D", D)
        if D.ndim == 1:
            checks.require_shape("D", D, (H,), "[H] or [H, P]")
        else:
            checks.require_shape("D", D, (H, P), "[H] or [H, P]")
    if dt_bias is not None:
        dt_bias = checks.require_float("dt_bias", dt_bias)
        checks.require_shape("dt_bias", dt_bias, (H,), "[H]")
    return A, D, dt_bias


def _check_groups(name, value, lead, H):
    value = checks.require_float(name, value)
    checks.require_ndim(name, value, len(lead) + 2)
    checks.require_shape(name, value, tuple(lead) + (None, None), "[..., G, N]")
    G = value.shape[-2]
    if H % G:
        raise ValueError(f"{name}: the number of heads H = {H} must be a multiple of the number of groups "
                         f"G = {G} ({name}.shape[-2])")
    return value


def _check_ssd(x, dt, A, B, C, *, chunk_size=None, D=None, z=None, dt_bias=None, dt_softplus=False,
               dt_limit=(0.0, _INF), initial_states=None, cu_seqlens=None, return_final_states=False,
               precision=None) -> Call:
    x = checks.require_float("x", x)
    checks.require_ndim("x", x, 4)
    batch, T, H, P = x.shape
    dt = checks.require_float("dt", dt)
    checks.require_shape("dt", dt, (batch, T, H), "[B, T, H]")
    B = _check_groups("B", B, (batch, T), H)
    C = _check_groups("C", C, (batch, T), H)
    checks.require_shape("C", C, B.shape, "B.shape")
    A, D, dt_bias = _check_head_params(H, P, D, dt_bias, A)
    if z is not None:
        z = checks.require_float("z", z)
        checks.require_shape("z", z, x.shape, "x.shape")
    cu_seqlens, n = base.check_cu_seqlens(cu_seqlens, batch, T, what="x")
    bad_data.require_cu_seqlens(cu_seqlens, T)
    initial_states = base.check_state("initial_states", initial_states, (n, H, P, B.shape[-1]),
                                      "[N, H, P, N_state]")
    return Call(
        {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
         "initial_states": initial_states, "cu_seqlens": cu_seqlens},
        {"chunk_size": base.check_chunk_size(chunk_size),
         "dt_softplus": base.require_bool("dt_softplus", dt_softplus),
         "dt_limit": _check_dt_limit(dt_limit),
         "return_final_states": base.require_bool("return_final_states", return_final_states),
         "precision": resolve_precision(precision)},
    )


def _check_ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                    dt_limit=(0.0, _INF), precision=None) -> Call:
    x = checks.require_float("x", x)
    checks.require_ndim("x", x, 3)
    batch, H, P = x.shape
    dt = checks.require_float("dt", dt)
    if dt.ndim == 3:  # mamba_ssm's tied-head-dim decode: one dt per (head, head_dim)
        checks.require_shape("dt", dt, (batch, H, P), "[B, H] or [B, H, P]")
    else:
        checks.require_shape("dt", dt, (batch, H), "[B, H] or [B, H, P]")
    B = _check_groups("B", B, (batch,), H)
    C = _check_groups("C", C, (batch,), H)
    checks.require_shape("C", C, B.shape, "B.shape")
    N = B.shape[-1]
    state = base.check_state("state", state, (batch, H, P, N), "[B, H, P, N]")
    if state is None:
        raise TypeError("state: expected an array [B, H, P, N], got None")
    A, D, dt_bias = _check_step_head_params(H, P, N, D, dt_bias, A)
    if z is not None:
        z = checks.require_float("z", z)
        checks.require_shape("z", z, x.shape, "x.shape")
    return Call({"state": state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias},
                {"dt_softplus": base.require_bool("dt_softplus", dt_softplus),
                 "dt_limit": _check_dt_limit(dt_limit), "precision": resolve_precision(precision)})


def _check_step_head_params(H, P, N, D, dt_bias, A):
    """`ssd_step`'s per-head parameters: the `ssd` shapes, or mamba_ssm's
    tied-head-dim ones (``A [H, P, N]``, ``dt_bias [H, P]``; ``D [H, P]`` is
    allowed by `ssd` already)."""
    A = checks.require_float("A", A)
    checks.require_shape("A", A, (H, P, N) if A.ndim == 3 else (H,), "[H] or [H, P, N]")
    _check_negative_A(A)
    if dt_bias is not None:
        dt_bias = checks.require_float("dt_bias", dt_bias)
        checks.require_shape("dt_bias", dt_bias, (H, P) if dt_bias.ndim == 2 else (H,), "[H] or [H, P]")
    _, D, _ = _check_head_params(H, P, D, None, jnp.zeros((H,), F32))
    return A, D, dt_bias


# -- implementations -----------------------------------------------------------
def _transpose_state(s):
    return None if s is None else jnp.swapaxes(s, -1, -2)


def _run_ssd(row: Backend, call: Call, config):
    """`ssd` on ``row``: invalid ``cu_seqlens`` make every output NaN (`bad_data`)."""
    call, scales = bad_data.guard(call, decay=None)
    y, final = _run_ssd_valid(row, call, config)
    y, final = bad_data.poison(scales, y, final)
    return (y, final) if call.return_final_states else y


def _ssd_reference(call: Call):
    """The golden with `ssd`'s documented result for invalid ``cu_seqlens`` (`bad_data`)."""
    call, scales = bad_data.guard(call, decay=None)
    out = ssd_reference(call)
    y, final = bad_data.poison(scales, *(out if call.return_final_states else (out, None)))
    return (y, final) if call.return_final_states else y


_ssd_reference.__wrapped__ = ssd_reference  # what the lab shows as the golden (inspect.unwrap)


def ssd_preparer(call: Call):
    """SSD as gated linear attention, token by token (`recurrence.recurrence`):
    ``q = C``, ``k = B`` (groups expanded to heads; ``expand=False``: left as groups), ``v = dt·x``,
    ``g = dt·A``, no ``β``."""
    group = call.x.shape[2] // call.B.shape[2]

    def prepare(tokens, expand=True):
        dt = ssd_dt(tokens["dt"], call.dt_bias, call.dt_softplus, call.dt_limit)
        times = group if expand else 1
        q = jnp.repeat(tokens["C"].astype(F32), times, axis=-2)
        k = jnp.repeat(tokens["B"].astype(F32), times, axis=-2)
        return q, k, tokens["x"].astype(F32) * dt[..., None], dt * call.A.astype(F32), None
    return prepare


def ssd_initial_state(call: Call):
    """The call's initial states on the recurrence's layout ``[N, H, N_state, P]``, float32."""
    x = call.x
    n = x.shape[0] if call.cu_seqlens is None else call.cu_seqlens.shape[0] - 1
    if call.initial_states is None:
        return jnp.zeros((n, x.shape[2], call.B.shape[-1], x.shape[3]), F32)
    return _transpose_state(call.initial_states.astype(F32))


def _run_ssd_valid(row: Backend, call: Call, config):
    x = call.x
    tokens = {"x": x, "dt": call.dt, "B": call.B, "C": call.C}
    y, final = recurrence(row, tokens, ssd_preparer(call), ssd_initial_state(call), call.cu_seqlens,
                          per_channel=False, chunk_size=base.xla_chunk(call.chunk_size, False), config=config,
                          precision=call.precision, inputs=jnp.result_type(call.x, call.B, call.C))
    y = ssd_epilogue(y, x, call.D, call.z).astype(x.dtype)
    return y, (_transpose_state(final) if call.return_final_states else None)


def _run_step(row: Backend, call: Call, config):
    return row.kernels.ssd_step(call, config)


ssd_op = BACKENDS.op(
    "ssd", _run_ssd, check=_check_ssd, reference=_ssd_reference, flops=ssd_flops, bytes_accessed=ssd_bytes,
    examples=ssd_examples, benchmarks=ssd_benchmarks, peers={"naive_scan": naive_ssd},
    differentiable=("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"))

ssd_step_op = STEP_BACKENDS.op(
    "ssd_step", _run_step, family="linear_attention", check=_check_ssd_step, reference=ssd_step_reference,
    bytes_accessed=ssd_bytes, examples=ssd_step_examples, benchmarks=ssd_step_benchmarks,
    differentiable=("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias"))


def ssd(x, dt, A, B, C, *, chunk_size=None, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, _INF),
        initial_states=None, cu_seqlens=None, return_final_states=False, implementation=None, config=None,
        precision=None):
    """Mamba2 SSD scan (mamba_ssm's ``mamba_chunk_scan_combined``).

    Per head ``h`` (group ``h // (H // G)``), state ``[P, N]``:
    ``dt ← softplus(dt + dt_bias)`` (``dt_softplus``) clipped to ``dt_limit``;
    ``state ← exp(dt·A_h)·state + dt·x_t ⊗ B_t``; ``y_t = state·C_t + D_h·x_t``,
    times ``silu(z_t)`` when ``z`` is given.

    Args:
      x: ``[B, T, H, P]``; dt: ``[B, T, H]``; A: ``[H]`` (negative);
      B, C: ``[B, T, G, N]`` with ``H % G == 0``; D: ``[H]`` or ``[H, P]``;
      z: ``[B, T, H, P]``; dt_bias: ``[H]``;
      initial_states: ``[N_seq, H, P, N]`` (N_seq = B, or the number of packed sequences);
      cu_seqlens: ``[N_seq + 1]`` offsets of packed sequences (B must be 1); starting
        at 0, non-decreasing, ending at T (checked eagerly; under ``jit`` invalid offsets
        make every output and final state NaN: `bad_data`);
      chunk_size: tokens per chunk of the XLA path; ``None`` (default) picks the
        fastest (32 on a CPU, 64 elsewhere; mamba_ssm's default is 256). The result
        does not depend on it. The Triton kernels always use 64.
      implementation: ``"mosaic_tpu"`` (config `TpuLinearAttentionConfig`), ``"triton"``
        (`LinearAttentionConfig`), ``"xla"`` (no config), a sequence of them tried in
        order, or ``None``: the best available, ending in ``"xla"``.
      config: the chosen kernels' config (above).
      precision: of the float32 contractions, forward and backward: ``None``
        (``"highest"`` unless `jax.default_matmul_precision` says otherwise),
        ``"default"``, ``"high"``, ``"highest"`` or a `jax.lax.Precision`
        (what each means per backend: `stellax.core.precision`).
    Returns ``y [B, T, H, P]`` in x.dtype, or ``(y, final_states [N_seq, H, P, N] float32)``
    with ``return_final_states``.

    Data-dependent checks (`stellax.checked` mode, ``checkify`` checks naming the argument):
    ``A <= 0`` (unchecked under ``jit``, a positive ``A`` grows the state as in mamba_ssm;
    the chunked form matches the recurrence wherever finite) and ``cu_seqlens`` valid.
    """
    return ssd_op(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                  dt_limit=dt_limit, initial_states=initial_states, cu_seqlens=cu_seqlens,
                  return_final_states=return_final_states, implementation=implementation, config=config,
                  precision=precision)


def ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, _INF),
             implementation=None, precision=None):
    """One SSD decode step (mamba_ssm's ``selective_state_update``), functional.

    ``state [B, H, P, N]``, ``x [B, H, P]``, ``dt [B, H]``, ``A [H]``,
    ``B, C [B, G, N]``, optional ``D``, ``z [B, H, P]``, ``dt_bias [H]``.
    mamba_ssm's tied-head-dim shapes are accepted too, with its meaning
    (the values may differ per head dim and state dim): ``dt [B, H, P]``,
    ``A [H, P, N]``, ``D`` and ``dt_bias [H, P]`` — what its decode passes
    (``A[:, None, None].expand(-1, P, N)`` and so on).
    ``precision`` as in `ssd` (`stellax.core.precision`). ``implementation``:
    ``None`` (best available, ending in ``"xla"``), ``"mosaic_tpu"`` (the Mosaic TPU
    step kernel, configs `SsdStepTpuConfig` through `stellax.use_configs`), ``"xla"``
    or a sequence.
    Returns ``(y [B, H, P] in x.dtype, new_state [B, H, P, N] in state.dtype)``.
    Data-dependent check (`stellax.checked` mode): ``A <= 0``; unchecked, a positive ``A``
    grows the state exactly (one step of the recurrence).
    """
    return ssd_step_op(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                       dt_limit=dt_limit, implementation=implementation, precision=precision)
