"""The page side of the Mosaic TPU paged kernels (`mosaic_tpu`, `mosaic_tpu_mla`):
the pools as the kernels see them, the double-buffered page pipeline, the
kv-head-group views of a block and the dequantization of quantized blocks in
VMEM.

**Page pipeline** (`PagePipeline`, `run_pipeline`). The pools stay in HBM
(``memory_space=ANY``); a program walks the blocks of ``pages_per_block``
pages covering ``[lo, hi)`` with two VMEM slots per pool array (codes,
scales, zero points: a page of all kv heads is one
``pltpu.make_async_copy`` HBM → VMEM, all copies of a slot signalling the
slot's DMA semaphore; pages at or past ``hi`` are not copied):

    (first program of a core) start(block 0 → slot s)
    for j in 0 .. n-1:
        if j + 1 < n: start(block j+1 → other slot)               # in flight ...
        elif next program has blocks: start(its block 0 → other slot)
        wait(slot); compute(block j from slot, every head group)  # ... during this

so the copy of the next block, across programs too (the slot is carried in
SMEM from one grid step to the next), overlaps the matmuls and the softmax
update of this one; only a core's first block is exposed. Blocks inside
the range every valid row sees (all of a decode step's but the last) skip
the visibility mask and the value zeroing (`mosaic_tpu.by_coverage`).

**Quantized pools** are dequantized in VMEM, never in HBM. Packed int4/int2
codes are not interleaved back into channels (a lane shuffle): byte ``j``
holds channels ``per_byte·j + i`` in bit field ``i``, so the codes split
into ``per_byte`` *parts* ``[T·hg, H/per_byte]`` by shifts and masks, the query
is split the same way outside the kernel (``s = Σ_i q_i · k_iᵀ``), values
accumulate per part and the wrapper interleaves the output. Group scales
(and zero points) are expanded onto the parts with exact 0/1 matmuls at
``HIGHEST`` precision (head-dim groups: ``[T·hg, H/g] @ E_i``; token groups:
``E_t @ [T·hg/g, H] @ S_i``, with the groups past ``hi`` zeroed first in a
masked block: the expansion mixes rows). Mosaic loads neither uint8 nor float16 vectors
here, so packed bytes travel as int8 and float16 scales as their int16 bits
(same-width bitcasts), decoded in VMEM. Folded e4m3 pools are read as
``float8_e4m3b11fnuz`` (a bitcast: the v5e converts those natively, e4m3fn
through five more VPU ops per vreg), their value / 16 (`B11_SCALE`, folded
into the scale row) and NaN for the code of -0 (selected to 0). That bitcast
happens in VMEM, on each block after its DMA: done in XLA on the pool, it
compiled to a ``bitcast-convert`` of the whole pool per call (a copy), and a
v5e measured the fp8 cache at 0.56x the bf16 cache's throughput. Folded int4
pools of 8 kv heads take the word path (`word_codes`): the slot read as int32
words, two kv heads' bfloat16 codes made from two nibbles, scales by head pair.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import dot
from .cache import Source
from .configs import TOKEN_MAJOR_HEADS, folds_scales

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
B11 = jnp.float8_e4m3b11fnuz
#: An e4m3 (bias 7) code read as e4m3b11fnuz (bias 11) is its value / 2^4, but for the code of -0
#: (0x80), NaN there (and the e4m3 NaN 0x7F reads 30, which no quantized value uses).
B11_SCALE = 16.0


# -- a paged source as the kernel sees it ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SourceMeta:
    """Static description of one paged source (keys, values, MLA rope part)."""

    spec: Any               # KVQuant or None
    part: int | None        # combined kv_pages index
    head_dim: int
    page_size: int
    fold: bool = False      # scales applied to the logits / probabilities (`folded_scales`)
    words: bool = False     # int4 codes read as int32 words of a token's 8 kv heads (`word_codes`)

    @property
    def b11(self) -> bool:
        """e4m3 codes read as e4m3b11fnuz (`B11_SCALE`): folded fp8 (e4m3) pools."""
        return self.fold and self.spec.format == "fp8"

    @property
    def per_byte(self) -> int:
        """Codes per loaded element: 4 for int2's packed bytes (split into parts), else 1
        (int4 pools are ``uint4``, one code per element, loaded and converted as they are)."""
        return 1 if self.spec is None else self.spec.per_element

    @property
    def part_dim(self) -> int:
        """Channels per part (``H / per_byte``)."""
        return self.head_dim // self.per_byte

    @property
    def token_groups(self) -> bool:
        return self.spec is not None and self.spec.group_axis == "token"

    @property
    def group(self) -> int:
        return self.spec.group(self.head_dim)


def source_meta(src: Source, words: bool = False) -> SourceMeta:
    """The kernel's static view of ``src``; ``words``: read through `word_codes` (the
    caller checked `word_codes` for its block size)."""
    return SourceMeta(src.spec, src.part, src.head_dim, src.page_size, source_folds(src), words)


#: kv heads whose uint4 codes of one token and channel share an int32 word (XLA:TPU's and Mosaic's
#: ``(8, 1)`` packing of 4-bit types: 8 consecutive rows, row ``8w + j`` in bits ``4j .. 4j + 3``).
WORD_HEADS = 8
#: The kv heads of `word_codes` group ``g``: ``g`` and ``g + 4``, 16 bits apart in a word.
WORD_PAIRS = tuple((g, g + WORD_HEADS // 2) for g in range(WORD_HEADS // 2))
#: A bfloat16 `word_codes` key or value is ``WORD_OFFSET + code`` (bits ``0x4300 | code``).
WORD_OFFSET = 128.0


def word_codes(src: Source) -> bool:
    """Whether ``src`` takes the word path of the Mosaic decode kernel: folded int4 pools
    (`source_folds`: one scale and zero point per token and kv head) of exactly `WORD_HEADS`
    kv heads, ``H`` a multiple of 128 and pages a multiple of 64 tokens.

    A slot's codes are read as int32 words ``[T, H]`` (word ``(t, c)``: channel ``c`` of token
    ``t``, kv head ``j`` in bits ``4j .. 4j + 3``) and the kv heads are taken in pairs
    (`WORD_PAIRS`): ``((w >> 4g) & 0x000F000F) | 0x43004300`` is, read as bfloat16 ``[2T, H]``,
    the keys (values) of heads ``g`` (row ``2t``) and ``g + 4`` (row ``2t + 1``) plus
    `WORD_OFFSET` — three VPU ops per word vreg for two heads, no unpack, permute or
    conversion — so a block update is a head group of 2 (`Softmax` with ``heads = 2``); the
    offset is taken out through the zero points (`word_scales`) and, for the values, with the
    rounded probabilities' sum (`Softmax.update`)."""
    return (source_folds(src) and src.spec.format == "int4" and src.num_heads == WORD_HEADS
            and src.head_dim % 128 == 0 and src.page_size % 64 == 0)


