"""`stellax.nn` (Flax NNX layers) against the same math in plain ``jnp``:
each layer on random inputs, the paged KV cache against full attention, MoE
with and without expert parallelism, the linear-attention mixers against
token-by-token recurrences, the flax sharding annotations, bad arguments, and
a tiny decoder trained 20 optax steps with losses equal to a plain-jnp twin
(1e-5 relative, float32)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="pip install 'stellax[nn]'")
optax = pytest.importorskip("optax", reason="pip install 'stellax[nn]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import stellax.nn as snn  # noqa: E402

HI = jax.lax.Precision.HIGHEST


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _x(shape, seed=1):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# -- plain-jnp twins ---------------------------------------------------------------------------
def ref_rms(x, scale, eps=1e-6):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def ref_rope(x, pos, theta=10000.0):
    h = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    ang = pos[..., None].astype(jnp.float32) * inv
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def ref_attention(p, x, *, rope=True, mask=None, cap=None, sinks=None):
    b, t, _ = x.shape
    q, k, v = (jnp.einsum("btd,dnh->btnh", x, p[n], precision=HI) for n in ("q", "k", "v"))
    if rope:
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        q, k = ref_rope(q, pos), ref_rope(k, pos)
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k, precision=HI) / np.sqrt(q.shape[-1])
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    allowed = jnp.tril(jnp.ones((t, t), bool))
    if mask is not None:
        allowed = allowed & mask
    s = jnp.where(allowed, s, -jnp.inf)
    if sinks is not None:
        s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))], -1)
    w = jax.nn.softmax(s, -1)[..., :t]
    o = jnp.einsum("bnts,bsnh->btnh", w, v, precision=HI)
    return jnp.einsum("btnh,nhd->btd", o, p["o"], precision=HI)


def ref_mlp(p, x):
    h = jnp.einsum("...d,dkf->...kf", x, p["gate_up"], precision=HI)
    return jnp.dot(jax.nn.silu(h[..., 0, :]) * h[..., 1, :], p["down"], precision=HI)


def _pure(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


# -- layers ----------------------------------------------------------------------------------------
def test_norms_and_gated_mlp_match_jnp():
    r = nnx.Rngs(0)
    x = _x((2, 5, 32))
    norm = snn.RMSNorm(32, rngs=r)
    norm.scale[...] = jax.random.uniform(jax.random.key(3), (32,)) + 0.5
    assert _rel(norm(x), ref_rms(x, norm.scale[...])) < 1e-6
    ln = snn.LayerNorm(32, rngs=r)
    ln.bias[...] = jnp.linspace(-1, 1, 32)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    assert _rel(ln(x), (x - mean) / jnp.sqrt(var + 1e-6) + ln.bias[...]) < 1e-6
    mlp = snn.GatedMLP(32, 48, rngs=r)
    assert _rel(mlp(x), ref_mlp(_pure(mlp), x)) < 1e-6


def test_attention_gqa_mask_softcap_sinks_match_jnp():
    r = nnx.Rngs(0)
    layer = snn.Attention(32, 4, 2, 8, logits_soft_cap=5.0, use_sinks=True, rngs=r)
    layer.sinks[...] = jnp.array([0.5, -1.0, 2.0, 0.0])
    x = _x((2, 7, 32))
    mask = jax.random.bernoulli(jax.random.key(5), 0.7, (2, 1, 7, 7)) | jnp.eye(7, dtype=bool)
    p = _pure(layer)
    out = nnx.jit(lambda m, x, mask: m(x, mask=mask))(layer, x, mask)
    ref = jax.jit(lambda p, x, mask: ref_attention(p, x, mask=mask, cap=5.0, sinks=p["sinks"]))(p, x, mask)
    assert _rel(out, ref) < 1e-5


def test_attention_output_gate_matches_jnp():
    """``output_gate``: ``o · sigmoid(x W_gate)`` per head before ``W_o`` (Qwen3-Next's gated attention)."""
    layer = snn.Attention(32, 4, 2, 8, output_gate=True, rngs=nnx.Rngs(0))
    x = _x((2, 7, 32))
    p = _pure(layer)
    gate = jax.nn.sigmoid(jnp.einsum("btd,dnh->btnh", x, p["gate"], precision=HI))
    ungated = {k: v for k, v in p.items() if k != "gate"}
    # ref_attention ends with o W_o; gating o first is the same as W_o applied to the gated heads.
    heads = jax.jit(lambda p, x: ref_attention({**p, "o": jnp.eye(32).reshape(4, 8, 32)}, x))(ungated, x)
    ref = jnp.einsum("btnh,nhd->btd", heads.reshape(2, 7, 4, 8) * gate, p["o"], precision=HI)
    assert _rel(nnx.jit(lambda m, x: m(x))(layer, x), ref) < 1e-5
    assert _rel(ref, jax.jit(lambda p, x: ref_attention(p, x))(ungated, x)) > 1e-2   # the gate changes the output


def test_attention_paged_kv_cache_decode_equals_full_attention():
    layer = snn.Attention(32, 4, 2, 8, rngs=nnx.Rngs(0))
    x = _x((2, 9, 32))
    call = nnx.jit(lambda m, x: m(x))
    full = call(layer, x)
    layer.init_cache(batch=2, max_length=16, page_size=4)
    parts = [call(layer, x[:, :5])] + [call(layer, x[:, i:i + 1]) for i in range(5, 9)]  # prefill 5, decode 4
    assert _rel(jnp.concatenate(parts, 1), full) < 1e-5
    assert layer.cache.lengths[...].tolist() == [9, 9]


def _ref_moe(p, x, top_k):
    logits = jnp.dot(x, p["router"], precision=HI)
    probs = jax.nn.softmax(logits, -1)
    w, ids = jax.lax.top_k(probs, top_k)
    w = w / w.sum(-1, keepdims=True)
    y = jnp.zeros_like(x)
    for e in range(p["router"].shape[1]):
        h = jnp.einsum("td,dkf->tkf", x, p["w_gate_up"][e], precision=HI)
        ye = jnp.dot(jax.nn.silu(h[:, 0]) * h[:, 1], p["w_down"][e], precision=HI)
        y = y + (w * (ids == e)).sum(-1, keepdims=True) * ye
    return y


def test_moe_matches_jnp():
    moe = snn.MoE(16, 8, 8, 2, rngs=nnx.Rngs(0))
    x = _x((2, 8, 16))
    out = nnx.jit(lambda m, x: m(x))(moe, x)
    assert _rel(out, jax.jit(_ref_moe, static_argnums=2)(_pure(moe), x.reshape(-1, 16), 2).reshape(x.shape)) < 1e-5


@pytest.mark.slow
def test_moe_expert_parallel_matches_single_device():
    moe = snn.MoE(16, 8, 8, 2, rngs=nnx.Rngs(0))
    x = _x((2, 8, 16))
    out = nnx.jit(lambda m, x: m(x))(moe, x)
    n = min(4, jax.device_count())
    if n < 2:
        pytest.skip("expert parallelism needs >= 2 devices (tests/conftest.py simulates 8 CPU devices)")
    mesh = jax.make_mesh((n,), ("ep",))
    ep = snn.MoE(16, 8, 8, 2, mesh=mesh, axis_name="ep", rngs=nnx.Rngs(0))
    assert _rel(nnx.jit(lambda m, x: m(x))(ep, x), out) < 1e-5
    grad = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))
    g1, g2 = grad(moe, x), grad(ep, x)
    assert _rel(g2.w_gate_up[...], g1.w_gate_up[...]) < 1e-5


