"""Autotuning with a persistent cache.

``stellax.autotune(fn, *args)`` finds every stellax op inside ``fn`` (under
``jax.grad`` too), tunes the calls no cache knows yet, writes them to the
user cache and returns an `AutotuneResult` (``with result: ...``). At run
time configs resolve deterministically: explicit config > ``use_configs``
context (an `AutotuneResult` is one) > user cache > shipped cache >
cache-miss policy (`set_policy`, `policy`, ``STELLAX_AUTOTUNE_POLICY``:
``heuristic`` | ``autotune`` | ``error``) > heuristic.

This module is callable: ``stellax.autotune(fn, *args)`` is
``stellax.autotune.autotune(fn, *args)``, and ``stellax.autotune.policy``,
``stellax.autotune.cli`` and the rest stay reachable as attributes.
"""

from __future__ import annotations

import sys
import types

from .api import AutotuneResult, ObservedCall, ResultEntry, autotune, find_calls, tune_calls
from .cache import (
    CacheWarning, ConfigCache, Entry, shipped_cache, shipped_dir, user_autotune_dir, user_cache,
    user_cache_root,
)
from .keys import call_key, device_slug, key_from_string, key_to_string, make_key
from .programs import ProgramError, TracedCall, calls_from_hlo, calls_from_trace, observed_calls
from .search import Candidate, TuneError, TuneResult, tune_call
from .sources import (
    POLICIES, AutotuneMissWarning, CacheMissError, cached_config, get_policy, policy, register_sources,
    set_policy,
)

__all__ = [
    "AutotuneMissWarning", "AutotuneResult", "CacheMissError", "CacheWarning", "Candidate", "ConfigCache",
    "Entry", "ObservedCall", "POLICIES", "ProgramError", "ResultEntry", "TracedCall", "TuneError",
    "TuneResult", "autotune", "cached_config", "call_key", "calls_from_hlo", "calls_from_trace",
    "device_slug", "find_calls", "get_policy", "key_from_string", "key_to_string", "make_key",
    "observed_calls", "policy", "register_sources", "set_policy", "shipped_cache", "shipped_dir", "tune_call",
    "tune_calls", "user_autotune_dir", "user_cache", "user_cache_root",
]

register_sources()


class _CallableModule(types.ModuleType):
    """Lets ``stellax.autotune(fn, *args)`` call `autotune` while
    ``stellax.autotune.<name>`` keeps working."""

    def __call__(self, fn, *args, **kwargs) -> AutotuneResult:
        return autotune(fn, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
