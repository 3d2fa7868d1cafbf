"""Where a Mosaic TPU kernel's time goes, without a TPU: the static schedule of
its compiled LLO (the TPU's VLIW bundles), read from libtpu's dumps.

libtpu writes, per compiled kernel, its final bundles, the per-bundle use of
each functional unit and the critical path of every basic block when told so
by ``LIBTPU_INIT_ARGS`` (`dump_flags`) — flags it reads once, when it starts,
so the compile runs in a fresh process (`kernel_schedules`, this module's
``__main__``). `parse_dump` reads a dump directory into one `KernelSchedule`
per kernel:

* ``bundles``: the instruction bundles of the kernel (one issue cycle each; the
  grid loop's body is most of them): the cycles of one pass through the code
  if nothing stalls;
* ``critical_path``: the longest chain of dependent instructions of any basic
  block (cycles, from the compiler's latencies: a matmul's weight push, its
  row issues and the ~130 cycles before its first result pops). A step takes
  at least ``max(bundles, critical_path)`` cycles: results that are not ready
  stall the bundle that pops them;
* ``unit_bundles``: per functional unit (MXU, XLU, VALU, VPOP, EUP, VLOAD,
  VSTORE, ...), the bundles its instructions need at the unit's issue width:
  which unit bounds ``bundles``;
* ``ops``: a histogram of opcodes (``vmatmul``, ``vmatpush``, ``vpop``,
  ``vpack``, ``vxpose``, ``vpow2`` (``exp``), ...; the MXU index and the
  accumulate flags dropped), ``matmuls`` by operand type (``bf16``, ``f32``)
  and ``spills`` (loads and stores of spilled vector registers).

Run ``python -m stellax.testing.llo_schedule MODULE:BUILDER [key=value ...]``
with ``BUILDER(**kwargs)`` returning ``(fn, args)`` (args: shape structs) to
print the schedules as JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

#: The dump files of one kernel: ``{fingerprint}-{kernel}-{NN}-{what}.txt``.
_FILE = re.compile(r"^\d+-(?P<kernel>.+)-\d\d-(?P<what>final_bundles|critical-path|"
                   r"final_hlo-static-per-bundle-utilization)\.txt$")
_BUNDLE = re.compile(r"^\s*0x[0-9a-f]+\b")
_OPCODE = re.compile(r"%\S+ = ([a-z_][a-z0-9_.]*)")
_TYPE = re.compile(r"^(bf16|f32|f16|[su](4|8|16|32)|f8\w*)$")
_LENGTH = re.compile(r"Length to end: (\d+)")
#: Suffixes of an opcode that name where it runs or how it accumulates, not what it does.
_PLACEMENT = re.compile(r"\.(mxu\d|xlu\d|msra|msrb|gmra|vlgmr|msk|mrf|cont|start|end)\b")


@dataclasses.dataclass(frozen=True)
class KernelSchedule:
    """The static schedule of one compiled kernel (module docstring)."""

    kernel: str
    bundles: int
    critical_path: int
    unit_bundles: dict
    ops: dict
    matmuls: dict
    spills: int

    @property
    def bound(self) -> int:
        """Cycles of one pass through the code at least: ``max(bundles, critical_path)``."""
        return max(self.bundles, self.critical_path)

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (e.g. ``"vmatmul"``, ``"vxpose"``)."""
        return sum(n for op, n in self.ops.items() if op.startswith(prefix))

    def describe(self) -> str:
        units = ", ".join(f"{u} {n}" for u, n in sorted(self.unit_bundles.items(), key=lambda x: -x[1])[:4])
        return (f"{self.kernel}: {self.bundles} bundles, critical path {self.critical_path} cycles; busiest units "
                f"(bundles) {units}; matmul issues {self.matmuls}, weight pushes {self.count('vmatpush')}, "
                f"pops {self.count('vpop')}, packs {self.count('vpack') + self.count('vunpack')}, "
                f"transposes {self.count('vxpose')}, exp {self.count('vpow2')}, spills {self.spills}")


def dump_flags(directory: str) -> str:
    """``LIBTPU_INIT_ARGS`` that make libtpu dump each compiled kernel's LLO under ``directory``."""
    return f"--xla_jf_dump_to={directory} --xla_jf_dump_llo_text=true"


def _opcode(name: str) -> str:
    return _PLACEMENT.sub("", name)


def _read_bundles(path: str):
    bundles, ops, spills = 0, collections.Counter(), 0
    with open(path) as f:
        for line in f:
            if not _BUNDLE.match(line):
                continue
            bundles += 1
            for instruction in line.split(";;"):
                found = _OPCODE.search(instruction)
                if found:
                    ops[_opcode(found.group(1))] += 1
                    spills += "_spill]" in instruction
    return bundles, ops, spills


