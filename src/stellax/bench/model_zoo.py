"""The models of the one-chip model benchmarks (`stellax.bench.model_train`,
`stellax.bench.model_serve`), each built over one parameter pytree three ways: from `stellax.nn`
layers (``stellax``: every op what stellax picks on the device), as the same math in plain JAX
(``jax``, `JAX_OPS`), and as that plain model with tokamax's ops where tokamax has them
(``tokamax``, `tokamax_ops`: attention, RMSNorm, GLU, ragged dot, the fused loss; the GDN stays
stellax's XLA path), an optional peer. The two peers share their code: the blocks take a `PeerOps`.

* `DenseConfig`: a Llama-3-style decoder (RMSNorm, GQA attention with RoPE, SwiGLU), the
  ``stellax`` blocks ``RMSNorm`` / ``Attention`` / ``GatedMLP``.
* `HybridConfig`: a Qwen3-Next-style hybrid MoE decoder. ``groups`` repeats of three Gated DeltaNet
  blocks then one gated-attention block; every block's MLP is a top-k MoE plus a shared SwiGLU
  expert. ``stellax`` blocks: ``RMSNorm``, ``GatedDeltaNet`` (`stellax.chunk_gated_delta_rule`),
  ``Attention(output_gate=True)``, ``MoE`` (`stellax.moe_mlp`: routing, permutation, grouped
  matmuls), ``GatedMLP``. The plain twin: ``jnp`` norms / GLU / routing, `jax.lax.ragged_dot` for the
  experts, `jax.nn.dot_product_attention`, and stellax's XLA chunked GDN
  (``implementation="xla"``) as the only XLA Gated DeltaNet there is -- so the plain hybrid's
  ``stellax_ops`` lists ``chunk_gated_delta_rule: xla`` and nothing else.
  Left out of Qwen3-Next: the short causal convolutions before q/k/v of the GDN layers, the sigmoid
  gate on the shared expert, the zero-centred norm weights and the partial RoPE (the layers of
  `stellax.nn` have none of them; the FLOPs they would add are < 1 %).

The losses are mean next-token cross-entropy: stellax's fused `stellax.linear_cross_entropy` (no
``[T, V]`` logits), float32 logits and `optax.softmax_cross_entropy_with_integer_labels` (plain), and
tokamax's fused ``linear_softmax_cross_entropy_loss``.

Parameter pytree (float32): ``embed [V, D]``, the blocks' pure state dicts stacked on leading axes
(dense: ``layers [L, ...]``; hybrid: ``gdn [G, 3, ...]`` and ``attn [G, ...]``), ``final_norm [D]``,
``unembed [D, V]``. Activations bfloat16: each layer casts its parameters to the activations' dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

GDN_CHUNK = 64   # the chunk of the chunked GDN algorithm, in its FLOP count


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    rope_theta: float = 500000.0
    epsilon: float = 1e-5
    family = "dense"

    def matmul_params(self) -> int:
        """Parameters that enter a matmul per token: the blocks' projections and the output projection."""
        d, n, k, h, f = self.d_model, self.heads, self.kv_heads, self.head_dim, self.hidden
        block = d * n * h + 2 * d * k * h + n * h * d + 2 * d * f + f * d
        return self.layers * block + d * self.vocab

    def total_params(self) -> int:
        return self.matmul_params() + self.vocab * self.d_model + (2 * self.layers + 1) * self.d_model

    def flops_per_step(self, batch: int, seq: int) -> float:
        """Training (forward + backward) model FLOPs: ``6·P_matmul·B·S + 6·B·S²·N·H·L`` (causal
        attention at half of ``12·B·S²·N·H`` per layer, as MaxText)."""
        dense = 6.0 * self.matmul_params() * batch * seq
        attention = 12.0 * batch * seq * seq * self.heads * self.head_dim * self.layers / 2
        return dense + attention


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    vocab: int
    d_model: int
    groups: int                  # each: 3 Gated DeltaNet blocks, then 1 gated-attention block
    heads: int                   # attention query heads
    kv_heads: int
    head_dim: int
    gdn_heads: int               # GDN q/k heads (= value heads)
    gdn_head_dim: int            # GDN K = V
    experts: int
    top_k: int
    expert_hidden: int
    shared_hidden: int
    rope_theta: float = 10000000.0
    epsilon: float = 1e-6
    family = "hybrid"
    gdn_per_group = 3

    @property
    def layers(self) -> int:
        return self.groups * (self.gdn_per_group + 1)

    def _mixers(self) -> tuple[int, int]:
        d, hg, kg = self.d_model, self.gdn_heads, self.gdn_head_dim
        gdn = 5 * d * hg * kg + 2 * d * hg          # q k v gate o; a b
        n, k, h = self.heads, self.kv_heads, self.head_dim
        attn = 3 * d * n * h + 2 * d * k * h         # q gate o; k v
        return gdn, attn

    def _mlp(self, experts: int) -> int:
        d = self.d_model
        return d * self.experts + 3 * d * self.expert_hidden * experts + 3 * d * self.shared_hidden

    def matmul_params(self) -> int:
        """Parameters that enter a matmul per token (active: ``top_k`` of the experts), plus ``D·V``."""
        gdn, attn = self._mixers()
        g = self.groups
        return g * (self.gdn_per_group * gdn + attn) + self.layers * self._mlp(self.top_k) + self.d_model * self.vocab

    def total_params(self) -> int:
        gdn, attn = self._mixers()
        g, d, hg = self.groups, self.d_model, self.gdn_heads
        small = g * self.gdn_per_group * (2 * hg + self.gdn_head_dim) + 2 * self.layers * d + d  # A_log dt_bias norms
        return (g * (self.gdn_per_group * gdn + attn) + self.layers * self._mlp(self.experts)
                + 2 * self.vocab * d + small)

    def flops_per_step(self, batch: int, seq: int) -> float:
        """Training model FLOPs: ``6·P_active·B·S`` (``P_active``: `matmul_params`, the router, the
        top-k experts' ``3·D·F`` each, the shared expert) + causal attention ``6·B·S²·N·H`` per
        attention layer + Gated DeltaNet ``3·B·S·HG·(6·K·V + C·(2K + V))`` per GDN layer: per token
        and head the forward's state read for the output, the state read for the delta and the
        state update (``2·K·V`` each) and the intra-chunk ``q kᵀ``, ``k kᵀ`` and ``A·v`` over half
        of a chunk of ``C = 64`` on average (``C·K`` + ``C·K`` + ``C·V``), times 3 for the backward."""
        dense = 6.0 * self.matmul_params() * batch * seq
        attn = 12.0 * batch * seq * seq * self.heads * self.head_dim * self.groups / 2
        k = self.gdn_head_dim
        gdn = 3.0 * batch * seq * self.gdn_heads * (6 * k * k + GDN_CHUNK * 3 * k) * self.groups * self.gdn_per_group
        return dense + attn + gdn


