"""How a config is chosen for a call, and who gets told about op calls.

Order of precedence (deterministic):
  1. a config passed explicitly to the op (``config=...``);
  2. the innermost `use_configs` context (an autotuning result is one);
  3. registered config sources, in registration order (the autotuning
     package registers the user cache, then the shipped cache);
  4. the implementation's heuristic default.

Call observers (`observe_calls`) see every op call at trace time with its
checked `Call`; autotuning uses this to find the ops inside a function.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Mapping, Protocol

from .call import Call

ConfigKey = tuple[str, str]  # (op name, implementation name)


class ConfigSource(Protocol):
    def __call__(self, op_name: str, implementation: str, call: Call) -> Any | None: ...


_CONTEXT: contextvars.ContextVar[tuple[Callable[[str, str, Call], Any | None], ...]] = (
    contextvars.ContextVar("stellax_config_context", default=())
)
_SOURCES: list[ConfigSource] = []
_OBSERVERS: contextvars.ContextVar[tuple[Callable[..., None], ...]] = contextvars.ContextVar(
    "stellax_call_observers", default=()
)


def register_config_source(source: ConfigSource) -> None:
    """Add a lookup consulted after contexts and before the heuristic."""
    if source not in _SOURCES:
        _SOURCES.append(source)


def unregister_config_source(source: ConfigSource) -> None:
    if source in _SOURCES:
        _SOURCES.remove(source)


@contextlib.contextmanager
def use_configs(lookup: Callable[[str, str, Call], Any | None] | Mapping[ConfigKey, Any]):
    """Within the block, ops take their config from ``lookup``.

    ``lookup`` is either a function ``(op_name, implementation, call) ->
    config | None`` or a mapping ``{(op_name, implementation): config}`` that
    applies to every call of that op and implementation.
    """
    if isinstance(lookup, Mapping):
        table = dict(lookup)

        def lookup(op_name, implementation, call, _table=table):  # noqa: F811
            return _table.get((op_name, implementation))

    token = _CONTEXT.set(_CONTEXT.get() + (lookup,))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def resolve_config(op_name: str, implementation, call: Call, explicit: Any | None = None):
    """The config for ``implementation`` of ``op_name`` on ``call`` and where it came from."""
    if implementation.config_type is None:
        return None, "none"
    if explicit is not None:
        return _coerce(implementation, explicit), "explicit"
    for lookup in reversed(_CONTEXT.get()):
        found = lookup(op_name, implementation.name, call)
        if found is not None:
            return _coerce(implementation, found), "context"
    for source in _SOURCES:
        found = source(op_name, implementation.name, call)
        if found is not None:
            return _coerce(implementation, found), getattr(source, "label", "source")
    return implementation.heuristic(call), "heuristic"


def _coerce(implementation, config):
    if isinstance(config, Mapping):
        return implementation.config_type.from_dict(config)
    if not isinstance(config, implementation.config_type):
        raise TypeError(
            f"config: expected {implementation.config_type.__name__} for implementation "
            f"{implementation.name!r}, got {type(config).__name__}"
        )
    return config


@contextlib.contextmanager
def observe_calls(observer: Callable[[Any, Any, Call, Any], None]):
    """Call ``observer(op, implementation, call, config)`` for every op call in
    the block (at trace time; calls inside ``jax.grad`` included)."""
    token = _OBSERVERS.set(_OBSERVERS.get() + (observer,))
    try:
        yield
    finally:
        _OBSERVERS.reset(token)


def notify(op, implementation, call: Call, config) -> None:
    for observer in _OBSERVERS.get():
        observer(op, implementation, call, config)
