"""Config sources: the user cache, the shipped cache and the cache-miss policy.

They are registered with `stellax.core.selection` when stellax is imported,
in this order, after contexts (explicit config > ``use_configs`` /
autotuning results > user cache > shipped cache > miss policy > heuristic).

Entries written by another stellax or jax version are not trusted blindly:
one is used only if its config still parses, validates and is a member of
the implementation's current config space for the call; otherwise it is
ignored (one warning per cache file).

The miss policy (`set_policy`, the `policy` context, or
``STELLAX_AUTOTUNE_POLICY``) decides what happens when neither cache has a
config: ``"heuristic"`` (default) uses the implementation's heuristic and,
on a real accelerator, warns once per missed key (``STELLAX_AUTOTUNE_WARN=0``
silences it); ``"autotune"`` tunes the call right there (at trace time, in a
helper thread), stores the result in the user cache and uses it;
``"error"`` raises `CacheMissError`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import warnings
from typing import Any

from ..core.call import Call
from ..core.op import registered_ops
from ..core.platform import current_platform, host_platform, interpret_enabled
from ..core.selection import register_config_source
from . import cache as cache_lib
from . import keys as keys_lib
from .search import TUNING, run_in_thread, tune_call

POLICIES = ("heuristic", "autotune", "error")

_POLICY: contextvars.ContextVar[str | None] = contextvars.ContextVar("stellax_autotune_policy", default=None)
_GLOBAL_POLICY: list[str | None] = [None]
#: Set while `autotune` discovers the ops of a function: misses are expected then.
DISCOVERING: contextvars.ContextVar[bool] = contextvars.ContextVar("stellax_autotune_discovering", default=False)


class CacheMissError(LookupError):
    """No cached config for a call while the miss policy is ``"error"``."""


class AutotuneMissWarning(UserWarning):
    """A kernel runs with its heuristic config: no tuned config was cached."""


def _check_policy(value: str) -> str:
    if value not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {value!r}")
    return value


def get_policy() -> str:
    """The cache-miss policy in force (context > `set_policy` > environment > ``heuristic``)."""
    value = _POLICY.get() or _GLOBAL_POLICY[0]
    if value:
        return value
    env = os.environ.get("STELLAX_AUTOTUNE_POLICY", "").strip().lower()
    if env:
        if env not in POLICIES:
            cache_lib.warn_once(("policy-env", env), f"STELLAX_AUTOTUNE_POLICY={env!r} is not one of "
                                                     f"{POLICIES}; using 'heuristic'")
            return "heuristic"
        return env
    return "heuristic"


def set_policy(value: str | None) -> None:
    """Set the process-wide cache-miss policy (``None``: back to the environment/default)."""
    _GLOBAL_POLICY[0] = None if value is None else _check_policy(value)


@contextlib.contextmanager
def policy(value: str):
    """Use cache-miss policy ``value`` inside the block."""
    token = _POLICY.set(_check_policy(value))
    try:
        yield
    finally:
        _POLICY.reset(token)


def _implementation(op_name: str, impl_name: str):
    op = registered_ops().get(op_name)
    if op is None:
        return None, None
    return op, op.implementations.get(impl_name)


def validate_entry(entry: cache_lib.Entry, call: Call) -> str | None:
    """Why an entry from another stellax/jax version cannot be used for
    ``call`` (``None``: it can)."""
    op, impl = _implementation(entry.op, entry.implementation)
    if impl is None or impl.config_type is None:
        return f"{entry.op}/{entry.implementation} is not a tunable implementation here"
    try:
        config = impl.config_type.from_dict(entry.config)
    except (TypeError, ValueError) as e:
        return f"config {entry.config} is invalid now: {e}"
    space = impl.config_space(call)
    if space and config not in space:
        return f"config {entry.config} is not in the current config space"
    return None


def trusted_config(entry: cache_lib.Entry | None, call: Call, cache: cache_lib.ConfigCache) -> dict | None:
    """The entry's config if it can be trusted for ``call``, else ``None``."""
    if entry is None:
        return None
    if entry.same_versions():
        # Same versions: trusted, but it must still build a config (a hand-edited or
        # stale entry with an unknown or invalid field is skipped: the heuristic is used).
        problem = config_problem(entry)
        if problem is None:
            return entry.config
    else:
        problem = validate_entry(entry, call)
        if problem is None:
            return entry.config
    cache_lib.warn_once(
        (str(cache.path), "foreign", entry.key_string),
        f"stellax autotuning cache {cache.path}: ignoring an entry for {entry.op}/{entry.implementation} "
        f"tuned with stellax {entry.stellax_version or '?'} / jax {entry.jax_version or '?'}: {problem}",
    )
    return None


def config_problem(entry: cache_lib.Entry) -> str | None:
    """Why the entry's config does not build a config of its implementation (``None``: it does)."""
    _, impl = _implementation(entry.op, entry.implementation)
    if impl is None or impl.config_type is None:
        return None  # not ours to judge here (selection ignores it for other implementations)
    try:
        impl.config_type.from_dict(entry.config)
    except (TypeError, ValueError) as e:
        return f"config {entry.config} is invalid now: {e}"
    return None


