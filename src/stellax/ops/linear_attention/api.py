"""Public Gated DeltaNet and Kimi Delta Attention API (the flash-linear-attention contract).

``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (GDN, decay
``g [B, T, HV]``) and ``chunk_kda`` / ``fused_recurrent_kda`` (KDA, decay
``g [B, T, HV, K]``, optionally computed from raw inputs by Kimi Linear's
fused gate). The golden recurrence is in `reference.py`; the chunked
algorithm is `recurrence.recurrence` over the pipeline's stages (`decay`,
`scores`, `solve`, `wy`, `scan`, `output`); examples and benchmark shapes
are in `examples.py`. The ops' implementations are generated from the
backend tables of `base` (`BACKENDS`: ``mosaic_tpu``, ``triton``, ``xla``;
`RECURRENT_BACKENDS`: ``mosaic_tpu``, ``xla``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ...core import Call, Op, checks
from ...core.backends import Backend
from ...core.pallas import F32
from ...core.precision import resolve_precision
from . import bad_data, base
from .base import BACKENDS, RECURRENT_BACKENDS
from .costs import delta_rule_bytes, delta_rule_flops, recurrent_flops
from .examples import (delta_rule_benchmarks, delta_rule_examples, naive_scan, recurrent_benchmarks,
                       recurrent_examples)
from .recurrence import recurrence
from .reference import delta_rule_reference, prepare_delta_inputs


# -- argument checks -----------------------------------------------------------
def _check(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False,
           cu_seqlens=None, chunk_size=None, per_channel: bool, A_log=None, dt_bias=None, lower_bound=None,
           use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, precision=None) -> Call:
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, 4)
    B, T, H, K = q.shape
    k = checks.require_float("k", k)
    checks.require_shape("k", k, q.shape, "q.shape [B, T, H, K]")
    checks.require_same_dtype("k", k, "q", q)
    v = checks.require_float("v", v)
    checks.require_ndim("v", v, 4)
    checks.require_shape("v", v, (B, T, None, None), "B, T of q; [B, T, HV, V]")
    checks.require_same_dtype("v", v, "q", q)
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"v: the number of value heads HV = {HV} (v.shape[2]) must be a multiple of the "
                         f"number of query/key heads H = {H} (q.shape[2])")
    g = checks.require_float("g", g)
    g_shape = (B, T, HV, K) if per_channel else (B, T, HV)
    checks.require_ndim("g", g, len(g_shape))
    checks.require_shape("g", g, g_shape, "[B, T, HV, K]" if per_channel else "[B, T, HV]")
    beta = checks.require_float("beta", beta)
    checks.require_shape("beta", beta, (B, T, HV), "[B, T, HV]")
    cu_seqlens, n = base.check_cu_seqlens(cu_seqlens, B, T)
    initial_state = base.check_state("initial_state", initial_state, (n, HV, K, v.shape[3]),
                                     "[N, HV, K, V] with N = " + ("len(cu_seqlens) - 1" if cu_seqlens is not None
                                                                  else "B"))
    arrays = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state, "cu_seqlens": cu_seqlens}
    options = {
        "scale": base.check_scale(scale, K),
        "output_final_state": base.require_bool("output_final_state", output_final_state),
        "use_qk_l2norm": base.require_bool("use_qk_l2norm", use_qk_l2norm),
        "chunk_size": base.check_chunk_size(chunk_size),
        "precision": resolve_precision(precision),
    }
    if per_channel:
        use_gate = base.require_bool("use_gate_in_kernel", use_gate_in_kernel)
        if not use_gate:
            for name, value in (("A_log", A_log), ("dt_bias", dt_bias), ("lower_bound", lower_bound)):
                if value is not None:
                    raise ValueError(f"{name}: only used by the fused gate; pass use_gate_in_kernel=True "
                                     f"(g is then the raw gate input)")
        if A_log is not None:
            A_log = checks.require_float("A_log", A_log)
            checks.require_shape("A_log", A_log, (HV,), "[HV]")
        if dt_bias is not None:
            dt_bias = checks.require_float("dt_bias", dt_bias)
            checks.require_shape("dt_bias", dt_bias, (HV * K,), "[HV * K]")
        lower_bound = base.check_optional_float("lower_bound", lower_bound)
        if lower_bound is not None and lower_bound >= 0:
            raise ValueError(f"lower_bound: expected a negative float (the smallest log decay per step), "
                             f"got {lower_bound}")
        arrays.update(A_log=A_log, dt_bias=dt_bias)
    if not (per_channel and options_use_gate(use_gate_in_kernel)):
        _check_log_decay(g)
        bad_data.require_decay(g)
    bad_data.require_cu_seqlens(cu_seqlens, T)
    if per_channel:
        options.update(use_gate_in_kernel=use_gate, lower_bound=lower_bound,
                       use_beta_sigmoid_in_kernel=base.require_bool("use_beta_sigmoid_in_kernel",
                                                                    use_beta_sigmoid_in_kernel))
    return Call(arrays, options)


def options_use_gate(use_gate_in_kernel) -> bool:
    return bool(use_gate_in_kernel) if isinstance(use_gate_in_kernel, (bool, np.bool_)) else False


def _check_log_decay(g) -> None:
    """``g`` is a log-space decay: every value ``<= 0`` (checked when concrete;
    under ``jit`` a positive or NaN value makes its (sequence, head) NaN: `bad_data`)."""
    values = checks.concrete_values(g)
    if values is None:
        return
    bad = np.argwhere(~(values <= 0))
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        raise ValueError(f"g{list(idx)}: expected a log-space decay <= 0 (finite), got {float(values[idx])} "
                         "(pass use_gate_in_kernel=True for a raw gate input, where available)")


def _check_gdn(q, k, v, g, beta, **kwargs) -> Call:
    return _check(q, k, v, g, beta, per_channel=False, **kwargs)


def _check_kda(q, k, v, g, beta, **kwargs) -> Call:
    return _check(q, k, v, g, beta, per_channel=True, **kwargs)


# -- implementations -----------------------------------------------------------
def delta_rule_preparer(call: Call):
    """Per-token preparation (`recurrence.recurrence`): float32, l2-norm, gate, beta
    sigmoid (`reference.prepare_delta_inputs`), q/k heads expanded to the value
    heads (``expand=False``: left as the key heads), q scaled."""
    group = call.v.shape[2] // call.q.shape[2]

    def prepare(tokens, expand=True):
        q, k, g, beta = prepare_delta_inputs(call.replace_arrays(**tokens))
        if expand:
            q, k = jnp.repeat(q, group, axis=-2), jnp.repeat(k, group, axis=-2)
        return q * call.scale, k, tokens["v"].astype(F32), g, beta
    return prepare


def delta_rule_initial_state(call: Call):
    """The call's initial states ``[N, HV, K, V]`` as float32 (zeros when absent)."""
    if call.initial_state is not None:
        return call.initial_state.astype(F32)
    n = call.q.shape[0] if call.cu_seqlens is None else call.cu_seqlens.shape[0] - 1
    return jnp.zeros((n, call.v.shape[2], call.q.shape[3], call.v.shape[3]), F32)