# -- stellax blocks -----------------------------------------------------------------------------------
def block_classes(cfg):
    """The `stellax.nn` block(s) of ``cfg``: ``{"layers": Block}`` (dense) or ``{"gdn": GDNBlock,
    "attn": AttnBlock}`` (hybrid); each maps ``(x [B, S, D], positions [B, S]) -> [B, S, D]``."""
    from flax import nnx

    from stellax.nn import Attention, GatedDeltaNet, GatedMLP, MoE, RMSNorm

    if cfg.family == "dense":
        class Block(nnx.Module):
            """``h = x + attn(norm(x)); y = h + mlp(norm(h))``."""

            def __init__(self, cfg, *, rngs):
                d = cfg.d_model
                self.attn_norm = RMSNorm(d, epsilon=cfg.epsilon, rngs=rngs)
                self.attn = Attention(d, cfg.heads, cfg.kv_heads, cfg.head_dim, rope_theta=cfg.rope_theta, rngs=rngs)
                self.mlp_norm = RMSNorm(d, epsilon=cfg.epsilon, rngs=rngs)
                self.mlp = GatedMLP(d, cfg.hidden, activation="silu", rngs=rngs)

            def __call__(self, x, positions):
                a = self.attn(self.attn_norm(x), positions=positions)
                m, h = self.mlp_norm(a, residual=x)          # fused: norm(a + x), a + x
                return h + self.mlp(m)

        return {"layers": Block}

    class _MoEBlock(nnx.Module):
        """``h = x + mix(norm(x)); y = h + moe(norm(h)) + shared(norm(h))``."""

        def _mlp(self, cfg, rngs):
            d = cfg.d_model
            self.mlp_norm = RMSNorm(d, epsilon=cfg.epsilon, rngs=rngs)
            self.moe = MoE(d, cfg.expert_hidden, cfg.experts, cfg.top_k, rngs=rngs)
            self.shared = GatedMLP(d, cfg.shared_hidden, activation="silu", rngs=rngs)

        def __call__(self, x, positions):
            a = self.mix(self.mix_norm(x), positions)
            m, h = self.mlp_norm(a, residual=x)
            return h + self.moe(m) + self.shared(m)

    class GDNBlock(_MoEBlock):
        def __init__(self, cfg, *, rngs):
            self.mix_norm = RMSNorm(cfg.d_model, epsilon=cfg.epsilon, rngs=rngs)
            self.gdn = GatedDeltaNet(cfg.d_model, cfg.gdn_heads, cfg.gdn_head_dim, epsilon=cfg.epsilon, rngs=rngs)
            self._mlp(cfg, rngs)

        def mix(self, x, positions):
            return self.gdn(x)

    class AttnBlock(_MoEBlock):
        def __init__(self, cfg, *, rngs):
            self.mix_norm = RMSNorm(cfg.d_model, epsilon=cfg.epsilon, rngs=rngs)
            self.attn = Attention(cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, rope_theta=cfg.rope_theta,
                                  output_gate=True, rngs=rngs)
            self._mlp(cfg, rngs)

        def mix(self, x, positions):
            return self.attn(x, positions=positions)

    return {"gdn": GDNBlock, "attn": AttnBlock}


