"""The stellax calls of a program, recovered without its code: from HLO text or a profiler trace.

Every op call annotates the operations it emits (`stellax.core.metadata`), so

* `calls_from_hlo(path)` reads them from a lowered or compiled module's text
  (``jax.jit(f).lower(...).as_text()``, ``.compile().as_text()``) or from an
  XLA dump directory (``--xla_dump_to``: ``*.txt`` / ``*.mlir`` files);
* `calls_from_trace(dir)` reads them from the HLO a `jax.profiler` / XProf
  trace stores, and adds each call's measured time: the union of the
  intervals of the XLA operations that carry its annotation, summed over the
  trace. Calls come back most expensive first, so tuning starts where the time is.

`observed_calls` turns records into the `ObservedCall`s `stellax.autotune`
tunes (those whose implementation has a config).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable

from ..bench import trace as trace_lib
from ..core import metadata
from ..core.metadata import CallRecord
from ..core.op import registered_ops
from . import keys as keys_lib
from .api import ObservedCall

_TEXT_SUFFIXES = (".txt", ".mlir", ".hlo", ".stablehlo")


class ProgramError(ValueError):
    """A program text or trace that holds no stellax calls, or cannot be read."""


def _texts(path: Path) -> list[tuple[Path, str]]:
    if path.is_file():
        return [(path, path.read_text(errors="replace"))]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
        if not files:
            raise ProgramError(f"--from-hlo: {path} holds no HLO text files ({', '.join(_TEXT_SUFFIXES)})")
        return [(p, p.read_text(errors="replace")) for p in files]
    raise ProgramError(f"--from-hlo: {path} does not exist")


def calls_from_hlo(path: str | Path) -> list[CallRecord]:
    """Distinct stellax calls in an HLO / StableHLO text file or an XLA dump directory, in order."""
    path = Path(path)
    records = []
    for file, text in _texts(path):
        try:
            records.extend(metadata.calls_in_text(text))
        except metadata.MetadataError as e:
            raise ProgramError(f"--from-hlo: {file}: {e}") from None
    if not records:
        raise ProgramError(f"--from-hlo: no stellax call in {path}: the program was not built with stellax ops, "
                           f"or with a stellax older than the call annotations")
    return metadata.distinct(records)


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """A stellax call found in a trace, with its measured device time."""

    record: CallRecord
    time_ms: float
    executions: int


def calls_from_trace(directory: str | Path) -> list[TracedCall]:
    """Distinct stellax calls of the programs in a profiler trace, most measured time first."""
    times: dict[str, float] = {}
    runs: dict[str, set] = {}
    for file in trace_lib.xplane_files(directory):
        data = file.read_bytes()
        modules = {}
        for module in trace_lib.hlo_modules(data):
            modules[(module.name, module.program_id)] = module
            modules.setdefault((module.name, None), module)
        intervals: dict[str, list] = {}
        for event in trace_lib.op_events(data):
            module = modules.get((event.module, event.program_id)) or modules.get((event.module, None))
            if module is None:
                continue
            for value in module.attribute(event.op, metadata.ATTRIBUTE):
                intervals.setdefault(value, []).append((event.start_ns, event.end_ns))
                runs.setdefault(value, set()).add((file, event.module, event.run_id))
        for value, spans in intervals.items():
            times[value] = times.get(value, 0.0) + trace_lib.union_ns(spans) / 1e6
    if not times:
        raise ProgramError(f"--from-trace: the programs that ran in the trace {directory} hold no stellax call "
                           f"(a trace of another program, or their HLO was not captured)")
    values = sorted(times, key=lambda v: -times[v])
    out, seen = [], set()
    for value in values:
        record = metadata.decode_call(value)
        key = (record.op, record.implementation, record.signature)
        if key in seen:
            continue
        seen.add(key)
        same = [v for v in values if _key(v) == key]
        out.append(TracedCall(record, sum(times[v] for v in same), sum(len(runs[v]) for v in same)))
    return out


def _key(value: str) -> tuple:
    r = metadata.decode_call(value)
    return r.op, r.implementation, r.signature


def record_key(record: CallRecord) -> keys_lib.Key:
    """The autotuning cache key of a recovered call."""
    return keys_lib.make_key(record.op, record.implementation, record.signature)


def observed_calls(records: Iterable[CallRecord]) -> tuple[list[ObservedCall], list[str]]:
    """The tunable calls among ``records`` (implementation with a config, rebuildable options), and
    one line per record left out, saying why."""
    ops = registered_ops()
    calls, skipped = [], []
    for record in records:
        op = ops.get(record.op)
        impl = None if op is None else op.implementations.get(record.implementation)
        if impl is None:
            skipped.append(f"{record.op}/{record.implementation}: not an op/implementation of this stellax")
        elif impl.config_type is None:
            skipped.append(f"{record.describe()}: no config to tune")
        elif record.rebuildable:
            skipped.append(f"{record.describe()}: {record.rebuildable}")
        else:
            calls.append(ObservedCall(op, record.implementation, record.call(), {}))
    return calls, skipped
