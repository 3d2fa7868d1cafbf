"""Configs of the paged-attention kernels (Triton and Mosaic TPU), their
heuristics, autotuning spaces and requirements.

Triton (`PagedConfig`, `RaggedConfig`, `MlaConfig`):

* ``pages_per_block``: pages read per loop step; a step covers
  ``pages_per_block · page_size`` tokens (at least 16: the width of a
  tensor-core dot).
* ``num_splits``: split-K ("flash-decoding"): each program's live pages are
  cut into this many contiguous ranges processed by separate programs, whose
  partials a reduction kernel merges by log-sum-exp. More splits = more
  parallelism for small batches and long contexts.
* ``block_rows``: query rows per program (query tokens × the query heads of
  one KV group, padded to at least 16); more rows are cut into several
  programs reading the same pages.
* ``block_q`` (ragged): query tokens of one sequence per program.
* ``num_warps``/``num_stages``: Triton's.

Mosaic TPU (`TpuPagedConfig`, `TpuRaggedConfig`, `TpuMlaConfig`):

* ``pages_per_block``: pages one pipeline block copies (HBM → VMEM) and
  computes; a block covers ``pages_per_block · page_size`` keys. Larger
  blocks mean fewer, longer DMAs and wider matmuls, and more VMEM (two slots).
* ``block_q`` (ragged): query tokens of one sequence per program (rows
  ``block_q · G`` per kv head).

A TPU step holds, in VMEM: two slots of every pool array's pages (codes,
scales, zero points), the query rows and output rows (double-buffered by the
grid pipeline), the float32 ``m`` / ``l`` / accumulator scratch, and the
block's temporaries (logits and probabilities ``[R, T]``, dequantized
tiles ``[T, H]``) (`paged_tpu_vmem`). Configs over the generation's scoped
VMEM default are not in its space.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ...core import (Call, KernelConfig, TritonConfig, current_platform, is_power_of_two, next_power_of_two,
                     product_space)
from ...core.config import TRITON_DOT_MIN, require_power_of_two
from ...core.pallas import cdiv
from ...core.platform import target_generation
from .quant_cache import KVQuant


@dataclasses.dataclass(frozen=True)
class PagedConfig(TritonConfig):
    pages_per_block: int = 4
    num_splits: int = 1
    block_rows: int = 16

    CHOICES = {"num_splits": (1, 2, 4, 8, 16, 32, 64), "block_rows": (16, 32, 64, 128)}

    def validate(self) -> None:
        super().validate()
        require_power_of_two(type(self).__name__, "pages_per_block", self.pages_per_block)


@dataclasses.dataclass(frozen=True)
class RaggedConfig(PagedConfig):
    block_q: int = 16

    CHOICES = {"block_q": (1, 2, 4, 8, 16, 32, 64, 128)}


@dataclasses.dataclass(frozen=True)
class MlaConfig(PagedConfig):
    block_rows: int = 16


# -- call geometry ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Geometry:
    page_size: int
    max_pages: int
    programs: int          # batch rows (paged, MLA) or an estimate of token blocks (ragged)
    kv_heads: int
    rows: int              # query rows per kv head and program (Q·G, or N for MLA)
    dims: tuple            # head dims the kernel tiles (keys, values, rope)
    quants: tuple          # KVQuant of each quantized pool


def _quants(call: Call, prefixes) -> tuple:
    return tuple(call.options[f"{p}_quant"] for p in prefixes if call.options.get(f"{p}_quant") is not None)


def _dim(call: Call, prefix: str) -> int:
    if call.options.get(f"{prefix}_quant") is not None:
        return call.options[f"{prefix}_head_dim"]
    return call.arrays[f"{prefix}_pages"].shape[-1]


def geometry(call: Call, kind: str, block_q: int = 1) -> Geometry:
    if kind == "mla":
        q = call.q_nope
        data = call.latent_pages
        nq = 1 if q.ndim == 3 else q.shape[1]
        return Geometry(data.shape[1], call.block_tables.shape[1], q.shape[0], 1, nq * q.shape[-2],
                        (_dim(call, "latent"), _dim(call, "pe")), _quants(call, ("latent", "pe")))
    q = call.q
    data = call.k_pages
    combined = call.v_pages is None
    kv_heads = data.shape[3] if combined else data.shape[2]
    g = q.shape[-2] // kv_heads
    if kind == "paged":
        nq = 1 if q.ndim == 3 else q.shape[1]
        programs = q.shape[0]
    else:
        nq = block_q
        programs = cdiv(q.shape[0], block_q) + min(call.kv_lens.shape[0], q.shape[0])
    hv = q.shape[-1] if combined else _dim(call, "v")
    return Geometry(data.shape[1], call.block_tables.shape[1], programs, kv_heads, nq * g,
                    (q.shape[-1], hv), _quants(call, ("k", "v")))


# -- requirements -------------------------------------------------------------------------------
def _requirements(geo: Geometry) -> str | None:
    if not is_power_of_two(geo.page_size):
        return f"the Triton paged kernels need a power-of-two page_size, got {geo.page_size}"
    for d in geo.dims:
        if not is_power_of_two(d) or d < TRITON_DOT_MIN:
            return f"the Triton paged kernels need power-of-two head dims >= {TRITON_DOT_MIN}, got {d}"
    for spec in geo.quants:
        assert isinstance(spec, KVQuant)
        if spec.group_axis == "token" and not is_power_of_two(geo.page_size // spec.group(geo.dims[0])):
            return "token-axis groups must split a page into a power-of-two number of groups"
        if spec.format == "fp8":
            platform = current_platform()
            if platform.nvidia_below((8, 9)):
                return f"fp8 caches need SM89 or newer for the Triton kernels, this GPU is {platform.describe()}"
    return None


def paged_requirements(call: Call) -> str | None:
    return _requirements(geometry(call, "paged"))


def ragged_requirements(call: Call) -> str | None:
    return _requirements(geometry(call, "ragged"))


def mla_requirements(call: Call) -> str | None:
    return _requirements(geometry(call, "mla"))


# -- heuristics ------------------------------------------------------------------------------------
#: Most elements of one [tokens, head_dim] tile a program holds at once.
MAX_TILE = 64 * 1024
#: Streaming multiprocessors of the target GPU class (H100/H200: 132).
TARGET_SMS = 132


def _pages_per_block(geo: Geometry, tokens: int) -> int:
    ppb = max(1, tokens // geo.page_size)
    ppb = max(ppb, cdiv(TRITON_DOT_MIN, geo.page_size))
    widest = max(geo.dims)
    while ppb > 1 and ppb * geo.page_size * widest > MAX_TILE // 2:
        ppb //= 2
    return ppb


def _block_rows(geo: Geometry, cap: int = 64) -> int:
    return max(TRITON_DOT_MIN, min(cap, next_power_of_two(geo.rows)))


def _splits(geo: Geometry, ppb: int, block_rows: int) -> int:
    programs = geo.programs * geo.kv_heads * cdiv(geo.rows, block_rows)
    blocks = cdiv(geo.max_pages, ppb)
    splits = 1
    while programs * splits < 2 * TARGET_SMS and splits * 2 <= min(32, blocks):
        splits *= 2
    return splits


def _warps(geo: Geometry, ppb: int, block_rows: int) -> int:
    tile = ppb * geo.page_size * max(geo.dims)
    # Static GPU tier, sm_80: 64 query rows x 128 dims on 4 warps take 255 registers and spill 52 B
    # (ragged, mixed batch); 8 warps take 176, no spills. sm_90 holds them on 4 warps (241 registers).
    rows_tile = 8192 if current_platform().nvidia_below((9, 0)) else 16384
    return 8 if tile >= 16384 or block_rows * max(geo.dims) >= rows_tile else 4


def paged_heuristic(call: Call) -> PagedConfig:
    geo = geometry(call, "paged")
    ppb = _pages_per_block(geo, 64)
    rows = _block_rows(geo)
    return PagedConfig(pages_per_block=ppb, num_splits=_splits(geo, ppb, rows), block_rows=rows,
                       num_warps=_warps(geo, ppb, rows), num_stages=2)


def ragged_heuristic(call: Call) -> RaggedConfig:
    g = geometry(call, "ragged").rows
    block_q = max(1, min(16, 64 // max(g, 1)))
    geo = geometry(call, "ragged", block_q)
    ppb = _pages_per_block(geo, 64)
    rows = _block_rows(geo, cap=128)
    return RaggedConfig(pages_per_block=ppb, num_splits=1, block_rows=rows, block_q=block_q,
                        num_warps=_warps(geo, ppb, rows), num_stages=2)


def _mla_stages(geo: Geometry, ppb: int) -> int:
    """Two pipeline stages double the latent tile's shared memory: 176 KB for 64
    tokens × R = 512 on sm_80 (static GPU tier), over its 163 KB; one stage takes
    104 KB. sm_90 (227 KB) keeps two."""
    return 1 if current_platform().nvidia_below((9, 0)) and ppb * geo.page_size * max(geo.dims) >= 64 * 512 else 2


def mla_heuristic(call: Call) -> MlaConfig:
    geo = geometry(call, "mla")
    ppb = _pages_per_block(geo, 32)
    rows = _block_rows(geo, cap=32)
    return MlaConfig(pages_per_block=ppb, num_splits=_splits(geo, ppb, rows), block_rows=rows,
                     num_warps=8, num_stages=_mla_stages(geo, ppb))


# -- autotuning spaces -------------------------------------------------------------------------------
def _ppb_choices(geo: Geometry, token_choices) -> list[int]:
    out = []
    for tokens in token_choices:
        ppb = max(1, tokens // geo.page_size)
        if ppb * geo.page_size >= TRITON_DOT_MIN and ppb * geo.page_size * max(geo.dims) <= MAX_TILE and ppb not in out:
            out.append(ppb)
    return out or [_pages_per_block(geo, 64)]


def _row_choices(geo: Geometry, cap: int) -> list[int]:
    top = _block_rows(geo, cap)
    return sorted({max(TRITON_DOT_MIN, top // 2), top})


def paged_space(call: Call) -> list[PagedConfig]:
    geo = geometry(call, "paged")
    return product_space(PagedConfig, pages_per_block=_ppb_choices(geo, (32, 64, 128)),
                         num_splits=(1, 4, 16), block_rows=_row_choices(geo, 64),
                         num_warps=(4, 8), num_stages=(2,))


def ragged_space(call: Call) -> list[RaggedConfig]:
    base = ragged_heuristic(call)
    geo = geometry(call, "ragged", base.block_q)
    configs = []
    for block_q in sorted({base.block_q, max(1, base.block_q // 2)}):
        configs += product_space(RaggedConfig, pages_per_block=_ppb_choices(geo, (32, 64, 128)),
                                 num_splits=(1, 4), block_rows=(_block_rows(geometry(call, "ragged", block_q), 128),),
                                 block_q=(block_q,), num_warps=(4, 8), num_stages=(2,))
    return configs


def mla_space(call: Call) -> list[MlaConfig]:
    geo = geometry(call, "mla")
    return product_space(MlaConfig, pages_per_block=_ppb_choices(geo, (16, 32, 64)),
                         num_splits=(1, 4, 16), block_rows=_row_choices(geo, 32),
                         num_warps=(4, 8), num_stages=(1, 2) if current_platform().nvidia_below((9, 0)) else (2,))


# == Mosaic TPU ======================================================================
PAGES = (1, 2, 4, 8, 16, 32, 64)
BLOCK_Q = (1, 2, 4, 8, 16, 32, 64)
#: Most keys of one block (the logits tile is ``[R, T]``).
MAX_TOKENS = 2048


#: KV head counts whose pages the TPU kernels read token-major (`mosaic_tpu.token_major`).
TOKEN_MAJOR_HEADS = (1, 2, 4)
#: Most kv heads a TPU block computes together (one sublane tile of a page's
#: ``[K, H]`` rows: 8 rows of 32-bit words, bf16 pairs or int8 quads).
HEAD_GROUP = 8


def head_group(kv_heads: int) -> int:
    """KV heads the Mosaic TPU kernels take together in one block: all ``K`` up
    to `HEAD_GROUP` (or when ``K`` is not a multiple of it), else whole tiles
    of `HEAD_GROUP`. A group's keys of a block are one contiguous
    ``[T·hg, H]`` matrix in VMEM (token-major, heads interleaved): the logits
    of all its query rows are one matmul, masked to each row's own kv head."""
    if kv_heads <= HEAD_GROUP or kv_heads % HEAD_GROUP:
        return kv_heads
    return HEAD_GROUP


