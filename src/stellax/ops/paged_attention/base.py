"""What the three serving ops share: argument checks of the page pools,
windows, scales and sinks; the cost-model pieces (live tokens, bytes per
cached token); and `serving_op`, the op constructor wiring the Triton
kernel and the XLA path of one op."""

from __future__ import annotations

import math

import numpy as np

from ...core.precision import resolve_precision
from ...core import Call, Implementation, Op, checks, register
from ...core.pallas import nbytes
from .quant_cache import QuantizedPages


# -- argument checks -------------------------------------------------------------------
def check_pool(name: str, pages, ranks=(4,)):
    """A page pool (float array or `QuantizedPages`) of one of the ``ranks``; raises naming ``name``."""
    if isinstance(pages, QuantizedPages):
        if pages.ndim not in ranks:
            raise ValueError(f"{name}: expected a rank {ranks[0]} pool, got a quantized pool of shape {pages.shape}")
        return pages
    checks.require_float(name, pages)
    return checks.require_ndim(name, pages, ranks)


def positive_float_or_none(name, value):
    """``None`` or a float > 0 (``name`` in the error)."""
    return None if value is None else checks.require_positive_float(name, value)


def window_left(local_window_size):
    """``None | int | (left, right)`` → ``left`` (``right`` beyond 0 is meaningless
    with causal queries and must be 0 or None)."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size: expected an int or a (left, right) pair, got {local_window_size!r}")
        left, right = local_window_size
        if right not in (None, 0):
            raise ValueError(f"local_window_size: the right window must be 0 or None for causal paged "
                             f"attention, got {right!r}")
        if left is None:
            return None
        local_window_size = left
    if isinstance(local_window_size, bool) or not isinstance(local_window_size, (int, np.integer)):
        raise TypeError(f"local_window_size: expected an int >= 0, got {type(local_window_size).__name__}")
    if local_window_size < 0:
        raise ValueError(f"local_window_size: expected an int >= 0, got {local_window_size}")
    return int(local_window_size)


def logit_scale(scale, head_dim: int):
    """The logit scale: ``scale`` as a float, or ``1/sqrt(head_dim)`` for ``None``."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    return float(scale)


def int_array(name: str, value, shape):
    """An integer array of ``shape`` (``None`` entries: any size)."""
    checks.require_int(name, value)
    return checks.require_shape(name, value, shape)


def check_windows(k_pages, v_pages, rows: int, what: str):
    """Full-precision windows of quantized pools: the same sink/recent sizes
    for keys and values, and at least ``rows`` sequence rows (``what`` says why)."""
    specs = [p.spec for p in (k_pages, v_pages) if isinstance(p, QuantizedPages) and p.window is not None]
    if len(specs) == 2 and (specs[0].sink_tokens, specs[0].recent_tokens) != (specs[1].sink_tokens,
                                                                               specs[1].recent_tokens):
        raise ValueError(f"v_pages: sink/recent windows ({specs[1].sink_tokens}, {specs[1].recent_tokens}) must "
                         f"match k_pages' ({specs[0].sink_tokens}, {specs[0].recent_tokens})")
    for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):
        if isinstance(p, QuantizedPages) and p.window is not None and p.window.shape[0] < rows:
            raise ValueError(f"{name}: the full-precision windows have {p.window.shape[0]} sequence rows; "
                             f"expected at least {rows} ({what})")


def check_pools(q_dtype, head_dim: int, n_heads: int, k_pages, v_pages):
    """Shapes of the key/value pools → (num_pages, page_size, kv_heads, value_dim)."""
    if v_pages is None:
        if isinstance(k_pages, QuantizedPages):
            raise ValueError("v_pages: None means a combined dense kv_pages [num_pages, page_size, 2, K, H]; "
                             "a quantized pool needs separate k_pages and v_pages")
        check_pool("k_pages", k_pages, ranks=(5,))
        if k_pages.shape[2] != 2:
            raise ValueError(f"k_pages: a combined kv_pages must be [num_pages, page_size, 2, K, H], got "
                             f"{tuple(k_pages.shape)}")
        num_pages, page_size, _, kv_heads, hk = k_pages.shape
        hv = hk
        dense = [("k_pages", k_pages)]
    else:
        check_pool("k_pages", k_pages)
        check_pool("v_pages", v_pages)
        num_pages, page_size, kv_heads, hk = k_pages.shape
        vs = tuple(v_pages.shape)
        if vs[:3] != (num_pages, page_size, kv_heads):
            raise ValueError(f"v_pages: expected shape ({num_pages}, {page_size}, {kv_heads}, *) to match "
                             f"k_pages' [num_pages, page_size, K], got {vs}")
        hv = vs[3]
        dense = [(n, p) for n, p in (("k_pages", k_pages), ("v_pages", v_pages)) if not isinstance(p, QuantizedPages)]
    if hk != head_dim:
        raise ValueError(f"k_pages: expected head_dim {head_dim} (q.shape[-1]), got {hk}")
    if n_heads % kv_heads:
        raise ValueError(f"q: the number of query heads {n_heads} must be a multiple of the kv heads {kv_heads}")
    for name, p in dense:
        if np.dtype(p.dtype) != np.dtype(q_dtype):
            raise TypeError(f"{name}: expected dtype {np.dtype(q_dtype).name} (q's), got {np.dtype(p.dtype).name}")
    return num_pages, page_size, kv_heads, hv


