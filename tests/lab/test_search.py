"""The mutate search: seeded and reproducible, ranks on correctness then
speed, stops when its neighbourhood is exhausted, and a search killed with
``kill -9`` resumes without losing a finished evaluation."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stellax.lab import cli, template
from stellax.lab.archive import Archive
from stellax.lab.candidate import find_op
from stellax.lab.errors import LabError
from stellax.lab.mutate import MutateProposer, mutate_source
from stellax.lab.search import search

FAST = {"dtypes": ["float32"], "max_examples": 1, "benchmark_min_time": 0.05, "benchmark_rounds": 5}

#: A candidate with one real performance knob: the built-in path computed REPEAT times. The choices are
#: far apart (a CI worker under load once ranked 3 repeats above 1) so the ranking is not noise.
REPEATED = '''import dataclasses

import stellax
from jax import lax

OP = "hadamard_transform"
_BASE = stellax.registered_ops()[OP].implementations["xla"]

REPEAT = 4  # lab: choices(1, 4, 16)


def run(call, config):
    first = _BASE.run(call, config)

    def again(i, previous):
        nudged = call.x + (previous.reshape(-1)[0] * 0.0).astype(call.x.dtype)
        return _BASE.run(call.replace_arrays(x=nudged), config)
    return lax.fori_loop(0, REPEAT - 1, again, first)


IMPLEMENTATION = dataclasses.replace(_BASE, name="repeated", run=run)
'''


def test_mutations_are_seeded_and_stay_in_the_choices():
    source = template.config_template(find_op("attention"), "xla_chunked")
    draws = [mutate_source(source, random.Random(f"7:{i}")) for i in range(6)]
    assert draws == [mutate_source(source, random.Random(f"7:{i}")) for i in range(6)]
    assert len({d[0] for d in draws}) > 1
    for new, note in draws:
        knobs = {k.name: k for k in template.parse_knobs(new)}
        assert set(knobs) == {"BLOCK_Q", "BLOCK_K"}
        assert all(k.value in k.choices for k in knobs.values()) and "->" in note
    with pytest.raises(LabError, match="has no '# lab: choices"):
        mutate_source("BASE = 'xla'\n", random.Random(0))
    with pytest.raises(LabError, match="not one of its choices"):
        template.set_knobs(source, {"BLOCK_Q": 3})


def test_search_finds_the_fast_knob_and_stops_when_exhausted(tmp_path, worker, hadamard_shapes):
    with Archive(tmp_path / "lab.sqlite") as archive:
        result = search("hadamard_transform", MutateProposer(), budget=6, seed_source=REPEATED, archive=archive,
                        run_id="m", options=FAST, shapes=hadamard_shapes, worker=worker, progress=None)
        assert result["evaluated"] == 3 and result["stopped"].startswith("exhausted")
        rows = archive.evaluated("m")
        repeat = {c["id"]: template.parse_knobs(c["source"])[0].value for c in rows}
        assert sorted(repeat.values()) == [1, 4, 16]
        best = result["best"]
        assert repeat[best["id"]] == 1 and best["passed"]
        speed = {repeat[c["id"]]: c["speedup"] for c in rows}
        assert speed[1] > speed[4] > speed[16]
        lineage = archive.lineage(best["id"])
        assert lineage[0]["proposer"] == "seed" and lineage[-1]["id"] == best["id"]
        assert [c["generation"] for c in lineage] == list(range(len(lineage)))
        out = tmp_path / "report"
        assert cli.main(["report", "--archive", str(tmp_path / "lab.sqlite"), "--run", "m", "--out", str(out)]) == 0
        md = (out / "report.md").read_text()
        assert f"**Winner: candidate #{best['id']}**" in md and "## The winner's lineage" in md
        assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"


def _search_process(archive_path: Path, shapes: str, run: str, budget: int, seed_file: Path) -> subprocess.Popen:
    argv = ["search", "--op", "hadamard_transform", "--proposer", "mutate", "--budget", str(budget), "--run", run,
            "--archive", str(archive_path), "--seed-file", str(seed_file), "--shapes", shapes, "--dtypes", "float32",
            "--max-examples", "1", "--bench-time", "0.05"]
    code = f"import sys; from stellax.lab.cli import main; sys.exit(main({argv!r}))"
    env = {**os.environ, "TMPDIR": str(archive_path.parent)}  # the killed child's directories stay in tmp_path
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)


def test_killed_search_resumes_without_losing_evaluations(tmp_path, worker, hadamard_shapes):
    archive_path = tmp_path / "lab.sqlite"
    seed_file = tmp_path / "seed.py"
    seed_file.write_text(REPEATED)
    proc = _search_process(archive_path, hadamard_shapes, "k", 3, seed_file)
    deadline = time.time() + 400
    try:
        while time.time() < deadline:
            if archive_path.exists():
                with Archive(archive_path) as archive:
                    if len(archive.evaluated("k")) >= 1 and archive.candidates("k", status="pending"):
                        break
            assert proc.poll() is None, "the search ended before it could be killed"
            time.sleep(0.2)
        else:
            pytest.fail("the search did not reach its second evaluation in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the search and its evaluation child
        proc.wait()
    with Archive(archive_path) as archive:
        assert archive.integrity() == "ok"
        before = {c["id"]: c["report"] for c in archive.evaluated("k")}
        pending = [c["id"] for c in archive.candidates("k", status="pending")]
        assert before and pending
        result = search("hadamard_transform", MutateProposer(), budget=3, seed_source=REPEATED, archive=archive,
                        run_id="k", options=FAST, shapes=hadamard_shapes, worker=worker, progress=None)
        assert result["evaluated"] == 3
        after = {c["id"]: c["report"] for c in archive.evaluated("k")}
        assert all(after[i] == report for i, report in before.items())  # nothing finished was lost or redone
        assert set(pending) <= set(after)  # the cut-off evaluation ran again
        assert not archive.candidates("k", status="pending") and archive.integrity() == "ok"
        with pytest.raises(LabError, match="proposer mutate, not hadamard_transform with llm"):
            archive.start_run("k", "hadamard_transform", "llm", {})


@pytest.mark.slow
def test_config_only_attention_search(tmp_path, worker):
    """A config-only `xla_chunked` search on the op's own examples and benchmark shapes."""
    seed = template.config_template(find_op("attention"), "xla_chunked")
    with Archive(tmp_path / "lab.sqlite") as archive:
        result = search("attention", MutateProposer(), budget=3, seed_source=seed, archive=archive, run_id="a",
                        options={**FAST, "max_benchmarks": 1}, worker=worker, progress=None)
        rows = archive.evaluated("a")
        assert result["evaluated"] == 3 and all(c["passed"] for c in rows), [c["first_failure"] for c in rows]
        assert rows[0]["report"]["candidate"]["kind"] == "config"
        assert all(c["report"]["benchmark"]["cases"][0]["baseline"] == "xla_chunked" for c in rows)
