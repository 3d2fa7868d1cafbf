"""The import graph of `src/stellax`: imports point downward only, and no
module imports itself back through others (issue 36).

The graph is read statically (AST): every ``import`` and ``from ... import``,
at module level or inside a function (both run, sooner or later), relative
imports resolved. ``from package import name`` is an edge to
``package.name`` when that is a module, else to ``package``. The implicit
import of a parent package (``stellax.a.b`` runs ``stellax/a/__init__.py``)
is no edge: every module would depend on every package above it.

What loads lazily by name (`importlib.import_module` in the package root's and
the lab's ``__getattr__``) is not an import statement and no edge: it runs
when a user touches the name, after `stellax` is imported. The runtime tests
at the end check that `import stellax` really leaves the upper layers out.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "stellax"

#: The layers, bottom to top. A module may import modules of its own layer and of the
#: layers below it. A module is in the row of the longest prefix naming it (``stellax.x``
#: names ``stellax.x`` and ``stellax.x.*``); the package root row names `stellax/__init__.py` only.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the op framework, and the plain helpers everything shares
    ("core", ("stellax._version", "stellax._files", "stellax._op_names", "stellax.core")),
    # the op families (they may use each other: paged attention uses attention, MoE uses quant)
    ("ops", ("stellax.ops",)),
    # implementations from outside stellax, registered by `import stellax` (needs the registry only)
    ("plugins", ("stellax.lab.errors", "stellax.lab.candidate", "stellax.lab.plugins")),
    # the public namespace: re-exports core and the families; the layers above load on first use
    ("package root", ("stellax",)),
    # the numerics harness, lowering and compile tiers (tests, `stellax check`, bench, lab)
    ("testing", ("stellax.testing",)),
    # timers, FLOP/byte models, suites, reports
    ("bench", ("stellax.bench",)),
    # the autotuner (times configs with bench) and its caches
    ("autotune", ("stellax.autotune",)),
    # the kernel lab (evaluates candidates with testing and bench)
    ("lab", ("stellax.lab",)),
    # front ends over the public functions
    ("front ends", ("stellax.parallel", "stellax.nn", "stellax.torch", "stellax.integrations")),
    # whole-model benchmarks built from the nn front end (`stellax bench model` loads them on first use)
    ("model benchmarks", ("stellax.bench.model_zoo", "stellax.bench.model_train", "stellax.bench.model_serve")),
    # the command line
    ("cli", ("stellax.cli",)),
]

# issue 36: being removed family by family. Known upward imports under ops/ as (importer, imported);
# delete an entry when its import goes (the test fails on an entry that no longer occurs).
# (ops/moe/examples.py importing stellax.testing was the last; gone.)
KNOWN_UPWARD: set[tuple[str, str]] = set()

# issue 36: being removed family by family. Known import cycles, each as the set of its modules;
# delete an entry when its cycle goes (the test fails on an entry that no longer occurs).
KNOWN_CYCLES: list[frozenset[str]] = []


# -- the graph ------------------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` loads: itself when it is one of ours, else its longest prefix that is."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` over the modules of `stellax` (first line of each edge)."""
    known = modules()
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges = graph.setdefault(name, {})
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] != "stellax":
                    continue
                resolved = _target(target, known)
                if resolved is not None and resolved != name:
                    edges.setdefault(resolved, node.lineno)
    return graph


def layer_of(module: str) -> int | None:
    """The index in `LAYERS` of ``module``'s row (None: no row names it)."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix == "stellax"
            if module == prefix or (not exact_only and module.startswith(prefix + ".")):
                if len(prefix) > best_length:
                    best, best_length = index, len(prefix)
    return best


def upward_imports(graph) -> list[tuple[str, str, int]]:
    """``(importer, imported, line)`` for every import of a higher layer."""
    return [(a, b, line) for a, edges in sorted(graph.items()) for b, line in sorted(edges.items())
            if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def cycle_path(graph, component: list[str]) -> str:
    """One cycle through the component's first module, as ``a:line -> b:line -> ... -> a``."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}

    def walk(v: str) -> bool:
        for w in sorted(graph[v]):
            if w == start:
                path.append(w)
                return True
            if w in members and w not in seen:
                seen.add(w)
                path.append(w)
                if walk(w):
                    return True
                path.pop()
        return False

    walk(start)
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {start}"


# -- the rules ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_is_in_a_layer(graph):
    missing = [m for m in graph if layer_of(m) is None]
    assert not missing, f"modules in no row of LAYERS (tests/test_architecture.py): {missing}"