def source_folds(src: Source) -> bool:
    """`configs.folds_scales` for a source: its scales travel as one row
    ``[1, PS·K]`` per page and are applied to the logits and probabilities."""
    return (src.quantized and src.data.ndim == 4
            and folds_scales(src.spec, src.page_size, src.num_heads, src.head_dim, src.part is not None))


def token_major(src: Source) -> bool:
    """Whether the pool's pages go to the kernel as ``[NP, PS·K, H']`` (rows
    token-major, heads interleaved) instead of ``[NP, PS, K, H']``: for ``K``
    of 1, 2 or 4, whose ``[K, H']`` rows fill only part of a sublane tile (the
    HBM tiles of such a pool are ``K`` rows, so merging the axes is a free
    reshape there, and VMEM then holds whole tiles that a block reads as one
    matrix with no relayout). A combined pool's half stays 4-D."""
    return src.part is None and src.data.ndim == 4 and src.data.shape[2] in TOKEN_MAJOR_HEADS


def source_arrays(src: Source, words: bool = False) -> dict:
    """The HBM arrays of a source: ``data`` and, quantized, ``scale`` / ``zero``.
    int4 codes go in as the pool's ``uint4`` (lane-dense in HBM; Mosaic loads
    and converts them). Packed int2 bytes are passed as int8 (a same-width bitcast: Mosaic
    cannot load the uint8 vectors; the kernel masks the bit fields, so the
    sign does not matter).

    ``words`` (`word_codes`): the codes token-major ``[NP, PS·K, H]`` (a free
    reshape of the ``(8, 1)``-packed tiles) and one float32 ``scale`` array
    ``[NP, 8, 2·PS]`` by head pair (`WORD_PAIRS`): row ``g`` the scales, row
    ``4 + g`` the zero points of pair ``g``, lane ``2t + k`` head ``g + 4k``'s
    at token ``t`` (the columns of the pair's logits; an XLA transpose of the
    pool's ``[NP, PS, K, 1]`` scales and zero points in each call)."""
    data = src.data
    if words:
        np_, ps, k, h = data.shape
        by_pair = lambda a: jnp.transpose(a.astype(F32).reshape(np_, ps, 2, k // 2), (0, 3, 1, 2)).reshape(
            np_, k // 2, 2 * ps)
        return {"data": data.reshape(np_, ps * k, h),
                "scale": jnp.concatenate([by_pair(src.scale), by_pair(src.zero)], axis=1)}
    if jnp.dtype(data.dtype) == jnp.uint8:
        data = jax.lax.bitcast_convert_type(data, jnp.int8)
    if token_major(src):
        data = data.reshape(data.shape[0], data.shape[1] * data.shape[2], data.shape[3])
    arrays = {"data": data}
    if src.quantized:
        arrays["scale"] = _loadable(src.scale)
        if not src.spec.symmetric:
            arrays["zero"] = _loadable(src.zero)
        if source_folds(src):                  # [NP, PS, K, 1] → one lane-dense row per page
            for name in ("scale", "zero"):
                if name in arrays:
                    a = arrays[name]
                    arrays[name] = a.reshape(a.shape[0], 1, a.shape[1] * a.shape[2])
    return arrays


def _loadable(x):
    """float16 scales / zero points as their int16 bits (Mosaic has no float16
    vectors on these generations; `_to_f32` decodes them in VMEM)."""
    if jnp.dtype(x.dtype) == jnp.float16:
        return jax.lax.bitcast_convert_type(x, jnp.int16)
    return x


def _to_f32(x):
    """A loaded scale block → float32; int16 holds float16 bits: ``(-1)^s ·
    2^(e-15) · (1 + m/1024)``, subnormals ``(-1)^s · m · 2^-24``, e = 31 inf/NaN."""
    if x.dtype != jnp.int16:
        return x.astype(F32)
    h = x.astype(jnp.int32) & 0xFFFF
    sign, exp, mant = (h >> 15) & 1, (h >> 10) & 0x1F, h & 0x3FF
    normal = jax.lax.bitcast_convert_type((sign << 31) | ((exp + 112) << 23) | (mant << 13), F32)
    special = jax.lax.bitcast_convert_type((sign << 31) | (255 << 23) | (mant << 13), F32)
    sub = jnp.where(sign == 1, -1.0, 1.0) * mant.astype(F32) * F32(2.0 ** -24)
    return jnp.where(exp == 0, sub, jnp.where(exp == 31, special, normal))


def _page_view(ref, meta: SourceMeta, page, name: str):
    """HBM view of page ``page``, every kv head: ``[rows, K, lanes]`` or
    token-major ``[rows·K, lanes]`` (a kv head alone is not a whole (8, 128)
    tile of the pool's HBM layout, so a DMA cannot address it)."""
    if name == "data" and meta.part is not None:
        return ref.at[page, :, meta.part]
    return ref.at[page]


# -- the double-buffered page pipeline ----------------------------------------------------
class PagePipeline:
    """Two VMEM slots per HBM pool array. ``start(row, block, slot, limit)``
    issues one async copy per page and array of block ``block`` of table row
    ``row`` (page ids read from the flattened block table in SMEM), skipping
    the pages at or past ``limit`` (the row's pages that hold no key of the
    program's range: a block's tail past the sequence is not read);
    ``wait(block, slot, limit)`` waits for the same copies (a wait needs only
    a copy's size and semaphore, so it names page 0). A slot's pages that were
    not copied hold an earlier block's data, or nothing: only keys at
    positions no row sees live there, and the masked block update selects
    them away."""

    def __init__(self, pools: dict, bufs: dict, sems, metas: dict, *, tables, width: int, ppb: int):
        self.pools, self.bufs, self.sems, self.metas = pools, bufs, sems, metas
        self.tables, self.width, self.ppb = tables, width, ppb

    def _copy(self, src, name, slot, i, page):
        meta, buf = self.metas[src], self.bufs[(src, name)]
        if meta.fold and not meta.words and name != "data":         # page i's scales: lanes [i·W, (i+1)·W) of the slot's row
            width = buf.shape[-1] // self.ppb
            dst = buf.at[slot, :, pl.ds(i * width, width)]
        else:
            dst = buf.at[slot, i]
        return pltpu.make_async_copy(_page_view(self.pools[(src, name)], meta, page, name), dst,
                                     self.sems.at[slot])

    def _each(self, block, limit, page_of, op):
        first = block * self.ppb

        def one(i):
            page = page_of(i)
            for src, name in self.pools:
                op(self._copy(src, name, page[1], i, page[0]))

        @pl.when(first + self.ppb <= limit)
        def _():
            for i in range(self.ppb):
                one(i)

        @pl.when(first + self.ppb > limit)
        def _():
            for i in range(self.ppb):
                pl.when(first + i < limit)(functools.partial(one, i))

    def start(self, row, block, slot, limit):
        base = row * self.width + block * self.ppb
        self._each(block, limit, lambda i: (self.tables[base + i], slot), lambda c: c.start())

    def wait(self, block, slot, limit):
        self._each(block, limit, lambda i: (0, slot), lambda c: c.wait())


def pipeline_scratch(sources: dict, ppb: int, words: bool = False) -> dict:
    """VMEM slots ``[2, ppb, *page]`` (a page: ``[rows, K, lanes]`` or token-major
    ``[rows·K, lanes]``) for every pool array of ``sources`` (name → `Source`;
    ``words``: their `source_arrays` for `word_codes`),
    the two DMA semaphores and the SMEM word carrying the slot of the next
    program's first block from one grid step to the next."""
    scratch = {}
    for src_name, src in sources.items():
        for name, arr in source_arrays(src, words).items():
            if name != "data" and source_folds(src) and not words:              # a block's scales: one row [1, ppb·PS·K]
                shape = (2, 1, ppb * arr.shape[-1])
            else:
                shape = (2, ppb, *(arr.shape[1:] if arr.ndim == 3 else (arr.shape[1], arr.shape[-2], arr.shape[-1])))
            scratch[f"buf_{src_name}_{name}"] = pltpu.VMEM(shape, arr.dtype)
    scratch["sems"] = pltpu.SemaphoreType.DMA((2,))
    scratch["next_slot"] = pltpu.SMEM((1,), jnp.int32)
    return scratch


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Where each program's blocks are: its table row (``seq``), its key range
    ``[key_lo, key_hi)`` (scalar-prefetch refs), ``tokens`` keys per block of
    ``ppb`` pages of ``page_size``, ``programs`` programs (padded ones have an
    empty range) in ``cores`` runs of ``per_core``."""

    seq: Any
    key_lo: Any
    key_hi: Any
    tokens: int
    page_size: int
    width: int
    per_core: int

    def of(self, b):
        """``(row, first block, blocks, page limit)`` of program ``b``."""
        first, n = block_range(self.key_lo[b], self.key_hi[b], self.tokens)
        limit = jnp.minimum(idiv(jnp.maximum(self.key_hi[b], 0) + self.page_size - 1, self.page_size), self.width)
        return self.seq[b], first, n, limit


def run_pipeline(pipe: PagePipeline, sched: Schedule, next_slot, compute):
    """``compute(block, slot)`` for program ``b``'s blocks (grid step ``(c, i)``,
    ``b = c·per_core + i``), the copy of the next block in flight during each
    — across programs too: the last block of program ``b`` starts the first
    block of program ``b + 1`` (the next step of this core), so only the
    first block of a core's first program is exposed (see the module doc)."""
    c, i = pl.program_id(0), pl.program_id(1)
    b = c * sched.per_core + i
    row, first, n, limit = sched.of(b)
    has_next = i + 1 < sched.per_core
    n_row, n_first, n_n, n_limit = sched.of(jnp.where(has_next, b + 1, b))
    n_n = jnp.where(has_next, n_n, 0)

    @pl.when(i == 0)
    def _():
        next_slot[0] = 0

    slot0 = next_slot[0]

    @pl.when((i == 0) & (n > 0))
    def _():
        pipe.start(row, first, slot0, limit)

    def body(j, carry):
        slot = jax.lax.rem(slot0 + j, 2)

        @pl.when(j + 1 < n)
        def _():
            pipe.start(row, first + j + 1, 1 - slot, limit)

        @pl.when((j + 1 == n) & (n_n > 0))
        def _():
            pipe.start(n_row, n_first, 1 - slot, n_limit)

        pipe.wait(first + j, slot, limit)
        compute(first + j, slot)
        return carry

    jax.lax.fori_loop(0, n, body, 0)

    @pl.when((n == 0) & (n_n > 0))
    def _():
        pipe.start(n_row, n_first, slot0, n_limit)

    next_slot[0] = jax.lax.rem(slot0 + n, 2)


# -- kv head groups ------------------------------------------------------------------------
def idiv(x, n: int):
    """``x // n`` of non-negative int32 values: a shift when ``n`` is a power of
    two, else `jax.lax.div` (Mosaic lowers ``//`` through ``sign``, which needs
    a TPU to query)."""
    if n & (n - 1) == 0:
        return jax.lax.shift_right_logical(x, jnp.int32(n.bit_length() - 1))
    return jax.lax.div(x, jnp.int32(n))


def imod(x, n: int):
    """``x % n`` of non-negative int32 values (a mask when ``n`` is a power of two)."""
    if n & (n - 1) == 0:
        return x & jnp.int32(n - 1)
    return jax.lax.rem(x, jnp.int32(n))


def group_rows(ref, slot, group: int, hg: int):
    """Slot ``slot`` of a ``[2, ppb, rows, K, lanes]`` buffer, kv heads
    ``group·hg .. group·hg + hg - 1``, as ``[ppb·rows·hg, lanes]`` in the
    buffer's dtype: row ``(page·rows + t)·hg + k``. The buffer's tiles are
    ``[K, lanes]`` per token (or whole token-major tiles, `token_major`), so
    this is a plain view (no relayout) when the group is all ``K`` heads or a
    whole tile of them (`configs.head_group`)."""
    if ref.ndim == 4:                                       # token-major pages [2, ppb, rows·K, lanes]
        x = ref[slot]
        return x.reshape(x.shape[0] * x.shape[1], x.shape[2])
    x = ref[slot] if hg == ref.shape[3] else ref[slot, :, :, pl.ds(group * hg, hg), :]
    return x.reshape(x.shape[0] * x.shape[1] * hg, x.shape[-1])


# -- dequantization in VMEM ---------------------------------------------------------------
def _select(rows: int, cols: int, fn):
    """A float32 0/1 matrix ``[rows, cols]``: ``fn(row_iota, col_iota)``."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return jnp.where(fn(r, c), 1.0, 0.0).astype(F32)


def _expand(a, meta: SourceMeta, part: int, ppb: int, hg: int):
    """A block's float32 scales (or zero points) of one head group expanded onto
    part ``part``: head-dim groups ``a [T·hg, H/g]``, token groups ``a
    [(ppb·PS/g)·hg, H]`` (row ``(token group)·hg + head``) → ``[T·hg, H']``."""
    pb, hp, g, tokens = meta.per_byte, meta.part_dim, meta.group, ppb * meta.page_size
    if meta.token_groups:
        same = lambda c, r: (idiv(idiv(c, hg), g) == idiv(r, hg)) & (imod(c, hg) == imod(r, hg))
        a = dot(_select(tokens * hg, a.shape[0], same), a, precision=HIGHEST)                        # [T·hg, H]
        if pb == 1:
            return a
        return dot(a, _select(meta.head_dim, hp, lambda ch, j: ch == pb * j + part), precision=HIGHEST)
    ng = a.shape[-1]
    if ng == 1:
        return a
    return dot(a, _select(ng, hp, lambda gi, j: idiv(pb * j + part, g) == gi), precision=HIGHEST)


def dequantize(bufs: dict, src: str, meta: SourceMeta, slot, group: int, hg: int, ppb: int, dtype,
               keys=None) -> list:
    """Block ``slot`` of source ``src``, kv heads of group ``group`` (``hg`` of
    them) → ``per_byte`` parts ``[ppb·PS·hg, H']`` in ``dtype`` (rows as
    `group_rows`): ``codes · scale (+ zero)``; a dense pool is used as loaded.

    ``keys = (block, key_hi)`` in a masked block: token-group scales and zero
    points of groups starting at or past ``key_hi`` are zeroed before their
    expansion, a matmul that mixes rows (free groups and uncopied pages may
    hold NaN, and ``0 · NaN = NaN`` would reach every row)."""
    raw = group_rows(bufs[(src, "data")], slot, group, hg)
    if meta.b11:  # in VMEM, not in XLA: a bitcast of the pool there is a copy of the whole pool per call
        raw = jax.lax.bitcast_convert_type(raw, B11)
    if meta.spec is None:
        return [raw if raw.dtype == dtype else raw.astype(dtype)]
    spec = meta.spec
    if meta.per_byte == 1:
        codes = [raw.astype(F32)]
    else:
        ints = raw.astype(jnp.int32)
        mask = (1 << spec.bits) - 1
        codes = [((ints >> (spec.bits * p)) & mask).astype(F32) for p in range(meta.per_byte)]
    if meta.fold:                                  # the scales go to the logits / probabilities
        if meta.b11:                               # -0 reads NaN (`B11_SCALE`): 0 there
            codes = [jnp.where(c == c, c, 0.0) for c in codes]
        return [c.astype(dtype) for c in codes]
    scale = _to_f32(group_rows(bufs[(src, "scale")], slot, group, hg))
    zero = None if spec.symmetric else _to_f32(group_rows(bufs[(src, "zero")], slot, group, hg))
    if meta.token_groups and keys is not None:
        block, key_hi = keys
        r = jax.lax.broadcasted_iota(jnp.int32, (scale.shape[0], 1), 0)
        live = block * ppb * meta.page_size + idiv(r, hg) * meta.group < key_hi
        scale = jnp.where(live, scale, 0.0)
        zero = None if zero is None else jnp.where(live, zero, 0.0)
    parts = []
    for p, c in enumerate(codes):
        x = c * _expand(scale, meta, p, ppb, hg)
        if zero is not None:
            x = x + _expand(zero, meta, p, ppb, hg)
        parts.append(x.astype(dtype))
    return parts


def folded_scales(bufs: dict, src: str, meta: SourceMeta, slot, hg: int, ppb: int, keys=None):
    """The float32 scale row ``[1, T·K]`` (column ``t·K + k``, as the block's
    logits) of a folding source (`configs.folds_scales`), and its zero-point
    row or ``None``: the codes' logits are ``s = scale · (q · codes) + zero ·
    Σ q`` and the values' contribution ``(p · scale) · codes + Σ p · zero``.
    In a masked block (``keys = (block, key_hi)``) the columns at or past
    ``key_hi`` are zeroed (free slots and uncopied pages may hold NaN, and
    ``p = 0`` would not cancel it)."""
    rows = [_to_f32(bufs[(src, name)][slot]) if (src, name) in bufs else None for name in ("scale", "zero")]
    if meta.b11:                                   # the codes were read as e4m3b11fnuz: value / 16
        rows[0] = rows[0] * F32(B11_SCALE)
    if keys is not None:
        block, key_hi = keys
        c = jax.lax.broadcasted_iota(jnp.int32, rows[0].shape, 1)
        live = block * ppb * meta.page_size + idiv(c, hg) < key_hi
        rows = [None if r is None else jnp.where(live, r, 0.0) for r in rows]
    return rows[0], rows[1]


def word_block(bufs: dict, src: str, slot):
    """Slot ``slot`` of a `word_codes` source's codes ``[2, ppb, PS·K, H]`` uint4 as
    int32 words ``[T, H]`` (`pltpu.bitcast` of the loaded ``[T·K, H]`` codes: word
    ``(t, c)`` holds channel ``c`` of token ``t`` of all 8 kv heads, head ``j``
    in bits ``4j .. 4j + 3``; a reinterpretation of the packed vregs)."""
    x = bufs[(src, "data")][slot]                                         # [ppb, PS·K, H] uint4
    return pltpu.bitcast(x.reshape(x.shape[0] * x.shape[1], x.shape[2]), jnp.int32)


def pair_codes(words, pair: int, dtype):
    """Head pair ``pair``'s (`WORD_PAIRS`) keys or values ``[2T, H]`` in ``dtype``:
    row ``2t + k`` is the code of token ``t``, kv head ``pair + 4k``, plus
    `word_offset` ``(dtype)`` (bfloat16 ``0x4300 | code`` is ``128 + code``, exact;
    other dtypes subtract the 128 after the conversion)."""
    w = words if pair == 0 else jax.lax.shift_right_logical(words, jnp.int32(4 * pair))
    x = pltpu.bitcast((w & 0x000F000F) | 0x43004300, jnp.bfloat16)
    if x.dtype == dtype:
        return x
    return x.astype(dtype) - jnp.asarray(WORD_OFFSET, dtype)


def word_offset(dtype) -> float:
    """What `pair_codes` adds to the codes in ``dtype``: `WORD_OFFSET` in bfloat16, else 0."""
    return WORD_OFFSET if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 0.0


def word_scales(bufs: dict, src: str, meta: SourceMeta, slot, ppb: int, keys=None) -> list:
    """A `word_codes` block's float32 scale and zero-point rows ``(scale [1, 2T],
    zero [1, 2T])`` of each head pair (column ``2t + k``: the block's token ``t``,
    head ``pair + 4k``, as the pair's logits), from the slot's ``[ppb, 8, 2·PS]``
    (`source_arrays`). In a masked block (``keys =
    (block, key_hi)``) the columns at or past ``key_hi`` are zeroed (free slots and
    uncopied pages may hold NaN; `folded_scales`)."""
    x = bufs[(src, "scale")][slot]                                       # [ppb, 8, 2·PS]
    live = None
    if keys is not None:
        block, key_hi = keys
        c = jax.lax.broadcasted_iota(jnp.int32, (1, ppb * x.shape[-1]), 1)
        live = block * ppb * meta.page_size + idiv(c, 2) < key_hi
    rows = []
    for g in range(len(WORD_PAIRS)):
        scale = jnp.concatenate([x[i, g:g + 1] for i in range(ppb)], axis=1)
        zero = jnp.concatenate([x[i, 4 + g:5 + g] for i in range(ppb)], axis=1)
        if live is not None:
            scale, zero = jnp.where(live, scale, 0.0), jnp.where(live, zero, 0.0)
        rows.append((scale, zero))
    return rows


def split_parts(x, per_byte: int):
    """``[..., R, H]`` → ``[..., per_byte, R, H / per_byte]`` (part ``i`` = channels ``per_byte·j + i``)."""
    *lead, r, h = x.shape
    return jnp.moveaxis(x.reshape(*lead, r, h // per_byte, per_byte), -1, -3)


def merge_parts(x):
    """Inverse of `split_parts` on ``[..., per_byte, R, H']`` → ``[..., R, H]``."""
    *lead, pb, r, hp = x.shape
    return jnp.moveaxis(x, -3, -1).reshape(*lead, r, hp * pb)


def block_range(lo, hi, tokens: int):
    """Blocks of ``tokens`` keys covering ``[lo, hi)``: ``(first, count)``."""
    lo = jnp.maximum(lo, 0)
    hi = jnp.maximum(hi, lo)
    first = idiv(lo, tokens)
    return first, jnp.where(hi > lo, idiv(hi + tokens - 1, tokens) - first, 0)


def program_pipeline(refs: dict, *, tables, seq, key_lo, key_hi, sems, metas: dict, tokens: int, ppb: int,
                     width: int, per_core: int):
    """A kernel step's program ``b``, the `PagePipeline` over its
    ``hbm_<source>_<array>`` pools and ``buf_<source>_<array>`` slots
    (``tables``: the flattened block table, ``width`` entries per row), the
    slots by ``(source, array)`` and the programs' `Schedule`."""
    b = pl.program_id(0) * per_core + pl.program_id(1)
    pools = {tuple(k[4:].split("_", 1)): r for k, r in refs.items() if k.startswith("hbm_")}
    bufs = {tuple(k[4:].split("_", 1)): r for k, r in refs.items() if k.startswith("buf_")}
    pipe = PagePipeline(pools, bufs, sems, metas, tables=tables, width=width, ppb=ppb)
    sched = Schedule(seq, key_lo, key_hi, tokens, tokens // ppb, width, per_core)
    return b, pipe, bufs, sched
