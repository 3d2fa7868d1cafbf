"""Candidate files: what they define and how one becomes an `Implementation`.

A candidate is a Python file for one registered op. It defines either

* ``IMPLEMENTATION = Implementation(name, run, ...)``: a complete
  implementation (kernel or pure XLA) with the API the built-in kernels use
  (``run(call, config)``, a frozen config dataclass, ``heuristic``,
  ``space``, ``requirements``); or
* a config-only candidate for an existing implementation: ``BASE =
  "xla_chunked"`` and any of ``CONFIG`` (one config, or a dict of its
  fields, used for every call), ``HEURISTIC`` (``call -> config``) and
  ``SPACE`` (``call -> [config, ...]``).

Optional: ``OP = "name"`` (must match ``--op``), ``NAME`` (the
implementation name of a config-only candidate), ``BENCHMARKS``
(``platform -> [Example]``, only used when the evaluator is told to take the
benchmark shapes from the file).

Only the child process of an evaluation, a plugin loader and the MCP
server's evaluation child import candidate files; `stellax.lab.evaluate`
never does.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

from .._op_names import OP_ALIASES, UnknownOpError, resolve_op_name
from ..core import Implementation, Op, registered_ops
from .errors import LabError

_COUNTER = itertools.count()


def source_hash(source: str) -> str:
    """The sha256 of a candidate's source text (the archive's identity of a candidate)."""
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def find_op(name: str) -> Op:
    """The registered op ``name`` names (its registry name or its public
    function's: ``rms_norm`` is ``layer_norm``), or a `LabError` listing the
    known names."""
    ops = registered_ops()
    try:
        return ops[resolve_op_name(name, ops)]
    except UnknownOpError as e:
        raise LabError(f"--op: {e}") from None


def load_module(path: str | Path, module_name: str | None = None) -> ModuleType:
    """Import the candidate file at ``path`` as a fresh module (a package
    directory's ``__init__.py`` for a directory)."""
    path = Path(path)
    if path.is_dir():
        init = path / "__init__.py"
        if not init.exists():
            raise LabError(f"{path}: a plugin directory must be a package with an __init__.py")
        name = module_name or path.name
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(path)])
    else:
        if not path.exists():
            raise LabError(f"{path}: no such candidate file")
        name = module_name or f"stellax_lab_candidate_{next(_COUNTER)}"
        spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LabError(f"{path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _config_of(base: Implementation, value: Any, where: str):
    if isinstance(value, Mapping):
        return base.config_type.from_dict(value)
    if not isinstance(value, base.config_type):
        raise LabError(f"{where}: CONFIG must be a {base.config_type.__name__} (or a dict of its fields), "
                       f"got {type(value).__name__}")
    return value


def tunable_base(op: Op, base_name: str, where: str) -> Implementation:
    """Implementation ``base_name`` of ``op`` as the base of a config-only candidate; `LabError`
    (prefixed by ``where``) when ``op`` has no such implementation or it has no config type."""
    if base_name not in op.implementations:
        raise LabError(f"{where}: {base_name!r} is not an implementation of {op.name}; "
                       f"expected one of {list(op.implementations)}")
    base = op.implementations[base_name]
    if base.config_type is None:
        tunable = [n for n, i in op.implementations.items() if i.config_type is not None]
        raise LabError(f"{where}: implementation {base_name!r} of {op.name} has no config type; a config-only "
                       f"candidate needs one (tunable: {tunable})")
    return base


def implementation_of(module: ModuleType, op: Op, where: str = "candidate") -> Implementation:
    """The `Implementation` a loaded candidate module defines for ``op``
    (see the module docstring); `LabError` naming what is missing or wrong."""
    declared = getattr(module, "OP", None)
    if declared is not None and declared != op.name and OP_ALIASES.get(declared) != op.name:
        raise LabError(f"{where}: the file declares OP = {declared!r} but --op is {op.name!r}")
    impl = getattr(module, "IMPLEMENTATION", None)
    if impl is not None:
        if not isinstance(impl, Implementation):
            raise LabError(f"{where}: IMPLEMENTATION must be a stellax.core.Implementation, "
                           f"got {type(impl).__name__}")
        if impl.name in op.implementations:
            raise LabError(f"{where}: implementation name {impl.name!r} is taken by a built-in implementation "
                           f"of {op.name} ({list(op.implementations)}); give the candidate another name")
        return impl
    base_name = getattr(module, "BASE", None)
    if base_name is None:
        raise LabError(f"{where} defines no implementation: expected IMPLEMENTATION = Implementation(...) "
                       f"or a config-only candidate BASE = '<one of {list(op.implementations)}>' with "
                       f"CONFIG, HEURISTIC or SPACE")
    base = tunable_base(op, base_name, f"{where}: BASE")
    config, heuristic, space = (getattr(module, n, None) for n in ("CONFIG", "HEURISTIC", "SPACE"))
    if config is None and heuristic is None and space is None:
        raise LabError(f"{where}: BASE = {base_name!r} but no CONFIG, HEURISTIC or SPACE: nothing to change")
    if config is not None:
        fixed = _config_of(base, config, where)
        heuristic = heuristic or (lambda call, _c=fixed: _c)
        space = space or (lambda call, _c=fixed: [_c])
    name = getattr(module, "NAME", None) or f"lab_{base_name}"
    if name in op.implementations:
        raise LabError(f"{where}: NAME = {name!r} is taken by a built-in implementation of {op.name}")
    return dataclasses.replace(base, name=name, heuristic=heuristic or base.heuristic, space=space or base.space)


def candidate_kind(module: ModuleType) -> str:
    """``"implementation"`` or ``"config"``."""
    return "implementation" if getattr(module, "IMPLEMENTATION", None) is not None else "config"


def with_implementation(op: Op, impl: Implementation, *, first: bool = True) -> Op:
    """A copy of ``op`` whose dispatch also knows ``impl`` (first in the
    default order unless ``first=False``); ``op`` itself is unchanged."""
    lab_op = copy.copy(op)
    others = {n: i for n, i in op.implementations.items() if n != impl.name}
    lab_op.implementations = {impl.name: impl, **others} if first else {**others, impl.name: impl}
    return lab_op


def add_implementation(op: Op, impl: Implementation, *, first: bool = True) -> None:
    """Register ``impl`` as an implementation of ``op`` in place (plugins)."""
    if impl.name in op.implementations and op.implementations[impl.name] is not impl:
        raise LabError(f"{op.name}: an implementation named {impl.name!r} exists already")
    others = {n: i for n, i in op.implementations.items() if n != impl.name}
    op.implementations = {impl.name: impl, **others} if first else {**others, impl.name: impl}
