"""Public grouped-matmul API: `ragged_dot`, `ragged_dot_general`, `ragged_dot_tgmm`
and the backward op, with the contract of ``jax.lax.ragged_dot``.

Three registered ops:

* ``ragged_dot`` — ``lhs [M, K]`` (rows sorted by group) times one of
  ``rhs [G, K, N]`` per group (or ``[G, N, K]`` with ``transpose_rhs``, the
  dlhs layout), optional fused activation and fused gate/up
  (``rhs [G, K, 2, N]`` → ``act(gate) * up``);
* ``ragged_dot_tgmm`` — the ragged dimension contracted:
  ``lhs [K, M]`` (or ``[M, K]``), ``rhs [M, N]`` → ``[G, K, N]`` (drhs);
* ``ragged_dot_backward`` — ``(dlhs, drhs)`` of ``ragged_dot``: the activation
  gradient in XLA, ``dlhs`` by ``ragged_dot`` with the transposed weights and
  ``drhs`` by ``ragged_dot_tgmm`` (each dispatched as an op with its own
  configs), wired in with ``jax.custom_vjp``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Example, Implementation, Op, backward_implementation, checks, register
from . import triton as triton_kernels
from . import xla as xla_kernels
from .activations import activation_grad, check_activation
from .checks import (check_group_offset, check_group_sizes, check_group_values, check_groups, check_out_dtype,
                     check_precision, concrete)
from .configs import (GroupedMatmulConfig, XlaGroupedMatmulConfig, gmm_dims, gmm_heuristic, gmm_space,
                      tgmm_dims, tgmm_heuristic, tgmm_space, gmm_xla_heuristic, tgmm_xla_heuristic,
                      xla_space)
from .reference import ragged_dot_backward_reference, ragged_dot_reference, ragged_dot_tgmm_reference

FAMILY = "moe"


# -- argument checks ---------------------------------------------------------------
def _check_rhs(lhs, rhs, transpose_rhs: bool):
    checks.require_same_dtype("rhs", rhs, "lhs", lhs)
    k = lhs.shape[1]
    if transpose_rhs:
        checks.require_ndim("rhs", rhs, 3)
        checks.require_shape("rhs", rhs, (None, None, k), "G, N, lhs.shape[1] (transpose_rhs)")
    else:
        checks.require_ndim("rhs", rhs, (3, 4))
        if rhs.ndim == 3:
            checks.require_shape("rhs", rhs, (None, k, None), "G, lhs.shape[1], N")
        else:
            checks.require_shape("rhs", rhs, (None, k, 2, None), "G, lhs.shape[1], 2, N (gated)")


def _check_ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                      activation=None, transpose_rhs=False) -> Call:
    lhs = checks.require_float("lhs", lhs)
    checks.require_ndim("lhs", lhs, 2)
    rhs = checks.require_float("rhs", rhs)
    if not isinstance(transpose_rhs, bool):
        raise TypeError(f"transpose_rhs: expected a bool, got {type(transpose_rhs).__name__}")
    _check_rhs(lhs, rhs, transpose_rhs)
    num_local = rhs.shape[0]
    group_sizes, group_offset = check_groups(group_sizes, group_offset, num_local, lhs.shape[0], "lhs.shape[0]")
    return Call(
        {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes, "group_offset": group_offset},
        {"precision": check_precision(precision),
         "out_dtype": check_out_dtype(preferred_element_type, lhs.dtype),
         "activation": check_activation(activation), "transpose_rhs": transpose_rhs},
    )


def _check_tgmm(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                num_local_groups=None, transpose_lhs=False) -> Call:
    lhs = checks.require_float("lhs", lhs)
    checks.require_ndim("lhs", lhs, 2)
    rhs = checks.require_float("rhs", rhs)
    checks.require_ndim("rhs", rhs, 2)
    checks.require_same_dtype("rhs", rhs, "lhs", lhs)
    if not isinstance(transpose_lhs, bool):
        raise TypeError(f"transpose_lhs: expected a bool, got {type(transpose_lhs).__name__}")
    m = lhs.shape[0] if transpose_lhs else lhs.shape[1]
    what = "lhs.shape[0] (transpose_lhs)" if transpose_lhs else "lhs.shape[1]"
    checks.require_shape("rhs", rhs, (m, None), f"{what}, N")
    group_offset = check_group_offset(group_offset)
    group_sizes = check_group_sizes(group_sizes, None)
    if num_local_groups is None:
        if group_offset is not None:
            raise ValueError("num_local_groups: required with group_offset (the number of groups this shard holds)")
        num_local_groups = group_sizes.shape[0]
    if isinstance(num_local_groups, bool) or not isinstance(num_local_groups, (int, np.integer)):
        raise TypeError(f"num_local_groups: expected an int, got {type(num_local_groups).__name__}")
    if not 1 <= num_local_groups <= group_sizes.shape[0]:
        raise ValueError(f"num_local_groups: expected a value in [1, {group_sizes.shape[0]}] (len(group_sizes)), "
                         f"got {num_local_groups}")
    if group_offset is None and num_local_groups != group_sizes.shape[0]:
        raise ValueError(f"num_local_groups: expected len(group_sizes) = {group_sizes.shape[0]} without "
                         f"group_offset, got {num_local_groups}")
    check_group_values(group_sizes, group_offset, int(num_local_groups), m, what)
    return Call(
        {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes, "group_offset": group_offset},
        {"precision": check_precision(precision), "out_dtype": check_out_dtype(preferred_element_type, lhs.dtype),
         "num_local_groups": int(num_local_groups), "transpose_lhs": transpose_lhs},
    )


def _check_backward(dy, lhs, rhs, group_sizes, group_offset=None, preactivation=None, *, activation=None,
                    transpose_rhs=False, precision=None) -> Call:
    call = _check_ragged_dot(lhs, rhs, group_sizes, precision, None, group_offset, activation=activation,
                             transpose_rhs=transpose_rhs)
    m, _, n_total, _, gated = gmm_dims(call)
    n_out = n_total // 2 if gated else n_total
    dy = checks.require_float("dy", dy)
    checks.require_shape("dy", dy, (m, n_out), "lhs.shape[0], N")
    needs_pre = gated or activation is not None
    if needs_pre:
        if preactivation is None:
            raise ValueError("preactivation: required with an activation or gated rhs (the forward's saved "
                             "pre-activation)")
        checks.require_shape("preactivation", preactivation, (m, 2, n_out) if gated else (m, n_out))
    return Call({**call.arrays, "dy": dy, "preactivation": preactivation if needs_pre else None},
                dict(call.options))


# -- cost models -----------------------------------------------------------------------
def _local_rows(call: Call, m: int, num_local: int) -> int:
    """Rows the call computes: exact for concrete group sizes, else ``m``."""
    sizes = concrete(call.group_sizes)
    if sizes is None:
        return m
    ends = np.minimum(np.cumsum(np.maximum(sizes.astype(np.int64), 0)), m)
    starts = np.concatenate([[0], ends[:-1]])
    offset = concrete(call.group_offset)
    lo = 0 if offset is None else int(offset)
    return int((ends[lo:lo + num_local] - starts[lo:lo + num_local]).sum())


def _gmm_flops(call: Call) -> float:
    m, k, n_total, g, gated = gmm_dims(call)
    rows = _local_rows(call, m, g)
    return 2.0 * rows * k * n_total + (rows * n_total if call.activation is not None or gated else 0)


def _gmm_bytes(call: Call) -> float:
    m, k, n_total, g, gated = gmm_dims(call)
    size = np.dtype(call.lhs.dtype).itemsize
    return float(m * k * size + g * k * n_total * size + m * (n_total // 2 if gated else n_total)
                 * np.dtype(call.out_dtype).itemsize)


def _tgmm_flops(call: Call) -> float:
    m, k, n, g = tgmm_dims(call)
    return 2.0 * _local_rows(call, m, g) * k * n


def _tgmm_bytes(call: Call) -> float:
    m, k, n, g = tgmm_dims(call)
    size = np.dtype(call.lhs.dtype).itemsize
    return float(m * (k + n) * size + g * k * n * np.dtype(call.out_dtype).itemsize)


# -- the forward op ----------------------------------------------------------------------
def _kernel_options(name: str, config):
    return {"block_m": config.block_m} if name == "xla" else {"config": config}


def _kernels(name: str):
    return xla_kernels if name == "xla" else triton_kernels


def _forward_runner(name: str):
    def run(call: Call, config):
        kernels, kernel_opts = _kernels(name), _kernel_options(name, config)
        options = dict(transpose_rhs=call.transpose_rhs, activation=call.activation, precision=call.precision,
                       out_dtype=call.out_dtype, **kernel_opts)
        gated = call.rhs.ndim == 4
        save = gated or call.activation is not None

        @jax.custom_vjp
        def grouped(lhs, rhs, group_sizes, group_offset):
            return kernels.gmm(lhs, rhs, group_sizes, group_offset, save_preactivation=False, **options)[0]

        def forward(lhs, rhs, group_sizes, group_offset):
            out, pre = kernels.gmm(lhs, rhs, group_sizes, group_offset, save_preactivation=save, **options)
            return out, (lhs, rhs, group_sizes, group_offset, pre)

        def backward(residuals, dy):
            lhs, rhs, group_sizes, group_offset, pre = residuals
            dlhs, drhs = ragged_dot_backward_op(
                dy, lhs, rhs, group_sizes, group_offset, pre, activation=call.activation,
                transpose_rhs=call.transpose_rhs, precision=call.precision,
                implementation=backward_implementation(ragged_dot_backward_op, name))
            return dlhs, drhs, None, None

        grouped.defvjp(forward, backward)
        return grouped(call.lhs, call.rhs, call.group_sizes, call.group_offset)
    return run


def _tgmm_runner(name: str):
    def run(call: Call, config):
        kernels, kernel_opts = _kernels(name), _kernel_options(name, config)
        transpose_lhs = call.transpose_lhs
        options = dict(num_local=call.num_local_groups, transpose_lhs=transpose_lhs, precision=call.precision,
                       out_dtype=call.out_dtype, **kernel_opts)

        @jax.custom_vjp
        def tgmm(lhs, rhs, group_sizes, group_offset):
            return kernels.tgmm(lhs, rhs, group_sizes, group_offset, **options)

        def forward(lhs, rhs, group_sizes, group_offset):
            return tgmm(lhs, rhs, group_sizes, group_offset), (lhs, rhs, group_sizes, group_offset)

        def backward(residuals, dout):
            # out[g] = A[rows]^T B[rows] with A [M, K] (lhs or lhs^T), B = rhs [M, N]:
            #   dA = B @ dout[g]^T (transposed-rhs ragged_dot), dB = A @ dout[g].
            lhs, rhs, group_sizes, group_offset = residuals
            rows_lhs = lhs if transpose_lhs else lhs.T
            dout = dout.astype(lhs.dtype)
            impl = backward_implementation(ragged_dot_op, name)
            da = ragged_dot_op(rhs, dout, group_sizes, call.precision, lhs.dtype, group_offset,
                               transpose_rhs=True, implementation=impl)
            db = ragged_dot_op(rows_lhs, dout, group_sizes, call.precision, rhs.dtype, group_offset,
                               implementation=impl)
            return (da if transpose_lhs else da.T), db, None, None

        tgmm.defvjp(forward, backward)
        return tgmm(call.lhs, call.rhs, call.group_sizes, call.group_offset)
    return run


def _backward_runner(name: str):
    def run(call: Call, config):
        del config
        lhs, rhs = call.lhs, call.rhs
        gated = rhs.ndim == 4
        m = lhs.shape[0]
        if call.preactivation is None:
            dz = call.dy
        else:
            dz = activation_grad(call.activation, call.dy, call.preactivation, gated).reshape(m, -1)
        dz = dz.astype(lhs.dtype)
        impl = (name,)
        sizes, offset, precision = call.group_sizes, call.group_offset, call.precision
        num_local = rhs.shape[0]
        if call.transpose_rhs:  # y = x @ rhs[g]^T, rhs [G, N, K]
            dlhs = ragged_dot_op(dz, rhs, sizes, precision, lhs.dtype, offset, implementation=impl)
            drhs = ragged_dot_tgmm_op(dz, lhs, sizes, precision, rhs.dtype, offset, num_local_groups=num_local,
                                      transpose_lhs=True, implementation=impl)
            return dlhs, drhs
        weights = rhs.reshape(num_local, rhs.shape[1], -1)  # [G, K, N] (gate/up flattened to 2N)
        dlhs = ragged_dot_op(dz, weights, sizes, precision, lhs.dtype, offset, transpose_rhs=True,
                             implementation=impl)
        drhs = ragged_dot_tgmm_op(lhs, dz, sizes, precision, rhs.dtype, offset, num_local_groups=num_local,
                                  transpose_lhs=True, implementation=impl)
        return dlhs, drhs.reshape(rhs.shape)
    return run


# -- examples, benchmarks, peers ----------------------------------------------------------
def _random(key, shape, dtype):
    from ...testing import random_array
    return random_array(key, shape, dtype)


def _sizes(values):
    return jnp.asarray(values, jnp.int32)


def _forward_examples(dtype):
    k = jax.random.split(jax.random.PRNGKey(5), 8)
    return [
        Example("M=40 K=24 N=40 G=3 empty middle, sum<M", (_random(k[0], (40, 24), dtype),
                _random(k[1], (3, 24, 40), dtype), _sizes([13, 0, 20]))),
        Example("gated silu M=33 K=16 N=20 G=4 empty first", (_random(k[2], (33, 16), dtype),
                _random(k[3], (4, 16, 2, 20), dtype), _sizes([0, 17, 9, 7])), {"activation": "silu"}),
        Example("transpose_rhs M=24 K=20 N=18 G=2", (_random(k[4], (24, 20), dtype),
                _random(k[5], (2, 18, 20), dtype), _sizes([11, 13])), {"transpose_rhs": True}),
        Example("group_offset=2 of 5, M=30 K=16 N=24", (_random(k[6], (30, 16), dtype),
                _random(k[7], (2, 16, 24), dtype), _sizes([4, 6, 7, 0, 9])), {"group_offset": _sizes(2)}),
    ]


def _tgmm_examples(dtype):
    k = jax.random.split(jax.random.PRNGKey(6), 4)
    return [
        Example("K=20 M=40 N=24 G=3 empty last", (_random(k[0], (20, 40), dtype), _random(k[1], (40, 24), dtype),
                _sizes([17, 21, 0]))),
        Example("transpose_lhs M=30 K=16 N=20 G=2 of 4 offset 1", (_random(k[2], (30, 16), dtype),
                _random(k[3], (30, 20), dtype), _sizes([3, 12, 0, 9])),
                {"transpose_lhs": True, "group_offset": _sizes(1), "num_local_groups": 2}),
    ]


def _backward_examples(dtype):
    from .xla import gmm
    out = []
    for i, (m, k, n, sizes, activation, gated) in enumerate(((37, 16, 24, [10, 0, 20], None, False),
                                                             (29, 24, 16, [0, 12, 9], "gelu", True))):
        keys = jax.random.split(jax.random.PRNGKey(20 + i), 3)
        lhs = _random(keys[0], (m, k), dtype)
        rhs = _random(keys[1], (len(sizes), k, 2, n) if gated else (len(sizes), k, n), dtype)
        pre = None
        if gated or activation is not None:
            _, pre = gmm(lhs, rhs, _sizes(sizes), None, transpose_rhs=False, activation=activation, precision=None,
                         out_dtype=lhs.dtype, save_preactivation=True, block_m=16)
        dy = _random(keys[2], (m, n), dtype)
        out.append(Example(f"M={m} K={k} N={n} G={len(sizes)} act={activation} gated={gated}",
                           (dy, lhs, rhs, _sizes(sizes), None, pre), {"activation": activation}))
    return out


def _group_sizes_for(m: int, g: int, skew: bool):
    if not skew:
        base = np.full(g, m // g)
        base[: m - base.sum()] += 1
        return _sizes(base)
    # Zipf-like: group i gets ∝ 1/(i+1) of the rows; some groups are empty.
    weights = 1.0 / np.arange(1, g + 1)
    sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
    sizes[0] += m - sizes.sum()
    return _sizes(sizes)


def _forward_benchmarks(platform):
    if platform.backend == "cpu":
        shapes, dtype = [(4096, 512, 512, 16)], jnp.float32
    else:
        shapes, dtype = [(16384, 7168, 2048, 64), (32768, 7168, 2048, 256), (16384, 2048, 7168, 64)], jnp.bfloat16
    out = []
    for i, (m, k, n, g) in enumerate(shapes):
        keys = jax.random.split(jax.random.PRNGKey(100 + i), 2)
        lhs, rhs = _random(keys[0], (m, k), dtype), _random(keys[1], (g, k, n), dtype)
        for skew in (False, True):
            label = f"M={m} K={k} N={n} G={g} {'skewed' if skew else 'balanced'}"
            out.append(Example(label, (lhs, rhs, _group_sizes_for(m, g, skew))))
    return out


def _tgmm_benchmarks(platform):
    if platform.backend == "cpu":
        shapes, dtype = [(4096, 512, 512, 16)], jnp.float32
    else:
        shapes, dtype = [(16384, 7168, 2048, 64), (32768, 2048, 7168, 256)], jnp.bfloat16
    out = []
    for i, (m, k, n, g) in enumerate(shapes):
        keys = jax.random.split(jax.random.PRNGKey(200 + i), 2)
        lhs, rhs = _random(keys[0], (m, k), dtype), _random(keys[1], (m, n), dtype)
        for skew in (False, True):
            label = f"M={m} K={k} N={n} G={g} {'skewed' if skew else 'balanced'} (lhs [M, K])"
            out.append(Example(label, (lhs, rhs, _group_sizes_for(m, g, skew)), {"transpose_lhs": True}))
    return out


def _peer_ragged_dot(lhs, rhs, group_sizes, *args, **kwargs):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def _peer_dense(lhs, rhs, group_sizes, *args, **kwargs):
    """A dense matmul of the same FLOPs (all rows against one group's weights)."""
    return jnp.dot(lhs, rhs[0], preferred_element_type=jnp.float32).astype(lhs.dtype)


def _peer_tgmm_ragged_dot_general(lhs, rhs, group_sizes, *args, transpose_lhs=False, **kwargs):
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0 if transpose_lhs else 1], [0]), ([], [])),
        lhs_ragged_dimensions=[0 if transpose_lhs else 1], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)


