"""`stellax lab mcp`: the lab as an MCP server over stdio.

Tools: ``list_ops``, ``describe_op`` (signature, docstring, reference source,
examples, implementations, the current best: what dispatch picks and the
archive's best candidate), ``evaluate_candidate`` (a candidate's source →
the JSON report; evaluated in a child process like `stellax lab
evaluate`), ``benchmark`` (an op's implementations on its benchmark shapes)
and ``search_status`` (the archive's runs and their best candidates).

Needs the ``mcp`` package: ``pip install 'stellax[lab]'`` (or ``pip install
mcp``); both the 1.x (``FastMCP``) and 2.x (``MCPServer``) APIs work.
"""

from __future__ import annotations

import inspect
import jax.numpy as jnp

from ..bench import benchmark as run_benchmark
from ..bench.inputs import materialize_example
from ..core import current_platform
from . import archive as archive_lib
from .candidate import find_op
from .evaluate import Worker
from .llm import op_context

INSTALL = "pip install 'stellax[lab]'  (or: pip install mcp)"


def server_class():
    """The MCP server class of the installed ``mcp`` package."""
    try:
        from mcp.server.mcpserver import MCPServer
        return MCPServer
    except ImportError:
        pass
    try:
        from mcp.server.fastmcp import FastMCP
        return FastMCP
    except ImportError:
        raise ImportError(f"stellax lab mcp needs the mcp package: {INSTALL}") from None


class LabTools:
    """The tools, as plain methods (the server wraps them; tests can call them)."""

    def __init__(self, archive_path: str | None = None, *, time_limit: float = 600.0, memory_limit_mb: int = 8192):
        self.archive_path = archive_path
        self.worker = Worker(time_limit=time_limit, memory_limit_mb=memory_limit_mb)

    def close(self) -> None:
        self.worker.close()

    def list_ops(self) -> list[dict]:
        """Every registered op: name, family and implementations (backend, config type)."""
        from ..core import registered_ops
        return [{"name": n, "family": op.family,
                 "implementations": {k: {"backend": i.backend,
                                         "config_type": i.config_type.__name__ if i.config_type else None}
                                     for k, i in op.implementations.items()}}
                for n, op in sorted(registered_ops().items())]

    def describe_op(self, name: str) -> dict:
        """Signature, docstring, reference source, examples and the current best of op ``name``."""
        import stellax
        op = find_op(name)
        fn = getattr(stellax, name, None)
        try:
            signature = f"{name}{inspect.signature(fn)}" if fn is not None else None
        except (TypeError, ValueError):
            signature = None
        examples = op.examples(jnp.float32)
        best_dispatch = None
        shapes = op.benchmarks(current_platform()) or examples
        if shapes:
            example = materialize_example(shapes[0])
            call = op.check(*example.args, **example.kwargs)
            best_dispatch = {"implementation": op.select(call).name, "on": example.label}
        with archive_lib.Archive(self.archive_path) as archive:
            runs = [r["id"] for r in archive.runs() if r["op"] == name]
            candidates = [archive.best(r) for r in runs]
        candidates = [c for c in candidates if c is not None and c["passed"]]
        best_candidate = max(candidates, key=lambda c: c["score"]) if candidates else None
        return {"name": name, "signature": signature, "context": op_context(op),
                "examples": [e.label for e in examples], "differentiable": list(op.differentiable),
                "implementations": self.list_ops_entry(op), "current_best": best_dispatch,
                "best_lab_candidate": None if best_candidate is None else {
                    "id": best_candidate["id"], "run": best_candidate["run_id"], "score": best_candidate["score"],
                    "speedup": best_candidate["speedup"], "source": best_candidate["source"]}}

    @staticmethod
    def list_ops_entry(op) -> dict:
        return {k: {"backend": i.backend, "config_type": i.config_type.__name__ if i.config_type else None}
                for k, i in op.implementations.items()}

    def evaluate_candidate(self, op: str, source: str, dtypes: list[str] | None = None,
                           max_examples: int | None = None, benchmark: bool = True) -> dict:
        """Evaluate a candidate's source for ``op``; returns the JSON report (``summary`` is the plain text)."""
        op = find_op(op).name
        options = {"dtypes": dtypes or ["float32", "bfloat16"], "max_examples": max_examples, "benchmark": benchmark}
        return self.worker.evaluate(source, op, display="mcp-candidate.py", options=options)

    def benchmark(self, op: str, implementation: str | None = None, max_shapes: int = 1) -> list[dict]:
        """Median / fastest time of the op's implementations (or one) on its first benchmark shapes."""
        op_obj = find_op(op)
        platform = current_platform()
        out = []
        for raw in op_obj.benchmarks(platform)[:max_shapes]:
            example = materialize_example(raw)
            call = op_obj.check(*example.args, **example.kwargs)
            names = [implementation] if implementation else list(op_obj.implementations)
            for name in names:
                impl = op_obj.implementations[name]
                if (impl.is_kernel and platform.backend == "cpu") or not impl.supported(call):
                    out.append({"example": example.label, "implementation": name, "skipped": "not native here"})
                    continue

                def fn(*args, _name=name, **kwargs):
                    return op_obj(*args, implementation=_name, **kwargs)
                record = run_benchmark(fn, *example.args, timer="wall", min_time=0.2, input_sets=1, randomize=False,
                                       name=name, **example.kwargs)
                out.append({"example": example.label, "implementation": name, "median_ms": record.median_ms,
                            "min_ms": record.min_ms, "pct_roofline": record.roofline.get("pct_roofline")})
        return out

    def search_status(self, run: str | None = None) -> list[dict]:
        """The archive's runs (or one): evaluations, pending, and the best candidate."""
        with archive_lib.Archive(self.archive_path) as archive:
            runs = [r for r in archive.runs() if run is None or r["id"] == run]
            out = []
            for r in runs:
                best = archive.best(r["id"])
                out.append({"run": r["id"], "op": r["op"], "proposer": r["proposer"],
                            "evaluated": len(archive.evaluated(r["id"])),
                            "pending": len(archive.candidates(r["id"], status="pending")),
                            "best": None if best is None else {"id": best["id"], "score": best["score"],
                                                               "status": best["report"]["status"],
                                                               "speedup": best["speedup"], "note": best["note"]}})
            return out


