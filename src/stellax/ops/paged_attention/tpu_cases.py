"""Paged decode kernels on abstract operands, for the static schedule tool
(`stellax.testing.llo_schedule`): stellax's Mosaic TPU decode kernel and,
as the peer, jax's bundled ``paged_attention`` kernel, on one decode shape.

    python -m stellax.testing.llo_schedule stellax.ops.paged_attention.tpu_cases:decode_case \\
        batch=64 context=4096 page_size=64 pages_per_block=8

`decode_case` returns ``(fn, args)`` (args: shape structs): one decode step,
``batch`` sequences of ``context`` tokens on pages of ``page_size``,
``q_heads`` query heads over ``kv_heads``, head dim ``head_dim``, bfloat16
queries; ``cache``: ``"bf16"`` or a `quantize_pages` format (``"int8"``,
``"fp8"``, ``"int4"``, ...); ``peer=True``: jax's kernel on the same pages in
its head-major layout ``[K, pages, page_size, H]`` (bf16 only), with
``pages_per_block`` as its ``pages_per_compute_block``.

`block_dma_cycles` is the HBM time of one block's pages in v5e clock cycles,
what a block's compute has to stay under for the decode to be bound by HBM.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

#: v5e: HBM bandwidth (bytes/s) and TensorCore clock (Hz) the static comparison uses.
V5E_HBM_BYTES_PER_S = 819e9
V5E_CLOCK_HZ = 1.5e9


def _pages(num_pages: int, page_size: int, kv_heads: int, head_dim: int, cache: str):
    from . import quantize_pages

    dense = jax.ShapeDtypeStruct((num_pages, page_size, kv_heads, head_dim), jnp.bfloat16)
    if cache == "bf16":
        return dense
    return jax.eval_shape(lambda x: quantize_pages(x, cache), dense)


def decode_case(batch: int = 64, context: int = 4096, page_size: int = 64, pages_per_block: int = 8,
                q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128, cache: str = "bf16",
                peer: bool = False):
    """``(fn, args)``: one decode step (module docstring); ``fn(q, k, v, tables, lengths)``
    with ``q [batch, q_heads, head_dim]`` bf16, pools ``[pages, page_size, kv_heads,
    head_dim]`` (or jax's ``[kv_heads, pages, page_size, head_dim]`` for the ``peer``),
    ``tables [batch, context / page_size]`` and ``lengths [batch]`` int32."""
    if context % page_size:
        raise ValueError(f"context: expected a multiple of page_size {page_size}, got {context}")
    width = context // page_size
    if width % pages_per_block:
        raise ValueError(f"pages_per_block: expected a divisor of the table width {width}, got {pages_per_block}")
    num_pages = batch * width
    q = jax.ShapeDtypeStruct((batch, q_heads, head_dim), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    if peer:
        if cache != "bf16":
            raise ValueError(f"cache: jax's kernel is compiled on the bf16 cache only, got {cache!r}")
        from jax.experimental.pallas.ops.tpu.paged_attention import (
            paged_attention as jax_paged,
        )

        pool = jax.ShapeDtypeStruct((kv_heads, num_pages, page_size, head_dim), jnp.bfloat16)

        def peer_fn(q, k, v, tables, lengths):
            return jax_paged(q, k, v, lengths, tables, pages_per_compute_block=pages_per_block)
        return peer_fn, (q, pool, pool, tables, lengths)

    from . import paged_attention
    from .configs import TpuPagedConfig

    pool = _pages(num_pages, page_size, kv_heads, head_dim, cache)
    config = TpuPagedConfig(pages_per_block=pages_per_block)

    def fn(q, k, v, tables, lengths):
        return paged_attention(q, k, v, tables, lengths, implementation="mosaic_tpu", config=config)
    return fn, (q, pool, pool, tables, lengths)


def mla_case(batch: int = 64, context: int = 4096, page_size: int = 64, pages_per_block: int = 8,
             heads: int = 128, latent: int = 512, rope: int = 64, cache: str = "bf16"):
    """``(fn, args)``: one `mla_decode` step on the Mosaic TPU kernel (DeepSeek-V3 by
    default: 128 heads, latent 512 + rope 64), ``fn(q_nope, q_pe, latent_pages, pe_pages,
    tables, lengths)`` with ``q_nope [batch, heads, latent]``, ``q_pe [batch, heads, rope]``
    bf16, ``latent_pages [pages, page_size, latent]`` (bf16 or a `quantize_pages` format),
    ``pe_pages [pages, page_size, rope]`` bf16."""
    if context % page_size or (context // page_size) % pages_per_block:
        raise ValueError(f"context: expected a multiple of page_size · pages_per_block "
                         f"{page_size * pages_per_block}, got {context}")
    from . import mla_decode, quantize_pages
    from .configs import TpuMlaConfig

    width = context // page_size
    num_pages = batch * width
    q = jax.ShapeDtypeStruct((batch, heads, latent), jnp.bfloat16)
    q_pe = jax.ShapeDtypeStruct((batch, heads, rope), jnp.bfloat16)
    lat = jax.ShapeDtypeStruct((num_pages, page_size, latent), jnp.bfloat16)
    if cache != "bf16":
        lat = jax.eval_shape(lambda x: quantize_pages(x, cache), lat)
    pe = jax.ShapeDtypeStruct((num_pages, page_size, rope), jnp.bfloat16)
    tables = jax.ShapeDtypeStruct((batch, width), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    config = TpuMlaConfig(pages_per_block=pages_per_block)

    def fn(q, q_pe, lat, pe, tables, lengths):
        return mla_decode(q, q_pe, lat, pe, tables, lengths, scale=(latent + rope) ** -0.5,
                          implementation="mosaic_tpu", config=config)
    return fn, (q, q_pe, lat, pe, tables, lengths)


def block_dma_cycles(tokens: int, kv_heads: int, head_dim: int, bytes_per_value: float,
                     hbm_bytes_per_s: float = V5E_HBM_BYTES_PER_S, clock_hz: float = V5E_CLOCK_HZ) -> float:
    """Clock cycles the HBM takes to deliver one block's keys and values: ``2 · tokens ·
    kv_heads · head_dim · bytes_per_value`` bytes at ``hbm_bytes_per_s``, times ``clock_hz``
    (v5e: 819 GB/s, 1.5 GHz; 512 tokens × 8 bf16 heads of 128: 2 MiB, ~3840 cycles)."""
    return 2 * tokens * kv_heads * head_dim * bytes_per_value / hbm_bytes_per_s * clock_hz


# -- the block loop in libtpu's final bundles -------------------------------------------------------
_BUNDLE_LINE = re.compile(r"^\s*(0x[0-9a-f]+)\s*([A-Z]*):?\s*(>*)")


@dataclasses.dataclass(frozen=True)
class Segment:
    """A straight-line run of bundles of a kernel's final schedule: ``[first, first + bundles)``
    (bundle indices), its loop depth (``>`` markers of the dump), and the instructions it holds
    of a few kinds: ``matmuls`` (``vmatmul``), ``exps`` (``vpow2``), ``spills`` (spill slot
    loads / stores) and ``dmas`` (DMA starts and waits, as the dump names them)."""

    first: int
    bundles: int
    depth: int
    matmuls: int
    exps: int
    spills: int
    dmas: int


def segments(path: str) -> list[Segment]:
    """The `Segment` s of a ``*-final_bundles.txt`` dump: split before every labelled bundle
    (loop header / body / exit, predicated region, control target) and after every branch."""
    rows = []
    with open(path) as f:
        for line in f:
            found = _BUNDLE_LINE.match(line)
            if found:
                counts = (line.count("vmatmul"), line.count("vpow2"), line.count("_spill]"), line.count("dma"))
                rows.append((int(found.group(1), 16), bool(found.group(2)), len(found.group(3)),
                             "target = $region" in line, counts))
    out, start, acc = [], 0, [0, 0, 0, 0]

    def close(end: int):
        if end > start:
            out.append(Segment(rows[start][0], rows[end - 1][0] - rows[start][0] + 1, rows[start][2], *acc))

    for i, (_, labelled, _, branch, counts) in enumerate(rows):
        if labelled and i > start:
            close(i)
            start, acc = i, [0, 0, 0, 0]
        acc = [a + b for a, b in zip(acc, counts)]
        if branch:
            close(i + 1)
            start, acc = i + 1, [0, 0, 0, 0]
    close(len(rows))
    return out


_GRANULES = re.compile(r"size_in_granules=\*/(\d+)")
#: Bytes of a DMA granule in the dumps' ``size_in_granules`` (an int8 page of 64 tokens × 8 heads × 128
#: channels, 64 KiB, is 2048 of them on v5e).
DMA_GRANULE_BYTES = 32


def dma_sizes(path: str) -> dict[int, int]:
    """``{bytes: count}`` of the DMAs in a ``*-final_bundles.txt`` dump (`DMA_GRANULE_BYTES` per granule of
    their ``size_in_granules``): the page copies of a paged kernel are the largest."""
    sizes: dict[int, int] = {}
    with open(path) as f:
        for found in _GRANULES.finditer(f.read()):
            size = int(found.group(1)) * DMA_GRANULE_BYTES
            sizes[size] = sizes.get(size, 0) + 1
    return sizes


def block_compute(path: str) -> tuple[int, int]:
    """``(unmasked, masked)`` bundles of the block update of a paged kernel's dump: the
    segments holding the block's matmuls (a block every row sees whole, and a masked one; the
    same segment twice when the kernel has one body)."""
    sizes = sorted(s.bundles for s in segments(path) if s.matmuls)
    if not sizes:
        raise ValueError(f"path: no segment with a vmatmul in {path}")
    return sizes[0], sizes[-1]


def dump_kernel(builder_kwargs: dict, directory: str, kernel: str, generation: str = "v5e",
                timeout: float = 600, builder: str = "decode_case") -> str:
    """Compile ``builder`` (`decode_case` or `mla_case`) ``(**builder_kwargs)`` for ``generation`` in a fresh process with
    libtpu's dumps under ``directory`` (`stellax.testing.llo_schedule`) and return the path of
    the final bundles of the kernel whose name starts with ``kernel``."""
    command = [sys.executable, "-m", "stellax.testing.llo_schedule", f"{__name__}:{builder}",
               f"--generation={generation}", f"--dump={directory}"]
    command += [f"{key}={json.dumps(value)}" for key, value in builder_kwargs.items()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode:
        raise RuntimeError(f"compiling {builder}({builder_kwargs}) failed: {done.stderr.strip()[-400:]}")
    paths = sorted(glob.glob(os.path.join(directory, f"*-{kernel}*-final_bundles.txt")))
    paths = [p for p in paths if "schedule-analysis" not in p]
    if not paths:
        raise RuntimeError(f"kernel: no final bundles of {kernel!r} under {directory}")
    return paths[-1]