def init_params(cfg, seed: int):
    """The one parameter pytree (float32, see the module doc); deterministic in ``seed``."""
    from flax import nnx

    classes = block_classes(cfg)
    if cfg.family == "dense":
        stacks = {"layers": (cfg.layers,)}
    else:
        stacks = {"gdn": (cfg.groups, cfg.gdn_per_group), "attn": (cfg.groups,)}

    def init(key):
        k_embed, k_out, k_layers = jax.random.split(key, 3)
        out = {"embed": jax.random.normal(k_embed, (cfg.vocab, cfg.d_model), jnp.float32),
               "final_norm": jnp.ones((cfg.d_model,), jnp.float32),
               "unembed": jax.random.normal(k_out, (cfg.d_model, cfg.vocab), jnp.float32) / math.sqrt(cfg.d_model)}
        for i, (name, shape) in enumerate(stacks.items()):
            cls = classes[name]
            one = lambda k, cls=cls: nnx.split(cls(cfg, rngs=nnx.Rngs(k)))[1].to_pure_dict()
            keys = jax.random.split(jax.random.fold_in(k_layers, i), math.prod(shape))
            flat = jax.vmap(one)(keys)
            out[name] = jax.tree.map(lambda a, shape=shape: a.reshape(*shape, *a.shape[1:]), flat)
        return out

    return jax.jit(init)(jax.random.key(seed))


def _stack(block_fns, params, x, positions, remat: str, family: str):
    """The blocks over ``x``: dense ``scan`` over ``layers``; hybrid ``scan`` over the groups, each a
    ``scan`` over its GDN blocks then its attention block. ``remat="full"``: ``jax.checkpoint`` per block."""
    def body(name):
        f = lambda h, p: (block_fns[name](p, h, positions), None)
        return jax.checkpoint(f) if remat == "full" else f

    if family == "dense":
        return jax.lax.scan(body("layers"), x, params["layers"])[0]

    def group(h, p):
        h = jax.lax.scan(body("gdn"), h, p["gdn"])[0]
        return body("attn")(h, p["attn"])

    return jax.lax.scan(group, x, {"gdn": params["gdn"], "attn": params["attn"]})[0]


