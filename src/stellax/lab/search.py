"""The evolutionary search (`stellax lab search`).

Each step selects a parent from the population (the ``population`` best
evaluated candidates of the run, correctness first and speed second) by a
tournament of two, asks the proposer for a child, skips sources the run has
seen, evaluates the child in the worker child process and stores it in the
archive. The budget counts evaluations, the starting candidate included.

Randomness is drawn per step from ``random.Random(f"{seed}:{step}")``, so a
resumed search (the same ``run`` id) continues the same sequence of draws; a
``pending`` candidate (its evaluation was cut off by a kill) is evaluated
again first, and every finished evaluation is kept.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Mapping

from .archive import Archive
from .candidate import find_op, source_hash
from .errors import LabError
from .evaluate import DEFAULT_MEMORY_LIMIT_MB, Worker
from .mutate import Proposal
from .report import rank_key

#: Proposals a step may draw before it gives up on finding an unseen source
#: (a proposer's ``max_duplicates`` attribute overrides it).
MAX_DUPLICATES = 40


@dataclasses.dataclass
class Context:
    """What a proposer sees: the op, the selected parent, the best so far, the
    run's evaluated candidates, the step's random generator and the archive."""

    op: Any
    parent: dict
    best: dict
    evaluated: list
    rng: random.Random
    archive: Archive
    run_id: str


def select_parent(evaluated: list[dict], rng: random.Random, population: int) -> dict:
    """A tournament of two among the ``population`` best evaluated candidates."""
    ranked = sorted(evaluated, key=lambda c: (rank_key(c["report"]), -c["id"]), reverse=True)[:max(1, population)]
    a, b = rng.choice(ranked), rng.choice(ranked)
    return max((a, b), key=lambda c: (rank_key(c["report"]), -c["id"]))


def _log(progress, message):
    if progress is not None:
        progress(message)


def search(op: str, proposer, *, budget: int, seed_source: str, archive: Archive, run_id: str | None = None,
           seed: int = 0, population: int = 4, time_limit: float = 600.0,
           memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB, options: Mapping | None = None, shapes: str | None = None,
           progress: Callable[[str], None] | None = print, worker: Worker | None = None) -> dict:
    """Run (or resume) a search; returns ``{"run", "best", "evaluated", "stopped"}``."""
    op_obj = find_op(op)
    op = op_obj.name  # the registry name (``--op`` may name the public function)
    if budget < 1:
        raise LabError(f"--budget: expected at least 1 evaluation, got {budget}")
    if population < 1:
        raise LabError(f"--population: expected at least 1, got {population}")
    run_id = run_id or f"{op}-{proposer.name}-seed{seed}"
    params = {"seed": seed, "population": population, "options": dict(options or {}), "shapes": shapes,
              "time_limit": time_limit, "memory_limit_mb": memory_limit_mb}
    archive.start_run(run_id, op, proposer.name, params)
    own_worker = worker is None
    worker = worker or Worker(time_limit=time_limit, memory_limit_mb=memory_limit_mb)
    stopped = "budget"

    def evaluate(candidate_id: int, source: str, label: str) -> dict:
        report = worker.evaluate(source, op, display=f"candidate-{candidate_id}.py", options=options, shapes=shapes)
        archive.finish_candidate(candidate_id, report)
        speed = (report.get("benchmark") or {}).get("speedup")
        _log(progress, f"[{run_id}] #{candidate_id} {label}: {report['status']}"
             + (f" (tier {report['first_failure']['tier']})" if report.get("first_failure") else "")
             + (f" speedup {speed:.3f}" if speed else "") + f" score {report['score']:.4f}")
        return report

    try:
        for pending in archive.candidates(run_id, status="pending"):
            _log(progress, f"[{run_id}] resuming: #{pending['id']} was cut off; evaluating it again")
            evaluate(pending["id"], pending["source"], pending["note"] or "resumed")
        if not archive.candidates(run_id):
            cid = archive.add_candidate(run_id, seed_source, source_hash(seed_source), parent_id=None, generation=0,
                                        proposer="seed", note="starting candidate")
            evaluate(cid, seed_source, "starting candidate")
        while True:
            evaluated = archive.evaluated(run_id)
            if len(evaluated) >= budget:
                break
            every = archive.candidates(run_id)
            seen = {c["source_hash"] for c in every}
            step = len(every)
            rng = random.Random(f"{seed}:{step}")
            best = archive.best(run_id)
            proposal: Proposal | None = None
            for _ in range(getattr(proposer, "max_duplicates", MAX_DUPLICATES)):
                parent = select_parent(evaluated, rng, population)
                context = Context(op_obj, parent, best, evaluated, rng, archive, run_id)
                candidate = proposer.propose(context)
                if candidate is None:
                    break
                if source_hash(candidate.source) not in seen:
                    proposal = candidate
                    break
            if proposal is None:
                stopped = "exhausted: no unseen candidate in the neighbourhood of the population"
                _log(progress, f"[{run_id}] stopping: {stopped}")
                break
            parent = archive.candidate(proposal.parent_id) if proposal.parent_id is not None else None
            generation = parent["generation"] + 1 if parent else 1
            cid = archive.add_candidate(run_id, proposal.source, source_hash(proposal.source),
                                        parent_id=proposal.parent_id, generation=generation,
                                        proposer=proposer.name, note=proposal.note)
            evaluate(cid, proposal.source, proposal.note or proposer.name)
    finally:
        if own_worker:
            worker.close()
    best = archive.best(run_id)
    return {"run": run_id, "best": best, "evaluated": len(archive.evaluated(run_id)), "stopped": stopped}