def kernel_head_group(kv_heads: int, split: bool = False) -> int:
    """KV heads one block computes together: `head_group`, or 1 with ``split``
    (a kv head's ``[T, H]`` rows read out of the slot's ``[T, K, H]`` tiles)
    where the pool is not read token-major (`TOKEN_MAJOR_HEADS`: a token-major
    slot has no kv-head axis to index)."""
    if split and kv_heads not in TOKEN_MAJOR_HEADS:
        return 1
    return head_group(kv_heads)


def can_split_heads(call: Call) -> bool:
    """Whether ``split_heads`` changes anything for a ragged call: dense (not
    quantized) separate K and V pools of more than 4 kv heads."""
    if call.v_pages is None or any(call.options.get(f"{p}_quant") is not None for p in ("k", "v")):
        return False
    return call.k_pages.ndim == 4 and call.k_pages.shape[2] not in TOKEN_MAJOR_HEADS


def folds_scales(spec, page_size: int, kv_heads: int, head_dim: int, combined: bool = False) -> bool:
    """Whether the Mosaic TPU kernels apply a quantized pool's scales (and zero
    points) to a block's logits and probabilities instead of dequantizing its
    keys and values (`mosaic_tpu_pages.folded_scales`): one scale per token and
    kv head (head-dim groups of the whole head: int8 and fp8 by default), all
    kv heads in one group (`head_group`), and a page's ``page_size · K``
    scales a whole number of 128-lane rows (they travel as one lane-dense row
    per page)."""
    return (spec is not None and not combined and spec.group_axis == "head_dim"
            and spec.group(head_dim) == head_dim and head_group(kv_heads) == kv_heads
            and (page_size * kv_heads) % 128 == 0)


