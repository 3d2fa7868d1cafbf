"""Configs of the paged-attention Triton kernels, their heuristics and
autotuning spaces.

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
"""

from __future__ import annotations

import dataclasses

from ...core import Call, TritonConfig, current_platform, is_power_of_two, next_power_of_two, product_space
from ...core.config import require_in, require_power_of_two
from ...core.pallas import cdiv
from .quant_cache import KVQuant

#: Smallest dot dimension on tensor cores (rows, tokens per step, head dims).
MIN_DOT = 16
#: Most elements of one [tokens, head_dim] tile a program holds at once.
MAX_TILE = 64 * 1024
#: Streaming multiprocessors of the target GPU class (H100/H200: 132).
TARGET_SMS = 132


@dataclasses.dataclass(frozen=True)
class PagedConfig(TritonConfig):
    pages_per_block: int = 4
    num_splits: int = 1
    block_rows: int = 16

    def validate(self) -> None:
        super().validate()
        name = type(self).__name__
        require_power_of_two(name, "pages_per_block", self.pages_per_block)
        require_in(name, "num_splits", self.num_splits, (1, 2, 4, 8, 16, 32, 64))
        require_in(name, "block_rows", self.block_rows, (16, 32, 64, 128))


@dataclasses.dataclass(frozen=True)
class RaggedConfig(PagedConfig):
    block_q: int = 16

    def validate(self) -> None:
        super().validate()
        require_in(type(self).__name__, "block_q", self.block_q, (1, 2, 4, 8, 16, 32, 64, 128))


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
        if not is_power_of_two(d) or d < MIN_DOT:
            return f"the Triton paged kernels need power-of-two head dims >= {MIN_DOT}, got {d}"
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
def _pages_per_block(geo: Geometry, tokens: int) -> int:
    ppb = max(1, tokens // geo.page_size)
    ppb = max(ppb, cdiv(MIN_DOT, geo.page_size))
    widest = max(geo.dims)
    while ppb > 1 and ppb * geo.page_size * widest > MAX_TILE // 2:
        ppb //= 2
    return ppb


def _block_rows(geo: Geometry, cap: int = 64) -> int:
    return max(MIN_DOT, min(cap, next_power_of_two(geo.rows)))


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
        if ppb * geo.page_size >= MIN_DOT and ppb * geo.page_size * max(geo.dims) <= MAX_TILE and ppb not in out:
            out.append(ppb)
    return out or [_pages_per_block(geo, 64)]


def _row_choices(geo: Geometry, cap: int) -> list[int]:
    top = _block_rows(geo, cap)
    return sorted({max(MIN_DOT, top // 2), top})


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
