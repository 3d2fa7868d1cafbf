"""`quantized_linear`: a linear layer whose three training GEMMs run on
quantized operands (NVFP4 / MXFP8 recipes, `recipes.QuantRecipe`).

For ``x [..., K]`` (``M`` tokens: the product of the leading dims) and
``w [K, N]``, with ``Q_a(·)`` the quantize step of `stellax.quantize` along
axis ``a`` (the GEMM's contraction axis) and ``D(·)`` its dequantization:

    forward:  y  = D(Q_K(x)) · D(Q_K(w))                         [M, N]
    dgrad:    dx = D(Q_N(dy; SR)) · D(Q_N(wᵀ))                    [M, K]
    wgrad:    dw = D(Q_M(H_M xᵀ)) · D(Q_M(H_M dy; SR))            [K, N]

``H_M`` is the ``b``-point randomized Hadamard transform over blocks of the
token axis (``(xᵀ Hᵀ)(H dy) = xᵀ dy`` in exact arithmetic; both operands use
the same random signs), ``SR`` stochastic rounding of the gradient codes. With
the NVFP4 recipe's 16×16 weight blocks, ``Q_N(wᵀ)`` is not a second
quantization: it is `transpose_qarray` of the forward's ``Q_K(w)`` (same codes,
transposed scales). The gradient is exactly this backward — no other
derivative flows through the quantizers (straight-through); see
`quantized_linear_reference`.

The GEMMs (`GEMMS`, one row per backend): on a GPU the Pallas Triton kernel
`triton_training.dual_quantized_matmul` decodes both operands' codes in registers in
its K loop (emulation where there are no FP4 tensor cores); elsewhere (and with ``implementation="xla"``) the
operands are dequantized to float32 and multiplied by XLA. Both equal
dequantize-then-matmul in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ...core import checks
from ...core.backends import Backend, BackendTable
from . import triton_training
from . import formats as F
from .hadamard import hadamard_reference, random_signs
from .qarray import QArray
from .api import quantize
from .recipes import QuantRecipe, get_recipe
from .reference import dequantize_reference, quantize_reference

IMPLEMENTATIONS = (None, "xla", "triton")


# -- operand helpers -----------------------------------------------------------------


def transpose_qarray(q: QArray, axis: int | None = None) -> QArray:
    """The `QArray` of ``dequantize(q).T`` for a rank-2 ``q``, without
    requantizing: codes transposed (4-bit codes unpacked and repacked along
    the result's ``axis``), scales transposed. ``axis`` (of the result):
    ``None`` keeps the quantized dimension (``1 - q.axis``); square 2-D blocks
    may also take the other one (their blocks do not depend on the axis), which
    is how one 16×16-block weight ``[K, N]`` (along K) becomes ``wᵀ [N, K]``
    along N for the data-gradient GEMM. ``dequantize(transpose_qarray(q)) ==
    dequantize(q).T`` bit for bit."""
    if q.ndim != 2:
        raise ValueError(f"q: expected a rank-2 QArray, got shape {q.shape}")
    new_axis = 1 - q.axis if axis is None else axis % 2
    square = q.block_shape[0] == q.block_shape[1] or tuple(q.block_shape) == tuple(q.shape)
    if new_axis != 1 - q.axis and not square:
        raise ValueError(f"axis: only square 2-D blocks can change the quantized dimension, got block_shape "
                         f"{q.block_shape}")
    fmt = q.spec
    if fmt.packed:
        codes = F.unpack_nibbles(q.values, q.axis, q.shape[q.axis]).T
        values = F.pack_nibbles(codes, new_axis)
    else:
        values = q.values.T
    zp = None if q.zero_points is None else q.zero_points.T
    return QArray(values, q.scales.T, zp, q.tensor_scale, format=q.format, shape=q.shape[::-1],
                  block_shape=q.block_shape[::-1], axis=new_axis, rotation=q.rotation)


def _keys(key, recipe: QuantRecipe):
    """``(dgrad SR key, wgrad SR key, Hadamard signs key)`` from ``key`` (``None`` where unused)."""
    if key is None:
        return None, None, None
    kd, kw, kh = jax.random.split(key, 3)
    if jax.dtypes.issubdtype(kd.dtype, jax.dtypes.prng_key):
        # raw uint32 key data (same random bits): the op metadata encoder takes no typed-key dtypes
        kd, kw, kh = (jax.random.key_data(k) for k in (kd, kw, kh))
    sr = recipe.stochastic_rounding
    signs = recipe.hadamard is not None and recipe.random_signs
    return (kd if sr else None), (kw if sr else None), (kh if signs else None)


def _rotate_arg(recipe: QuantRecipe, key_h):
    if recipe.hadamard is None:
        return None
    return recipe.hadamard if key_h is None else (recipe.hadamard, key_h)


def forward_operands(x2, w, recipe: QuantRecipe):
    """``(Q_K(x) [M, K] along axis 1, Q_K(w) [K, N] along axis 0)``: round-to-nearest-even."""
    xq = quantize(x2, recipe.format, axis=1, block_size=recipe.block)
    return xq, _weight(w, recipe)


def _weight(w, recipe: QuantRecipe):
    return quantize(w, recipe.format, axis=0, block_size=recipe.weight_block)


def dgrad_weight(w, wq, recipe: QuantRecipe):
    """``Q_N(wᵀ) [N, K]`` along axis 0: the forward's ``wq`` transposed (2-D
    blocks, no requantization) or ``w`` quantized again along N (1-D blocks)."""
    if recipe.weight_2d:
        return transpose_qarray(wq, axis=0)
    return quantize(w.T, recipe.format, axis=0, block_size=recipe.weight_block)


def dgrad_operands(dy, w, wq, recipe: QuantRecipe, key_d):
    """``(Q_N(dy; SR) [M, N] along axis 1, Q_N(wᵀ) [N, K] along axis 0)``."""
    dyq = quantize(dy, recipe.format, axis=1, block_size=recipe.block, stochastic_rounding_key=key_d)
    return dyq, dgrad_weight(w, wq, recipe)


def wgrad_operands(x2, dy, recipe: QuantRecipe, key_w, key_h):
    """``(Q_M(H xᵀ) [K, M] along axis 1, Q_M(H dy; SR) [M, N] along axis 0)``."""
    rotate = _rotate_arg(recipe, key_h)
    xtq = quantize(x2.T, recipe.format, axis=1, block_size=recipe.block, rotate=rotate)
    dyq = quantize(dy, recipe.format, axis=0, block_size=recipe.block, stochastic_rounding_key=key_w, rotate=rotate)
    return xtq, dyq


class _XlaGemms:
    """The XLA training GEMMs (the ``"xla"`` row of `GEMMS`): dequantize, one float32 matmul."""

    @staticmethod
    def gemm(a: QArray, b: QArray):
        """``D(a) · D(b)`` in float32 (``a [M, K]``, ``b [K, N]``)."""
        return jnp.matmul(dequantize_reference(a), dequantize_reference(b), precision=jax.lax.Precision.HIGHEST)

    @staticmethod
    def quantize_gemm(x, b: QArray, recipe: QuantRecipe, key=None):
        """`stellax.quantize` of ``x`` along K, then `gemm`."""
        xq = quantize(x, recipe.format, axis=1, block_size=recipe.block, stochastic_rounding_key=key)
        return _XlaGemms.gemm(xq, b)


#: The backends of the training GEMMs: each row's kernels provide ``gemm(a, b)`` and
#: ``quantize_gemm(x, b, recipe, key)``.
GEMMS = BackendTable("quantized_linear", [
    Backend("triton", triton_training, "triton"),
    Backend("xla", _XlaGemms),
])


def _resolve(implementation):
    if implementation is None:
        return "triton" if jax.default_backend() == "gpu" else "xla"
    return implementation


def gemm(a: QArray, b: QArray, implementation=None):
    """float32 ``D(a) · D(b)`` for ``a [M, K]`` quantized along axis 1 and
    ``b [K, N]`` along axis 0 (same format): the Triton kernel with both
    operands' codes decoded in its K loop, or XLA dequantize-then-matmul."""
    return GEMMS.kernels(_resolve(implementation)).gemm(a, b)


