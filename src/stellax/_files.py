"""The files stellax keeps: where (the user cache directory), how they are
written (atomically) and how a device names one (a slug).

Shared by the autotuning cache, the benchmark peaks and reports, at the bottom
of the import graph (they are re-exported by `stellax.autotune.cache` and
`stellax.autotune.keys`)."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from pathlib import Path


def user_cache_root() -> Path:
    """``$STELLAX_CACHE_DIR`` or the platform's user cache directory + ``stellax``."""
    env = os.environ.get("STELLAX_CACHE_DIR", "").strip()
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
        return base / "stellax" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "stellax"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "stellax"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new file only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The writer's pid is in the name: `ConfigCache._clean_temporaries` (stellax.autotune.cache) removes
    # the files of dead writers.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)
        os.umask(mask)
        with contextlib.suppress(OSError):
            os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if hasattr(os, "O_DIRECTORY"):
        with contextlib.suppress(OSError):
            dir_fd = os.open(str(path.parent), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)


def slug(text: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` → ``"nvidia_h100_80gb_hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "_", str(text).lower()).strip("_") or "unknown"
