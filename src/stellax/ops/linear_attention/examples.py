"""Built-in calls of the linear attention ops: random inputs, examples for
`stellax check` and the tests, benchmark shapes for `stellax bench`, and the
naive-scan peers the chunked algorithm is measured against."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example, current_platform
from ...core.pallas import F32
from .configs import TRITON_CHUNK
from .reference import delta_rule_recurrence, l2norm, ssd_dt, ssd_epilogue, ssd_recurrence

_INF = float("inf")


# -- random inputs ---------------------------------------------------------------------
def make_inputs(key, B, T, H, HV, K, V, *, dtype=jnp.float32, per_channel=False, decay=1.0, n_states=None,
                normalized_keys=True):
    """Random GDN/KDA inputs: ``(q, k, v, g, beta, initial_state)``.

    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g [B, T, HV]`` (``[B, T, HV, K]``
    with ``per_channel``), ``beta [B, T, HV]`` in ``dtype``; ``initial_state
    [n_states or B, HV, K, V]`` float32. ``g = −decay·softplus(N(0,1))`` (strong
    decays for large ``decay``); keys are unit-norm (or of norm ~1 without
    ``normalized_keys``, for use_qk_l2norm); ``beta = sigmoid(N(0, 1))``."""
    keys = jax.random.split(key, 6)
    q = jax.random.normal(keys[0], (B, T, H, K), F32)
    k = jax.random.normal(keys[1], (B, T, H, K), F32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True) if normalized_keys else k
    v = jax.random.normal(keys[2], (B, T, HV, V), F32)
    g = -decay * jax.nn.softplus(jax.random.normal(keys[3], (B, T, HV, K) if per_channel else (B, T, HV), F32))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, HV), F32))
    h0 = 0.5 * jax.random.normal(keys[5], (n_states or B, HV, K, V), F32)
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (h0,)


def make_ssd_inputs(key, batch, T, H, P, G, N, *, dtype=jnp.float32, n_states=None):
    """Random SSD inputs ``(x, dt, A, B, C, D, z, dt_bias, initial_states)``:
    ``x, z [batch, T, H, P]``, ``dt [batch, T, H]``, ``A = −exp(U(0, 1.5)) [H]``,
    ``B, C [batch, T, G, N]`` (scaled by ``N^-½``), ``D, dt_bias [H]`` in
    ``dtype``; ``initial_states [n_states or batch, H, P, N]`` float32."""
    keys = jax.random.split(key, 9)
    x = jax.random.normal(keys[0], (batch, T, H, P), F32)
    dt = jax.random.normal(keys[1], (batch, T, H), F32) - 1.0
    A = -jnp.exp(jax.random.uniform(keys[2], (H,), F32, 0.0, 1.5))
    B = jax.random.normal(keys[3], (batch, T, G, N), F32) / np.sqrt(N)
    C = jax.random.normal(keys[4], (batch, T, G, N), F32) / np.sqrt(N)
    D = jax.random.normal(keys[5], (H,), F32)
    z = jax.random.normal(keys[6], (batch, T, H, P), F32)
    dt_bias = 0.5 * jax.random.normal(keys[7], (H,), F32)
    h0 = 0.5 * jax.random.normal(keys[8], (n_states or batch, H, P, N), F32)
    return tuple(a.astype(dtype) for a in (x, dt, A, B, C, D, z, dt_bias)) + (h0,)


# -- GDN / KDA ---------------------------------------------------------------------------
def delta_rule_examples(per_channel: bool):
    """The examples of the GDN (``per_channel=False``) or KDA ops: a grouped-head
    batch, a packed batch with an empty sequence and l2-normalized q/k, and for
    KDA Kimi Linear's fused gate."""
    return functools.partial(_delta_rule_examples, per_channel=per_channel)


