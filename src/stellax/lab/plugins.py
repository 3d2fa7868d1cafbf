"""Plugin discovery: implementations from outside stellax.

A plugin is a module in the candidate format (`stellax.lab.candidate`) that
names its op (``OP = "attention"``) and optionally ``POSITION = "first"``
(the default: dispatch with ``implementation=None`` tries it before the
built-ins, where it supports the call) or ``"last"``. Plugins come from

* the ``stellax.implementations`` entry-point group (``name = "module"``),
  e.g. a package written by `stellax lab promote` and pip-installed;
* ``STELLAX_PLUGIN_PATH``: ``os.pathsep``-separated entries, each a ``.py``
  file, a package directory, or a directory whose ``.py`` files and
  packages are plugins.

Loaded plugins are registered as implementations of their op and take part
in dispatch, autotuning and `stellax check` like built-ins. A plugin that
fails to load is skipped and listed by `broken_plugins` (`stellax info`
shows them); `load_plugins` never raises.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

from .._op_names import is_op_name, resolve_op_name
from ..core import registered_ops
from .candidate import add_implementation, implementation_of, load_module
from .errors import LabError

ENTRY_POINT_GROUP = "stellax.implementations"
PATH_VARIABLE = "STELLAX_PLUGIN_PATH"

_LOADED: dict[str, str] = {}  # source -> "op/implementation"
_BROKEN: dict[str, str] = {}  # source -> error


def _register(module, source: str) -> str:
    op_name = getattr(module, "OP", None)
    if not op_name:
        raise LabError(f"plugin {source}: defines no OP = '<op name>'")
    ops = registered_ops()
    if not is_op_name(op_name, ops):
        raise LabError(f"plugin {source}: OP = {op_name!r} is not a registered op")
    op = ops[resolve_op_name(op_name, ops)]
    position = getattr(module, "POSITION", "first")
    if position not in ("first", "last"):
        raise LabError(f"plugin {source}: POSITION must be 'first' or 'last', got {position!r}")
    impl = implementation_of(module, op, f"plugin {source}")
    add_implementation(op, impl, first=position == "first")
    return f"{op.name}/{impl.name}"


def _path_entries(value: str) -> list[Path]:
    found: list[Path] = []
    for entry in filter(None, value.split(os.pathsep)):
        path = Path(entry).expanduser()
        if path.is_file() and path.suffix == ".py":
            found.append(path)
        elif (path / "__init__.py").is_file():
            found.append(path)
        elif path.is_dir():
            for child in sorted(path.iterdir()):
                if child.name.startswith(("_", ".")):
                    continue
                if (child.is_file() and child.suffix == ".py") or (child / "__init__.py").is_file():
                    found.append(child)
        else:
            found.append(path)  # reported as broken below
    return found


def _module_name(path: Path) -> str:
    stem = path.name if path.is_dir() else path.stem
    return path.name if path.is_dir() else "stellax_plugin_" + re.sub(r"\W", "_", stem)


def load_plugins() -> list[str]:
    """Discover and register every plugin not loaded yet; returns the
    ``op/implementation`` names registered by this call. Never raises."""
    added = []

    def attempt(source: str, load):
        if source in _LOADED or source in _BROKEN:
            return
        try:
            name = _register(load(), source)
        except BaseException as e:  # noqa: BLE001 - a broken plugin must never break `import stellax`
            if isinstance(e, KeyboardInterrupt):
                raise
            _BROKEN[source] = f"{type(e).__name__}: {e}"[:500]
            return
        _LOADED[source] = name
        added.append(name)

    try:
        entry_points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as e:  # noqa: BLE001
        _BROKEN[f"entry points ({ENTRY_POINT_GROUP})"] = f"{type(e).__name__}: {e}"
        entry_points = []
    for ep in entry_points:
        attempt(f"entry point {ep.name} = {ep.value}", ep.load)
    for path in _path_entries(os.environ.get(PATH_VARIABLE, "")):
        if not path.exists():
            _BROKEN.setdefault(f"{PATH_VARIABLE} entry {path}", "no such file or directory")
            continue
        attempt(str(path), lambda p=path: load_module(p, _module_name(p)))
    return added


def loaded_plugins() -> dict[str, str]:
    """``{source: "op/implementation"}`` of the plugins registered so far."""
    return dict(_LOADED)


def broken_plugins() -> dict[str, str]:
    """``{source: error}`` of the plugins that failed to load (for `stellax info`)."""
    return dict(_BROKEN)


def info_lines() -> list[str]:
    """Lines for `stellax info`: loaded and broken plugins."""
    lines = [f"plugin {name} (from {source})" for source, name in _LOADED.items()]
    lines += [f"broken plugin {source}: {error} (skipped)" for source, error in _BROKEN.items()]
    return lines