def _positions(tokens):
    b, t = tokens.shape
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def stellax_loss(cfg, remat: str, params, tokens, labels):
    """Mean next-token cross-entropy with the `stellax.nn` blocks and stellax's fused loss.
    ``tokens``, ``labels``: ``[B, S]`` int32."""
    from flax import nnx

    import stellax

    def block_fn(cls):
        def f(p, h, positions):
            graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
            nnx.replace_by_pure_dict(state, p)
            return nnx.merge(graphdef, state)(h, positions)
        return f

    fns = {name: block_fn(cls) for name, cls in block_classes(cfg).items()}
    b, t = tokens.shape
    x = params["embed"].astype(jnp.bfloat16)[tokens]
    x = _stack(fns, params, x, _positions(tokens), remat, cfg.family)
    x = stellax.rms_norm(x, params["final_norm"].astype(x.dtype), epsilon=cfg.epsilon)
    return stellax.linear_cross_entropy(x.reshape(b * t, -1), params["unembed"].astype(x.dtype), labels.reshape(-1))


# -- plain JAX (and tokamax) ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PeerOps:
    """The ops a peer model's blocks call, over bfloat16 activations; the rest of the block (the
    projections, RoPE, routing, the GDN's gates) is the same ``jnp`` code for every peer.

    * ``attention(q [B, T, N, H], k, v [B, T, K, H]) -> [B, T, N, H]``: causal GQA attention;
    * ``rms(x [..., D], scale [D], eps) -> x.dtype``: RMSNorm;
    * ``glu(x [..., D], gate_up [D, 2, F]) -> [..., F] x.dtype``: ``silu(x W_g) · x W_u``;
    * ``ragged_dot(rows [M, D], w [E, D, N], sizes [E] int32) -> [M, N] float32``;
    * ``loss(x [B, S, D], unembed [D, V] x.dtype, labels [B, S]) -> float32 scalar``: mean
      next-token cross-entropy of ``x @ unembed``.
    """

    name: str
    attention: object
    rms: object
    glu: object
    ragged_dot: object
    loss: object


def rms(x, scale, eps):
    """``x / sqrt(mean(x², -1) + eps) · scale`` in float32, back in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta):
    """Half-split rotary embedding of ``x [B, T, N, H]`` at ``positions [B, T]``."""
    h = x.shape[-1]
    inv = theta ** (-jnp.arange(0, h // 2, dtype=jnp.float32) * 2 / h)
    ang = positions.astype(jnp.float32)[..., None] * inv
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def proj(x, w):
    """``x [..., D] @ w [D, *rest]`` in ``x.dtype``."""
    return jnp.tensordot(x, w.astype(x.dtype), axes=1)


def gate(x, gate_up):
    """``silu(x W_g) · x W_u`` with ``gate_up [D, 2, F]``: float32 products, ``x.dtype`` result."""
    u = jnp.einsum("...d,dgf->...gf", x, gate_up.astype(x.dtype), preferred_element_type=jnp.float32)
    return (jax.nn.silu(u[..., 0, :]) * u[..., 1, :]).astype(x.dtype)


def glu(x, gate_up, down, ops=None):
    """SwiGLU ``(silu(x W_g) · x W_u) W_d`` with ``gate_up [D, 2, F]``, ``down [F, D]`` (the gating by
    ``ops.glu``, plain JAX's `gate` by default)."""
    return proj((ops.glu if ops else gate)(x, gate_up), down)


def _optax_loss(x, unembed, labels):
    import optax

    logits = jnp.einsum("btd,dv->btv", x, unembed, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


#: Plain JAX/XLA: `jax.nn.dot_product_attention`, ``jnp`` norms and GLU, `jax.lax.ragged_dot`,
#: float32 ``[B, S, V]`` logits and optax's cross-entropy.
JAX_OPS = PeerOps(
    name="jax",
    attention=lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    rms=rms, glu=gate,
    ragged_dot=lambda rows, w, sizes: jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32),
    loss=_optax_loss)


def tokamax_ops() -> PeerOps:
    """tokamax's ops, each with the implementation tokamax picks on the device (its Mosaic TPU
    kernels on a TPU where it has them, XLA elsewhere): ``dot_product_attention``, ``layer_norm``
    (``subtract_mean=False``: RMSNorm), ``gated_linear_unit``, ``ragged_dot`` and
    ``linear_softmax_cross_entropy_loss`` (no ``[T, V]`` logits). Raises ImportError without tokamax."""
    from stellax.core import tokamax_peer

    tokamax = tokamax_peer.load()

    def loss(x, unembed, labels):
        # tokamax 0.0.12's XLA loss returns a float32 cotangent for bfloat16 ``x``, which the next
        # layer's VJP rejects; the lossless round trip through float32 casts it back (its transpose
        # converts the cotangent to each operand's dtype) and costs nothing in the forward.
        x = x.astype(jnp.float32).astype(x.dtype)
        return tokamax.linear_softmax_cross_entropy_loss(x.reshape(-1, x.shape[-1]), labels.reshape(-1), unembed,
                                                         reduction="mean")

    return PeerOps(
        name="tokamax",
        attention=lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True),
        rms=lambda x, scale, eps: tokamax.layer_norm(x, scale.astype(x.dtype), None, epsilon=eps,
                                                     subtract_mean=False),
        glu=lambda x, gate_up: tokamax.gated_linear_unit(x, gate_up.astype(x.dtype), activation=jax.nn.silu),
        ragged_dot=lambda rows, w, sizes: tokamax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32),
        loss=loss)