def quantize_gemm(x, b: QArray, recipe: QuantRecipe, key=None, implementation=None):
    """float32 ``D(Q_K(x; SR with key)) · D(b)`` for float ``x [M, K]``: on the
    Triton path the quantize of ``x`` runs in the kernel's prologue
    (`triton_training.fused_quantize_matmul`, the noise drawn as
    `stellax.quantize` draws it); on the XLA path `stellax.quantize` then `gemm`."""
    return GEMMS.kernels(_resolve(implementation)).quantize_gemm(x, b, recipe, key)


# -- the custom VJP ------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _qlinear(x2, w, key, recipe, implementation):
    return quantize_gemm(x2, _weight(w, recipe), recipe, None, implementation).astype(x2.dtype)


def _qlinear_fwd(x2, w, key, recipe, implementation):
    wq = _weight(w, recipe)
    y = quantize_gemm(x2, wq, recipe, None, implementation).astype(x2.dtype)
    return y, (x2, w, wq, key)


def _qlinear_bwd(recipe, implementation, res, dy):
    x2, w, wq, key = res
    _require_key(recipe, key)
    key_d, key_w, key_h = _keys(key, recipe)
    dx = quantize_gemm(dy, dgrad_weight(w, wq, recipe), recipe, key_d, implementation)
    xtq, dyq_m = wgrad_operands(x2, dy, recipe, key_w, key_h)
    dw = gemm(xtq, dyq_m, implementation)
    dkey = None if key is None else np.zeros(key.shape, jax.dtypes.float0)
    return dx.astype(x2.dtype), dw.astype(w.dtype), dkey


