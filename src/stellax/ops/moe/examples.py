"""Built-in calls of the MoE ops: examples for `stellax check` and the tests,
benchmark shapes for `stellax bench moe`, and peer implementations.

One section per op: `ragged_dot`, `ragged_dot_tgmm`, `ragged_dot_backward`,
the quantized `ragged_dot`, `moe_mlp` and `moe_route`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Example
from ..quant import quantize
from .checks import flatten_quantized
from .configs import XlaGroupedMatmulConfig
from .xla import gmm as xla_gmm


def random_array(key, shape, dtype=jnp.float32, *, scale: float = 1.0):
    """Normal random values times ``scale`` in ``dtype``, exact zeros nudged away (the values of
    `stellax.testing.random_array`, which an op family must not import)."""
    x = scale * jax.random.normal(key, shape, jnp.float32)
    return jnp.where(x == 0, jnp.float32(scale * 1e-3 + 1e-3), x).astype(dtype)


def _sizes(values):
    return jnp.asarray(values, jnp.int32)


def _group_sizes_for(m: int, g: int, skew: bool):
    """``g`` group sizes summing to ``m``: balanced, or Zipf-like (group ``i``
    gets ∝ 1/(i+1) of the rows; some groups are empty)."""
    if not skew:
        base = np.full(g, m // g)
        base[: m - base.sum()] += 1
        return _sizes(base)
    weights = 1.0 / np.arange(1, g + 1)
    sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
    sizes[0] += m - sizes.sum()
    return _sizes(sizes)


# -- ragged_dot ---------------------------------------------------------------------------
def forward_examples(dtype):
    """Small `ragged_dot` calls: empty groups, gated, transposed rhs, group offset."""
    k = jax.random.split(jax.random.PRNGKey(5), 8)
    return [
        Example("M=40 K=24 N=40 G=3 empty middle, sum<M", (random_array(k[0], (40, 24), dtype),
                random_array(k[1], (3, 24, 40), dtype), _sizes([13, 0, 20]))),
        Example("gated silu M=33 K=16 N=20 G=4 empty first", (random_array(k[2], (33, 16), dtype),
                random_array(k[3], (4, 16, 2, 20), dtype), _sizes([0, 17, 9, 7])), {"activation": "silu"}),
        Example("transpose_rhs M=24 K=20 N=18 G=2", (random_array(k[4], (24, 20), dtype),
                random_array(k[5], (2, 18, 20), dtype), _sizes([11, 13])), {"transpose_rhs": True}),
        Example("group_offset=2 of 5, M=30 K=16 N=24", (random_array(k[6], (30, 16), dtype),
                random_array(k[7], (2, 16, 24), dtype), _sizes([4, 6, 7, 0, 9])), {"group_offset": _sizes(2)}),
    ]


def forward_benchmarks(platform):
    """MoE expert shapes (balanced and skewed groups); small on a CPU."""
    if platform.backend == "cpu":
        shapes, dtype = [(4096, 512, 512, 16)], jnp.float32
    else:
        shapes, dtype = [(16384, 7168, 2048, 64), (32768, 7168, 2048, 256), (16384, 2048, 7168, 64)], jnp.bfloat16
    out = []
    for i, (m, k, n, g) in enumerate(shapes):
        keys = jax.random.split(jax.random.PRNGKey(100 + i), 2)
        lhs, rhs = random_array(keys[0], (m, k), dtype), random_array(keys[1], (g, k, n), dtype)
        for skew in (False, True):
            label = f"M={m} K={k} N={n} G={g} {'skewed' if skew else 'balanced'}"
            out.append(Example(label, (lhs, rhs, _group_sizes_for(m, g, skew))))
    return out


def _peer_ragged_dot(lhs, rhs, group_sizes, *args, **kwargs):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _peer_dense(lhs, rhs, group_sizes, *args, **kwargs):
    """A dense matmul of the same FLOPs (all rows against one group's weights)."""
    return jnp.dot(lhs, rhs[0], preferred_element_type=jnp.float32).astype(lhs.dtype)


FORWARD_PEERS = {"jax.lax.ragged_dot": _peer_ragged_dot, "dense matmul (same FLOPs)": _peer_dense}


# -- ragged_dot_tgmm ----------------------------------------------------------------------------
def tgmm_examples(dtype):
    """Small `ragged_dot_tgmm` calls: an empty group, ``transpose_lhs`` with a group offset."""
    k = jax.random.split(jax.random.PRNGKey(6), 4)
    return [
        Example("K=20 M=40 N=24 G=3 empty last", (random_array(k[0], (20, 40), dtype),
                random_array(k[1], (40, 24), dtype), _sizes([17, 21, 0]))),
        Example("transpose_lhs M=30 K=16 N=20 G=2 of 4 offset 1", (random_array(k[2], (30, 16), dtype),
                random_array(k[3], (30, 20), dtype), _sizes([3, 12, 0, 9])),
                {"transpose_lhs": True, "group_offset": _sizes(1), "num_local_groups": 2}),
    ]


def tgmm_benchmarks(platform):
    """Weight-gradient shapes of the `forward_benchmarks` experts (``lhs [M, K]``)."""
    if platform.backend == "cpu":
        shapes, dtype = [(4096, 512, 512, 16)], jnp.float32
    else:
        shapes, dtype = [(16384, 7168, 2048, 64), (32768, 2048, 7168, 256)], jnp.bfloat16
    out = []
    for i, (m, k, n, g) in enumerate(shapes):
        keys = jax.random.split(jax.random.PRNGKey(200 + i), 2)
        lhs, rhs = random_array(keys[0], (m, k), dtype), random_array(keys[1], (m, n), dtype)
        for skew in (False, True):
            label = f"M={m} K={k} N={n} G={g} {'skewed' if skew else 'balanced'} (lhs [M, K])"
            out.append(Example(label, (lhs, rhs, _group_sizes_for(m, g, skew)), {"transpose_lhs": True}))
    return out


def _peer_tgmm_ragged_dot_general(lhs, rhs, group_sizes, *args, transpose_lhs=False, **kwargs):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0 if transpose_lhs else 1], [0]), ([], [])),
        lhs_ragged_dimensions=[0 if transpose_lhs else 1], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)