def _peer_tgmm_dense(lhs, rhs, group_sizes, *args, transpose_lhs=False, **kwargs):
    a = lhs.T if transpose_lhs else lhs
    return jnp.dot(a, rhs, preferred_element_type=jnp.float32).astype(lhs.dtype)


# -- registration ---------------------------------------------------------------------------
def _triton_requirements(call: Call) -> str | None:
    if np.dtype(call.lhs.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"the Triton grouped matmul needs float32/bfloat16/float16 operands, got {np.dtype(call.lhs.dtype).name}"
    return None


def _implementations(runner, heuristic, space, xla_heuristic):
    return [
        Implementation("triton", runner("triton"), backend="triton", config_type=GroupedMatmulConfig,
                       heuristic=heuristic, space=space, requirements=_triton_requirements),
        Implementation("xla", runner("xla"), config_type=XlaGroupedMatmulConfig, heuristic=xla_heuristic,
                       space=xla_space),
    ]


ragged_dot_tgmm_op = register(Op(
    "ragged_dot_tgmm", family=FAMILY, check=_check_tgmm, reference=ragged_dot_tgmm_reference,
    implementations=_implementations(_tgmm_runner, tgmm_heuristic, tgmm_space, tgmm_xla_heuristic),
    flops=_tgmm_flops, bytes_accessed=_tgmm_bytes, examples=_tgmm_examples, benchmarks=_tgmm_benchmarks,
    peers={"jax.lax.ragged_dot_general": _peer_tgmm_ragged_dot_general,
           "dense matmul (same FLOPs)": _peer_tgmm_dense},
    differentiable=("lhs", "rhs"),
))

ragged_dot_backward_op = register(Op(
    "ragged_dot_backward", family=FAMILY, check=_check_backward, reference=ragged_dot_backward_reference,
    implementations=[Implementation("triton", _backward_runner("triton"), backend="triton",
                                    requirements=_triton_requirements),
                     Implementation("xla", _backward_runner("xla"))],
    flops=lambda call: 2 * _gmm_flops(call), bytes_accessed=lambda call: 2 * _gmm_bytes(call),
    examples=_backward_examples,
))

ragged_dot_op = register(Op(
    "ragged_dot", family=FAMILY, check=_check_ragged_dot, reference=ragged_dot_reference,
    implementations=_implementations(_forward_runner, gmm_heuristic, gmm_space, gmm_xla_heuristic),
    flops=_gmm_flops, bytes_accessed=_gmm_bytes, examples=_forward_examples, benchmarks=_forward_benchmarks,
    peers={"jax.lax.ragged_dot": _peer_ragged_dot, "dense matmul (same FLOPs)": _peer_dense},
    differentiable=("lhs", "rhs"),
))


# -- public functions ------------------------------------------------------------------------
def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
               activation=None, implementation=None, config=None):
    """Grouped matmul with the contract of ``jax.lax.ragged_dot``.

    Args:
      lhs: ``[M, K]`` float32/bfloat16/float16, rows sorted by group.
      rhs: ``[G, K, N]`` (one matrix per group), or ``[G, K, 2, N]`` for the
        fused gate/up projection: the result is ``act(lhs @ gate) * (lhs @ up)``.
      group_sizes: ``[G_total]`` integers; group ``g`` owns the next
        ``group_sizes[g]`` rows. Rows past ``sum(group_sizes)`` give zeros.
        Eagerly, negative sizes or ``sum > M`` raise; under ``jit`` sizes are
        clamped (negative → 0, a group running past row M is cut at M).
      precision: as for ``jax.lax.dot`` (``None``/``"highest"``/...); ``None``
        with float32 operands means full float32 dots (``HIGHEST``, not TF32).
      preferred_element_type: output dtype (default: ``lhs.dtype``);
        accumulation is always float32.
      group_offset: an int (or int array of shape ``()``/``(1,)``) for
        expert-sharded weights: ``rhs`` holds groups ``[offset, offset + G)``
        of ``group_sizes`` (``G = rhs.shape[0]``, the local group count);
        rows of the other groups give zeros.
      activation: ``None``, ``"silu"``, ``"gelu"``, ``"gelu_tanh"``,
        ``"relu"``, ``"sigmoid"`` or a callable, applied to the product
        (to the gate half for a gated rhs). Callables are applied by XLA after
        the Triton kernel, names are fused into it.
      implementation: ``None`` (Triton on GPUs, else XLA), ``"triton"``,
        ``"xla"`` or a sequence tried in order.
      config: a `GroupedMatmulConfig` (Triton) or `XlaGroupedMatmulConfig`.

    Quantized weights: ``rhs`` may be a `stellax.QArray` ``[G, K, N]``
    quantized along axis 1 (K) in int8/int8_asym/int4/int4_asym/fp8_e4m3/
    fp8_e5m2/mxfp8_*/mxfp4/nvfp4 (no gated rhs); decoding is fused into the
    Triton kernel's K loop, gradients flow to ``lhs`` only (the weights are
    frozen). See `stellax.ops.moe.quantized` and docs/moe.md.

    Returns:
      ``[M, N]`` in ``preferred_element_type``.
    """
    from ..quant.qarray import QArray
    if isinstance(rhs, QArray):
        from .quantized import ragged_dot_quantized
        return ragged_dot_quantized(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                    activation=activation, implementation=implementation, config=config)
    return ragged_dot_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                         activation=activation, implementation=implementation, config=config)


