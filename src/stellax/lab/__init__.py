"""The kernel lab: an evaluation environment and an automated search for
candidate implementations of stellax ops (docs/lab.md).

* `evaluate` / `Worker`: a candidate file in a child process with time and
  memory limits, tiers load → contract → numerics → gradients → determinism
  → lowering → compile → benchmark, one versioned JSON report;
* `search` with `MutateProposer` or `LLMProposer`, stored in an `Archive`
  (SQLite; resumable);
* `promote` and `load_plugins`: winners as plugin packages, discovered
  through the ``stellax.implementations`` entry points or
  ``STELLAX_PLUGIN_PATH``;
* `stellax lab mcp`: the lab as an MCP server (`stellax.lab.mcp_server`).
"""

from __future__ import annotations

import importlib
import sys
import types

# Public name -> the submodule defining it. Loaded on first use, so that `import stellax`, which loads
# the plugins (`stellax.lab.plugins`), does not import the rest of the lab (nor bench, testing, autotune).
_EXPORTS = {
    "Archive": "archive", "default_path": "archive",
    "find_op": "candidate", "implementation_of": "candidate", "load_module": "candidate",
    "with_implementation": "candidate",
    "LabError": "errors",
    "Worker": "evaluate", "evaluate": "evaluate",
    "LLMProposer": "llm", "extract_code": "llm",
    "MutateProposer": "mutate", "Proposal": "mutate", "mutate_source": "mutate",
    "broken_plugins": "plugins", "info_lines": "plugins", "load_plugins": "plugins", "loaded_plugins": "plugins",
    "promote": "promote",
    "SCHEMA_VERSION": "report", "TIERS": "report",
    "search": "search",
    "write_report": "summary",
    "config_template": "template", "implementation_template": "template", "parse_knobs": "template",
    "set_knobs": "template",
}

__all__ = [
    "Archive", "LLMProposer", "LabError", "MutateProposer", "Proposal", "SCHEMA_VERSION", "TIERS", "Worker",
    "broken_plugins", "config_template", "default_path", "evaluate", "extract_code", "find_op",
    "implementation_of", "implementation_template", "info_lines", "load_module", "load_plugins",
    "loaded_plugins", "mutate_source", "parse_knobs", "promote", "search", "set_knobs", "with_implementation",
    "write_report",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _LabModule(types.ModuleType):
    """``stellax.lab.search`` (``evaluate``, ``promote``) is the function, not the
    submodule of the same name: when the import system binds a submodule to
    its package, a function named after it takes its place, as an eager
    ``from .search import search`` would have left it."""

    def __setattr__(self, name, value):
        if (isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name
                and value.__name__ == f"{__name__}.{name}"):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _LabModule