def plain_attention(cfg, a, x, positions, gated: bool, ops: PeerOps = JAX_OPS):
    """GQA attention with RoPE (and the hybrid's sigmoid output gate) over ``x [B, T, D]``."""
    q, k, v = proj(x, a["q"]), proj(x, a["k"]), proj(x, a["v"])
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    o = ops.attention(q, k, v)
    if gated:
        o = o * jax.nn.sigmoid(proj(x, a["gate"])).astype(o.dtype)
    return jnp.einsum("btnh,nhd->btd", o, a["o"].astype(x.dtype))


def plain_gdn(cfg, p, x, ops: PeerOps = JAX_OPS):
    """Gated DeltaNet as `stellax.nn.GatedDeltaNet` with stellax's XLA chunked kernel (no peer has one)."""
    import stellax

    q, k, v = proj(x, p["q"]), proj(x, p["k"]), proj(x, p["v"])
    a = proj(x, p["a"]).astype(jnp.float32) + p["dt_bias"]
    g = (-jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a)).astype(x.dtype)
    beta = jax.nn.sigmoid(proj(x, p["b"])).astype(x.dtype)
    o, _ = stellax.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, implementation="xla")
    o = ops.rms(o, p["norm"], cfg.epsilon) * jax.nn.silu(proj(x, p["gate"]))
    return jnp.einsum("bthv,hvd->btd", o, p["o"].astype(o.dtype))