def _read_units(path: str) -> dict:
    """Bundles each unit needs: its instructions summed over the bundles, over its issue width."""
    with open(path) as f:
        lines = [line.split("#")[0].strip() for line in f]
    header = lines.index("== CAPACTIY:") if "== CAPACTIY:" in lines else lines.index("== CAPACITY:")
    names = [n.strip() for n in lines[header + 1].split(",")]
    widths = [int(x) for x in lines[header + 2].split()]
    totals = [0] * len(names)
    for line in lines[header + 3:]:
        fields = line.split()
        if len(fields) == len(names) and all(x.isdigit() for x in fields):
            totals = [t + int(x) for t, x in zip(totals, fields)]
    return {n: -(-t // w) for n, t, w in zip(names, totals, widths) if w}


def parse_dump(directory: str) -> dict[str, KernelSchedule]:
    """`KernelSchedule` of every kernel (a custom call with its own final bundles) dumped under ``directory``."""
    files: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for path in glob.glob(os.path.join(directory, "*.txt")):
        found = _FILE.match(os.path.basename(path))
        if found and not found.group("kernel").startswith("<"):
            files[found.group("kernel")][found.group("what")] = path
    out = {}
    for kernel, paths in sorted(files.items()):
        if "final_bundles" not in paths:
            continue
        bundles, ops, spills = _read_bundles(paths["final_bundles"])
        critical = 0
        if "critical-path" in paths:
            with open(paths["critical-path"]) as f:
                critical = max((int(x) for x in _LENGTH.findall(f.read())), default=0)
        units = _read_units(paths["final_hlo-static-per-bundle-utilization"]) \
            if "final_hlo-static-per-bundle-utilization" in paths else {}
        matmuls = collections.Counter()
        for op, n in ops.items():
            if op.startswith("vmatmul"):
                types = [part for part in op.split(".") if _TYPE.match(part)]
                matmuls[types[0] if types else "?"] += n
        out[kernel] = KernelSchedule(kernel, bundles, critical, units, dict(ops), dict(matmuls), spills)
    return out


def _split(builder: str) -> tuple[str, str]:
    module, _, name = builder.partition(":")
    if not module or not name:
        raise ValueError(f"builder: expected 'module:function', got {builder!r}")
    return module, name


def _build(builder: str, kwargs: dict):
    module, name = _split(builder)
    return getattr(importlib.import_module(module), name)(**kwargs)


def compile_and_dump(builder: str, kwargs: dict, generation: str, directory: str) -> dict[str, KernelSchedule]:
    """In this process (libtpu not started yet): set `dump_flags`, compile ``builder(**kwargs)``'s
    ``(fn, args)`` for ``generation`` and parse the dump."""
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " " + dump_flags(directory)).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from ..core import LOWERING_TARGETS, lowering_target
    from .lowering import on_device
    from .tpu_compile import _no_persistent_cache, topology_device

    device = topology_device(generation)
    fn, args = _build(builder, kwargs)
    with lowering_target(LOWERING_TARGETS[generation]):
        lowered = jax.jit(fn).trace(*on_device(args, device)).lower()
    with _no_persistent_cache():
        lowered.compile()
    return parse_dump(directory)


def kernel_schedules(builder: str, generation: str = "v5e", timeout: float = 600, **kwargs) -> dict[str, KernelSchedule]:
    """The `KernelSchedule` of every kernel ``builder(**kwargs)`` compiles to for ``generation``
    (``builder``: ``"module:function"`` returning ``(fn, args)``; ``kwargs``: ints, floats,
    strings or booleans), compiled in a fresh process (libtpu reads its dump flags once)."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", __name__, builder, f"--generation={generation}", f"--dump={directory}"]
        command += [f"{key}={json.dumps(value)}" for key, value in kwargs.items()]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise RuntimeError(f"compiling {builder}({kwargs}) for {generation} failed (exit {done.returncode}): "
                               f"{done.stderr.strip().splitlines()[-1:] or done.stdout[-400:]}")
        return {name: KernelSchedule(**fields) for name, fields in json.loads(lines[-1]).items()}


def main(argv: list[str]) -> int:
    """``MODULE:BUILDER [--generation=v5e] [--dump=DIR] [key=JSON ...]``: print the schedules as one JSON line."""
    builder, options, kwargs = argv[0], {"generation": "v5e", "dump": None}, {}
    _split(builder)
    for arg in argv[1:]:
        key, _, value = arg.lstrip("-").partition("=")
        if arg.startswith("--"):
            options[key] = value
        else:
            kwargs[key] = json.loads(value)
    directory = options["dump"] or tempfile.mkdtemp(prefix="llo-")
    schedules = compile_and_dump(builder, kwargs, options["generation"], directory)
    for schedule in schedules.values():
        print(schedule.describe(), file=sys.stderr)
    print(json.dumps({name: dataclasses.asdict(s) for name, s in schedules.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
