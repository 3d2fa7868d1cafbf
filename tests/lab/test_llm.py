"""The llm proposer against the scripted local server: replies that do not
import, are wrong, slow or faster are ranked correctly and the right winner
is kept; malformed replies are retried and recorded; an endpoint that
refuses or times out is a clear error."""

import os
import socket

import pytest

from stellax.lab import cli
from stellax.lab.archive import Archive
from stellax.lab.candidate import find_op
from stellax.lab.errors import LabError
from stellax.lab.fake_llm import FakeLLMServer, demo_replies
from stellax.lab.llm import LLMProposer, extract_code
from stellax.lab.search import Context, search

FAST = {"dtypes": ["float32"], "max_examples": 1, "benchmark_min_time": 0.05, "benchmark_rounds": 5}


def test_extract_code():
    assert extract_code("text\n```python\nBASE = 'xla'\n```\n") == "BASE = 'xla'\n"
    two = "```python\nprint(1)\n```\nand\n```py\nIMPLEMENTATION = f()\n```"
    assert extract_code(two) == "IMPLEMENTATION = f()\n"
    assert extract_code("IMPLEMENTATION = f()\n") == "IMPLEMENTATION = f()\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nprint('no definition')\n```") is None


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_timeout_and_http_errors(tmp_path, capsys):
    refused = LLMProposer(base_url=f"http://127.0.0.1:{_closed_port()}/v1", model="m", timeout=5)
    with pytest.raises(LabError, match=r"http://127\.0\.0\.1:\d+/v1/chat/completions: .*refused"):
        refused.complete([{"role": "user", "content": "hi"}])
    with FakeLLMServer([{"delay": 3, "content": "late"}], lifetime=30) as server:
        slow = LLMProposer(base_url=server.url, model="m", timeout=0.5)
        with pytest.raises(LabError, match=r"no answer within 0.5 s"):
            slow.complete([{"role": "user", "content": "hi"}])
    with pytest.raises(LabError, match="no base URL"):
        LLMProposer(base_url="", model="m")
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("STELLAX_LAB_", "OPENAI_"))}
    try:
        assert cli.main(["search", "--op", "hadamard_transform", "--proposer", "llm", "--model", "m",
                         "--archive", str(tmp_path / "x.sqlite")]) == 2
    finally:
        os.environ.update(env)
    assert "no base URL (pass --base-url or set STELLAX_LAB_BASE_URL" in capsys.readouterr().err
    op = find_op("hadamard_transform")
    with FakeLLMServer([{"status": 500}, "no code", {"status": 502}], lifetime=30) as server, \
            Archive(tmp_path / "a.sqlite") as archive:
        archive.start_run("r", op.name, "llm", {})
        best = {"id": 1, "source": "BASE = 'xla'\n", "report": {"summary": "s"}}
        proposer = LLMProposer(base_url=server.url, model="m", timeout=5, retries=3)
        with pytest.raises(LabError, match="3 attempts gave no usable candidate"):
            proposer.propose(Context(op, best, best, [best], None, archive, "r"))
        assert [a["kind"] for a in archive.attempts("r")] == ["bad_response", "malformed", "bad_response"]
        assert server.requests == 3


def test_search_ranks_scripted_candidates(tmp_path, worker, hadamard_shapes):
    op = "hadamard_transform"
    with FakeLLMServer(demo_replies(op, "x"), lifetime=600) as server, Archive(tmp_path / "lab.sqlite") as archive:
        proposer = LLMProposer(base_url=server.url, model="scripted", api_key="k", timeout=30, retries=3)
        replies = demo_replies(op, "x")
        # A correct but slowed starting point (the built-in path three times), so that the winner is unambiguous.
        seed = extract_code(replies[3]).replace("fori_loop(0, 4", "fori_loop(0, 2").replace('name="slow"', 'name="seed"')
        result = search(op, proposer, budget=5, seed_source=seed, archive=archive, run_id="llm", options=FAST,
                        shapes=hadamard_shapes, worker=worker, progress=None)
        assert result["evaluated"] == 5 and server.requests == 5
        rows = {c["id"]: c for c in archive.evaluated("llm")}
        by_name = {}
        for c in rows.values():
            for name in ("broken", "wrong", "slow", "fast"):
                if f'name="{name}"' in c["source"] or f"name='{name}'" in c["source"]:
                    by_name[name] = c
        assert set(by_name) == {"broken", "wrong", "slow", "fast"}
        assert by_name["broken"]["first_failure"] == "load"
        assert by_name["wrong"]["first_failure"] == "numerics"
        assert by_name["slow"]["passed"] and by_name["fast"]["passed"]
        assert by_name["fast"]["speedup"] > by_name["slow"]["speedup"]
        ranked = sorted(by_name, key=lambda n: by_name[n]["score"], reverse=True)
        assert ranked == ["fast", "slow", "wrong", "broken"]
        assert archive.best("llm")["id"] == by_name["fast"]["id"]
        assert rows[1]["passed"] and rows[1]["speedup"] < by_name["fast"]["speedup"]
        assert [a["kind"] for a in archive.attempts("llm")] == ["malformed"]
        first_prompt = server.received[0]["messages"][-1]["content"]
        assert "Reference implementation" in first_prompt and "IMPLEMENTATION = dataclasses.replace" in first_prompt
        assert "Your reply had no ```python block" in server.received[1]["messages"][-1]["content"]
        assert "PASSED" in server.received[2]["messages"][1]["content"]  # the best candidate's report summary
        for c in rows.values():
            if c["parent_id"] is not None:
                assert c["parent_id"] in rows
