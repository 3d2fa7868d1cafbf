"""Reading `jax.profiler` / XProf traces: XLA op events and the programs' HLO.

A trace directory holds ``plugins/profile/<run>/<host>.xplane.pb`` files
(serialized ``XSpace`` protos). Two things are read from them:

* **op events** (`op_events`): every execution of an XLA operation, through
  `jax.profiler.ProfileData` (XProf's parser, shipped in jaxlib). On a CPU they
  are the thunk events on the host threads (stats ``hlo_module``/``hlo_op``);
  on GPUs/TPUs the events of the ``/device:*`` planes.
* **the HLO of every program** (`hlo_modules`): the ``/host:metadata`` plane
  stores each compiled module's ``HloProto`` as a bytes stat; `ProfileData`
  does not expose it, so the few fields needed (module name, computations,
  instruction name / id / called computations / frontend attributes) are read
  with a minimal protobuf wire-format reader. Field numbers are those of
  ``xla/service/hlo.proto`` and ``tsl/profiler/protobuf/xplane.proto``
  (protobuf field numbers never change).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterator

from jax.profiler import ProfileData


class TraceError(ValueError):
    """A trace directory or file that cannot be read."""


# -- protobuf wire format ------------------------------------------------------------------------
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(buf):
            raise TraceError("truncated protobuf varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """``(field number, value)`` of a serialized message: ints for varints, bytes otherwise."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        elif wire == 2:
            length, i = _varint(buf, i)
            value, i = buf[i:i + length], i + length
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        else:
            raise TraceError(f"unsupported protobuf wire type {wire}")
        yield number, value


def _packed(value: int | bytes) -> list[int]:
    if isinstance(value, int):
        return [value]
    out, i = [], 0
    while i < len(value):
        v, i = _varint(value, i)
        out.append(v)
    return out


# XSpace.planes = 1; XPlane.name = 2, event_metadata = 4 (map), stat_metadata = 5 (map);
# map entry: key = 1, value = 2; XEventMetadata.name = 2, stats = 5; XStatMetadata.name = 2;
# XStat.metadata_id = 1, bytes_value = 6.
# HloProto.hlo_module = 1; HloModuleProto.name = 1, computations = 3;
# HloComputationProto.name = 1, instructions = 2, id = 5;
# HloInstructionProto.name = 1, id = 35, called_computation_ids = 38, frontend_attributes = 68;
# FrontendAttributes.map = 1.
@dataclasses.dataclass
class HloModule:
    """One compiled program from a trace: each instruction's own frontend attributes, and those of
    the instructions inside the computations it calls (a fusion names what it fused)."""

    name: str
    program_id: int | None
    own: dict[str, dict[str, str]]            # instruction → {attribute: value}
    called: dict[str, dict[str, set[str]]]    # instruction → {attribute: values inside its computations}

    def attribute(self, instruction: str, key: str) -> set[str]:
        """Every value of attribute ``key`` on ``instruction`` or inside what it calls."""
        values = set(self.called.get(instruction, {}).get(key, set()))
        if key in self.own.get(instruction, {}):
            values.add(self.own[instruction][key])
        return values


def _message(buf: bytes) -> dict[int, list]:
    out: dict[int, list] = {}
    for number, value in _fields(buf):
        out.setdefault(number, []).append(value)
    return out


def _text(values: list | None) -> str:
    return values[0].decode("utf-8", "replace") if values else ""


def _parse_module(hlo_proto: bytes, label: str) -> HloModule:
    module = _message(_message(hlo_proto).get(1, [b""])[0])
    own: dict[str, dict[str, str]] = {}
    calls: dict[str, list[int]] = {}
    by_computation: dict[int, list[str]] = {}
    for comp_bytes in module.get(3, []):
        comp = _message(comp_bytes)
        comp_id = comp.get(5, [None])[0]
        names = []
        for ins_bytes in comp.get(2, []):
            ins = _message(ins_bytes)
            name = _text(ins.get(1))
            names.append(name)
            attrs = {}
            for fa in ins.get(68, []):
                for entry in _message(fa).get(1, []):
                    e = _message(entry)
                    attrs[_text(e.get(1))] = _text(e.get(2))
            own[name] = attrs
            called = [c for v in ins.get(38, []) for c in _packed(v)]
            if called:
                calls[name] = called
        if comp_id is not None:
            by_computation[comp_id] = names

    def inside(comp_id: int, seen: set[int]) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        if comp_id in seen:
            return found
        seen.add(comp_id)
        for name in by_computation.get(comp_id, []):
            for k, v in own.get(name, {}).items():
                found.setdefault(k, set()).add(v)
            for sub in calls.get(name, []):
                for k, vs in inside(sub, seen).items():
                    found.setdefault(k, set()).update(vs)
        return found

    called = {}
    for name, ids in calls.items():
        merged: dict[str, set[str]] = {}
        for comp_id in ids:
            for k, vs in inside(comp_id, set()).items():
                merged.setdefault(k, set()).update(vs)
        called[name] = merged
    match = re.fullmatch(r"(.*)\((\d+)\)", label)
    name = _text(module.get(1)) or (match.group(1) if match else label)
    program_id = int(match.group(2)) if match else None
    return HloModule(name, program_id, own, called)


def hlo_modules(xspace: bytes) -> list[HloModule]:
    """The programs whose HLO a serialized ``XSpace`` holds (its ``/host:metadata`` plane)."""
    modules = []
    for plane_bytes in _message(xspace).get(1, []):
        plane = _message(plane_bytes)
        if _text(plane.get(2)) != "/host:metadata":
            continue
        stat_names = {}
        for entry in plane.get(5, []):
            e = _message(entry)
            meta = _message(e.get(2, [b""])[0])
            stat_names[e.get(1, [None])[0]] = _text(meta.get(2))
        for entry in plane.get(4, []):
            meta = _message(_message(entry).get(2, [b""])[0])
            label = _text(meta.get(2))
            for stat_bytes in meta.get(5, []):
                stat = _message(stat_bytes)
                if stat_names.get(stat.get(1, [None])[0]) == "Hlo Proto" and stat.get(6):
                    modules.append(_parse_module(stat[6][0], label))
    return modules


# -- files and events ----------------------------------------------------------------------------
def xplane_files(directory: str | Path) -> list[Path]:
    """Every ``*.xplane.pb`` under a trace directory (or the file itself)."""
    path = Path(directory)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise TraceError(f"trace: {path} is neither a trace directory nor an .xplane.pb file")
    files = sorted(path.rglob("*.xplane.pb"))
    if not files:
        raise TraceError(f"trace: no *.xplane.pb file under {path} (a jax.profiler trace directory has "
                         "plugins/profile/<run>/<host>.xplane.pb)")
    return files


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One execution of an XLA operation: program, instruction, interval (ns) and run id."""

    module: str
    program_id: int | None
    op: str
    start_ns: float
    end_ns: float
    run_id: int | None


def op_events(data: bytes) -> list[OpEvent]:
    """XLA op executions in a serialized ``XSpace``: events that name their ``hlo_op``, on the host
    planes (CPU thunks) and the device planes."""
    profile = ProfileData.from_serialized_xspace(data)
    out = []
    for plane in profile.planes:
        if plane.name == "/host:metadata":
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is None:
                    continue
                start = float(event.start_ns)
                out.append(OpEvent(str(stats.get("hlo_module", "")), stats.get("program_id"), str(op),
                                   start, start + float(event.duration_ns), stats.get("run_id")))
    return out


def union_ns(intervals) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total
