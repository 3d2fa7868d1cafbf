"""The compiled-function cache the custom ops share: jitted JAX functions keyed
by (op, input shapes / dtypes, options); past 1024 the oldest is dropped.

`stellax.torch.registry` (the custom ops) and `stellax.torch.torchax` (torchax
tensors) both take their functions from here.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

_CACHE_SIZE = 1024
_cache: "collections.OrderedDict[tuple, Callable]" = collections.OrderedDict()
_lock = threading.RLock()  # a build may trace an op that takes its own function from here
_stats = {"hits": 0, "misses": 0}


def _cached(key: tuple, build: Callable[[], Callable]) -> Callable:
    fn = _cache.get(key)
    if fn is not None:
        _stats["hits"] += 1
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            _stats["misses"] += 1
            fn = build()
            _cache[key] = fn
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return fn


def cache_info() -> dict:
    """Hits, misses and size of the compiled-function cache."""
    return {**_stats, "size": len(_cache)}


def clear_cache() -> None:
    """Drop every cached compiled function (they are rebuilt on the next call)."""
    with _lock:
        _cache.clear()
        _stats.update(hits=0, misses=0)