def _delta_rule_examples(dtype, *, per_channel: bool):
    out = []
    cases = ((2, 70, 2, 4, 32, 16, None, False), (1, 100, 2, 2, 16, 32, (0, 30, 30, 100), True))
    for i, (B, T, H, HV, K, V, cu, l2) in enumerate(cases):
        n = B if cu is None else len(cu) - 1
        q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(i), B, T, H, HV, K, V, dtype=dtype,
                                           per_channel=per_channel, n_states=n, normalized_keys=not l2)
        if l2:
            k = k * 0.2  # keep raw keys small; they are normalized in the op
        kwargs = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm": l2}
        if cu is not None:
            kwargs["cu_seqlens"] = jnp.array(cu, jnp.int32)
        label = f"B={B} T={T} H={H} HV={HV} K={K} V={V}" + (f" cu_seqlens={list(cu)}" if cu else "")
        out.append(Example(label, (q, k, v, g, beta), kwargs))
    if per_channel:  # Kimi Linear's fused gate on raw inputs
        q, k, v, g, beta, _ = make_inputs(jax.random.PRNGKey(7), 1, 40, 1, 2, 16, 16, dtype=dtype,
                                          per_channel=True)
        keys = jax.random.split(jax.random.PRNGKey(8), 2)
        kwargs = {"use_gate_in_kernel": True, "A_log": (0.3 * jax.random.normal(keys[0], (2,))).astype(dtype),
                  "dt_bias": (0.3 * jax.random.normal(keys[1], (32,))).astype(dtype), "lower_bound": -5.0}
        out.append(Example("fused gate lower_bound=-5 T=40", (q, k, v, -g, beta), kwargs))
    return out


def delta_rule_benchmarks(per_channel: bool):
    """Benchmark shapes of the chunked GDN / KDA ops: float32 on the CPU (T = 4096)
    and GPUs (32k tokens of one sequence, a batch of 8 × 4096); bfloat16 on a TPU
    at sizes whose forward and backward fit a v5e's 16 GiB (16k tokens with 32
    value heads, a batch of 4 × 4096 with 16: the float32 GPU shapes need more)."""
    def benchmarks(platform):
        dtype = jnp.float32
        if platform.backend == "cpu":
            shapes = [(1, 4096, 16, 16, 128, 128)]
        elif platform.backend == "tpu":
            shapes, dtype = [(1, 16384, 16, 32, 128, 128), (4, 4096, 16, 16, 128, 128)], jnp.bfloat16
        else:
            shapes = [(1, 32768, 16, 64, 128, 128), (8, 4096, 16, 32, 128, 128)]
        out = []
        for B, T, H, HV, K, V in shapes:
            q, k, v, g, beta, _ = make_inputs(jax.random.PRNGKey(0), B, T, H, HV, K, V, dtype=dtype,
                                              per_channel=per_channel)
            label = f"B={B} T={T} H={H} HV={HV} K={K} V={V}" + ("" if dtype == jnp.float32 else " bf16")
            out.append(Example(label, (q, k, v, g, beta)))
        return out
    return benchmarks


# -- SSD -----------------------------------------------------------------------------------
def ssd_examples(dtype):
    """The examples of `ssd`: a grouped batch and a packed one, with D, z, dt_bias, softplus."""
    out = []
    cases = ((2, 70, 4, 16, 2, 32, None), (1, 90, 2, 32, 1, 16, (0, 40, 90)))
    for i, (batch, T, H, P, G, N, cu) in enumerate(cases):
        n = batch if cu is None else len(cu) - 1
        x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(i), batch, T, H, P, G, N,
                                                            dtype=dtype, n_states=n)
        kwargs = {"chunk_size": 32, "D": D, "z": z, "dt_bias": dt_bias, "dt_softplus": True,
                  "initial_states": h0, "return_final_states": True}
        if cu is not None:
            kwargs["cu_seqlens"] = jnp.array(cu, jnp.int32)
        label = f"B={batch} T={T} H={H} P={P} G={G} N={N}" + (f" cu_seqlens={list(cu)}" if cu else "")
        out.append(Example(label, (x, dt, A, B, C), kwargs))
    return out


def ssd_step_examples(dtype):
    """The example of `ssd_step`: one decode token of a grouped batch."""
    x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(3), 2, 1, 4, 16, 2, 32, dtype=dtype)
    return [Example("B=2 H=4 P=16 G=2 N=32", (h0, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0]),
                    {"D": D, "z": z[:, 0], "dt_bias": dt_bias, "dt_softplus": True})]


def ssd_benchmarks(platform):
    """Benchmark shapes of `ssd` (Mamba2-like heads: P = 64, N = 128)."""
    dtype = jnp.float32
    if platform.backend == "cpu":
        shapes = [(1, 4096, 16, 64, 1, 128)]
    elif platform.backend == "tpu":  # bfloat16, 16k tokens: forward and backward fit a v5e's 16 GiB
        shapes, dtype = [(1, 16384, 32, 64, 8, 128)], jnp.bfloat16
    else:
        shapes = [(1, 32768, 64, 64, 8, 128)]
    out = []
    for batch, T, H, P, G, N in shapes:
        x, dt, A, B, C, *_ = make_ssd_inputs(jax.random.PRNGKey(0), batch, T, H, P, G, N, dtype=dtype)
        label = f"B={batch} T={T} H={H} P={P} G={G} N={N}" + ("" if dtype == jnp.float32 else " bf16")
        out.append(Example(label, (x, dt, A, B, C), {"dt_softplus": True}))
    return out


