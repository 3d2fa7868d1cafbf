"""`stellax lab mcp` driven by the MCP Python client over stdio."""

import asyncio
import json
import os
import sys

import pytest

mcp = pytest.importorskip("mcp", reason="needs the mcp package: pip install 'stellax[lab]' (or pip install mcp)")

from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

from stellax.lab import template  # noqa: E402
from stellax.lab.archive import Archive  # noqa: E402
from stellax.lab.candidate import find_op, source_hash  # noqa: E402


def _payload(result) -> dict:
    error = getattr(result, "is_error", None) or getattr(result, "isError", None)
    assert not error, result
    return json.loads(result.content[0].text)


async def _session(archive_path, calls):
    code = f"import sys; from stellax.lab.cli import main; sys.exit(main(['mcp', '--archive', {str(archive_path)!r}]))"
    params = StdioServerParameters(command=sys.executable, args=["-c", code], env=dict(os.environ))
    out = {}
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            tools = await session.list_tools()
            out["tools"] = sorted(t.name for t in tools.tools)
            for name, arguments in calls:
                out[name] = _payload(await session.call_tool(name, arguments))
    return out


def test_mcp_tools_over_stdio(tmp_path):
    archive_path = tmp_path / "lab.sqlite"
    with Archive(archive_path) as archive:  # a finished run for search_status to show
        archive.start_run("r", "hadamard_transform", "mutate", {})
        archive.add_candidate("r", "X = 1\n", source_hash("X = 1\n"), parent_id=None, generation=0, proposer="seed")
    source = template.implementation_template(find_op("hadamard_transform"))
    calls = [("list_ops", {}), ("describe_op", {"name": "hadamard_transform"}),
             ("evaluate_candidate", {"op": "hadamard_transform", "source": source, "dtypes": ["float32"],
                                     "max_examples": 1, "benchmark": False}),
             ("search_status", {}), ("benchmark", {"op": "hadamard_transform", "implementation": "xla"})]
    out = asyncio.run(asyncio.wait_for(_session(archive_path, calls), timeout=400))
    assert out["tools"] == ["benchmark", "describe_op", "evaluate_candidate", "list_ops", "search_status"]
    assert "attention" in {o["name"] for o in out["list_ops"]["ops"]}
    described = out["describe_op"]
    assert described["signature"].startswith("hadamard_transform(") and "Reference implementation" in described["context"]
    assert described["current_best"]["implementation"] == "xla" and len(described["examples"]) == 4
    report = out["evaluate_candidate"]
    assert report["schema_version"] == 1 and report["status"] == "passed", report.get("summary")
    runs = out["search_status"]["runs"]
    assert runs == [{"run": "r", "op": "hadamard_transform", "proposer": "mutate", "evaluated": 0, "pending": 1,
                     "best": None}]
    bench = out["benchmark"]["results"]
    assert bench and all(r["implementation"] == "xla" and r["median_ms"] > 0 for r in bench)
