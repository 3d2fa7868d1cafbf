"""What the three serving ops share: the argument checks (of the page pools,
windows, scales and sinks, and each op's `check_paged` / `check_ragged` /
`check_mla`, which `validation` reuses), the cost models (live tokens,
bytes per cached token, each op's FLOPs and bytes) and the backend tables.

The ops are forward-only (serving). Each has its own configs on every kernel
backend, so each has its own backend table (rows in dispatch order:
``mosaic_tpu``, ``triton``, ``xla``): `PAGED_BACKENDS`, and, retuned with
the other ops' configs, `RAGGED_BACKENDS` and `MLA_BACKENDS`. The tables
share the kernel modules (MLA's Mosaic TPU kernels are in `mosaic_tpu_mla`),
whose entry points ``run_paged`` / ``run_ragged`` / ``run_mla`` take
``(call, config)``. A new backend is a kernel module with those entry
points, its configs in `configs`, and one row per table. The ops and the
public functions are in `api`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.backends import Backend, BackendTable, Tuning
from ...core.pallas import nbytes
from ...core.precision import resolve_precision
from . import mosaic_tpu as mosaic_tpu_kernels
from . import mosaic_tpu_mla as mosaic_tpu_mla_kernels
from . import triton as triton_kernels
from . import xla as xla_kernels
from .cache import pool_entries
from .configs import (
    MlaConfig, PagedConfig, RaggedConfig, TpuMlaConfig, TpuPagedConfig, TpuRaggedConfig, mla_heuristic,
    mla_requirements, mla_space, mla_tpu_heuristic, mla_tpu_requirements, mla_tpu_space, paged_heuristic,
    paged_requirements, paged_space, paged_tpu_heuristic, paged_tpu_requirements,
    paged_tpu_space, ragged_heuristic, ragged_requirements, ragged_space, ragged_tpu_heuristic,
    ragged_tpu_requirements, ragged_tpu_space,
)
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


def check_tables(block_tables, rows: int, layout: str, lengths_name: str | None = None, lengths=None):
    """Integer ``block_tables [rows, max_pages]`` (``layout`` in the error) and, when
    ``lengths_name`` is given, integer ``lengths [rows]``."""
    checks.require_int("block_tables", block_tables)
    checks.require_ndim("block_tables", block_tables, 2)
    checks.require_shape("block_tables", block_tables, (rows, None), layout)
    if lengths_name is not None:
        int_array(lengths_name, lengths, (rows,))


def pools_entries(**pools) -> tuple[dict, dict]:
    """The named arrays and options of several pools (`cache.pool_entries`), in argument order."""
    arrays, options = {}, {}
    for prefix, pages in pools.items():
        pool_arrays, pool_options = pool_entries(prefix, pages)
        arrays.update(pool_arrays)
        options.update(pool_options)
    return arrays, options


# -- the ops' checks -------------------------------------------------------------------
def check_paged(q, k_pages, v_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
                local_window_size=None, sinks=None, precision=None) -> Call:
    """Checked `paged_attention_op` arguments (see `paged_attention`); pools become named
    arrays and options (`cache.pool_entries`)."""
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, (3, 4))
    b, n, h = q.shape[0], q.shape[-2], q.shape[-1]
    check_pools(q.dtype, h, n, k_pages, v_pages)
    check_tables(block_tables, b, "[batch, max_pages_per_seq]", "lengths", lengths)
    sinks = check_sinks(sinks, n)
    check_windows(k_pages, v_pages, b, "one per batch row")
    pool_arrays, pool_opts = pools_entries(k=k_pages, v=v_pages)
    arrays = {"q": q, **pool_arrays, "block_tables": block_tables, "lengths": lengths, "sinks": sinks}
    return Call(arrays, {**common_options(scale, logits_soft_cap, local_window_size, h, precision), **pool_opts})


def _num_seqs(value):
    """``num_seqs`` (an int or a size-1 int array) as an int32 ``[1]`` array."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return jnp.asarray([value], jnp.int32)
    checks.require_int("num_seqs", value)
    if value.size != 1:
        raise ValueError(f"num_seqs: expected a scalar or a [1] array, got shape {tuple(value.shape)}")
    if tuple(value.shape) == (1,):   # also abstract values (the compile tier's ShapeDtypeStructs)
        return value
    return value.reshape(1)