def build_server(tools: LabTools):
    """An MCP server exposing ``tools``."""
    server = server_class()(name="stellax-lab", instructions="Evaluate and search stellax kernel candidates.")

    @server.tool()
    def list_ops() -> dict:
        """Every registered stellax op with its implementations."""
        return {"ops": tools.list_ops()}

    @server.tool()
    def describe_op(name: str) -> dict:
        """An op's signature, docstring, reference source, examples and current best."""
        return tools.describe_op(name)

    @server.tool()
    def evaluate_candidate(op: str, source: str, dtypes: list[str] | None = None, max_examples: int | None = None,
                           benchmark: bool = True) -> dict:
        """Evaluate candidate source code for an op (child process, time and memory limits): the report."""
        return tools.evaluate_candidate(op, source, dtypes, max_examples, benchmark)

    @server.tool()
    def benchmark(op: str, implementation: str | None = None, max_shapes: int = 1) -> dict:
        """Time an op's implementations on its benchmark shapes."""
        return {"results": tools.benchmark(op, implementation, max_shapes)}

    @server.tool()
    def search_status(run: str | None = None) -> dict:
        """Runs in the lab archive and their best candidates."""
        return {"runs": tools.search_status(run)}

    return server


def serve(archive_path: str | None = None) -> None:
    """Serve over stdio until the client disconnects."""
    tools = LabTools(archive_path)
    try:
        build_server(tools).run("stdio")
    finally:
        tools.close()
