"""The persistent autotuning cache: one JSON file per device kind.

Layout (``format_version`` 1)::

    {"format": "stellax-autotune-cache", "format_version": 1,
     "device": "nvidia_h200", "device_kind": "NVIDIA H200",
     "entries": {"<key>": {"op": ..., "implementation": ..., "signature": [...],
                           "config": {...}, "time_ms": ..., "stellax_version": ...,
                           "jax_version": ..., ...}}}

where ``<key>`` is `keys.key_to_string`. Files live in the user cache
directory (``$STELLAX_CACHE_DIR/autotune``, default under the user's cache
directory) and, for known devices, inside the package (``shipped/``).

Guarantees:

* writes are atomic: a temporary file in the same directory is written,
  flushed, fsynced and renamed over the cache, so a writer killed at any
  moment leaves the old or the new file, never half of one;
* concurrent writers lose no entries: each write takes an exclusive file lock
  (``<file>.lock``), re-reads the file, merges its entries in and writes;
* a corrupted or foreign-format file gives one warning and is ignored (and
  replaced, with a ``.corrupt`` copy kept, on the next write); nothing is ever
  unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import jax

from .._files import atomic_write_text, user_cache_root  # noqa: F401  (part of this module's API)
from .._version import __version__
from . import keys as keys_lib

FORMAT = "stellax-autotune-cache"
FORMAT_VERSION = 1


class CacheWarning(UserWarning):
    """A cache file could not be used (corrupted, foreign format, untrusted entry)."""


def user_autotune_dir() -> Path:
    return user_cache_root() / "autotune"


def shipped_dir() -> Path:
    """Cache files shipped inside the package (``stellax/autotune/shipped``)."""
    return Path(__file__).resolve().parent / "shipped"


def versions() -> dict[str, str]:
    return {"stellax_version": __version__, "jax_version": jax.__version__}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclasses.dataclass
class Entry:
    """One tuned config."""

    op: str
    implementation: str
    signature: tuple
    config: dict
    time_ms: float | None = None
    default_time_ms: float | None = None
    stellax_version: str = ""
    jax_version: str = ""
    timer: str = ""
    created: str = ""
    candidates: int = 0
    failures: int = 0

    @property
    def key(self) -> keys_lib.Key:
        return keys_lib.make_key(self.op, self.implementation, self.signature)

    @property
    def key_string(self) -> str:
        return keys_lib.key_to_string(self.key)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["signature"] = keys_lib.signature_to_json(self.signature)
        return out

    @classmethod
    def from_json(cls, data: Any) -> "Entry":
        if not isinstance(data, dict):
            raise ValueError(f"entry: expected an object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for required in ("op", "implementation", "signature", "config"):
            if required not in kwargs:
                raise ValueError(f"entry: missing field {required!r}")
        if not isinstance(kwargs["config"], dict):
            raise ValueError("entry.config: expected an object")
        kwargs["signature"] = keys_lib.signature_from_json(kwargs["signature"])
        return cls(**kwargs)

    def same_versions(self) -> bool:
        current = versions()
        return (self.stellax_version == current["stellax_version"]
                and self.jax_version == current["jax_version"])


# -- warnings (one per file state) ---------------------------------------------
_WARNED: set = set()
_WARNED_LOCK = threading.Lock()


def warn_once(token, message: str) -> None:
    with _WARNED_LOCK:
        if token in _WARNED:
            return
        _WARNED.add(token)
    warnings.warn(message, CacheWarning, stacklevel=3)


def reset_warnings() -> None:
    """Forget which warnings were given (tests)."""
    with _WARNED_LOCK:
        _WARNED.clear()


# -- file helpers --------------------------------------------------------------
def parse_cache_text(text: str, path: str = "<cache>") -> tuple[dict[str, Entry], dict, list[str]]:
    """Parse a cache file: ``(entries, header, problems)``. Raises ValueError
    when the whole file is unusable (corrupted JSON, foreign format)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a stellax autotuning cache (format {data.get('format') if isinstance(data, dict) else None!r})")
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"cache format version {data.get('format_version')!r}, this stellax reads {FORMAT_VERSION}")
    raw = data.get("entries", {})
    if not isinstance(raw, dict):
        raise ValueError("'entries' is not an object")
    entries, problems = {}, []
    for name, value in raw.items():
        try:
            entry = Entry.from_json(value)
            entries[entry.key_string] = entry
        except (ValueError, TypeError, RecursionError) as e:
            problems.append(f"{str(name)[:80]}: {type(e).__name__ if isinstance(e, RecursionError) else e}")
    header = {k: v for k, v in data.items() if k != "entries"}
    return entries, header, problems