def check_ragged(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale=None,
                 logits_soft_cap=None, local_window_size=None, sinks=None, precision=None) -> Call:
    """Checked `ragged_paged_attention_op` arguments (see `ragged_paged_attention`)."""
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, 3)
    _, n, h = q.shape
    check_pools(q.dtype, h, n, k_pages, v_pages)
    checks.require_int("kv_lens", kv_lens)
    checks.require_ndim("kv_lens", kv_lens, 1)
    s = kv_lens.shape[0]
    check_tables(block_tables, s, "[S, max_pages_per_seq], S = kv_lens.shape[0]")
    int_array("cu_q_lens", cu_q_lens, (s + 1,))
    num_seqs = _num_seqs(num_seqs)
    sinks = check_sinks(sinks, n)
    check_windows(k_pages, v_pages, s, "one per sequence")
    pool_arrays, pool_opts = pools_entries(k=k_pages, v=v_pages)
    arrays = {"q": q, **pool_arrays, "kv_lens": kv_lens, "block_tables": block_tables,
              "cu_q_lens": cu_q_lens, "num_seqs": num_seqs, "sinks": sinks}
    return Call(arrays, {**common_options(scale, logits_soft_cap, local_window_size, h, precision), **pool_opts})


def _check_mla_pools(q_nope, q_pe, latent_pages, pe_pages):
    """The latent ``[num_pages, page_size, R]`` and rope ``[num_pages, page_size, P]`` pools."""
    r, p = q_nope.shape[-1], q_pe.shape[-1]
    check_pool("latent_pages", latent_pages, ranks=(3,))
    check_pool("pe_pages", pe_pages, ranks=(3,))
    num_pages, page_size, lr = latent_pages.shape
    if lr != r:
        raise ValueError(f"latent_pages: expected latent dim {r} (q_nope.shape[-1]), got {lr}")
    if tuple(pe_pages.shape) != (num_pages, page_size, p):
        raise ValueError(f"pe_pages: expected shape {(num_pages, page_size, p)} ([num_pages, page_size, "
                         f"q_pe.shape[-1]]), got {tuple(pe_pages.shape)}")
    for name, pool in (("latent_pages", latent_pages), ("pe_pages", pe_pages)):
        if not isinstance(pool, QuantizedPages) and np.dtype(pool.dtype) != np.dtype(q_nope.dtype):
            raise TypeError(f"{name}: expected dtype {np.dtype(q_nope.dtype).name} (q_nope's), "
                            f"got {np.dtype(pool.dtype).name}")


def check_mla(q_nope, q_pe, latent_pages, pe_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
              local_window_size=None, precision=None) -> Call:
    """Checked `mla_decode_op` arguments (see `mla_decode`); ``scale`` is required."""
    q_nope = checks.require_float("q_nope", q_nope)
    checks.require_ndim("q_nope", q_nope, (3, 4))
    q_pe = checks.require_float("q_pe", q_pe)
    checks.require_same_dtype("q_pe", q_pe, "q_nope", q_nope)
    checks.require_shape("q_pe", q_pe, (*q_nope.shape[:-1], None), "q_nope's leading dims")
    b = q_nope.shape[0]
    _check_mla_pools(q_nope, q_pe, latent_pages, pe_pages)
    check_tables(block_tables, b, "[batch, max_pages_per_seq]", "lengths", lengths)
    if scale is None:
        raise TypeError("scale: mla_decode needs an explicit scale (1/sqrt(qk_nope_dim + qk_rope_dim) "
                        "of the un-absorbed model)")
    check_windows(latent_pages, pe_pages, b, "one per batch row")
    pool_arrays, pool_opts = pools_entries(latent=latent_pages, pe=pe_pages)
    arrays = {"q_nope": q_nope, "q_pe": q_pe, **pool_arrays, "block_tables": block_tables, "lengths": lengths}
    return Call(arrays, {**common_options(scale, logits_soft_cap, local_window_size, q_nope.shape[-1], precision),
                         **pool_opts})


# -- cost models ----------------------------------------------------------------------------
def concrete_sum(x, default: float) -> float:
    """``sum(x)`` of a concrete array, ``default`` when ``x`` is traced or abstract."""
    try:
        return float(np.sum(np.asarray(x)))
    except Exception:  # traced or abstract: assume full tables
        return default


def _array_bytes(a) -> float:
    """Bytes of an array, sub-byte dtypes (int4's ``uint4`` codes) at their bits."""
    return float(np.prod(a.shape, dtype=np.int64)) * jax.dtypes.itemsize_bits(a.dtype) / 8