@dataclasses.dataclass(frozen=True)
class TpuPagedConfig(KernelConfig):
    """``pages_per_block`` pages per pipeline block."""

    pages_per_block: int = 8

    CHOICES = {"pages_per_block": PAGES}


@dataclasses.dataclass(frozen=True)
class TpuRaggedConfig(TpuPagedConfig):
    """... and ``block_q`` query tokens per program; ``split_heads``: one kv head
    at a time (`kernel_head_group`) instead of a head group's keys as one
    matrix — for programs with many query rows per kv head (prefill), where
    the group's ``hg``-times wider logits and matmuls cost more than reading
    a head's rows out of the slot."""

    block_q: int = 8
    split_heads: bool = False

    CHOICES = {"block_q": BLOCK_Q, "split_heads": (False, True)}


@dataclasses.dataclass(frozen=True)
class TpuMlaConfig(TpuPagedConfig):
    """MLA: ``pages_per_block`` pages of the latent and rope caches per block."""


# -- Mosaic TPU: VMEM ------------------------------------------------------------------------------
def _tiled(rows: int, lanes: int, itemsize: int) -> int:
    """VMEM bytes of a ``[rows, lanes]`` tile: lanes padded to 128, rows to the
    sublane tile (8 rows of 32-bit words: 16 bf16 / 32 int8 rows, or 8 packed
    rows when there are fewer, as Mosaic tiles a page's ``[K, H]`` rows)."""
    sub = 8 * max(1, 4 // itemsize)
    if rows < sub:
        sub = 8
    return cdiv(rows, sub) * sub * cdiv(lanes, 128) * 128 * itemsize


def _page_bytes(shape, dtype, token_major: bool = False) -> int:
    """VMEM bytes of one page ``[rows, (K,) lanes]`` of a pool array (the
    ``(K, lanes)`` tiles of every row; K = 1 without a head axis), or of a
    token-major page ``[rows·K, lanes]`` (`mosaic_tpu.token_major`)."""
    rows, heads, lanes = shape[1], (shape[-2] if len(shape) > 3 else 1), shape[-1]
    itemsize = np.dtype(dtype).itemsize
    if token_major:
        return _tiled(rows * heads, lanes, itemsize)
    return rows * _tiled(heads, lanes, itemsize)


def _pool_folds(call: Call, prefix: str) -> bool:
    """`folds_scales` for pool ``prefix`` of a call."""
    spec = call.options.get(f"{prefix}_quant")
    data = call.arrays.get(f"{prefix}_pages")
    if spec is None or len(data.shape) != 4:
        return False
    return folds_scales(spec, data.shape[1], data.shape[2], call.options[f"{prefix}_head_dim"])


def _pool_page_bytes(call: Call, prefix: str) -> int:
    """VMEM bytes of one page (every kv head) of pool ``prefix``: codes, scales, zero points."""
    spec = call.options.get(f"{prefix}_quant")
    data = call.arrays.get(f"{prefix}_pages")
    shape = tuple(data.shape)
    combined = len(shape) == 5
    if combined:                                      # combined kv_pages: one half per copy
        shape = shape[:2] + shape[3:]
    heads = shape[-2] if len(shape) > 3 else 1
    total = _page_bytes(shape, data.dtype, token_major=not combined and heads in TOKEN_MAJOR_HEADS)
    if spec is None:
        return total
    scale = call.arrays[f"{prefix}_scale"]
    if _pool_folds(call, prefix):                     # one lane-dense row per page
        per = _tiled(1, shape[1] * heads, np.dtype(scale.dtype).itemsize)
    else:
        per = _page_bytes(scale.shape, scale.dtype)
    return total + per * (1 if spec.symmetric else 2)


def _pool_hbm_bytes(call: Call, prefix: str) -> int:
    """HBM bytes of one page (every kv head) of pool ``prefix``: codes, scales, zero points."""
    spec = call.options.get(f"{prefix}_quant")
    data = call.arrays.get(f"{prefix}_pages")
    per_page = int(np.prod(data.shape[1:])) * jax.dtypes.itemsize_bits(data.dtype) // 8   # uint4: 1/2 byte
    if len(data.shape) == 5:
        per_page //= 2
    if spec is not None:
        scale = call.arrays[f"{prefix}_scale"]
        per_page += int(np.prod(scale.shape[1:])) * np.dtype(scale.dtype).itemsize * (1 if spec.symmetric else 2)
    return per_page


def _pool_prefixes(call: Call, kind: str) -> tuple[tuple, int]:
    """The pools a step copies and how many copies of each (a combined pool: both halves)."""
    if kind == "mla":
        return ("latent", "pe"), 1
    return (("k",), 2) if call.v_pages is None else (("k", "v"), 1)


def _dequant_tiles(spec: KVQuant, dim: int) -> int:
    """``[keys, H'/per_byte]`` float32 tiles a block's dequantization keeps in
    VMEM (fitted to what compiles on v5e, `paged_tpu_vmem`): one for a scale
    per token and head (int8/fp8), the codes, expanded scales / zero points
    and results of every part otherwise (twice that for token groups, which
    expand through a full-width tile)."""
    pb = spec.per_element
    if spec.group_axis == "token":
        return 6 * pb + 4
    if pb == 1 and spec.group(dim) == dim:
        return 1
    return 4 * pb + 3


def paged_tpu_vmem(call: Call, kind: str, c: TpuPagedConfig) -> int:
    """VMEM bytes of one grid step of config ``c`` (see the module doc): the
    two slots of every pool array's pages, the query and output blocks
    (double-buffered), the softmax state, the block's logits and
    probabilities ``[R, T·hg]`` (`head_group`) and, for a quantized pool, its
    dequantization tiles ``[T·hg, H']`` (`_dequant_tiles`; the keys' and the
    values' are not live together). Fitted so that what it admits compiles
    on v5e (`benchmarks/results/tpu_compile_paged_attention_cpu.json`)."""
    geo = _geo(call, kind, c)
    hg = kernel_head_group(geo.kv_heads, getattr(c, "split_heads", False) and can_split_heads(call))
    groups = geo.kv_heads // hg
    rows = cdiv(hg * geo.rows, 8) * 8
    ps, ppb = geo.page_size, c.pages_per_block
    keys = ps * ppb * hg
    prefixes, copies = _pool_prefixes(call, kind)
    q = call.q_nope if kind == "mla" else call.q
    q_item = np.dtype(q.dtype).itemsize
    q_dims = geo.dims[0] + geo.dims[1] if kind == "mla" else geo.dims[0]
    hv = geo.dims[0] if kind == "mla" else geo.dims[1]
    slots = copies * sum(2 * ppb * _pool_page_bytes(call, p) for p in prefixes)
    io = groups * (2 * _tiled(rows, q_dims, q_item) + 2 * _tiled(rows, hv, 4))
    scratch = groups * (2 * _tiled(rows, 128, 4) + _tiled(rows, hv, 4))
    dequant = [0]
    for prefix, dim in zip(prefixes, geo.dims):
        spec = call.options.get(f"{prefix}_quant")
        if spec is not None and _pool_folds(call, prefix):
            dequant.append(_tiled(keys, dim, 4))
        elif spec is not None:
            tiles = _dequant_tiles(spec, dim) * _tiled(keys, dim // spec.per_element, 4)
            if spec.group_axis == "token":
                tiles += _tiled(keys, keys // spec.group(dim), 4)
            dequant.append(tiles)
    if hg < geo.kv_heads:
        # A head's keys and values read out of the slot's [K, H] tiles land as [T, 1, H]: a
        # whole (8, 128) tile of 32-bit words per token (fitted: 19.1 MiB on v5e for 1024 keys,
        # block_q 16, 64q/8kv, head dim 128, where the unpadded rows would count 5.6 MiB less).
        dequant.append(2 * keys * 8 * cdiv(max(geo.dims), 128) * 128 * 4)
    return slots + io + scratch + 3 * _tiled(rows, keys, 4) + max(dequant)


def block_bytes(call: Call, kind: str, c: TpuPagedConfig) -> int:
    """HBM bytes one block of config ``c`` copies (every pool array's pages)."""
    prefixes, copies = _pool_prefixes(call, kind)
    return copies * c.pages_per_block * sum(_pool_hbm_bytes(call, p) for p in prefixes)


# -- Mosaic TPU: geometry ---------------------------------------------------------------------------
def _geo(call: Call, kind: str, c=None) -> Geometry:
    bq = c.block_q if isinstance(c, TpuRaggedConfig) else 1
    return geometry(call, kind, block_q=bq)


def _ragged_block_q(call: Call) -> int:
    """Tokens per ragged program: rows ``block_q · G`` near 64 (at most 32 tokens,
    at most the call's tokens)."""
    g = call.q.shape[-2] // (call.k_pages.shape[3] if call.v_pages is None else call.k_pages.shape[2])
    bq = max(1, min(32, 64 // max(g, 1)))
    return min(bq, next_power_of_two(max(1, call.q.shape[0])))


def target_block_bytes() -> int:
    """HBM bytes a block should copy: enough in flight to keep the HBM busy
    while the previous block is computed (2 MiB on v5e/v5p, 4 MiB on v6e and
    TPU7x, whose HBM is faster and scoped VMEM twice as large)."""
    return (2 if target_generation().mxu <= 128 else 4) * 1024 * 1024


def _pages_choices(geo: Geometry) -> list[int]:
    cap = next_power_of_two(max(1, geo.max_pages))
    return [p for p in PAGES if p <= cap and p * geo.page_size <= MAX_TOKENS] or [1]


def _tpu_space(call: Call, kind: str, make) -> list:
    budget = target_generation().scoped_vmem_bytes
    out = [c for c in make() if paged_tpu_vmem(call, kind, c) <= budget]
    return out


def paged_tpu_space(call: Call) -> list[TpuPagedConfig]:
    """``pages_per_block`` up to the table width (and 2048 keys) that fits scoped VMEM."""
    geo = _geo(call, "paged")
    return _tpu_space(call, "paged", lambda: product_space(TpuPagedConfig, pages_per_block=_pages_choices(geo))) \
        or [TpuPagedConfig(1)]


def mla_tpu_space(call: Call) -> list[TpuMlaConfig]:
    """As `paged_tpu_space`, for the latent and rope caches."""
    geo = _geo(call, "mla")
    return _tpu_space(call, "mla", lambda: product_space(TpuMlaConfig, pages_per_block=_pages_choices(geo))) \
        or [TpuMlaConfig(1)]


#: Fewest query tokens of a ragged call whose autotuning space tries ``split_heads``
#: (a batch of decodes gains nothing from it: a few rows per kv head).
SPLIT_MIN_TOKENS = 256


def ragged_tpu_space(call: Call) -> list[TpuRaggedConfig]:
    """``pages_per_block`` × ``block_q`` (up to the call's tokens) × ``split_heads``
    (calls of `SPLIT_MIN_TOKENS` or more that `can_split_heads`) that fit scoped VMEM."""
    geo = _geo(call, "ragged")
    tokens = next_power_of_two(max(1, call.q.shape[0]))
    bqs = [b for b in BLOCK_Q if b <= max(tokens, 1)]
    split = (False, True) if can_split_heads(call) and tokens >= SPLIT_MIN_TOKENS else (False,)
    return _tpu_space(call, "ragged", lambda: product_space(TpuRaggedConfig, pages_per_block=_pages_choices(geo),
                                                         block_q=bqs, split_heads=split)) \
        or [TpuRaggedConfig(1, 1)]


def _heuristic_pages(call: Call, kind: str, space: list, bq: int | None = None):
    """The largest block of the space (for ``block_q``) that copies at most
    `target_block_bytes`, else the smallest."""
    want = target_block_bytes()
    pool = [c for c in space if bq is None or c.block_q == bq] or space
    fitting = [c for c in pool if block_bytes(call, kind, c) <= want]
    return max(fitting, key=lambda c: c.pages_per_block) if fitting else min(pool, key=lambda c: c.pages_per_block)


def paged_tpu_heuristic(call: Call) -> TpuPagedConfig:
    """Blocks of about `target_block_bytes` (e.g. 512 tokens of 8 bf16 kv heads
    of 128 on a v5e), fewer pages when the table is narrower or VMEM is short."""
    return _heuristic_pages(call, "paged", paged_tpu_space(call))


def mla_tpu_heuristic(call: Call) -> TpuMlaConfig:
    """As `paged_tpu_heuristic` for the latent and rope caches."""
    return _heuristic_pages(call, "mla", mla_tpu_space(call))


#: Fewest query rows per kv head and program (``block_q · G``) for which the heuristic
#: splits the heads (analysis, docs/paged_attention.md: with ~64 rows the head group's
#: 8-times wider softmax costs more than reading a head's rows out of the slot; to be
#: confirmed on the chip, `benchmarks/ragged_paged_tpu.py` times both).
SPLIT_MIN_ROWS = 32


def ragged_tpu_heuristic(call: Call) -> TpuRaggedConfig:
    """``block_q`` with about 64 rows per kv head, blocks as `paged_tpu_heuristic`;
    ``split_heads`` when the space has it (prefill-sized dense calls) and a
    program has `SPLIT_MIN_ROWS` query rows per kv head or more."""
    bq = _ragged_block_q(call)
    split = any(c.split_heads for c in ragged_tpu_space(call)) and bq * _geo(call, "ragged").rows >= SPLIT_MIN_ROWS
    space = [c for c in ragged_tpu_space(call) if c.split_heads == split]
    return _heuristic_pages(call, "ragged", space or [TpuRaggedConfig(1, 1)], bq)


# -- Mosaic TPU: requirements -------------------------------------------------------------------------
def _quant_reason(spec, dim: int) -> str | None:
    if spec is None:
        return None
    if spec.group_axis not in ("head_dim", "token"):
        return (f"the Mosaic TPU paged kernels dequantize head-dim or token groups, not "
                f"{spec.group_axis!r} scales (the XLA path runs them)")
    if getattr(spec, "part", None) is not None:
        return "the Mosaic TPU paged kernels do not read quantized halves of a combined kv buffer"
    if spec.group_axis == "head_dim" and spec.group(dim) != dim and spec.group(dim) % spec.per_element:
        return (f"the Mosaic TPU paged kernels need {spec.format} head-dim groups that are a multiple of "
                f"{spec.per_element} (values per byte), got group_size {spec.group(dim)}")
    return None


def _tpu_requirements(call: Call, kind: str) -> str | None:
    geo = _geo(call, kind)
    prefixes = ("latent", "pe") if kind == "mla" else ("k", "v")
    for prefix, dim in zip(prefixes, geo.dims):
        reason = _quant_reason(call.options.get(f"{prefix}_quant"), dim)
        if reason:
            return reason
    return None


def paged_tpu_requirements(call: Call) -> str | None:
    return _tpu_requirements(call, "paged")


def ragged_tpu_requirements(call: Call) -> str | None:
    return _tpu_requirements(call, "ragged")


def mla_tpu_requirements(call: Call) -> str | None:
    return _tpu_requirements(call, "mla")
