"""Token layouts for the chunked algorithm: padding to whole chunks and packed
(``cu_seqlens``) batches.

A `Stream` describes how ``[B, T, ...]`` tokens map onto ``[Bs, Tp, ...]``
rows of whole chunks:

* no ``cu_seqlens``: ``Bs = B``, each row padded at the end to a multiple of ``C``;
* ``cu_seqlens [N+1]`` (batch 1): one row where every sequence starts on a
  chunk boundary (each is padded to a multiple of ``C``), so a chunk belongs
  to exactly one sequence. ``Tp`` is exact when ``cu_seqlens`` is concrete and
  the static bound ``T + N·(C−1)`` (rounded up) when it is traced.

Padding tokens have ``k = v = q = 0``, ``β = 0`` and ``g = 0``: the identity
transition, so the state flows through them unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .reference import sequence_tokens


def _concrete(x):
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


@dataclasses.dataclass(frozen=True)
class Stream:
    batch: int          # B of the user's arrays
    length: int         # T
    rows: int           # Bs
    padded: int         # Tp (a multiple of chunk)
    chunk: int
    dest: jax.Array | None = None          # [T] destination of each token (varlen)
    chunk_seq: jax.Array | None = None     # [NT] sequence of each chunk (varlen)
    chunk_first: jax.Array | None = None   # [NT] chunk starts its sequence (varlen)
    last_chunk: jax.Array | None = None    # [N] last chunk of each sequence (varlen)
    empty: jax.Array | None = None         # [N] sequence has no token (varlen)

    @property
    def chunks(self) -> int:
        return self.padded // self.chunk

    @property
    def varlen(self) -> bool:
        return self.dest is not None

    def pack(self, x):
        """``[B, T, ...]`` → ``[Bs, Tp, ...]`` (zeros in the padding)."""
        if not self.varlen:
            if self.padded == self.length:
                return x
            pad = [(0, 0), (0, self.padded - self.length)] + [(0, 0)] * (x.ndim - 2)
            return jnp.pad(x, pad)
        out = jnp.zeros((1, self.padded) + x.shape[2:], x.dtype)
        return out.at[:, self.dest].set(x, unique_indices=True, indices_are_sorted=True)

    def unpack(self, x):
        """``[Bs, Tp, ...]`` → ``[B, T, ...]``."""
        if not self.varlen:
            return x[:, :self.length]
        return jnp.take(x, self.dest, axis=1, unique_indices=True, indices_are_sorted=True)


def make_stream(batch: int, length: int, chunk: int, cu_seqlens=None) -> Stream:
    if cu_seqlens is None:
        padded = -(-max(length, 1) // chunk) * chunk
        return Stream(batch, length, batch, padded, chunk)
    n = cu_seqlens.shape[0] - 1
    known = _concrete(cu_seqlens)
    if known is not None:
        lengths = np.diff(known.astype(np.int64))
        padded = int(np.sum(-(-lengths // chunk) * chunk))
    else:
        padded = length + n * (chunk - 1)
    padded = max(chunk, -(-padded // chunk) * chunk)
    cu = cu_seqlens.astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    chunks_per_seq = (lengths + chunk - 1) // chunk
    first_chunk = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(chunks_per_seq)[:-1]])
    seq, _, _ = sequence_tokens(cu, length)
    dest = first_chunk[seq] * chunk + (jnp.arange(length, dtype=jnp.int32) - cu[seq])
    c = jnp.arange(padded // chunk, dtype=jnp.int32)
    chunk_seq = jnp.clip(jnp.searchsorted(first_chunk, c, side="right").astype(jnp.int32) - 1, 0, n - 1)
    return Stream(
        batch, length, 1, padded, chunk, dest=dest, chunk_seq=chunk_seq,
        chunk_first=c == first_chunk[chunk_seq], last_chunk=first_chunk + chunks_per_seq - 1,
        empty=lengths == 0,
    )


def to_chunks(x, chunk: int):
    """``[Bs, Tp, ...]`` → ``[NT, Bs, C, ...]`` (scan-major; a free reshape when Bs = 1)."""
    bs, tp = x.shape[:2]
    return jnp.moveaxis(x.reshape(bs, tp // chunk, chunk, *x.shape[2:]), 1, 0)


def from_chunks(x):
    """``[NT, Bs, C, ...]`` → ``[Bs, Tp, ...]``."""
    nt, bs, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(bs, nt * c, *x.shape[3:])
