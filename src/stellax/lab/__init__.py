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

from .archive import Archive, default_path
from .candidate import find_op, implementation_of, load_module, with_implementation
from .errors import LabError
from .evaluate import Worker, evaluate
from .llm import LLMProposer, extract_code
from .mutate import MutateProposer, Proposal, mutate_source
from .plugins import broken_plugins, info_lines, load_plugins, loaded_plugins
from .promote import promote
from .report import SCHEMA_VERSION, TIERS
from .search import search
from .summary import write_report
from .template import config_template, implementation_template, parse_knobs, set_knobs

__all__ = [
    "Archive", "LLMProposer", "LabError", "MutateProposer", "Proposal", "SCHEMA_VERSION", "TIERS", "Worker",
    "broken_plugins", "config_template", "default_path", "evaluate", "extract_code", "find_op",
    "implementation_of", "implementation_template", "info_lines", "load_module", "load_plugins",
    "loaded_plugins", "mutate_source", "parse_knobs", "promote", "search", "set_knobs", "with_implementation",
    "write_report",
]