def ragged_dot_tgmm(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                    num_local_groups=None, transpose_lhs=False, implementation=None, config=None):
    """``out[g] = lhs[:, rows of g] @ rhs[rows of g, :]`` → ``[G, K, N]``.

    ``lhs [K, M]`` (or ``[M, K]`` with ``transpose_lhs``), ``rhs [M, N]``; the
    weight gradient of `ragged_dot`. With ``group_offset`` only groups
    ``[offset, offset + num_local_groups)`` are computed. An empty group gives
    zeros."""
    return ragged_dot_tgmm_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                              num_local_groups=num_local_groups, transpose_lhs=transpose_lhs,
                              implementation=implementation, config=config)


_LAYOUTS = {
    # (lhs contracting, rhs contracting, lhs ragged, rhs group) -> layout
    ((1,), (1,), (0,), (0,)): "forward",
    ((1,), (2,), (0,), (0,)): "transpose_rhs",
    ((1,), (0,), (1,), ()): "tgmm",
    ((0,), (0,), (0,), ()): "tgmm_transpose_lhs",
}


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, *, num_local_groups=None,
                       implementation=None, config=None):
    """``jax.lax.ragged_dot_general`` for the layouts training needs.

    Supported ``ragged_dot_dimension_numbers`` (``jax.lax.RaggedDotDimensionNumbers``,
    no batch dimensions):

    * forward: ``lhs [M, K]``, ``rhs [G, K, N]`` → ``[M, N]``
      (contracting ``([1], [1])``, lhs ragged ``[0]``, rhs group ``[0]``);
    * transposed rhs (dlhs): ``rhs [G, N, K]`` (contracting ``([1], [2])``);
    * ragged contraction (tgmm, drhs): ``lhs [K, M]``, ``rhs [M, N]`` →
      ``[G, K, N]`` (contracting ``([1], [0])``, lhs ragged ``[1]``, no rhs
      group), or ``lhs [M, K]`` (contracting ``([0], [0])``, lhs ragged ``[0]``).
    """
    dims = ragged_dot_dimension_numbers
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    key = (tuple(lc), tuple(rc), tuple(dims.lhs_ragged_dimensions), tuple(dims.rhs_group_dimensions))
    layout = _LAYOUTS.get(key) if not lb and not rb and np.ndim(lhs) == 2 else None
    if layout is None:
        raise ValueError(
            f"ragged_dot_dimension_numbers: expected one of the layouts forward (([1],[1]) ragged [0] group [0]), "
            f"transposed rhs (([1],[2]) ragged [0] group [0]) or tgmm (([1],[0]) ragged [1] / ([0],[0]) ragged [0], "
            f"no group) without batch dimensions, got {dims}")
    from ..quant.qarray import QArray
    if isinstance(rhs, QArray):
        if layout != "forward":
            raise ValueError(f"rhs: a QArray rhs supports only the forward layout (([1],[1]) ragged [0] group [0]), "
                             f"got the {layout} layout")
        from .quantized import ragged_dot_quantized
        return ragged_dot_quantized(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                                    implementation=implementation, config=config)
    if layout in ("forward", "transpose_rhs"):
        if num_local_groups is not None and np.ndim(rhs) >= 1 and num_local_groups != rhs.shape[0]:
            raise ValueError(f"num_local_groups: expected rhs.shape[0] = {rhs.shape[0]}, got {num_local_groups}")
        return ragged_dot_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                             transpose_rhs=layout == "transpose_rhs", implementation=implementation, config=config)
    return ragged_dot_tgmm_op(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset,
                              num_local_groups=num_local_groups, transpose_lhs=layout == "tgmm_transpose_lhs",
                              implementation=implementation, config=config)
