"""The ``mutate`` proposer: seeded, offline moves of a candidate's knobs.

A knob is a ``NAME = VALUE  # lab: choices(...)`` line (`template`); a
config-only candidate from `stellax lab new --config` has one per config
field, drawn from the implementation's autotuning space (config-space
mutation), and any candidate can carry its own knobs in its source
(source-template mutation: chunk sizes, unroll factors, code variants
selected by a constant). One proposal changes one knob (two with
probability 0.3) to a neighbouring choice (probability 0.7) or to any other
choice. Everything is drawn from the ``random.Random`` the search passes in,
so a search with the same seed proposes the same candidates.
"""

from __future__ import annotations

import dataclasses
import random

from .errors import LabError
from .template import parse_knobs, set_knobs


@dataclasses.dataclass(frozen=True)
class Proposal:
    """A proposed candidate: its source, the parent it came from and a note (what changed)."""

    source: str
    parent_id: int | None
    note: str = ""


def mutate_source(source: str, rng: random.Random) -> tuple[str, str]:
    """One mutation of ``source``'s knobs: (new source, what changed)."""
    knobs = [k for k in parse_knobs(source) if len(k.choices) > 1]
    if not knobs:
        raise LabError("the parent candidate has no '# lab: choices(...)' knob with two or more values: the mutate "
                       "proposer has nothing to change (start from `stellax lab new --config IMPL` or add knobs)")
    count = 2 if len(knobs) > 1 and rng.random() < 0.3 else 1
    changes, notes = {}, []
    for knob in rng.sample(knobs, count):
        current = knob.choices.index(knob.value) if knob.value in knob.choices else 0
        if rng.random() < 0.7:
            steps = [i for i in (current - 1, current + 1) if 0 <= i < len(knob.choices)]
        else:
            steps = [i for i in range(len(knob.choices)) if i != current]
        value = knob.choices[rng.choice(steps)]
        changes[knob.name] = value
        notes.append(f"{knob.name} {knob.value!r}->{value!r}")
    return set_knobs(source, changes), ", ".join(notes)


class MutateProposer:
    """Proposes knob mutations of the parent the search selected."""

    name = "mutate"

    def propose(self, context) -> Proposal:
        parent = context.parent
        source, note = mutate_source(parent["source"], context.rng)
        return Proposal(source, parent["id"], note)