_qlinear.defvjp(_qlinear_fwd, _qlinear_bwd)


def _bf16_linear(x, w):
    return jnp.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def check_quantized_linear(x, w, recipe, key):
    """Validate ``quantized_linear``'s arguments; returns ``(x, w, recipe)``."""
    x = checks.require_float("x", x)
    w = checks.require_float("w", w)
    recipe = get_recipe(recipe)
    if x.ndim < 1:
        raise ValueError("x: expected shape [..., K], got rank 0")
    if w.ndim != 2:
        raise ValueError(f"w: expected shape [K, N], got {tuple(w.shape)}")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected shape [..., {k}] (K = w.shape[0]), got {tuple(x.shape)}")
    if recipe is None:
        return x, w, recipe
    m = int(np.prod(x.shape[:-1]))
    b, wt = recipe.block, recipe.weight_tile
    if k % b or k % wt:
        raise ValueError(f"x: recipe {recipe.name} quantizes x and w in blocks of {max(b, wt)} along K; K = {k} "
                         f"(x.shape[-1]) is not divisible by {max(b, wt)}")
    if n % b or n % wt:
        raise ValueError(f"w: recipe {recipe.name} quantizes dy and w in blocks of {max(b, wt)} along N; N = {n} "
                         f"(w.shape[1]) is not divisible by {max(b, wt)}")
    tm = recipe.token_multiple
    if m % tm:
        what = f"blocks of {recipe.block}" + (f" and a {recipe.hadamard}-point Hadamard transform"
                                              if recipe.hadamard else "")
        raise ValueError(f"x: recipe {recipe.name} quantizes the weight-gradient operands along the token axis in "
                         f"{what}; the token count M = {m} (the product of x.shape[:-1] = {tuple(x.shape[:-1])}) "
                         f"is not divisible by {tm}")
    return x, w, recipe


def _require_key(recipe: QuantRecipe, key):
    """The backward consumes the key (forward-only calls need none)."""
    if recipe.needs_key and key is None:
        raise ValueError(f"key: recipe {recipe.name} uses stochastic rounding or random Hadamard signs in the "
                         f"backward; pass a JAX PRNG key (a fresh one per step) to differentiate quantized_linear")