def _decay_name(call: Call):
    """The array `bad_data.guard` range-checks: ``g``, unless KDA's fused gate makes it (≤ 0 then)."""
    return None if call.options.get("use_gate_in_kernel") else "g"


def _guarded(run):
    """``run(row, call, config, ...)`` on `bad_data.guard`'s call (valid offsets), bad data NaN
    (`bad_data`); valid data unchanged bit for bit. A bad (sequence, head)'s decays are made NaN
    before the recurrence (`bad_data.poison_decay`), so the recurrence itself writes its outputs NaN
    and ``o`` takes no extra pass; with no decay to range-check (KDA's fused gate), ``o`` is
    multiplied after it. ``__wrapped__`` is ``run``, the same program without `bad_data`."""
    @functools.wraps(run)
    def guarded(row: Backend, call: Call, config, **kwargs):
        decay = _decay_name(call)
        call, scales = bad_data.guard(call, decay=decay)
        if decay is None:
            return bad_data.poison(scales, *run(row, call, config, **kwargs))
        o, final = run(row, bad_data.poison_decay(scales, call, decay), config, **kwargs)
        return o, bad_data.poison(scales, None, final)[1]
    return guarded


def _guarded_reference(call: Call):
    """The golden with the ops' documented bad-data result (`bad_data`)."""
    call, scales = bad_data.guard(call, decay=_decay_name(call))
    o, final = delta_rule_reference(call)
    return bad_data.poison(scales, o, final)


_guarded_reference.__wrapped__ = delta_rule_reference  # what the lab shows as the golden (inspect.unwrap)