def check_sinks(sinks, n_heads):
    """``None`` or float sink logits ``[n_heads]``."""
    if sinks is None:
        return None
    checks.require_float("sinks", sinks)
    return checks.require_shape("sinks", sinks, (n_heads,), "one logit per query head")


def common_options(scale, logits_soft_cap, local_window_size, head_dim, precision=None):
    """The checked ``scale``, ``logits_soft_cap``, ``window_left`` and (resolved,
    `core.precision.resolve_precision`) ``precision`` options."""
    return {"precision": resolve_precision(precision),
            "scale": logit_scale(scale, head_dim),
            "logits_soft_cap": positive_float_or_none("logits_soft_cap", logits_soft_cap),
            "window_left": window_left(local_window_size)}


# -- cost models ----------------------------------------------------------------------------
def concrete_sum(x, default: float) -> float:
    """``sum(x)`` of a concrete array, ``default`` when ``x`` is traced or abstract."""
    try:
        return float(np.sum(np.asarray(x)))
    except Exception:  # traced or abstract: assume full tables
        return default


def pool_bytes_per_token(call: Call, prefix: str) -> float:
    """Bytes read per cached token (all heads) of pool ``prefix``."""
    data = call.arrays.get(f"{prefix}_pages")
    if data is None:
        return 0.0
    per_token = nbytes(data) / (data.shape[0] * data.shape[1])
    for extra in ("scale", "zero"):
        a = call.arrays.get(f"{prefix}_{extra}")
        if a is not None:
            per_token += nbytes(a) / (data.shape[0] * data.shape[1])
    return per_token


def live_tokens(call: Call, lengths, tables) -> float:
    """Cached tokens the call reads: ``sum(lengths)`` (all table entries when abstract)."""
    page_size = call.arrays[[k for k in call.arrays if k.endswith("_pages")][0]].shape[1]
    return concrete_sum(lengths, float(tables.shape[0] * tables.shape[1] * page_size))


def value_dim(call: Call, head_dim: int) -> int:
    """The value head dim ``Hv`` (``head_dim`` for a combined kv pool)."""
    if call.v_pages is None:
        return head_dim
    if call.options.get("v_quant") is not None:
        return call.options["v_head_dim"]
    return call.v_pages.shape[-1]


# -- ops -------------------------------------------------------------------------------------
def serving_op(name: str, *, check, reference, triton, xla, config_type, heuristic, space, requirements, flops,
               bytes_accessed, examples, benchmarks, mosaic_tpu: dict | None = None) -> Op:
    """Register a serving op: ``triton(call, config)`` (with its config type,
    heuristic, autotuning space and requirements) and ``xla(call, config)``;
    ``mosaic_tpu`` (``run``, ``config_type``, ``heuristic``, ``space``,
    ``requirements``) adds the Mosaic TPU kernel first."""
    on_tpu = [] if mosaic_tpu is None else [Implementation("mosaic_tpu", backend="mosaic_tpu", **mosaic_tpu)]
    return register(Op(
        name,
        family="paged_attention",
        check=check,
        reference=reference,
        implementations=[
            *on_tpu,
            Implementation("triton", triton, backend="triton", config_type=config_type, heuristic=heuristic,
                           space=space, requirements=requirements),
            Implementation("xla", xla),
        ],
        flops=flops,
        bytes_accessed=bytes_accessed,
        examples=examples,
        benchmarks=benchmarks,
    ))