def pool_bytes_per_token(call: Call, prefix: str) -> float:
    """Bytes read per cached token (all heads) of pool ``prefix``."""
    data = call.arrays.get(f"{prefix}_pages")
    if data is None:
        return 0.0
    per_token = _array_bytes(data) / (data.shape[0] * data.shape[1])
    for extra in ("scale", "zero"):
        a = call.arrays.get(f"{prefix}_{extra}")
        if a is not None:
            per_token += _array_bytes(a) / (data.shape[0] * data.shape[1])
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


def pool_read_bytes(call: Call, lengths, prefixes) -> float:
    """Bytes of the pools ``prefixes`` the call reads (`live_tokens` × `pool_bytes_per_token`)."""
    tokens = live_tokens(call, lengths, call.block_tables)
    return tokens * sum(pool_bytes_per_token(call, prefix) for prefix in prefixes)


def decode_flops(call: Call, q, dims: int) -> float:
    """``2 · Q · N · dims`` FLOPs per live cached token of a decode query ``q [B, (Q,) N, *]``."""
    nq = 1 if q.ndim == 3 else q.shape[1]
    return 2.0 * nq * q.shape[-2] * dims * live_tokens(call, call.lengths, call.block_tables)


def paged_flops(call: Call) -> float:
    h = call.q.shape[-1]
    return decode_flops(call, call.q, h + value_dim(call, h))


def paged_bytes(call: Call) -> float:
    kv = pool_read_bytes(call, call.lengths, ("k", "v"))
    return kv + 2 * nbytes(call.q) + nbytes(call.block_tables) + nbytes(call.lengths)


def ragged_flops(call: Call) -> float:
    n, h = call.q.shape[-2], call.q.shape[-1]
    hv = value_dim(call, h)
    # Upper bound without concrete lengths: every token against its whole sequence.
    try:
        cu = np.asarray(call.cu_q_lens)
        kv = np.asarray(call.kv_lens)
        ns = int(np.asarray(call.num_seqs).reshape(-1)[0])
        q_len = np.diff(cu)[:ns]
        pairs = float(np.sum(q_len * kv[:ns] - q_len * (q_len - 1) / 2))
    except Exception:
        pairs = float(call.q.shape[0]) * call.block_tables.shape[1] * call.k_pages.shape[1]
    return 2.0 * n * (h + hv) * pairs


def ragged_bytes(call: Call) -> float:
    kv = pool_read_bytes(call, call.kv_lens, ("k", "v"))
    return kv + 2 * nbytes(call.q) + nbytes(call.block_tables)


def mla_flops(call: Call) -> float:
    r, p = call.q_nope.shape[-1], call.q_pe.shape[-1]
    return decode_flops(call, call.q_nope, 2 * r + p)


def mla_bytes(call: Call) -> float:
    kv = pool_read_bytes(call, call.lengths, ("latent", "pe"))
    return kv + 2 * nbytes(call.q_nope) + nbytes(call.q_pe) + nbytes(call.block_tables)


# -- backends ------------------------------------------------------------------------------
PAGED_BACKENDS = BackendTable("paged_attention", [
    Backend("mosaic_tpu", mosaic_tpu_kernels, "mosaic_tpu",
            Tuning(TpuPagedConfig, paged_tpu_heuristic, paged_tpu_space, paged_tpu_requirements)),
    Backend("triton", triton_kernels, "triton", Tuning(PagedConfig, paged_heuristic, paged_space, paged_requirements)),
    Backend("xla", xla_kernels),
])

#: The other two ops run on the same backends with their own configs (MLA's TPU kernels in their own file).
RAGGED_BACKENDS = PAGED_BACKENDS.retuned({
    "mosaic_tpu": Tuning(TpuRaggedConfig, ragged_tpu_heuristic, ragged_tpu_space, ragged_tpu_requirements),
    "triton": Tuning(RaggedConfig, ragged_heuristic, ragged_space, ragged_requirements),
})

MLA_BACKENDS = PAGED_BACKENDS.retuned({
    "mosaic_tpu": Tuning(TpuMlaConfig, mla_tpu_heuristic, mla_tpu_space, mla_tpu_requirements),
    "triton": Tuning(MlaConfig, mla_heuristic, mla_space, mla_requirements),
}, kernels={"mosaic_tpu": mosaic_tpu_mla_kernels})