def quantized_linear(x, w, recipe="nvfp4", *, key=None, implementation=None):
    """``y = x · w`` whose forward, data-gradient and weight-gradient GEMMs run
    on quantized operands (see the module docstring for the math).

    Args:
      x: ``[..., K]`` float32/bfloat16/float16 activations (``M`` tokens).
      w: ``[K, N]`` float weights (the master copy; quantized every call).
      recipe: ``"nvfp4"``, ``"mxfp8"``, ``None`` / ``"bf16"`` (plain bf16
        matmul, float32 accumulation) or a `QuantRecipe`.
      key: a JAX PRNG key for the stochastic rounding of gradients and the
        Hadamard signs (required to differentiate when the recipe uses either;
        the forward ignores it; the same key gives bit-identical gradients).
        Use a fresh key per step.
      implementation: ``None`` (Triton GEMMs on a GPU, XLA elsewhere, a TPU included: there
        is no ``"mosaic_tpu"`` row in `GEMMS`), ``"xla"`` (dequantize, float32 matmul) or
        ``"triton"`` (Pallas Triton, `triton_training`). No config: the Triton GEMMs take
        `triton_training.default_config`.

    Returns:
      ``[..., N]`` in ``x.dtype``: ``D(Q(x)) · D(Q(w))`` accumulated in float32.

    Raises:
      ValueError: an unknown recipe, ``K``/``N``/``M`` not divisible by the
        recipe's blocks (naming ``x`` or ``w``); a missing ``key`` when
        differentiating a recipe that needs one.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation: expected one of {list(IMPLEMENTATIONS)}, got {implementation!r}")
    x, w, recipe = check_quantized_linear(x, w, recipe, key)
    if recipe is None:
        return _bf16_linear(x, w)
    lead = x.shape[:-1]
    y = _qlinear(x.reshape(-1, x.shape[-1]), w, key, recipe, implementation)
    return y.reshape(*lead, w.shape[1])


# -- the straight-through reference ------------------------------------------------------


def _qdq_reference(a, recipe: QuantRecipe, block_shape, axis, noise=None, signs_block=None, signs=None):
    """Golden quantize → dequantize of ``a`` (optionally Hadamard-rotated along ``axis`` first)."""
    if signs_block is not None:
        moved = jnp.moveaxis(a.astype(jnp.float32), axis, -1)
        moved = hadamard_reference(moved, block=signs_block, signs=signs)
        a = jnp.moveaxis(moved, -1, axis).astype(a.dtype)
    q = quantize_reference(a, recipe.format, block_shape, axis, noise=noise)
    return dequantize_reference(q)


def quantized_linear_reference(x, w, dy, recipe, key=None):
    """The straight-through golden of `quantized_linear`: ``(y, dx, dw)`` in float32.

    Every quantize step is the golden `reference.quantize_reference` followed
    by `reference.dequantize_reference`, the Hadamard transform a dense matrix
    product (`hadamard.hadamard_reference`), the GEMMs float32 matmuls at
    highest precision, and the quantizers pass the gradient through unchanged
    (identity), so ``dx = qdq(dy) · qdq(w)ᵀ`` and ``dw = qdq(H x)ᵀ · qdq(H dy)``.
    Stochastic-rounding noise is ``jax.random.uniform(k, shape)`` with the
    keys `quantized_linear` derives from ``key``.
    """
    recipe = get_recipe(recipe)
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    n = w.shape[1]
    dy = dy.reshape(m, n)
    hi = jax.lax.Precision.HIGHEST
    b, wb = recipe.block, recipe.weight_block
    w_blocks = wb if recipe.weight_2d else (min(wb, k), 1)
    y = jnp.matmul(_qdq_reference(x2, recipe, (1, b), 1), _qdq_reference(w, recipe, w_blocks, 0), precision=hi)
    key_d, key_w, key_h = _keys(key, recipe)
    noise = lambda kk, shape: None if kk is None else jax.random.uniform(kk, shape, jnp.float32)
    if recipe.weight_2d:
        wt = _qdq_reference(w, recipe, w_blocks, 0).T
    else:
        wt = _qdq_reference(w.T, recipe, (wb, 1), 0)
    dx = jnp.matmul(_qdq_reference(dy, recipe, (1, b), 1, noise(key_d, (m, n))), wt, precision=hi)
    hb = recipe.hadamard
    signs = None if key_h is None else random_signs(key_h, hb)
    xt = _qdq_reference(x2.T, recipe, (1, b), 1, signs_block=hb, signs=signs)
    dyt = _qdq_reference(dy, recipe, (b, 1), 0, noise(key_w, (m, n)), signs_block=hb, signs=signs)
    dw = jnp.matmul(xt, dyt, precision=hi)
    return y.reshape(*x.shape[:-1], n), dx.reshape(x.shape), dw


__all__ = ["check_quantized_linear", "dgrad_operands", "dgrad_weight", "quantize_gemm", "forward_operands", "gemm", "quantized_linear",
           "quantized_linear_reference", "transpose_qarray", "wgrad_operands"]
