"""Configs of the Mosaic TPU paged-attention kernels, their heuristics and spaces.

* ``pages_per_block``: pages one pipeline block copies (HBM → VMEM) and
  computes; a block covers ``pages_per_block · page_size`` keys. Larger
  blocks mean fewer, longer DMAs and wider matmuls, and more VMEM (two slots).
* ``block_q`` (ragged): query tokens of one sequence per program (rows
  ``block_q · G`` per kv head).

A step holds, in VMEM: two slots of every pool array's pages (codes, scales,
zero points), the query rows and output rows (double-buffered by the grid
pipeline), the float32 ``m`` / ``l`` / accumulator scratch, and the
block's temporaries (logits and probabilities ``[R, T]``, dequantized
tiles ``[T, H]``) (`paged_tpu_vmem`). Configs over the generation's scoped
VMEM default are not in its space.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core import Call, KernelConfig, next_power_of_two, product_space
from ...core.config import require_in, require_power_of_two
from ...core.pallas import cdiv
from ...core.tpu import target_generation
from .configs import Geometry, geometry

PAGES = (1, 2, 4, 8, 16, 32, 64)
BLOCK_Q = (1, 2, 4, 8, 16, 32, 64)
#: Most keys of one block (the logits tile is ``[R, T]``).
MAX_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class TpuPagedConfig(KernelConfig):
    """``pages_per_block`` pages per pipeline block."""

    pages_per_block: int = 8

    def validate(self) -> None:
        require_power_of_two(type(self).__name__, "pages_per_block", self.pages_per_block)
        require_in(type(self).__name__, "pages_per_block", self.pages_per_block, PAGES)


@dataclasses.dataclass(frozen=True)
class TpuRaggedConfig(TpuPagedConfig):
    """... and ``block_q`` query tokens per program."""

    block_q: int = 8

    def validate(self) -> None:
        super().validate()
        require_in(type(self).__name__, "block_q", self.block_q, BLOCK_Q)


@dataclasses.dataclass(frozen=True)
class TpuMlaConfig(TpuPagedConfig):
    """MLA: ``pages_per_block`` pages of the latent and rope caches per block."""


# -- VMEM ------------------------------------------------------------------------------
def _tiled(rows: int, lanes: int, itemsize: int) -> int:
    sub = 8 * max(1, 4 // itemsize)
    return cdiv(rows, sub) * sub * cdiv(lanes, 128) * 128 * itemsize


def _page_bytes(shape, dtype) -> int:
    """VMEM bytes of one page ``[rows, (K,) lanes]`` of a pool array (the
    ``(K, lanes)`` tiles of every row; K = 1 without a head axis)."""
    rows, heads, lanes = shape[1], (shape[-2] if len(shape) > 3 else 1), shape[-1]
    return rows * _tiled(heads, lanes, np.dtype(dtype).itemsize)


def _pool_page_bytes(call: Call, prefix: str) -> int:
    """VMEM bytes of one page (every kv head) of pool ``prefix``: codes, scales, zero points."""
    spec = call.options.get(f"{prefix}_quant")
    data = call.arrays.get(f"{prefix}_pages")
    shape = tuple(data.shape)
    if len(shape) == 5:                               # combined kv_pages: one half per copy
        shape = shape[:2] + shape[3:]
    total = _page_bytes(shape, data.dtype)
    if spec is None:
        return total
    scale = call.arrays[f"{prefix}_scale"]
    return total + _page_bytes(scale.shape, scale.dtype) * (1 if spec.symmetric else 2)


def paged_tpu_vmem(call: Call, kind: str, c: TpuPagedConfig) -> int:
    """VMEM bytes of one grid step of config ``c`` (see the module doc)."""
    geo = _geo(call, kind, c)
    rows = cdiv(geo.rows, 8) * 8
    ps, ppb = geo.page_size, c.pages_per_block
    tokens = ps * ppb
    if kind == "mla":
        prefixes, copies = ("latent", "pe"), 1
        q_item = np.dtype(call.q_nope.dtype).itemsize
        q_dims = geo.dims[0] + geo.dims[1]
        hv = geo.dims[0]
    else:
        combined = call.v_pages is None
        prefixes, copies = (("k",), 2) if combined else (("k", "v"), 1)   # combined: each half copied
        q_item = np.dtype(call.q.dtype).itemsize
        q_dims = geo.dims[0]
        hv = geo.dims[1]
    heads = geo.kv_heads
    slots = copies * sum(2 * ppb * _pool_page_bytes(call, p) for p in prefixes)
    io = heads * (2 * _tiled(rows, q_dims, q_item) + 2 * _tiled(rows, hv, 4))
    scratch = heads * (2 * _tiled(rows, 128, 4) + _tiled(rows, hv, 4))
    temps = 2 * _tiled(rows, tokens, 4) + 2 * _tiled(tokens, max(geo.dims), 4)
    return slots + io + scratch + temps


# -- geometry ---------------------------------------------------------------------------
def _geo(call: Call, kind: str, c=None) -> Geometry:
    bq = c.block_q if isinstance(c, TpuRaggedConfig) else 1
    return geometry(call, kind, block_q=bq)


def _ragged_block_q(call: Call) -> int:
    """Tokens per ragged program: rows ``block_q · G`` near 64 (at most 32 tokens,
    at most the call's tokens)."""
    g = call.q.shape[-2] // (call.k_pages.shape[3] if call.v_pages is None else call.k_pages.shape[2])
    bq = max(1, min(32, 64 // max(g, 1)))
    return min(bq, next_power_of_two(max(1, call.q.shape[0])))


def _target_tokens() -> int:
    return 256 if target_generation().mxu <= 128 else 512


def _pages_choices(geo: Geometry) -> list[int]:
    cap = next_power_of_two(max(1, geo.max_pages))
    return [p for p in PAGES if p <= cap and p * geo.page_size <= MAX_TOKENS] or [1]


def _space(call: Call, kind: str, make) -> list:
    budget = target_generation().scoped_vmem_bytes
    out = [c for c in make() if paged_tpu_vmem(call, kind, c) <= budget]
    return out


def paged_tpu_space(call: Call) -> list[TpuPagedConfig]:
    """``pages_per_block`` up to the table width (and 2048 keys) that fits scoped VMEM."""
    geo = _geo(call, "paged")
    return _space(call, "paged", lambda: product_space(TpuPagedConfig, pages_per_block=_pages_choices(geo))) \
        or [TpuPagedConfig(1)]


def mla_tpu_space(call: Call) -> list[TpuMlaConfig]:
    """As `paged_tpu_space`, for the latent and rope caches."""
    geo = _geo(call, "mla")
    return _space(call, "mla", lambda: product_space(TpuMlaConfig, pages_per_block=_pages_choices(geo))) \
        or [TpuMlaConfig(1)]


def ragged_tpu_space(call: Call) -> list[TpuRaggedConfig]:
    """``pages_per_block`` × ``block_q`` (up to the call's tokens) that fit scoped VMEM."""
    geo = _geo(call, "ragged")
    tokens = next_power_of_two(max(1, call.q.shape[0]))
    bqs = [b for b in BLOCK_Q if b <= max(tokens, 1)]
    return _space(call, "ragged", lambda: product_space(TpuRaggedConfig, pages_per_block=_pages_choices(geo),
                                                         block_q=bqs)) or [TpuRaggedConfig(1, 1)]


def _heuristic_pages(call: Call, kind: str, space: list, bq: int | None = None):
    geo = _geo(call, kind)
    want = max(1, _target_tokens() // geo.page_size)
    pool = [c for c in space if bq is None or c.block_q == bq] or space
    fitting = [c for c in pool if c.pages_per_block <= want]
    return max(fitting, key=lambda c: c.pages_per_block) if fitting else min(pool, key=lambda c: c.pages_per_block)


def paged_tpu_heuristic(call: Call) -> TpuPagedConfig:
    """Blocks of 256 keys (v5e, v5p) or 512 (v6e, TPU7x: the wider MXU), fewer
    when the table is narrower or VMEM is short."""
    return _heuristic_pages(call, "paged", paged_tpu_space(call))


def mla_tpu_heuristic(call: Call) -> TpuMlaConfig:
    """As `paged_tpu_heuristic` for the latent cache."""
    return _heuristic_pages(call, "mla", mla_tpu_space(call))


def ragged_tpu_heuristic(call: Call) -> TpuRaggedConfig:
    """``block_q`` with about 64 rows per kv head, blocks as `paged_tpu_heuristic`."""
    return _heuristic_pages(call, "ragged", ragged_tpu_space(call), _ragged_block_q(call))


# -- requirements -------------------------------------------------------------------------
def _quant_reason(spec, dim: int) -> str | None:
    if spec is None:
        return None
    if spec.group_axis not in ("head_dim", "token"):
        return (f"the Mosaic TPU paged kernels dequantize head-dim or token groups, not "
                f"{spec.group_axis!r} scales (the XLA path runs them)")
    if getattr(spec, "part", None) is not None:
        return "the Mosaic TPU paged kernels do not read quantized halves of a combined kv buffer"
    if spec.group_axis == "head_dim" and spec.group(dim) != dim and spec.group(dim) % spec.per_byte:
        return (f"the Mosaic TPU paged kernels need {spec.format} head-dim groups that are a multiple of "
                f"{spec.per_byte} (values per byte), got group_size {spec.group(dim)}")
    return None


def _requirements(call: Call, kind: str) -> str | None:
    geo = _geo(call, kind)
    prefixes = ("latent", "pe") if kind == "mla" else ("k", "v")
    for prefix, dim in zip(prefixes, geo.dims):
        reason = _quant_reason(call.options.get(f"{prefix}_quant"), dim)
        if reason:
            return reason
    return None


def paged_tpu_requirements(call: Call) -> str | None:
    return _requirements(call, "paged")


def ragged_tpu_requirements(call: Call) -> str | None:
    return _requirements(call, "ragged")


def mla_tpu_requirements(call: Call) -> str | None:
    return _requirements(call, "mla")
