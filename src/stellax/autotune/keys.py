"""Cache keys: which device a config was tuned on, and for which call.

A key is ``(op, implementation, signature)`` where the signature is
`Call.signature()` (shapes, dtypes and static options). Keys are stored as
canonical JSON strings, so they round-trip exactly: `key_to_string` then
`key_from_string` gives back the same tuple. The device a cache belongs to is
a slug of the device kind (``"NVIDIA H200"`` → ``"nvidia_h200"``), with
``-interpret`` appended for interpreted kernels (timings there say nothing
about a real accelerator, so they never mix with native ones).
"""

from __future__ import annotations

import json
from typing import Any

from .._files import slug  # noqa: F401  (part of this module's API)
from ..core import call as call_lib
from ..core.platform import Platform, current_platform, interpret_enabled

Key = tuple[str, str, tuple]


def device_slug(platform: Platform | None = None, interpret: bool | None = None) -> str:
    """The cache file stem of a device (``-interpret`` for interpreted kernels)."""
    platform = platform or current_platform()
    interpret = interpret_enabled() if interpret is None else interpret
    name = slug(platform.device_kind)
    return f"{name}-interpret" if interpret else name


def signature_to_json(signature: tuple) -> list:
    """A `Call.signature()` as JSON-able nested lists."""
    return call_lib.signature_to_json(signature)


def signature_from_json(data: Any) -> tuple:
    """Inverse of `signature_to_json` (lists back to tuples)."""
    return call_lib.signature_from_json(data)


def make_key(op: str, implementation: str, signature: tuple) -> Key:
    return (str(op), str(implementation), signature_from_json(signature_to_json(signature)))


def key_to_string(key: Key) -> str:
    """Canonical JSON text of a key (the cache file's entry name)."""
    op, implementation, signature = key
    return json.dumps([op, implementation, signature_to_json(signature)], separators=(",", ":"),
                      ensure_ascii=True, allow_nan=True)


def key_from_string(text: str) -> Key:
    op, implementation, signature = json.loads(text)
    return (op, implementation, signature_from_json(signature))


def call_key(op_name: str, implementation: str, call) -> Key:
    return make_key(op_name, implementation, call.signature())


def describe_signature(signature: tuple) -> str:
    """Short human text of a signature: ``x=bfloat16[8,1024] eps=1e-06``."""
    try:
        arrays, options = signature
        parts = []
        for name, value in arrays:
            if value is None:
                continue
            if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple):
                shape, dtype = value
                parts.append(f"{name}={dtype}[{','.join(str(d) for d in shape)}]")
            else:
                parts.append(f"{name}={value}")
        for name, value in options:
            if value is not None and value is not False:
                parts.append(f"{name}={value}")
        return " ".join(parts)
    except (TypeError, ValueError):
        return str(signature)