# -- the recurrence backward ops ---------------------------------------------------------
def backward_examples(per_channel: bool):
    """Examples of a recurrence backward op on the kernels' layout: a dense and a
    packed batch (the per-channel ones always with the delta rule)."""
    return functools.partial(_backward_examples, per_channel=per_channel)


def _backward_examples(dtype, *, per_channel: bool):
    out = []
    for bs, hv, nt, kdim, vdim, delta, packed in ((1, 2, 2, 32, 16, True, False),
                                                  (1, 2, 3, 16, 32, per_channel, True)):
        keys = jax.random.split(jax.random.PRNGKey(nt * kdim), 8)
        tp = nt * TRITON_CHUNK
        q = (0.3 * jax.random.normal(keys[0], (bs, hv, tp, kdim))).astype(dtype)
        k = (jax.random.normal(keys[1], (bs, hv, tp, kdim)) / np.sqrt(kdim)).astype(dtype)
        v = jax.random.normal(keys[2], (bs, hv, tp, vdim)).astype(dtype)
        g = -jax.nn.softplus(jax.random.normal(keys[3], (bs, hv, tp) + ((kdim,) if per_channel else ())))
        g = g.astype(dtype)
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (bs, hv, tp))).astype(dtype) if delta else None
        n = 2 if packed else bs
        h0 = jax.random.normal(keys[5], (n, hv, kdim, vdim)).astype(dtype)
        do = jax.random.normal(keys[6], v.shape).astype(dtype)
        dfinal = jax.random.normal(keys[7], h0.shape).astype(dtype)
        meta = (None, None, None)
        if packed:
            meta = (jnp.array([1, 0, 1], jnp.int32), jnp.array([0, 0, 1], jnp.int32), jnp.array([0, 1, 1], jnp.int32))
        out.append(Example(f"HV={hv} NT={nt} K={kdim} V={vdim} delta={delta} packed={packed}",
                           (q, k, v, g, beta, h0, do, dfinal) + meta))
    return out


# -- naive-scan peers ------------------------------------------------------------------------
#: Longest token count the naive-scan benchmark peer takes on an accelerator: its
#: autodiff stores the state of every step (T·HV·K·V floats: 137 GB at the GPU shape).
NAIVE_SCAN_MAX_TOKENS = 8192


def refuse_long_naive_scan(tokens: int) -> None:
    """Raise ``NotImplementedError`` for a naive scan over more than
    `NAIVE_SCAN_MAX_TOKENS` tokens on an accelerator."""
    if current_platform().backend != "cpu" and tokens > NAIVE_SCAN_MAX_TOKENS:
        raise NotImplementedError(f"the naive scan baseline takes at most {NAIVE_SCAN_MAX_TOKENS} tokens on an "
                                  f"accelerator (its gradient stores every step's state), got {tokens}")


def naive_scan(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False,
               cu_seqlens=None, chunk_size=None):
    """The baseline the chunked algorithm is measured against: the recurrence
    as one ``lax.scan`` over time steps (what one would write by hand)."""
    del chunk_size
    refuse_long_naive_scan(q.shape[0] * q.shape[1])
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    o, final = delta_rule_recurrence(q, k, v, g, beta, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                     initial_state=initial_state, cu_seqlens=cu_seqlens)
    return o.astype(v.dtype), (final if output_final_state else None)


def naive_ssd(x, dt, A, B, C, *, chunk_size=None, D=None, z=None, dt_bias=None, dt_softplus=False,
              dt_limit=(0.0, _INF), initial_states=None, cu_seqlens=None, return_final_states=False):
    """Baseline: SSD as one ``lax.scan`` over time steps."""
    del chunk_size
    refuse_long_naive_scan(x.shape[0] * x.shape[1])
    step = ssd_dt(dt, dt_bias, dt_softplus, dt_limit)
    y, final = ssd_recurrence(x, step, A, B, C, initial_states=initial_states, cu_seqlens=cu_seqlens)
    y = ssd_epilogue(y, x, D, z).astype(x.dtype)
    return (y, final) if return_final_states else y


# -- the decode ops -------------------------------------------------------------------------------
# Examples and benchmark shapes of `fused_recurrent_gated_delta_rule`, `fused_recurrent_kda` and
# `ssd_step`: serving steps of hybrid models, sized like Qwen3-Next / Kimi Linear (K = V = 128,
# 16 key heads, 32 value heads; and K = V = 256) and Mamba2 (P = 64, N = 128). Packed multi-token
# decode at these sizes is compiled by a ``slow`` test of
# `tests/ops/linear_attention/test_linear_attention_decode_mosaic_tpu.py`. They drive `stellax
# bench` and the TPU compile tier (`stellax check --tpu-compile`), where VMEM limits bite at real
# head sizes.