def _ref_delta(p, x, per_channel):
    """Token-by-token (gated / Kimi) delta rule with the layer's projections."""
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, p[n], precision=HI) for n in ("q", "k", "v"))
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    a = jnp.tensordot(x, p["a"], 1, precision=HI) + p["dt_bias"]
    A = -jnp.exp(p["A_log"])
    g = (A[:, None] if per_channel else A) * jax.nn.softplus(a)
    beta = jax.nn.sigmoid(jnp.tensordot(x, p["b"], 1, precision=HI))
    b, t, h, kd = q.shape
    S = jnp.zeros((b, h, kd, v.shape[-1]))
    outs = []
    for i in range(t):
        decay = jnp.exp(g[:, i])[..., :, None] if per_channel else jnp.exp(g[:, i])[..., None, None]
        S = S * decay
        u = beta[:, i, :, None] * (v[:, i] - jnp.einsum("bhk,bhkv->bhv", k[:, i], S, precision=HI))
        S = S + k[:, i, :, :, None] * u[:, :, None, :]
        outs.append(jnp.einsum("bhk,bhkv->bhv", q[:, i] / np.sqrt(kd), S, precision=HI))
    o = jnp.stack(outs, 1)
    gate = jnp.einsum("btd,dhv->bthv", x, p["gate"], precision=HI)
    o = ref_rms(o, p["norm"]) * jax.nn.silu(gate)
    return jnp.einsum("bthv,hvd->btd", o, p["o"], precision=HI), S


