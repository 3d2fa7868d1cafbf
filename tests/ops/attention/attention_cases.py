"""Shared helpers of the attention tests: random operands and a golden comparison
of the forward and every gradient."""

import jax
import jax.numpy as jnp
import numpy as np

import stellax
from stellax.core import use_configs
from stellax.testing import assert_close

OPTIONS = {
    "none": {},
    "causal": {"is_causal": True},
    "window": {"local_window_size": (9, 4)},
    "window_causal": {"local_window_size": (12, None), "is_causal": True},
    "chunk": {"chunk_size": 24},
    "softcap": {"logits_soft_cap": 3.0},
}


def make_inputs(seed, b, t, s, n, kh, h, hv, dtype, *, bias=None, mask=None, sinks=False, segments=False,
                lengths=False):
    keys = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(keys[0], (b, t, n, h)).astype(dtype)
    k = jax.random.normal(keys[1], (b, s, kh, h)).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, kh, hv)).astype(dtype)
    kwargs = {}
    bias_arr = None if bias is None else (0.5 * jax.random.normal(keys[3], bias)).astype(dtype)
    mask_arr = None if mask is None else jax.random.bernoulli(keys[4], 0.85, mask)
    if sinks:
        kwargs["sinks"] = jax.random.normal(keys[5], (n,)).astype(dtype)
    if segments:
        rng = np.random.default_rng(seed)
        kwargs["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), axis=1), jnp.int32)
        kwargs["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, s)), axis=1), jnp.int32)
    if lengths:
        kwargs["query_seq_lengths"] = jnp.asarray(np.maximum(1, t - np.arange(b) * 3), jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray(np.maximum(1, s - np.arange(b) * 5), jnp.int32)
    return (q, k, v, bias_arr, mask_arr), kwargs


def check_against_golden(impl, args, kwargs, *, configs=None, grads=True, dtype=None, repeat=False):
    """Forward (out, lse) and the gradients w.r.t. q, k, v, bias and sinks of a
    random projection of (out, lse) against the float32 golden."""
    q = args[0]
    dtype = q.dtype if dtype is None else dtype
    names = ["q", "k", "v"] + (["bias"] if args[3] is not None else []) + (["sinks"] if "sinks" in kwargs else [])
    float_kwargs = {k: v for k, v in kwargs.items() if k == "sinks"}
    other = {k: v for k, v in kwargs.items() if k != "sinks"}
    out_key, lse_key = jax.random.split(jax.random.PRNGKey(123))

    def loss_fn(implementation):
        def loss(q, k, v, bias, sinks, mask):
            out, lse = stellax.dot_product_attention(
                q, k, v, bias, mask, sinks=sinks, return_residuals=True, implementation=implementation, **other)
            w_out = jax.random.normal(out_key, out.shape)
            w_lse = jax.random.normal(lse_key, lse.shape)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(finite * w_lse), (out, lse)
        return loss

    diff = (0, 1, 2) + ((3,) if args[3] is not None else ()) + ((4,) if "sinks" in kwargs else ())
    operands = (args[0], args[1], args[2], args[3], float_kwargs.get("sinks"), args[4])

    def run(implementation, times=1):
        fn = jax.value_and_grad(loss_fn(implementation), argnums=diff, has_aux=True) if grads else \
            (lambda *a: (loss_fn(implementation)(*a), None))
        fn = jax.jit(fn)
        results = [fn(*operands) for _ in range(times)]
        for again in results[1:]:
            for a, b in zip(jax.tree_util.tree_leaves(results[0]), jax.tree_util.tree_leaves(again)):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), "two runs differ (non-deterministic)"
        return results[0]

    with use_configs(configs or {}):
        with stellax.interpret_mode(impl in ("triton", "mosaic_tpu")):
            (_, (out, lse)), g = run(impl, 2 if repeat else 1)
    (_, (ref_out, ref_lse)), ref_g = _golden_run(run)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_close(out, ref_out, dtype=dtype, name=f"{impl} out")
    finite = np.isfinite(np.asarray(ref_lse))
    assert (np.isneginf(np.asarray(lse)) == ~finite).all(), "lse: -inf rows differ"
    lse_tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], rtol=lse_tol, atol=lse_tol)
    if grads:
        for name, a, b in zip(names, g, ref_g):
            assert_close(a, b, dtype=dtype, gradient=True, name=f"{impl} d{name}")
    return out, g


def _golden_run(run):
    with jax.default_matmul_precision("highest"):
        return run("xla")
