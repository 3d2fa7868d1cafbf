"""Examples and benchmark shapes of the decode ops (`fused_recurrent_gated_delta_rule`,
`fused_recurrent_kda`, `ssd_step`): serving steps of hybrid models, sized
like Qwen3-Next / Kimi Linear (K = V = 128, 16 key heads, 32 value heads;
and K = V = 256) and Mamba2 (P = 64, N = 128). Packed multi-token decode at
these sizes is compiled by a ``slow`` test of
`tests/ops/linear_attention/test_linear_attention_decode_mosaic_tpu.py`. They drive `stellax bench` and the TPU compile
tier (`stellax check --tpu-compile`), where VMEM limits bite at real head
sizes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core import Example
from ...core.pallas import F32
from .examples import make_inputs, make_ssd_inputs


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