@_guarded
def _run_chunked(row: Backend, call: Call, config, *, per_channel: bool):
    """The chunked recurrence (`recurrence.recurrence`) on ``row``: ``(o [B, T, HV, V] in v's dtype,
    final states [N, HV, K, V] float32 or None)``."""
    tokens = {n: call.arrays[n] for n in ("q", "k", "v", "g", "beta")}
    chunk = base.xla_chunk(call.chunk_size, per_channel)
    o, final = recurrence(row, tokens, delta_rule_preparer(call), delta_rule_initial_state(call), call.cu_seqlens, per_channel=per_channel,
                          chunk_size=chunk, config=config, precision=call.precision,
                          inputs=jnp.result_type(call.q, call.k, call.v), out_dtype=call.v.dtype)
    return o.astype(call.v.dtype), (final if call.output_final_state else None)


@_guarded
def _run_recurrent(row: Backend, call: Call, config):
    return row.kernels.fused_recurrent(call, config)


# -- ops -------------------------------------------------------------------------
_DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _delta_rule_op(name: str, per_channel: bool, *, chunked: bool) -> Op:
    """Register a GDN (KDA: ``per_channel``) op: chunked (`BACKENDS`) or token by token
    (``chunked=False``, the decode ops: `RECURRENT_BACKENDS`)."""
    if chunked:
        table, run = BACKENDS, functools.partial(_run_chunked, per_channel=per_channel)
        extra = {"flops": delta_rule_flops(per_channel), "examples": delta_rule_examples(per_channel),
                 "benchmarks": delta_rule_benchmarks(per_channel), "peers": {"naive_scan": naive_scan}}
    else:
        table, run = RECURRENT_BACKENDS, _run_recurrent
        extra = {"flops": recurrent_flops, "examples": recurrent_examples(per_channel),
                 "benchmarks": recurrent_benchmarks(per_channel)}
    return table.op(name, run, family="linear_attention", check=_check_kda if per_channel else _check_gdn,
                    reference=_guarded_reference, bytes_accessed=delta_rule_bytes, differentiable=_DIFFERENTIABLE,
                    **extra)


chunk_gated_delta_rule_op = _delta_rule_op("chunk_gated_delta_rule", False, chunked=True)
fused_recurrent_gated_delta_rule_op = _delta_rule_op("fused_recurrent_gated_delta_rule", False, chunked=False)
chunk_kda_op = _delta_rule_op("chunk_kda", True, chunked=True)
fused_recurrent_kda_op = _delta_rule_op("fused_recurrent_kda", True, chunked=False)


