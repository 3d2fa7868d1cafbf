"""Argument checks shared by the linear attention ops (fla / mamba_ssm contracts)."""

from __future__ import annotations

import jax
import numpy as np

from ...core import checks, current_platform
from ...core.config import is_power_of_two


def require_bool(name: str, value) -> bool:
    """``value`` as a Python bool; ``TypeError`` naming ``name`` for anything but a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def check_scale(scale, head_dim: int) -> float:
    """The query scale: ``head_dim ** -0.5`` for ``None``, else a positive float."""
    if scale is None:
        return float(head_dim) ** -0.5
    return checks.require_positive_float("scale", scale)


def check_chunk_size(chunk_size) -> int | None:
    """``None`` or a power-of-two int in ``[1, 1024]`` (the XLA path's chunk)."""
    if chunk_size is None:
        return None
    is_int = isinstance(chunk_size, (int, np.integer)) and not isinstance(chunk_size, bool)
    if not is_int or not is_power_of_two(int(chunk_size)):
        raise ValueError(f"chunk_size: expected a positive power of two, got {chunk_size!r}")
    if not 1 <= chunk_size <= 1024:
        raise ValueError(f"chunk_size: expected a power of two in [1, 1024], got {chunk_size}")
    return int(chunk_size)


def check_cu_seqlens(cu_seqlens, batch: int, length: int, what: str = "q"):
    """``cu_seqlens [N+1]``: integers, batch 1, starting at 0, non-decreasing,
    ending at T (values are checked when concrete; traced values cannot be).
    Returns ``(cu_seqlens, N)``."""
    if cu_seqlens is None:
        return None, batch
    cu_seqlens = checks.require_int("cu_seqlens", cu_seqlens)
    checks.require_ndim("cu_seqlens", cu_seqlens, 1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 entries [0, ..., T], got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(
            f"cu_seqlens: a packed batch needs batch size 1 ({what}.shape[0] == 1) with the sequences "
            f"concatenated along T, got batch size {batch}")
    if not isinstance(cu_seqlens, jax.core.Tracer):
        values = np.asarray(cu_seqlens).astype(np.int64)
        if values[0] != 0:
            raise ValueError(f"cu_seqlens: expected to start at 0, got {values[0]}")
        steps = np.diff(values)
        if (steps < 0).any():
            i = int(np.argmax(steps < 0))
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {values[i]} then {values[i + 1]} "
                             f"at positions {i}, {i + 1}")
        if values[-1] != length:
            raise ValueError(f"cu_seqlens: expected to end at T = {length} ({what}.shape[1]), got {values[-1]}")
    return cu_seqlens, int(cu_seqlens.shape[0]) - 1


def check_state(name: str, state, shape, what: str):
    """``None`` or a float array of ``shape`` (``what`` describes it in the error)."""
    if state is None:
        return None
    state = checks.require_float(name, state)
    checks.require_ndim(name, state, len(shape))
    checks.require_shape(name, state, shape, what)
    return state


def check_optional_float(name: str, value):
    """``None`` or ``value`` as a Python float (``TypeError`` naming ``name`` otherwise)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name}: expected a float or None, got {type(value).__name__}")
    return float(value)


def xla_chunk(chunk_size: int | None, per_channel: bool) -> int:
    """The XLA path's chunk: the user's, else the fastest measured on a CPU
    (2-core x86, T=4096, H=16, K=V=128: GDN 32, KDA 16 — smaller chunks cost
    less intra-chunk work and, for KDA, fewer per-channel exps) and fla's 64
    on accelerators."""
    if chunk_size is not None:
        return chunk_size
    if current_platform().backend != "cpu":
        return 64
    return 16 if per_channel else 32