def plain_moe(cfg, p, x, ops: PeerOps = JAX_OPS):
    """Top-k MoE: softmax routing, normalized top-k weights, the copies sorted by expert, two
    ``ops.ragged_dot`` (fused gate/up, then down), weighted combine. ``x [B, T, D]``."""
    shape, dt = x.shape, x.dtype
    x = x.reshape(-1, shape[-1])
    k, e, f = cfg.top_k, cfg.experts, cfg.expert_hidden
    probs = jax.nn.softmax(proj(x, p["router"]).astype(jnp.float32), axis=-1)
    w, ids = jax.lax.top_k(jax.lax.stop_gradient(probs), k)
    w = jnp.take_along_axis(probs, ids, axis=-1)
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    gu = ops.ragged_dot(rows, p["w_gate_up"].astype(dt).reshape(e, shape[-1], 2 * f), sizes)
    h = (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(dt)
    y = ops.ragged_dot(h, p["w_down"].astype(dt), sizes)
    copies = jnp.zeros_like(y).at[order].set(y).reshape(-1, k, shape[-1])
    return jnp.einsum("tk,tkd->td", w, copies).astype(dt).reshape(shape)


def plain_block_fns(cfg, ops: PeerOps = JAX_OPS):
    """The peer's blocks, ``(params, x [B, S, D], positions [B, S]) -> [B, S, D]``, named as `block_classes`."""
    eps = cfg.epsilon
    if cfg.family == "dense":
        def dense_block(p, x, positions):
            h = x + plain_attention(cfg, p["attn"], ops.rms(x, p["attn_norm"]["scale"], eps), positions, False, ops)
            m = p["mlp"]
            return h + glu(ops.rms(h, p["mlp_norm"]["scale"], eps), m["gate_up"], m["down"], ops)
        return {"layers": dense_block}

    def mlp(p, h):
        m = ops.rms(h, p["mlp_norm"]["scale"], eps)
        return h + plain_moe(cfg, p["moe"], m, ops) + glu(m, p["shared"]["gate_up"], p["shared"]["down"], ops)

    def gdn_block(p, x, positions):
        return mlp(p, x + plain_gdn(cfg, p["gdn"], ops.rms(x, p["mix_norm"]["scale"], eps), ops))

    def attn_block(p, x, positions):
        return mlp(p, x + plain_attention(cfg, p["attn"], ops.rms(x, p["mix_norm"]["scale"], eps), positions, True,
                                          ops))

    return {"gdn": gdn_block, "attn": attn_block}


def plain_hidden(cfg, remat: str, params, tokens, ops: PeerOps = JAX_OPS):
    """The final-normed hidden states ``[B, S, D]`` bfloat16 of the peer model."""
    x = params["embed"].astype(jnp.bfloat16)[tokens]
    x = _stack(plain_block_fns(cfg, ops), params, x, _positions(tokens), remat, cfg.family)
    return ops.rms(x, params["final_norm"], cfg.epsilon)


def plain_loss(cfg, remat: str, params, tokens, labels, ops: PeerOps = JAX_OPS):
    """The same model and loss built from ``ops``: plain JAX/XLA by default (float32 ``[B, S, V]``
    logits and optax's loss)."""
    x = plain_hidden(cfg, remat, params, tokens, ops)
    return ops.loss(x, params["unembed"].astype(x.dtype), labels)


def tokamax_loss(cfg, remat: str, params, tokens, labels):
    """The model with tokamax's ops (`tokamax_ops`) where tokamax has them."""
    return plain_loss(cfg, remat, params, tokens, labels, tokamax_ops())


LOSSES = {"stellax": stellax_loss, "jax": plain_loss, "tokamax": tokamax_loss}


# -- data ------------------------------------------------------------------------------------------------------
def random_batch(cfg, seed: int, batch: int, seq: int):
    """``(tokens, labels) [B, S]`` int32: a uniform random stream shifted by one (nothing to learn)."""
    stream = jax.random.randint(jax.random.key(seed + 1), (batch, seq + 1), 0, cfg.vocab, jnp.int32)
    return stream[:, :-1], stream[:, 1:]


def learnable_batch(cfg, seed: int, step: int, batch: int, seq: int, noise: float = 0.1):
    """``(tokens, labels) [B, S]`` int32 of a learnable stream: token ``t+1`` is ``perm[token t]``
    (a fixed random permutation of the vocabulary, from ``seed``) except with probability ``noise``,
    where it is uniform. The entropy floor is ``-(1-ε') log(1-ε') - ε' log(ε'/(V-1))`` with
    ``ε' = noise·(V-1)/V``; batch ``step`` draws fresh sequences."""
    perm = jax.random.permutation(jax.random.key(seed + 7), cfg.vocab).astype(jnp.int32)
    key = jax.random.fold_in(jax.random.key(seed + 11), step)
    k0, k1, k2 = jax.random.split(key, 3)
    start = jax.random.randint(k0, (batch,), 0, cfg.vocab, jnp.int32)
    flip = jax.random.bernoulli(k1, noise, (seq, batch))
    rand = jax.random.randint(k2, (seq, batch), 0, cfg.vocab, jnp.int32)

    def next_token(t, xs):
        f, r = xs
        n = jnp.where(f, r, perm[t])
        return n, n

    _, rest = jax.lax.scan(next_token, start, (flip, rand))
    stream = jnp.concatenate([start[None], rest], axis=0).T
    return stream[:, :-1], stream[:, 1:]