# -- public functions ------------------------------------------------------------
def _delta_rule(op: Op, arguments: dict):
    """``op`` called with a public function's arguments (its ``locals()`` on entry): ``q, k, v, g,
    beta`` by position, the rest by name, fla's ``use_qk_l2norm_in_kernel`` (when given) as
    ``use_qk_l2norm``."""
    options = dict(arguments)
    operands = [options.pop(name) for name in ("q", "k", "v", "g", "beta")]
    in_kernel = options.pop("use_qk_l2norm_in_kernel")
    if in_kernel is not None:
        options["use_qk_l2norm"] = in_kernel
    return op(*operands, **options)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm=False, cu_seqlens=None, chunk_size=None, implementation=None, config=None,
                           use_qk_l2norm_in_kernel=None, precision=None):
    """Gated DeltaNet, chunked (training and prefill).

    Per value head, with state ``S [K, V]`` (the recurrence, token by token):
    ``S ← exp(g_t)·S``, ``S ← S + k_t ⊗ β_t (v_t − Sᵀk_t)``, ``o_t = Sᵀ(scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` with ``HV % H == 0`` (value
        head ``hv`` reads query/key head ``hv // (HV // H)``); same dtype.
      g: ``[B, T, HV]`` log-space decay (≤ 0; −20 per step is fine). A positive
        (or NaN) value raises eagerly; under ``jit`` it makes every output row and
        the final state of its (sequence, value head) NaN (the chunked algorithm is
        not exact for positive ``g``: `bad_data`).
      beta: ``[B, T, HV]`` write strength.
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``[N, HV, K, V]`` (N = B, or the number of sequences).
      output_final_state: also return the final states ``[N, HV, K, V]`` (float32).
      use_qk_l2norm: l2-normalize q and k over K first (fla's
        ``use_qk_l2norm_in_kernel``, accepted as an alias).
      cu_seqlens: ``[N+1]`` int offsets of packed sequences (B must be 1); each
        sequence starts from its own initial state and has its own final state.
        Starting at 0, non-decreasing, ending at T: checked eagerly; under ``jit``
        invalid offsets make every output and final state NaN.
      chunk_size: tokens per chunk of the XLA path; ``None`` (default) picks the
        fastest (32 on a CPU, 64 elsewhere). The result does not depend on it.
        The Triton kernels always use 64.
      implementation: ``None`` (best available, ending in ``"xla"``), ``"mosaic_tpu"``,
        ``"triton"``, ``"xla"`` or a sequence tried in order.
      config: a `TpuLinearAttentionConfig` for the Mosaic TPU kernels or a
        `LinearAttentionConfig` for the Triton kernels (the XLA path has none).
      precision: of the float32 contractions, forward and backward: ``None``
        (``"highest"`` unless `jax.default_matmul_precision` says otherwise),
        ``"default"``, ``"high"``, ``"highest"`` or a `jax.lax.Precision`
        (what each means per backend: `stellax.core.precision`).

    Returns ``(o [B, T, HV, V] in v.dtype, final_state or None)``.

    Data-dependent checks (`stellax.checked` mode: ``checkify`` checks naming the
    argument and the bad value): ``g <= 0`` and ``cu_seqlens`` valid; without them,
    the NaN results above (`bad_data`, docs/linear_attention.md).
    """
    return _delta_rule(chunk_gated_delta_rule_op, locals())


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm=False, cu_seqlens=None, chunk_size=None, implementation=None,
                                     config=None, use_qk_l2norm_in_kernel=None, precision=None):
    """Gated DeltaNet token by token — the decode path (one or a few tokens per
    step, state in and out). Same arguments and results as `chunk_gated_delta_rule`
    (``chunk_size`` is ignored), except: ``implementation`` ``None`` (best available,
    ending in ``"xla"``), ``"mosaic_tpu"`` (the fused Mosaic TPU kernel), ``"xla"`` or
    a sequence; ``config`` a `FusedRecurrentTpuConfig` for the Mosaic TPU kernel. The same
    data-dependent checks and NaN results for bad ``g`` / ``cu_seqlens`` (`bad_data`)."""
    return _delta_rule(fused_recurrent_gated_delta_rule_op, locals())


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False,
              cu_seqlens=None, chunk_size=None, A_log=None, dt_bias=None, lower_bound=None, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, implementation=None, config=None, use_qk_l2norm_in_kernel=None,
              precision=None):
    """Kimi Delta Attention, chunked: `chunk_gated_delta_rule` with a
    per-channel decay ``S ← diag(exp(g_t))·S``, ``g [B, T, HV, K]``.

    With ``use_gate_in_kernel=True``, ``g`` is the raw gate input and the
    decay is computed as in Kimi Linear (fla's ``fused_kda_gate``):
    ``g ← −exp(A_log)·softplus(g + dt_bias)``, or with ``lower_bound``
    ``g ← lower_bound·sigmoid(exp(A_log)·(g + dt_bias))``; ``A_log [HV]``,
    ``dt_bias [HV·K]`` (both optional, differentiable). With
    ``use_beta_sigmoid_in_kernel=True`` ``beta`` holds logits (``β = sigmoid(beta)``).
    Other arguments and results as in `chunk_gated_delta_rule`: ``implementation``
    ``None`` (best available, ending in ``"xla"``), ``"mosaic_tpu"``, ``"triton"``,
    ``"xla"`` or a sequence; ``config`` a `TpuLinearAttentionConfig` (Mosaic TPU) or
    `LinearAttentionConfig` (Triton). Data-dependent checks and bad-data results as in
    `chunk_gated_delta_rule` (``g <= 0`` is not required of the raw gate input).
    """
    return _delta_rule(chunk_kda_op, locals())


def fused_recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm=False, cu_seqlens=None, chunk_size=None, A_log=None, dt_bias=None,
                        lower_bound=None, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                        implementation=None, config=None, use_qk_l2norm_in_kernel=None, precision=None):
    """Kimi Delta Attention token by token (decode): `fused_recurrent_gated_delta_rule`
    with `chunk_kda`'s per-channel decay and fused gate, arguments as `chunk_kda`. Its
    implementations: ``"mosaic_tpu"`` (config `FusedRecurrentTpuConfig`) and ``"xla"``
    (``None``: the best available, ending in ``"xla"``). Data-dependent checks and
    bad-data results as in `chunk_kda`."""
    return _delta_rule(fused_recurrent_kda_op, locals())
