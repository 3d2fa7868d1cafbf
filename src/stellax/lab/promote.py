"""`stellax lab promote ID`: an archived candidate as a plugin package.

The package (``<out>/stellax-lab-<op>-<id>/``) holds ``pyproject.toml`` with
a ``stellax.implementations`` entry point, the package
``stellax_lab_<op>_<id>/__init__.py`` (the candidate source plus its ``OP``
and implementation ``NAME``), the evaluation report and a README. Install
it with pip, or point ``STELLAX_PLUGIN_PATH`` at the package directory.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .archive import Archive
from .errors import LabError

_BLOCK = '''

# -- promoted by `stellax lab promote` from candidate #{id} of run {run!r} ----------------------
OP = {op!r}
NAME = {name!r}
POSITION = "first"
if "IMPLEMENTATION" in globals():
    import dataclasses as _dataclasses
    IMPLEMENTATION = _dataclasses.replace(IMPLEMENTATION, name=NAME)
'''

_PYPROJECT = '''[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "stellax plugin: implementation {name} of op {op} (lab candidate #{id}, run {run})"
requires-python = ">=3.11"
dependencies = ["stellax"]

[project.entry-points."stellax.implementations"]
{name} = "{package}"

[tool.setuptools]
packages = ["{package}"]
'''


def promote(archive: Archive, candidate_id: int, out: str | Path, *, name: str | None = None,
            force: bool = False) -> Path:
    """Write candidate ``candidate_id`` into a plugin package under ``out``; returns its directory."""
    cand = archive.candidate(candidate_id)
    run = archive.run(cand["run_id"])
    if cand["status"] != "evaluated":
        raise LabError(f"candidate {candidate_id}: its evaluation never finished; evaluate it first")
    if not cand["passed"] and not force:
        failure = cand["first_failure"] or cand["report"].get("status")
        raise LabError(f"candidate {candidate_id}: did not pass (first failure: {failure}); pass --force to "
                       f"promote it anyway")
    op = run["op"]
    slug = re.sub(r"\W", "_", op)
    name = name or f"lab_{slug}_{candidate_id}"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise LabError(f"--name: expected a Python identifier, got {name!r}")
    package = f"stellax_lab_{slug}_{candidate_id}"
    root = Path(out) / package.replace("_", "-")
    pkg = root / package
    pkg.mkdir(parents=True, exist_ok=True)
    source = cand["source"].rstrip() + "\n" + _BLOCK.format(id=candidate_id, run=run["id"], op=op, name=name)
    (pkg / "__init__.py").write_text(source)
    (pkg / "report.json").write_text(json.dumps(cand["report"], indent=1, default=repr))
    (root / "pyproject.toml").write_text(_PYPROJECT.format(dist=package.replace("_", "-"), name=name, op=op,
                                                          id=candidate_id, run=run["id"], package=package))
    bench = cand["report"].get("benchmark") or {}
    (root / "README.md").write_text(
        f"# {package}\n\nImplementation `{name}` of stellax op `{op}`, promoted from lab candidate "
        f"#{candidate_id} (run `{run['id']}`, proposer `{cand['proposer']}`): {cand['report']['status']}, "
        f"speedup {bench.get('speedup')} vs `{bench.get('baseline')}` on "
        f"{cand['report'].get('environment', {}).get('device_kind', '?')}.\n\n"
        f"    pip install {root}\n    # or: STELLAX_PLUGIN_PATH={root}\n")
    return root