def _peer_tgmm_dense(lhs, rhs, group_sizes, *args, transpose_lhs=False, **kwargs):
    a = lhs.T if transpose_lhs else lhs
    return jnp.dot(a, rhs, preferred_element_type=jnp.float32).astype(lhs.dtype)


TGMM_PEERS = {"jax.lax.ragged_dot_general": _peer_tgmm_ragged_dot_general,
              "dense matmul (same FLOPs)": _peer_tgmm_dense}


# -- ragged_dot_backward ---------------------------------------------------------------------------
def backward_examples(dtype):
    """`ragged_dot_backward` calls: plain, and gated gelu with the forward's pre-activation."""
    out = []
    for i, (m, k, n, sizes, activation, gated) in enumerate(((37, 16, 24, [10, 0, 20], None, False),
                                                             (29, 24, 16, [0, 12, 9], "gelu", True))):
        keys = jax.random.split(jax.random.PRNGKey(20 + i), 3)
        lhs = random_array(keys[0], (m, k), dtype)
        rhs = random_array(keys[1], (len(sizes), k, 2, n) if gated else (len(sizes), k, n), dtype)
        pre = None
        if gated or activation is not None:
            # The forward's pre-activation at HIGHEST, as the golden recomputes it (None is one
            # bfloat16 pass for float32 on a TPU: a 3e-3 error in the activation gradient).
            _, pre = xla_gmm(lhs, rhs, _sizes(sizes), None, transpose_rhs=False, activation=activation,
                             precision=jax.lax.Precision.HIGHEST, out_dtype=lhs.dtype, save_preactivation=True,
                             config=XlaGroupedMatmulConfig(block_m=16))
        dy = random_array(keys[2], (m, n), dtype)
        out.append(Example(f"M={m} K={k} N={n} G={len(sizes)} act={activation} gated={gated}",
                           (dy, lhs, rhs, _sizes(sizes), None, pre), {"activation": activation}))
    return out


# -- quantized ragged_dot -------------------------------------------------------------------------
#: (format, block size) pairs the quantized tests sweep.
EXAMPLE_FORMATS = (("int8", "channel"), ("int8", 32), ("int8_asym", 64), ("int4", 32), ("int4_asym", 64),
                   ("fp8_e4m3", "channel"), ("fp8_e4m3", 128), ("fp8_e5m2", 32), ("mxfp8_e4m3", 32),
                   ("mxfp4", 32), ("nvfp4", 16))


def example_weights(key, g, k, n, fmt, block):
    """Random expert weights ``[g, k, n]`` quantized along K (axis 1) in ``fmt``."""
    w = jax.random.normal(key, (g, k, n), jnp.float32) / np.sqrt(k)
    return quantize(w, fmt, axis=1, block_size=block)