@pytest.mark.parametrize("cls,per_channel", [(snn.GatedDeltaNet, False), (snn.KimiDeltaAttention, True)])
def test_delta_rule_mixers_match_a_token_loop(cls, per_channel):
    layer = cls(24, 2, 8, rngs=nnx.Rngs(0))
    x = _x((2, 11, 24))
    y, state = nnx.jit(lambda m, x: m(x, return_state=True))(layer, x)
    ref_y, ref_s = jax.jit(_ref_delta, static_argnums=2)(_pure(layer), x, per_channel)
    assert _rel(y, ref_y) < 1e-5 and _rel(state, ref_s) < 1e-5


def _ref_mamba2(p, x, groups):
    b, t, _ = x.shape
    xs, z = (jnp.einsum("btd,dhp->bthp", x, p[n], precision=HI) for n in ("x", "z"))
    h = xs.shape[2]
    B_, C_ = (jnp.repeat(jnp.einsum("btd,dgn->btgn", x, p[n], precision=HI), h // groups, 2) for n in ("B", "C"))
    dt = jax.nn.softplus(jnp.tensordot(x, p["dt"], 1, precision=HI) + p["dt_bias"])
    A = -jnp.exp(p["A_log"])
    S = jnp.zeros((b, h, xs.shape[3], B_.shape[3]))
    outs = []
    for i in range(t):
        S = jnp.exp(dt[:, i] * A)[..., None, None] * S + dt[:, i, :, None, None] * xs[:, i, :, :, None] * \
            B_[:, i, :, None, :]
        outs.append(jnp.einsum("bhpn,bhn->bhp", S, C_[:, i], precision=HI) + p["D"][:, None] * xs[:, i])
    return jnp.einsum("bthp,hpd->btd", jnp.stack(outs, 1) * jax.nn.silu(z), p["o"], precision=HI), S


def test_mamba2_matches_a_token_loop():
    layer = snn.Mamba2(24, 4, 6, 8, num_groups=2, rngs=nnx.Rngs(0))
    x = _x((2, 10, 24))
    y, state = nnx.jit(lambda m, x: m(x, return_state=True))(layer, x)
    ref_y, ref_s = jax.jit(_ref_mamba2, static_argnums=2)(_pure(layer), x, 2)
    assert _rel(y, ref_y) < 1e-5 and _rel(state, ref_s) < 1e-5


# -- conventions and errors ------------------------------------------------------------------------
def test_sharding_annotations_place_parameters_on_the_mesh():
    if jax.device_count() < 2:
        pytest.skip("needs >= 2 devices (tests/conftest.py simulates 8 CPU devices)")
    mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        mlp = snn.GatedMLP(16, 32, sharding={"gate_up": (None, None, "model"), "down": ("model", None)},
                           rngs=nnx.Rngs(0))
    assert mlp.down.get_metadata()["out_sharding"] == ("model", None)
    specs = nnx.get_partition_spec(nnx.state(mlp, nnx.Param))
    assert specs["gate_up"].get_value() == jax.sharding.PartitionSpec(None, None, "model")
    # placing the state by its annotations (flax's recipe) shards the arrays over the mesh axis
    placed = jax.tree.map(lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)),
                          nnx.to_pure_dict(nnx.state(mlp, nnx.Param)), nnx.to_pure_dict(specs))
    assert placed["down"].sharding.shard_shape(placed["down"].shape) == (16, 16)


