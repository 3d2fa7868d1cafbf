"""Benchmark shapes of the decode ops (`fused_recurrent_gated_delta_rule`,
`fused_recurrent_kda`, `ssd_step`): serving steps of hybrid models, sized
like Qwen3-Next / Kimi Linear (K = V = 128, 16 key heads, 32 value heads)
and Mamba2 (P = 64, N = 128). They drive `stellax bench` and the TPU compile
tier (`stellax check --tpu-compile`), where VMEM limits bite at real head
sizes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example
from ...core.pallas import F32
from .examples import make_inputs, make_ssd_inputs


def _recurrent_shapes(platform):
    """``(B, T, H, HV, K, V, tokens per packed sequence or None)``."""
    if platform.backend == "cpu":
        return [(8, 1, 4, 8, 128, 128, None)]
    return [(64, 1, 16, 32, 128, 128, None),    # one decode token per sequence
            (16, 1, 8, 16, 256, 256, None)]     # K = V = 256


def recurrent_benchmarks(per_channel: bool):
    """Benchmark calls of a fused-recurrent op (GDN, or KDA with ``per_channel``):
    float32 inputs, initial states in, final states out."""
    return functools.partial(_recurrent_benchmarks, per_channel=per_channel)


def _recurrent_benchmarks(platform, *, per_channel: bool):
    out = []
    for B, T, H, HV, K, V, packed in _recurrent_shapes(platform):
        n = B if packed is None else T // packed
        q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(0), B, T, H, HV, K, V, per_channel=per_channel,
                                           n_states=n)
        kwargs = {"initial_state": h0, "output_final_state": True}
        label = f"B={B} T={T} H={H} HV={HV} K={K} V={V}"
        if packed is not None:
            kwargs["cu_seqlens"] = np.arange(0, T + 1, packed, dtype=np.int32)  # concrete: traced benchmarks keep it
            label += f" packed {n}x{packed}"
        out.append(Example(label, (q, k, v, g, beta), kwargs))
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