def dump_cache_text(entries: dict[str, Entry], *, device: str = "", device_kind: str = "") -> str:
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "device": device,
        "device_kind": device_kind,
        "updated": _now(),
        **versions(),
        "entries": {k: entries[k].to_json() for k in sorted(entries)},
    }
    return json.dumps(payload, indent=1, sort_keys=False) + "\n"


@contextlib.contextmanager
def file_lock(path: Path, timeout: float = 120.0) -> Iterator[bool]:
    """Exclusive inter-process lock on ``<path>.lock``; yields whether it was taken
    (after ``timeout`` seconds it gives up with a warning and proceeds)."""
    lock_path = Path(str(path) + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None
    if fcntl is not None:
        with open(lock_path, "a+") as handle:
            deadline = time.monotonic() + timeout
            locked = False
            while True:
                try:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.005)
            if not locked:
                warnings.warn(f"could not lock {lock_path} within {timeout:.0f}s; writing without the lock",
                              CacheWarning, stacklevel=3)
            try:
                yield locked
            finally:
                if locked:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return
    # Fallback: an exclusive-create lock file, stale after `timeout`.
    deadline = time.monotonic() + timeout  # pragma: no cover
    fd = None  # pragma: no cover
    while fd is None:  # pragma: no cover
        try:
            fd = os.open(str(lock_path), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - lock_path.stat().st_mtime > timeout:
                    os.unlink(lock_path)
                    continue
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
    try:  # pragma: no cover
        yield fd is not None
    finally:  # pragma: no cover
        if fd is not None:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(lock_path)


class ConfigCache:
    """One cache file. Reads are lazy and re-done when the file changes on disk."""

    def __init__(self, path: str | os.PathLike, *, device: str = "", device_kind: str = "",
                 writable: bool = True, label: str = "cache"):
        self.path = Path(path)
        self.device = device or self.path.stem
        self.device_kind = device_kind
        self.writable = writable
        self.label = label
        self._lock = threading.Lock()
        self._stat = None
        self._entries: dict[str, Entry] = {}
        self.header: dict = {}

    def __repr__(self) -> str:
        return f"ConfigCache({str(self.path)!r})"

    # -- reading -------------------------------------------------------------
    def _stat_token(self):
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load_file(self, token) -> tuple[dict[str, Entry], dict]:
        if token is None:
            return {}, {}
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            warn_once((str(self.path), token), f"stellax autotuning cache {self.path} cannot be read ({e}); ignoring it")
            return {}, {}
        try:
            entries, header, problems = parse_cache_text(text, str(self.path))
        except (ValueError, TypeError, RecursionError, MemoryError) as e:
            warn_once((str(self.path), token), f"stellax autotuning cache {self.path} is unusable: {e}; ignoring it")
            return {}, {}
        if problems:
            warn_once((str(self.path), token, "entries"),
                      f"stellax autotuning cache {self.path}: ignoring {len(problems)} malformed entries "
                      f"(first: {problems[0]})")
        return entries, header

    def entries(self) -> dict[str, Entry]:
        """All usable entries by key string (reloaded when the file changed)."""
        token = self._stat_token()
        with self._lock:
            if token != self._stat:
                self._entries, self.header = self._load_file(token)
                self._stat = token
            return self._entries

    def get(self, key: keys_lib.Key | str) -> Entry | None:
        name = key if isinstance(key, str) else keys_lib.key_to_string(key)
        return self.entries().get(name)

    def __len__(self) -> int:
        return len(self.entries())

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    # -- writing -------------------------------------------------------------
    def put(self, entries: Entry | Iterable[Entry]) -> None:
        """Merge ``entries`` into the file (atomically, under the file lock)."""
        if not self.writable:
            raise PermissionError(f"{self.path} is read-only")
        new = [entries] if isinstance(entries, Entry) else list(entries)
        if not new:
            return
        with file_lock(self.path):
            token = self._stat_token()
            current: dict[str, Entry] = {}
            if token is not None:
                try:
                    current, header, _ = parse_cache_text(self.path.read_text(encoding="utf-8"))
                    self.device_kind = self.device_kind or header.get("device_kind", "")
                except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError, MemoryError) as e:
                    warn_once((str(self.path), token), f"stellax autotuning cache {self.path} is unusable: {e}; "
                                                       f"replacing it (a copy is kept as {self.path.name}.corrupt)")
                    with contextlib.suppress(OSError):
                        os.replace(self.path, str(self.path) + ".corrupt")
            for entry in new:
                current[entry.key_string] = entry
            atomic_write_text(self.path, dump_cache_text(current, device=self.device, device_kind=self.device_kind))
            self._clean_temporaries()
        with self._lock:
            self._stat = None  # force a reload on next read

    def remove(self, keys: Iterable[keys_lib.Key | str]) -> int:
        names = {k if isinstance(k, str) else keys_lib.key_to_string(k) for k in keys}
        with file_lock(self.path):
            current = dict(self.entries())
            removed = [n for n in names if current.pop(n, None) is not None]
            if removed:
                atomic_write_text(self.path, dump_cache_text(current, device=self.device,
                                                             device_kind=self.device_kind))
        with self._lock:
            self._stat = None
        return len(removed)

    def _clean_temporaries(self, older_than_s: float = 3600.0) -> None:
        """Remove temporary files of dead writers: those whose writer process
        (the pid in the name) no longer exists, and any older than an hour
        (a writer on another host, or a name without a pid). Called under the
        file lock, after our own write."""
        now = time.time()
        with contextlib.suppress(OSError):
            for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
                with contextlib.suppress(OSError):
                    if not _writer_alive(tmp.name[len(self.path.name) + 2:]) or \
                            now - tmp.stat().st_mtime > older_than_s:
                        tmp.unlink()