def test_bad_arguments_name_the_module_and_argument():
    r = nnx.Rngs(0)
    with pytest.raises(ValueError, match=r"Attention: num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        snn.Attention(48, 6, 4, rngs=r)
    with pytest.raises(ValueError, match=r"GatedDeltaNet: num_v_heads \(3\) must be a multiple of num_heads \(2\)"):
        snn.GatedDeltaNet(16, 2, 8, num_v_heads=3, rngs=r)
    with pytest.raises(ValueError, match=r"Mamba2: num_heads \(3\) must be a multiple of num_groups \(2\)"):
        snn.Mamba2(16, 3, 4, 8, num_groups=2, rngs=r)
    with pytest.raises(ValueError, match=r"MoE: top_k \(5\) must be <= num_experts \(4\)"):
        snn.MoE(16, 8, 4, 5, rngs=r)
    with pytest.raises(ValueError, match=r"RMSNorm: sharding names unknown parameters \['weight'\]"):
        snn.RMSNorm(16, sharding={"weight": (None,)}, rngs=r)
    with pytest.raises(ValueError, match=r"Attention: x must be \[B, T, 16\]"):
        snn.Attention(16, 2, rngs=r)(jnp.zeros((1, 3, 8)))


# -- a tiny decoder trained with optax --------------------------------------------------------------
V, D = 32, 32


class Decoder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.norm1 = snn.RMSNorm(D, rngs=rngs)
        self.attn = snn.Attention(D, 4, 2, 8, rngs=rngs)
        self.norm2 = snn.RMSNorm(D, rngs=rngs)
        self.mlp = snn.GatedMLP(D, 64, rngs=rngs)
        self.norm = snn.RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        h = self.embed(ids)
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.head(self.norm(h))


def plain_decoder(p, ids):
    h = p["embed"]["embedding"][ids]
    h = h + ref_attention(p["attn"], ref_rms(h, p["norm1"]["scale"]))
    h = h + ref_mlp(p["mlp"], ref_rms(h, p["norm2"]["scale"]))
    return jnp.dot(ref_rms(h, p["norm"]["scale"]), p["head"]["kernel"], precision=HI)


def _loss(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def test_tiny_decoder_trains_20_steps_like_plain_jnp():
    model = Decoder(nnx.Rngs(0))
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(state)

    def nnx_loss(p, ids):
        nnx.replace_by_pure_dict(state, p)
        return _loss(nnx.merge(graphdef, state, rest)(ids), ids)

    def jnp_loss(p, ids):
        return _loss(plain_decoder(p, ids), ids)

    opt = optax.adam(1e-2)

    def trainer(loss_fn):
        @jax.jit
        def step(p, o, ids):
            loss, g = jax.value_and_grad(loss_fn)(p, ids)
            updates, o = opt.update(g, o, p)
            return optax.apply_updates(p, updates), o, loss
        return step

    batches = jax.random.randint(jax.random.key(7), (20, 2, 12), 0, V)
    runs = []
    for loss_fn in (nnx_loss, jnp_loss):
        p, o, losses, step = params, opt.init(params), [], trainer(loss_fn)
        for ids in batches:
            p, o, loss = step(p, o, ids)
            losses.append(float(loss))
        runs.append(np.array(losses))
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-5)
    assert runs[0][-1] < runs[0][0]  # it trains