def cached_config(op_name: str, impl_name: str, call: Call, *, user: bool = True,
                  shipped: bool = True) -> tuple[dict, str, cache_lib.Entry] | None:
    """``(config, source label, entry)`` from the user then shipped cache of
    the current device, or ``None``."""
    key = keys_lib.call_key(op_name, impl_name, call)
    caches = ([cache_lib.user_cache()] if user else []) + ([cache_lib.shipped_cache()] if shipped else [])
    for c in caches:
        entry = c.get(key)
        config = trusted_config(entry, call, c)
        if config is not None:
            return config, c.label, entry
    return None


class CacheSource:
    """A config source reading one of the current device's cache files."""

    def __init__(self, label: str, shipped: bool):
        self.label = label
        self.shipped = shipped

    def __repr__(self) -> str:
        return f"CacheSource({self.label!r})"

    def __call__(self, op_name: str, impl_name: str, call: Call) -> Any | None:
        c = cache_lib.shipped_cache() if self.shipped else cache_lib.user_cache()
        entry = c.get(keys_lib.call_key(op_name, impl_name, call))
        return trusted_config(entry, call, c)


_MISS_WARNED: set = set()
_MISS_LOCK = threading.Lock()


def _warn_miss_once(token, message: str, category=AutotuneMissWarning) -> None:
    with _MISS_LOCK:
        if token in _MISS_WARNED:
            return
        _MISS_WARNED.add(token)
    warnings.warn(message, category, stacklevel=5)


def reset_miss_warnings() -> None:
    with _MISS_LOCK:
        _MISS_WARNED.clear()


class MissPolicySource:
    """The last config source: applies the cache-miss policy."""

    label = "autotune-on-miss"

    def __repr__(self) -> str:
        return "MissPolicySource()"

    def __call__(self, op_name: str, impl_name: str, call: Call) -> Any | None:
        if TUNING.get() or DISCOVERING.get():
            return None
        mode = get_policy()
        platform = current_platform()
        device = keys_lib.device_slug(platform)
        where = f"{op_name}/{impl_name} on {platform.describe()}" + (" (interpreted)" if interpret_enabled() else "")
        what = f"{keys_lib.describe_signature(call.signature())}"
        token = (device, keys_lib.key_to_string(keys_lib.call_key(op_name, impl_name, call)))
        if mode == "error":
            raise CacheMissError(
                f"no tuned config for {where} with {what} in the user or shipped cache "
                f"(cache-miss policy 'error'); tune it with stellax.autotune(fn, ...) or `stellax autotune`, "
                f"or choose another policy (STELLAX_AUTOTUNE_POLICY=heuristic|autotune)"
            )
        if mode == "heuristic":
            native = (platform.backend != "cpu" and not interpret_enabled() and platform == host_platform())
            if native and os.environ.get("STELLAX_AUTOTUNE_WARN", "1").strip().lower() not in ("0", "false", "no", "off"):
                _warn_miss_once(token, f"no tuned config for {where} with {what}; using the heuristic. "
                                       f"Run stellax.autotune(fn, *args) or `stellax autotune` to tune it "
                                       f"(STELLAX_AUTOTUNE_WARN=0 silences this).")
            return None
        # mode == "autotune"
        if platform != host_platform():
            _warn_miss_once(token, f"cannot autotune {where} while lowering for another device; "
                                   f"using the heuristic", AutotuneMissWarning)
            return None
        return self._tune(op_name, impl_name, call, token, where)

    def _tune(self, op_name, impl_name, call, token, where):
        op = registered_ops().get(op_name)
        if op is None:
            return None
        max_configs = os.environ.get("STELLAX_AUTOTUNE_MAX_CONFIGS", "").strip()
        try:
            result = run_in_thread(tune_call, op, impl_name, call.abstract(),
                                   max_configs=int(max_configs) if max_configs else None)
        except Exception as e:  # noqa: BLE001 - tuning failed: fall back to the heuristic
            _warn_miss_once(token, f"autotuning {where} failed ({type(e).__name__}: {e}); using the heuristic")
            return None
        entry = result.entry()
        try:
            cache_lib.user_cache().put(entry)
        except OSError as e:
            _warn_miss_once(token, f"could not write the autotuning cache ({e}); the tuned config is used "
                                   f"for this process only")
            _SESSION_TUNED[token] = entry.config
        return entry.config


#: Configs tuned on a miss that could not be written to disk.
_SESSION_TUNED: dict = {}


class SessionSource:
    label = "session"

    def __call__(self, op_name, impl_name, call):
        if not _SESSION_TUNED:
            return None
        token = (keys_lib.device_slug(), keys_lib.key_to_string(keys_lib.call_key(op_name, impl_name, call)))
        return _SESSION_TUNED.get(token)


USER_SOURCE = CacheSource("user-cache", shipped=False)
SHIPPED_SOURCE = CacheSource("shipped-cache", shipped=True)
SESSION_SOURCE = SessionSource()
MISS_SOURCE = MissPolicySource()


def register_sources() -> None:
    """Register user cache, shipped cache and miss policy (idempotent)."""
    for source in (USER_SOURCE, SHIPPED_SOURCE, SESSION_SOURCE, MISS_SOURCE):
        register_config_source(source)