def quantized_examples(dtype):
    """Quantized `ragged_dot` calls over a spread of formats (M=40 K=160 N=40 G=3)."""
    out = []
    for i, (fmt, block) in enumerate(EXAMPLE_FORMATS[::3] + (("nvfp4", 16),)):
        keys = jax.random.split(jax.random.PRNGKey(300 + i), 2)
        lhs = jax.random.normal(keys[0], (40, 160), jnp.float32).astype(dtype)
        rhs = example_weights(keys[1], 3, 160, 40, fmt, block)
        args, kwargs = flatten_quantized(lhs, rhs, jnp.asarray([13, 0, 20], jnp.int32), None, None, None, None)
        out.append(Example(f"{fmt} ({block}) M=40 K=160 N=40 G=3", args, kwargs))
    return out


def quantized_benchmarks(platform):
    """MoE expert shapes with fp8 / int4 / nvfp4 weights (shapes only: `jax.eval_shape`)."""
    cpu = platform.backend == "cpu"
    m, k, n, g = (2048, 512, 512, 8) if cpu else (16384, 7168, 2048, 64)
    dtype = jnp.float32 if cpu else jnp.bfloat16
    out = []
    for fmt, block in (("fp8_e4m3", "channel"), ("fp8_e4m3", 128), ("int4", 128), ("nvfp4", 16)):
        q = jax.eval_shape(lambda a, fmt=fmt, block=block: quantize(a, fmt, axis=1, block_size=block),
                           jax.ShapeDtypeStruct((g, k, n), jnp.float32))
        sizes = np.full(g, m // g)
        args, kwargs = flatten_quantized(jax.ShapeDtypeStruct((m, k), dtype), q, jnp.asarray(sizes, jnp.int32),
                                         None, None, None, None)
        out.append(Example(f"{fmt} ({block}) M={m} K={k} N={n} G={g}", args, kwargs))
    return out


def _peer_unquantized(lhs, rhs_values, *args, rhs_shape, **kwargs):
    """Unquantized ``jax.lax.ragged_dot`` of the same shape (the speed baseline)."""
    sizes = args[3]
    return jax.lax.ragged_dot(lhs, jnp.ones(rhs_shape, lhs.dtype), sizes)


QUANTIZED_PEERS = {"jax.lax.ragged_dot (unquantized)": _peer_unquantized}


# -- moe_mlp ----------------------------------------------------------------------------------------
def mlp_examples(dtype):
    """Small `moe_mlp` layers, dropless and with a capacity factor."""
    keys = jax.random.split(jax.random.PRNGKey(31), 4)
    t, d, f, e = 24, 16, 32, 4
    x = random_array(keys[0], (t, d), dtype)
    logits = random_array(keys[1], (t, e), jnp.float32)
    w_gate_up = random_array(keys[2], (e, d, 2, f), dtype, scale=0.3)
    w_down = random_array(keys[3], (e, f, d), dtype, scale=0.3)
    return [
        Example("T=24 D=16 F=32 E=4 top-2", (x, logits, w_gate_up, w_down), {"top_k": 2}),
        Example("T=24 E=4 top-2 capacity 0.75", (x, logits, w_gate_up, w_down),
                {"top_k": 2, "capacity_factor": 0.75}),
    ]


def mlp_benchmarks(platform):
    """A DeepSeek-V3-sized MoE layer (a small one on a CPU)."""
    if platform.backend == "cpu":
        t, d, f, e, k, dtype = 2048, 256, 512, 16, 2, jnp.float32
    else:
        t, d, f, e, k, dtype = 8192, 7168, 2048, 64, 8, jnp.bfloat16
    keys = jax.random.split(jax.random.PRNGKey(41), 4)
    args = (random_array(keys[0], (t, d), dtype), random_array(keys[1], (t, e), jnp.float32),
            random_array(keys[2], (e, d, 2, f), dtype, scale=0.05), random_array(keys[3], (e, f, d), dtype, scale=0.05))
    return [Example(f"T={t} D={d} F={f} E={e} top-{k}", args, {"top_k": k})]


# -- moe_route ---------------------------------------------------------------------------------------
def route_examples(dtype):
    """Top-k routing: softmax, and sigmoid with a bias and group-limited selection."""
    keys = jax.random.split(jax.random.PRNGKey(11), 3)
    logits = jax.random.normal(keys[0], (37, 16), jnp.float32).astype(dtype)
    bias = (0.1 * jax.random.normal(keys[1], (16,))).astype(jnp.float32)
    return [
        Example("T=37 E=16 top-2 softmax", (logits,), {"top_k": 2}),
        Example("T=37 E=16 top-4 sigmoid bias, 4 groups keep 2", (logits,),
                {"top_k": 4, "scoring": "sigmoid", "bias": bias, "num_groups": 4, "top_k_groups": 2,
                 "routed_scaling": 2.5}),
    ]
