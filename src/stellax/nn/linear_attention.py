"""Linear-attention and state-space mixers: `GatedDeltaNet`, `KimiDeltaAttention`
(over stellax's chunked delta-rule kernels) and `Mamba2` (over `stellax.ssd`).

Each maps ``x [B, T, D] -> [B, T, D]`` (and, with ``return_state=True``, the
final recurrent state for decoding). The causal short convolutions the
reference models put in front of q/k/v (fla's ``ShortConvolution``, Mamba2's
``conv1d``) are not part of these layers: the mixers start from the
projections.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import stellax

from ._params import check_sharding, dense, ones, param, positive

_default_kernel = nnx.initializers.lecun_normal()


def _a_log_init(key, shape, dtype=jnp.float32):
    """``log(A)`` with ``A ~ U[1, 16]`` (Mamba2 / fla's initialization)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _dt_bias_init(key, shape, dtype=jnp.float32):
    """``softplus⁻¹(dt)`` with ``dt`` log-uniform in ``[1e-3, 1e-1]`` (Mamba2)."""
    dt = jnp.exp(jax.random.uniform(key, shape, jnp.float32, jnp.log(1e-3), jnp.log(1e-1)))
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def _gated_rms(o, gate, scale, eps):
    """``rms_norm(o) · scale · silu(gate)`` over the last axis (fla's ``FusedRMSNormGated``)."""
    return stellax.rms_norm(o, scale.astype(o.dtype), epsilon=eps) * jax.nn.silu(gate)


class _DeltaMixer(nnx.Module):
    """Projections shared by `GatedDeltaNet` and `KimiDeltaAttention`."""

    _name = "DeltaMixer"
    _per_channel_decay = False           # KDA: a decay per key channel, [B, T, HV, K]
    _chunk = staticmethod(stellax.chunk_gated_delta_rule)

    def __init__(self, features: int, num_heads: int, head_dim: int, num_v_heads: int | None = None,
                 v_head_dim: int | None = None, *, epsilon: float = 1e-6, dtype=None, param_dtype=jnp.float32,
                 kernel_init=_default_kernel, sharding: Mapping[str, Sequence[str | None]] | None = None,
                 rngs: nnx.Rngs):
        name, per_channel_decay = self._name, self._per_channel_decay
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        positive(name, features=features, num_heads=num_heads, head_dim=head_dim, num_v_heads=num_v_heads,
                 v_head_dim=v_head_dim)
        if num_v_heads % num_heads:
            raise ValueError(f"{name}: num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})")
        decay = (num_v_heads, head_dim) if per_channel_decay else (num_v_heads,)
        names = ["q", "k", "v", "a", "b", "gate", "o", "A_log", "dt_bias", "norm"]
        shard = check_sharding(name, sharding, names)
        p = lambda n, shape, init=kernel_init: param(name, rngs, n, init, shape, param_dtype, shard)
        self.features, self.num_heads, self.head_dim = features, num_heads, head_dim
        self.num_v_heads, self.v_head_dim, self.epsilon, self.dtype = num_v_heads, v_head_dim, float(epsilon), dtype
        self.q = p("q", (features, num_heads, head_dim))
        self.k = p("k", (features, num_heads, head_dim))
        self.v = p("v", (features, num_v_heads, v_head_dim))
        self.a = p("a", (features, *decay))             # decay input
        self.b = p("b", (features, num_v_heads))        # write strength logits
        self.gate = p("gate", (features, num_v_heads, v_head_dim))
        self.o = p("o", (num_v_heads, v_head_dim, features))
        self.A_log = p("A_log", (num_v_heads,), _a_log_init)
        self.dt_bias = p("dt_bias", decay, _dt_bias_init)
        self.norm = p("norm", (v_head_dim,), ones)

    def _inputs(self, x):
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(f"{self._name}: x must be [B, T, {self.features}], got shape {x.shape}")
        q, k, v = (dense(x, w[...]) for w in (self.q, self.k, self.v))
        a = dense(x, self.a[...]).astype(jnp.float32) + self.dt_bias[...]
        decay = -jnp.exp(self.A_log[...].astype(jnp.float32))
        g = (decay[:, None] if a.ndim == 4 else decay) * jax.nn.softplus(a)      # log-space decay <= 0
        beta = jax.nn.sigmoid(dense(x, self.b[...]))
        return q, k, v, g.astype(x.dtype), beta.astype(x.dtype)

    def _output(self, x, o):
        o = _gated_rms(o, dense(x, self.gate[...]), self.norm[...], self.epsilon)
        y = jnp.einsum("bthv,hvd->btd", o, self.o[...].astype(o.dtype), precision="highest")
        return y if self.dtype is None else y.astype(self.dtype)

    def __call__(self, x, *, initial_state=None, return_state: bool = False):
        """``x [B, T, D] -> [B, T, D]`` (``, state [B, HV, K, V]`` with ``return_state``)."""
        q, k, v, g, beta = self._inputs(x)
        o, state = self._chunk(q, k, v, g, beta, use_qk_l2norm=True, initial_state=initial_state,
                               output_final_state=return_state)
        y = self._output(x, o)
        return (y, state) if return_state else y


class GatedDeltaNet(_DeltaMixer):
    """Gated DeltaNet (Qwen3-Next's linear attention) over `stellax.chunk_gated_delta_rule`.

    ``q, k = l2norm(x W_q), l2norm(x W_k) [B, T, H, K]``, ``v = x W_v [B, T, HV, V]``,
    ``g = −exp(A_log) · softplus(x W_a + dt_bias) [B, T, HV]``, ``β = sigmoid(x W_b)``;
    per value head ``S ← exp(g_t) S + k_t ⊗ β_t (v_t − Sᵀ k_t)``, ``o_t = Sᵀ q_t / √K``;
    ``y = (rms_norm(o) · norm · silu(x W_gate)) W_o``.

    Args:
      features: ``D``; num_heads: ``H`` (query/key heads); head_dim: ``K``;
      num_v_heads: ``HV`` (a multiple of ``H``, default ``H``); v_head_dim: ``V`` (default ``K``).
      sharding: logical axes for any of ``q k v a b gate o A_log dt_bias norm``.
    """

    _name = "GatedDeltaNet"


class KimiDeltaAttention(_DeltaMixer):
    """Kimi Delta Attention (Kimi Linear) over `stellax.chunk_kda`: `GatedDeltaNet`
    with a per-channel decay ``g = −exp(A_log) · softplus(x W_a + dt_bias) [B, T, HV, K]``
    and ``S ← diag(exp(g_t)) S + k_t ⊗ β_t (v_t − Sᵀ k_t)``. Arguments as `GatedDeltaNet`."""

    _name = "KimiDeltaAttention"
    _per_channel_decay = True
    _chunk = staticmethod(stellax.chunk_kda)


class Mamba2(nnx.Module):
    """The Mamba2 mixer over `stellax.ssd` (the SSD scan).

    ``x_h = x W_x [B, T, H, P]``, ``z = x W_z [B, T, H, P]``, ``B_, C_ = x W_B, x W_C
    [B, T, G, N]``, ``dt = softplus(x W_dt + dt_bias) [B, T, H]``, ``A = −exp(A_log)``;
    per head ``S ← exp(dt·A) S + dt · x_t ⊗ B_t``, ``y_t = (S C_t + D x_t) · silu(z_t)``;
    output ``y W_o``.

    Args:
      features: ``D``; num_heads: ``H``; head_dim: ``P``; state_dim: ``N``;
      num_groups: ``G`` (``H % G == 0``; B/C shared by ``H / G`` heads).
      sharding: logical axes for any of ``x z B C dt o A_log D dt_bias``.
    """

    def __init__(self, features: int, num_heads: int, head_dim: int, state_dim: int, num_groups: int = 1, *,
                 dtype=None, param_dtype=jnp.float32, kernel_init=_default_kernel,
                 sharding: Mapping[str, Sequence[str | None]] | None = None, rngs: nnx.Rngs):
        positive("Mamba2", features=features, num_heads=num_heads, head_dim=head_dim, state_dim=state_dim,
                 num_groups=num_groups)
        if num_heads % num_groups:
            raise ValueError(f"Mamba2: num_heads ({num_heads}) must be a multiple of num_groups ({num_groups})")
        shard = check_sharding("Mamba2", sharding, ["x", "z", "B", "C", "dt", "o", "A_log", "D", "dt_bias"])
        p = lambda n, shape, init=kernel_init: param("Mamba2", rngs, n, init, shape, param_dtype, shard)
        self.features, self.num_heads, self.head_dim = features, num_heads, head_dim
        self.state_dim, self.num_groups, self.dtype = state_dim, num_groups, dtype
        self.x = p("x", (features, num_heads, head_dim))
        self.z = p("z", (features, num_heads, head_dim))
        self.B = p("B", (features, num_groups, state_dim))
        self.C = p("C", (features, num_groups, state_dim))
        self.dt = p("dt", (features, num_heads))
        self.o = p("o", (num_heads, head_dim, features))
        self.A_log = p("A_log", (num_heads,), _a_log_init)
        self.D = p("D", (num_heads,), ones)
        self.dt_bias = p("dt_bias", (num_heads,), _dt_bias_init)

    def __call__(self, x, *, initial_state=None, return_state: bool = False):
        """``x [B, T, D] -> [B, T, D]`` (``, state [B, H, P, N]`` with ``return_state``)."""
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(f"Mamba2: x must be [B, T, {self.features}], got shape {x.shape}")
        xs, z, b_, c_ = (dense(x, w[...]) for w in (self.x, self.z, self.B, self.C))
        dt = dense(x, self.dt[...])
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        out = stellax.ssd(xs, dt, a, b_, c_, D=self.D[...], z=z, dt_bias=self.dt_bias[...], dt_softplus=True,
                          initial_states=initial_state, return_final_states=return_state)
        y, state = out if return_state else (out, None)
        y = jnp.einsum("bthp,hpd->btd", y, self.o[...].astype(y.dtype), precision="highest")
        y = y if self.dtype is None else y.astype(self.dtype)
        return (y, state) if return_state else y