def recurrent_examples(per_channel: bool):
    """The examples of a fused-recurrent op (GDN, or KDA with ``per_channel``),
    small because interpreted TPU kernels walk tokens one by one: a dense
    grouped-head batch over two 8-token chunks, a packed batch with an empty
    sequence and l2-normalized q/k, and for KDA Kimi Linear's fused gate; all
    with initial and final states."""
    return functools.partial(_recurrent_examples, per_channel=per_channel)


def _recurrent_examples(dtype, *, per_channel: bool):
    out = []
    for i, (B, T, H, HV, K, V, cu, extra) in enumerate((
            (2, 11, 1, 2, 32, 16, None, {}),
            (1, 12, 2, 2, 16, 32, (0, 3, 3, 12), {"use_qk_l2norm": True}),
            (1, 9, 1, 2, 16, 16, None, {"use_gate_in_kernel": True, "lower_bound": -5.0}))[:3 if per_channel else 2]):
        n = B if cu is None else len(cu) - 1
        q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(i), B, T, H, HV, K, V, dtype=dtype,
                                           per_channel=per_channel, n_states=n)
        kwargs = {"initial_state": h0, "output_final_state": True, **extra}
        label = f"B={B} T={T} H={H} HV={HV} K={K} V={V}"
        if cu is not None:
            kwargs["cu_seqlens"] = jnp.array(cu, jnp.int32)
            label += f" cu_seqlens={list(cu)} l2norm"
        if "use_gate_in_kernel" in extra:  # raw gate input, Kimi Linear's parameters
            keys = jax.random.split(jax.random.PRNGKey(8), 2)
            g = -g
            kwargs.update(A_log=(0.3 * jax.random.normal(keys[0], (HV,))).astype(dtype),
                          dt_bias=(0.3 * jax.random.normal(keys[1], (HV * K,))).astype(dtype))
            label += " fused gate lower_bound=-5"
        out.append(Example(label, (q, k, v, g, beta), kwargs))
    return out


def _recurrent_shapes(platform):
    """``(B, T, H, HV, K, V)``: one decode token per sequence."""
    if platform.backend == "cpu":
        return [(8, 1, 4, 8, 128, 128)]
    return [(64, 1, 16, 32, 128, 128), (16, 1, 8, 16, 256, 256)]


def recurrent_benchmarks(per_channel: bool):
    """Benchmark calls of a fused-recurrent op (GDN, or KDA with ``per_channel``):
    float32 inputs, initial states in, final states out."""
    return functools.partial(_recurrent_benchmarks, per_channel=per_channel)


def _recurrent_benchmarks(platform, *, per_channel: bool):
    out = []
    for B, T, H, HV, K, V in _recurrent_shapes(platform):
        q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(0), B, T, H, HV, K, V, per_channel=per_channel)
        out.append(Example(f"B={B} T={T} H={H} HV={HV} K={K} V={V}", (q, k, v, g, beta),
                           {"initial_state": h0, "output_final_state": True}))
    return out


def ssd_step_benchmarks(platform):
    """Benchmark calls of `ssd_step`: a Mamba2-sized decode step (``[B, H]``
    shapes) and mamba_ssm's tied-head-dim form (``dt [B, H, P]``, ``A [H, P, N]``)."""
    batch, H, P, G, N = (8, 8, 64, 1, 128) if platform.backend == "cpu" else (64, 80, 64, 1, 128)
    x, dt, A, B, C, D, z, dt_bias, h0 = make_ssd_inputs(jax.random.PRNGKey(0), batch, 1, H, P, G, N)
    args = (h0, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
    out = [Example(f"B={batch} H={H} P={P} G={G} N={N}", args,
                   {"D": D, "z": z[:, 0], "dt_bias": dt_bias, "dt_softplus": True})]
    tied = (h0, x[:, 0], jnp.broadcast_to(dt[:, 0, :, None], (batch, H, P)),
            jnp.broadcast_to(A[:, None, None], (H, P, N)).astype(F32), B[:, 0], C[:, 0])
    out.append(Example(f"tied B={batch} H={H} P={P} G={G} N={N}", tied,
                       {"D": jnp.broadcast_to(D[:, None], (H, P)), "dt_bias": jnp.broadcast_to(dt_bias[:, None], (H, P)),
                        "dt_softplus": True}))
    return out