def _writer_alive(tail: str) -> bool:
    """Whether the writer of a temp file named ``.<cache>.<pid>-<random>.tmp`` may still
    run (``True`` when the name has no pid: only age decides then)."""
    pid, sep, _ = tail.partition("-")
    if not sep or not pid.isdigit():
        return True
    pid = int(pid)
    if pid == os.getpid():
        return False  # our own leftover: our write finished (we hold the lock)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


# -- the caches of the current device ------------------------------------------
_CACHES: dict[str, ConfigCache] = {}
_CACHES_LOCK = threading.Lock()


def _cache_at(path: Path, **kwargs) -> ConfigCache:
    with _CACHES_LOCK:
        cache = _CACHES.get(str(path))
        if cache is None:
            cache = _CACHES[str(path)] = ConfigCache(path, **kwargs)
        return cache


def user_cache(device: str | None = None, device_kind: str = "") -> ConfigCache:
    """The user cache file of ``device`` (default: the current device)."""
    device = device or keys_lib.device_slug()
    return _cache_at(user_autotune_dir() / f"{device}.json", device=device, device_kind=device_kind,
                     label="user-cache")


def shipped_cache(device: str | None = None) -> ConfigCache:
    """The read-only cache file shipped with stellax for ``device``."""
    device = device or keys_lib.device_slug()
    return _cache_at(shipped_dir() / f"{device}.json", device=device, writable=False, label="shipped-cache")
