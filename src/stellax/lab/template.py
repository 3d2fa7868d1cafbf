"""Starting candidates (`stellax lab new`) and the ``# lab: choices(...)`` knobs.

A knob is a module-level assignment annotated with the values it may take::

    BLOCK_Q = 256  # lab: choices(64, 128, 256, 512)

The mutate proposer (`stellax.lab.mutate`) moves knobs; everything else in a
candidate is left as written. Three starting points:

* `implementation_template`: the op's XLA implementation (or another one,
  ``base=``) in the full candidate format, delegating to the built-in
  ``run``; it evaluates as correct unchanged. Ops whose XLA path takes a
  performance-only option (the chunk size of the chunked linear attention)
  get it as a knob.
* `config_template`: a config-only candidate for an implementation with a
  config type, one knob per config field, the values drawn from the
  implementation's autotuning space and heuristic on the op's benchmark
  shapes (or examples), starting at the heuristic's choice.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

from ..core import Op, current_platform
from .candidate import tunable_base
from .errors import LabError

KNOB = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]*)\s*=\s*(?P<value>[^#\n]+?)\s*#\s*lab:\s*choices\((?P<choices>.*)\)\s*$")

#: Options of a call that change speed only, never results: op -> (option, choices).
PERFORMANCE_OPTIONS = {
    "chunk_gated_delta_rule": ("chunk_size", (8, 16, 32, 64, 128)),
    "chunk_kda": ("chunk_size", (8, 16, 32, 64, 128)),
}


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    value: Any
    choices: tuple
    line: int


def parse_knobs(source: str) -> list[Knob]:
    """The ``# lab: choices(...)`` knobs of a candidate source, in order."""
    knobs = []
    for i, line in enumerate(source.splitlines()):
        m = KNOB.match(line.strip())
        if not m:
            continue
        try:
            value = ast.literal_eval(m["value"].strip())
            choices = ast.literal_eval(f"({m['choices']},)")
        except (ValueError, SyntaxError) as e:
            raise LabError(f"line {i + 1}: knob {m['name']}: values must be Python literals ({e})") from None
        knobs.append(Knob(m["name"], value, tuple(choices), i))
    return knobs


def set_knobs(source: str, values: dict[str, Any]) -> str:
    """``source`` with the named knobs set to new values (choices unchanged)."""
    lines = source.splitlines()
    known = {k.name: k for k in parse_knobs(source)}
    for name, value in values.items():
        if name not in known:
            raise LabError(f"knob {name!r}: not in the candidate (knobs: {sorted(known)})")
        knob = known[name]
        if value not in knob.choices:
            raise LabError(f"knob {name}: {value!r} is not one of its choices {knob.choices}")
        choices = ", ".join(repr(c) for c in knob.choices)
        indent = lines[knob.line][: len(lines[knob.line]) - len(lines[knob.line].lstrip())]
        lines[knob.line] = f"{indent}{name} = {value!r}  # lab: choices({choices})"
    return "\n".join(lines) + "\n"


def _shape_calls(op: Op) -> list:
    import jax.numpy as jnp

    from ..bench.inputs import materialize_example
    examples = op.benchmarks(current_platform()) or op.examples(jnp.float32)
    return [op.check(*e.args, **e.kwargs) for e in (materialize_example(x) for x in examples)]


def _doc(op: Op) -> str:
    import stellax
    fn = getattr(stellax, op.name, None)
    text = (getattr(fn, "__doc__", None) or getattr(op.reference_fn, "__doc__", None) or "").strip()
    first = text.split("\n\n")[0].strip()
    return " ".join(first.split())[:300]


def implementation_template(op: Op, *, base: str = "xla", name: str = "candidate") -> str:
    """A full candidate delegating to implementation ``base`` of ``op``."""
    if base not in op.implementations:
        raise LabError(f"--from: {op.name} has no implementation {base!r}; expected one of {list(op.implementations)}")
    impl = op.implementations[base]
    knob_lines, body = "", "    return _BASE.run(call, config)"
    if base == "xla" and op.name in PERFORMANCE_OPTIONS:
        option, choices = PERFORMANCE_OPTIONS[op.name]
        knob_lines = (f"\n# The XLA path's {option} when the caller gives none (None: the built-in choice).\n"
                      f"{option.upper()} = None  # lab: choices({', '.join(repr(c) for c in (None, *choices))})\n")
        body = (f"    if {option.upper()} is not None and call.options.get({option!r}) is None:\n"
                f"        call = Call(call.arrays, {{**call.options, {option!r}: {option.upper()}}})\n"
                f"    return _BASE.run(call, config)")
    backend = impl.backend
    return f'''"""Lab candidate for stellax op `{op.name}` ({_doc(op)}).

Starting point: the built-in `{base}` implementation ({backend}), unchanged. Edit `run`
(it receives the checked `Call`: `call.arrays`, `call.options`, and the config) or
replace the whole implementation. Evaluate with:

    stellax lab evaluate THIS_FILE --op {op.name}
"""

import dataclasses

import stellax
from stellax.core import Call, Implementation

OP = {op.name!r}
_BASE = stellax.registered_ops()[OP].implementations[{base!r}]
{knob_lines}

def run(call: Call, config):
    """Compute `{op.name}` for a checked call (same outputs as the golden)."""
{body}


# Same backend, config type, heuristic, space and requirements as the base implementation.
IMPLEMENTATION = dataclasses.replace(_BASE, name={name!r}, run=run)
'''


def config_template(op: Op, base: str, *, calls=None) -> str:
    """A config-only candidate for implementation ``base`` of ``op`` (see the module docstring)."""
    impl = tunable_base(op, base, "--config")
    calls = _shape_calls(op) if calls is None else calls
    fields = [f.name for f in dataclasses.fields(impl.config_type)]
    values: dict[str, set] = {f: set() for f in fields}
    start = None
    for call in calls:
        space = impl.config_space(call)
        if not space:
            raise LabError(f"implementation {base!r} of {op.name} has an empty config space on "
                           f"{call.describe()}: nothing to search")
        default = impl.default_config(call)
        start = start or default
        for config in [*space, default]:
            for f in fields:
                values[f].add(getattr(config, f))
    if start is None:
        raise LabError(f"{op.name} has neither benchmark shapes nor examples to draw a config space from")
    cls = impl.config_type
    knobs = "\n".join(f"{f.upper()} = {getattr(start, f)!r}  # lab: choices({', '.join(repr(v) for v in sorted(values[f]))})"
                      for f in fields)
    args = ", ".join(f"{f}={f.upper()}" for f in fields)
    return f'''"""Config-only lab candidate: one `{cls.__name__}` for every call of `{op.name}`'s
`{base}` implementation (starting at the heuristic's choice for the first benchmark shape).

    stellax lab evaluate THIS_FILE --op {op.name}
    stellax lab search --op {op.name} --seed-file THIS_FILE --proposer mutate
"""

from {cls.__module__} import {cls.__name__}

OP = {op.name!r}
BASE = {base!r}

{knobs}

CONFIG = {cls.__name__}({args})
'''