def test_imports_point_downward(graph):
    found = upward_imports(graph)
    unexpected = [f"{a} (line {line}) imports {b}: layer {LAYERS[layer_of(a)][0]!r} below "
                  f"{LAYERS[layer_of(b)][0]!r}" for a, b, line in found if (a, b) not in KNOWN_UPWARD]
    assert not unexpected, "upward imports:\n  " + "\n  ".join(unexpected)
    stale = sorted(KNOWN_UPWARD - {(a, b) for a, b, _ in found})
    assert not stale, f"KNOWN_UPWARD entries that no longer occur (delete them): {stale}"


def test_no_import_cycles(graph):
    found = cycles(graph)
    unexpected = [cycle_path(graph, c) for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not unexpected, "import cycles:\n  " + "\n  ".join(unexpected)
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in {frozenset(f) for f in found}]
    assert not stale, f"KNOWN_CYCLES entries that no longer occur (delete them): {stale}"


def test_allow_lists_name_ops_only():
    """Outside ops/ the rules hold with no exceptions (core's one cycle is reported to its owner)."""
    outside = [a for a, _ in KNOWN_UPWARD if not a.startswith("stellax.ops.")]
    assert not outside, outside
    outside = [sorted(c) for c in KNOWN_CYCLES
               if not all(m.startswith(("stellax.ops.", "stellax.core.")) for m in c)]
    assert not outside, outside


def test_the_checker_sees_an_upward_import_and_a_cycle():
    graph = {"stellax.core.a": {"stellax.bench.x": 3}, "stellax.bench.x": {"stellax.bench.y": 1},
             "stellax.bench.y": {"stellax.bench.x": 2}}
    assert upward_imports(graph) == [("stellax.core.a", "stellax.bench.x", 3)]
    assert cycles(graph) == [["stellax.bench.x", "stellax.bench.y"]]
    assert cycle_path(graph, ["stellax.bench.x", "stellax.bench.y"]) == (
        "stellax.bench.x (line 1) -> stellax.bench.y (line 2) -> stellax.bench.x")
    assert layer_of("stellax") != layer_of("stellax.bench") and layer_of("stellax.something_new") is None


def test_function_level_and_relative_imports_are_edges(graph):
    # bench/cli.py imports `stellax` inside a function; lab/plugins.py imports `..core` relatively
    assert "stellax" in graph["stellax.bench.cli"]
    assert "stellax.core" in graph["stellax.lab.plugins"]


# -- at run time ------------------------------------------------------------------------------
def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_import_stellax_leaves_the_upper_layers_out():
    """`import stellax` loads the ops and the plugins, nothing of testing, bench, autotune, the lab's
    tools or the front ends; the lazy names then work as before."""
    out = _run("""
        import sys
        import stellax
        upper = ("stellax.testing", "stellax.bench", "stellax.autotune", "stellax.parallel", "stellax.lab.search",
                 "stellax.lab.evaluate", "stellax.torch", "stellax.nn", "stellax.integrations", "stellax.cli")
        print(sorted(m for m in sys.modules if m.startswith(upper)))
        assert callable(stellax.autotune) and stellax.autotune.policy is not None
        from stellax.bench import benchmark
        assert stellax.benchmark is benchmark
        from stellax import parallel
        assert parallel is stellax.parallel and parallel.__name__ == "stellax.parallel"
        assert stellax.lab.search.__module__ == "stellax.lab.search"  # the function, as before
        assert {"autotune", "benchmark", "parallel"} <= set(dir(stellax))
        try:
            stellax.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("no AttributeError")
    """)
    assert out.strip() == "[]"


def test_the_autotuning_caches_are_consulted_without_importing_autotune():
    """The first config lookup imports `stellax.autotune`, whose sources then answer it."""
    out = _run("""
        import sys
        import jax.numpy as jnp
        import stellax
        from stellax.core import selection
        assert "stellax.autotune" not in sys.modules
        op = stellax.registered_ops()["layer_norm"]
        impl = next(i for i in op.implementations.values() if i.config_type is not None)
        call = op.check(jnp.ones((4, 128)), jnp.ones((128,)), None)
        config, source = selection.resolve_config(op.name, impl, call)
        assert "stellax.autotune" in sys.modules
        print([getattr(s, "label", "?") for s in selection._SOURCES])
    """)
    assert out.strip() == "['autotune', 'user-cache', 'shipped-cache', 'session', 'autotune-on-miss']"
