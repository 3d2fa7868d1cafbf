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

The Triton kernels work on a heads-major layout of the padded stream
(`heads_major`): ``q, k [Bs, HV, Tp, K]``, ``v [Bs, HV, Tp, V]``,
``g [Bs, HV, Tp(, K)]``, ``beta [Bs, HV, Tp]``, head sizes zero-padded to
powers of two ≥ 16, flattened to ``[Bs·HV, Tp, ...]`` for a launch (`flat`),
and, for packed batches, int32 ``first, seq, last [NT]`` per chunk
(`chunk_meta`: the chunk starts its sequence, its sequence, it ends it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call
from ...core.pallas import F32, cdiv, pad_axis
from .configs import TRITON_CHUNK
from .reference import sequence_tokens


def _concrete(x):
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


@dataclasses.dataclass(frozen=True)
class Stream:
    """How ``[B, T, ...]`` tokens map onto ``[Bs, Tp, ...]`` rows of whole chunks
    (module docstring); the varlen fields are ``None`` for dense batches."""

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
    """The `Stream` of ``[B, T, ...]`` tokens cut into chunks of ``chunk``
    (packed by ``cu_seqlens [N+1]`` when given, with B = 1)."""
    if cu_seqlens is None:
        padded = cdiv(max(length, 1), chunk) * chunk
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


# -- the kernels' heads-major layout ------------------------------------------------
def heads_major(stream: Stream, x, dim: int | None = None, dtype=F32):
    """``[B, T, HV(, D)]`` → ``[Bs, HV, Tp(, D)]`` in ``dtype``, ``D`` zero-padded to ``dim``."""
    x = stream.pack(x.astype(dtype))
    if dim is not None:
        x = pad_axis(x, x.ndim - 1, dim)
    return jnp.moveaxis(x, 2, 1)


def chunk_meta(stream: Stream):
    """A packed stream's int32 ``(first, seq, last) [NT]`` per chunk (``None`` when dense)."""
    if not stream.varlen:
        return None
    last = jnp.zeros((stream.chunks,), jnp.int32).at[stream.last_chunk].max(
        jnp.where(stream.empty, 0, 1).astype(jnp.int32), mode="drop")
    return (stream.chunk_first.astype(jnp.int32), stream.chunk_seq, last)


def kernel_stream(rows: int, padded: int, chunk: int, meta=None, n_states: int | None = None) -> Stream:
    """The `Stream` behind a heads-major layout of ``rows`` × ``padded`` tokens:
    dense without ``meta``; else packed (one row) by ``meta = (first, seq, last)``
    over ``n_states`` sequences (its ``empty`` marks sequences with no chunk)."""
    if meta is None:
        return Stream(rows, padded, rows, padded, chunk)
    first, seq, last = meta
    first = first != 0
    c = jnp.arange(padded // chunk)
    last_chunk = jnp.zeros((n_states,), jnp.int32).at[seq].max(jnp.where(last != 0, c, 0))
    seen = jnp.zeros((n_states,), bool).at[seq].max(first)
    return Stream(1, padded, 1, padded, chunk, dest=jnp.arange(padded), chunk_seq=seq, chunk_first=first,
                  last_chunk=last_chunk, empty=~seen)


def flat(x):
    """``[Bs, HV, ...]`` → ``[Bs·HV, ...]`` (a launch's rows; ``None`` stays ``None``)."""
    return None if x is None else x.reshape((-1,) + x.shape[2:])


def per_chunk(x, chunk: int):
    """``[Bs, HV, Tp, ...]`` → ``[Bs, HV, NT, C, ...]`` (``None`` stays ``None``)."""
    return None if x is None else x.reshape(x.shape[:2] + (x.shape[2] // chunk, chunk) + x.shape[3:])


def _is_head_size(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def check_flat_layout(chunk: int, **arrays) -> None:
    """Validate the kernels' flattened layout; ``arrays`` maps names to ``(array,
    expected shape)`` where ``None`` entries are free. Raises ``ValueError``
    naming the argument: a shape mismatch, a padded length ``Tp`` that is not a
    multiple of ``chunk`` or a head size that is not a power of two ≥ 16."""
    for name, (x, shape) in arrays.items():
        if x.ndim != len(shape) or any(e is not None and e != d for e, d in zip(shape, x.shape)):
            want = tuple("*" if e is None else e for e in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    for name, (x, shape) in arrays.items():
        if name in ("q", "k", "kg", "qg", "w") and x.ndim == 3:
            if x.shape[1] % chunk:
                raise ValueError(f"{name}: expected a padded length that is a multiple of {chunk}, got {x.shape[1]}")
            if not _is_head_size(x.shape[-1]):
                raise ValueError(f"{name}: expected a head size that is a power of two >= 16, got {x.shape[-1]}")
        if name in ("v", "u", "do", "delta") and x.ndim == 3 and not _is_head_size(x.shape[-1]):
            raise ValueError(f"{name}: expected a value size that is a power of two >= 16, got {x.shape[-1]}")


# -- a backward op's call (`backward`: the kernels' layout, chunks of `TRITON_CHUNK`) ----------
def call_meta(call: Call):
    """A backward call's ``(first, seq, last)`` (``None``: a dense batch)."""
    return None if call.first is None else (call.first, call.seq, call.last)


def stream_of(call: Call) -> Stream:
    """The padded token layout of a backward call (``v [Bs, HV, Tp, V]``,
    packed when ``first, seq, last`` are given)."""
    bs, _, tp = call.v.shape[:3]
    return kernel_stream(bs, tp, TRITON_CHUNK, call_meta(call), n_states=call.h0.shape[0])


def dfinal_of(call: Call):
    """A backward call's ``dfinal`` in float32 (zeros when absent)."""
    return jnp.zeros(call.h0.shape, F32) if call.dfinal is None else call.dfinal.astype(F32)


def pass_empty_sequences(call: Call, dh0, dfinal):
    """An empty packed sequence passes its initial state straight through: its ``dh0`` is ``dfinal``."""
    if call.first is None:
        return dh0
    return jnp.where(stream_of(call).empty[:, None, None, None], dfinal, dh0)


def differentiate(call: Call, forward):
    """``(dq, dk, dv, dg, dβ or None, dh0)``: the VJP of ``forward(call, q, k, v, g, beta, h0)``
    for a backward call's cotangents ``do`` and ``dfinal``, in float32."""
    names = ("q", "k", "v", "g", "beta", "h0")
    has_beta = call.beta is not None
    args = [call.arrays[n].astype(F32) for n in names if n != "beta" or has_beta]

    def f(*a):
        a = list(a)
        if not has_beta:
            a.insert(4, None)
        return forward(call, *a)

    out, vjp = jax.vjp(f, *args)
    dfinal = jnp.zeros(out[1].shape, F32) if call.dfinal is None else call.dfinal.astype(F32)
    grads = list(vjp((call.do.astype(F32), dfinal)))
    if not has_beta:
        grads.insert(4, None)
    return tuple(grads)
