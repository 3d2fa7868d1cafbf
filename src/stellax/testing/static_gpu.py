"""The static GPU performance tier: every config of every Triton kernel,
read from its PTX at sm_90 (and sm_80), without a GPU.

For each Triton implementation of each registered op (`units`):

* every config of its autotuning space at the op's first H200 benchmark
  shape that has one (the headline shape the GPU suite tunes; the first
  bfloat16 example for ops without benchmarks): realistic loop lengths, so a
  K loop of one iteration at a toy shape does not hide or fake pipelining;
* the heuristic's config for each bfloat16 example and each H200 benchmark
  shape (`Op.benchmarks`): the configs *the heuristic can choose*;

is lowered for cuda and each of its Triton kernels compiled and read by
`stellax.testing.ptx_analysis.analyze`: dots on tensor cores (wgmma/mma.sync,
with the operand dtypes of the IR's dots), register spills, asynchronous
copies when ``num_stages > 1``, registers and occupancy (with ptxas).

Units are generated per arch: heuristics, spaces and dispatch's refusals run
under `lowering_target` of that arch's GPU (`ARCH_TARGETS`: an H200 for
sm_90, an A100 for sm_80), so the sm_80 pass reads what dispatch would run on
an A100 (the call shapes stay the H200 benchmark shapes).

`run_static_tier` returns one `StaticConfig` per (unit, arch); a failing
config the heuristic can choose is what `stellax check --static-gpu` exits 1
for. `format_findings` prints one line per kernel and config, `summary_rows`
/ `markdown_table` the per-family counts that go into the docs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Iterable, Mapping

import jax.numpy as jnp

from ..core import LOWERING_TARGETS, Example, Op, lowering_target
from .lowering import lower_config
from .ptx_analysis import Dot, KernelStatic, Occupancy, Ptxas, analyze, triton_sources
from .registry import config_id
from .validation import abstract_examples

#: The GPU whose benchmark shapes the calls take (the lent GPU).
TARGET = "h200"
ARCHS = ("9.0", "8.0")
#: The dispatch target (`stellax.core.LOWERING_TARGETS`) of each arch: what its units' heuristics,
#: spaces and refusals see as the device.
ARCH_TARGETS = {"9.0": "h200", "8.0": "a100"}


def _arch_target(arch: str) -> str:
    if arch not in ARCH_TARGETS:
        raise ValueError(f"arch: expected one of {sorted(ARCH_TARGETS)}, got {arch!r}")
    return ARCH_TARGETS[arch]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One (op, implementation, call, config) to compile."""

    op: Op
    implementation: str
    label: str  # which call: "ex0", "bench 'causal 16k'"
    args: tuple
    kwargs: dict
    config: Any
    config_index: int | None  # position in the autotuning space (None: not in it)
    heuristic: bool  # the heuristic chooses this config for some example or benchmark
    arch: str = "9.0"  # the arch whose dispatch target generated it (`ARCH_TARGETS`)


@dataclasses.dataclass(frozen=True)
class StaticConfig:
    """The static readings of one unit at one arch."""

    op: str
    implementation: str
    family: str
    label: str
    config: str
    config_index: int | None
    heuristic: bool
    arch: str
    kernels: tuple[KernelStatic, ...] = ()
    error: str | None = None

    @property
    def failures(self) -> list[str]:
        if self.error:
            return [self.error]
        return [f"{k.name}: {f}" for k in self.kernels for f in k.failures()]

    @property
    def warnings(self) -> list[str]:
        return [f"{k.name}: {w}" for k in self.kernels for w in k.warnings()]

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        return {"op": self.op, "implementation": self.implementation, "family": self.family, "call": self.label,
                "config": self.config, "config_index": self.config_index, "heuristic": self.heuristic,
                "arch": self.arch, "error": self.error, "failures": self.failures, "warnings": self.warnings,
                "kernels": [_kernel_json(k) for k in self.kernels]}


def _kernel_json(k: KernelStatic) -> dict:
    return {"name": k.name, "num_warps": k.num_warps, "num_stages": k.num_stages, "grid": list(k.grid),
            "smem_bytes": k.smem_bytes, "dots": [dataclasses.asdict(d) for d in k.dots], "wgmma": k.wgmma,
            "mma_sync": k.mma_sync, "cp_async": k.cp_async, "tma": k.tma, "has_loop": k.has_loop,
            "local_ptx": k.local_ptx, "ptxas": None if k.ptxas is None else dataclasses.asdict(k.ptxas),
            "occupancy": None if k.occupancy is None else dataclasses.asdict(k.occupancy),
            "ptxas_error": k.ptxas_error}


def _kernel_from_json(k: dict, arch: str) -> KernelStatic:
    return KernelStatic(name=k["name"], arch=arch, num_warps=k["num_warps"], num_stages=k["num_stages"],
                        grid=tuple(k["grid"]), smem_bytes=k["smem_bytes"], dots=tuple(Dot(**d) for d in k["dots"]),
                        wgmma=dict(k["wgmma"]), mma_sync=dict(k["mma_sync"]), cp_async=k["cp_async"], tma=k["tma"],
                        has_loop=k["has_loop"], local_ptx=k["local_ptx"],
                        ptxas=None if k["ptxas"] is None else Ptxas(**k["ptxas"]),
                        occupancy=None if k["occupancy"] is None else Occupancy(**k["occupancy"]),
                        ptxas_error=k.get("ptxas_error"))


def from_json(row: Mapping) -> StaticConfig:
    """The `StaticConfig` of one row of `StaticConfig.to_json` (failures and warnings are recomputed
    from the kernels' readings)."""
    return StaticConfig(op=row["op"], implementation=row["implementation"], family=row["family"], label=row["call"],
                        config=row["config"], config_index=row["config_index"], heuristic=row["heuristic"],
                        arch=row["arch"], kernels=tuple(_kernel_from_json(k, row["arch"]) for k in row["kernels"]),
                        error=row["error"])


def read_json(paths: Iterable) -> list[StaticConfig]:
    """The readings of `write_json` files (a JSON list) or JSON-lines files (one `to_json` row a line,
    as a run's ``progress`` can append them), merged in order: a later reading of the same (op,
    implementation, call, config, arch) replaces the earlier one, so per-op runs merge into one."""
    from pathlib import Path

    merged: dict = {}
    for path in paths:
        text = Path(path).read_text()
        stripped = text.lstrip()
        rows = json.loads(text) if stripped.startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
        for row in rows:
            merged[(row["op"], row["implementation"], row["call"], row["config"], row["arch"])] = from_json(row)
    return list(merged.values())


def triton_implementations(ops: Mapping[str, Op]) -> list[tuple[Op, str]]:
    return [(op, name) for _, op in sorted(ops.items())
            for name, impl in op.implementations.items() if impl.backend == "triton"]


def _calls(op: Op) -> list[tuple[str, Example]]:
    """(label, example) of the op's bf16 examples and H200 benchmark shapes, abstract."""
    key = op.name
    if key not in _CALLS:
        with lowering_target(TARGET):
            examples = abstract_examples(lambda: op.examples(jnp.bfloat16))
            benchmarks = abstract_examples(lambda: op.benchmarks(LOWERING_TARGETS[TARGET]))
        _CALLS[key] = ([(f"ex{i}", e) for i, e in enumerate(examples)]
                       + [(f"bench {e.label!r}", e) for e in benchmarks])
    return _CALLS[key]


_CALLS: dict = {}


def _heuristic_calls(op: Op, implementation: str, arch: str = "9.0") -> list[tuple[str, tuple, dict, Any]]:
    """(label, args, kwargs, heuristic config) for each bf16 example and H200 benchmark shape the
    implementation takes on a GPU of ``arch``."""
    impl = op.implementations[implementation]
    found = []
    with lowering_target(_arch_target(arch)):
        for label, example in _calls(op):
            try:
                call = op.check(*example.args, **example.kwargs)
                if not impl.supported(call):
                    continue
                found.append((label, example.args, example.kwargs, impl.default_config(call)))
            except Exception:  # noqa: BLE001 - a benchmark shape this implementation cannot take
                continue
    return found


def units(op: Op, implementation: str, arch: str = "9.0") -> list[Unit]:
    """The space's configs and the heuristic's choices of one implementation on a GPU of ``arch``
    (its `ARCH_TARGETS` dispatch target: heuristic, space and refusals as an A100 sees them for
    ``"8.0"``; see the module docstring). A config counts as the heuristic's where the heuristic
    picks it for that very call (spills depend on the shape): a space config when picked at the
    space's call, and each other heuristic choice once, at the first call that picks it."""
    impl = op.implementations[implementation]
    heuristic = _heuristic_calls(op, implementation, arch)
    calls = _calls(op)  # the space at the first benchmark shape that has one (else the first example's)
    ordered = [c for c in calls if c[0].startswith("bench")] + [c for c in calls if c[0].startswith("ex")]
    found, space_label = [], None
    with lowering_target(_arch_target(arch)):
        for label, example in ordered:
            try:
                call = op.check(*example.args, **example.kwargs)
            except Exception:  # noqa: BLE001 - a benchmark shape this op's check rejects
                continue
            space = impl.config_space(call) if impl.supported(call) else []
            if space:
                chosen = repr(impl.default_config(call))
                found = [Unit(op, implementation, label, example.args, example.kwargs, config, k,
                              repr(config) == chosen, arch) for k, config in enumerate(space)]
                space_label = label
                break
    seen = {repr(u.config) for u in found if u.heuristic}
    for label, args, kwargs, config in heuristic:  # the heuristic's other choices, once each
        if label == space_label or repr(config) in seen:
            continue
        seen.add(repr(config))
        index = next((u.config_index for u in found if repr(u.config) == repr(config)), None)
        found.append(Unit(op, implementation, label, args, kwargs, config, index, True, arch))
    return found


def supported_at(unit: Unit, arch: str) -> bool:
    """Whether dispatch would run ``unit``'s implementation on a GPU of ``arch``."""
    target = LOWERING_TARGETS[_arch_target(arch)]
    with lowering_target(target):
        call = unit.op.check(*unit.args, **unit.kwargs)
        return bool(unit.op.implementations[unit.implementation].supported(call, target))


def analyze_unit(unit: Unit, archs: Iterable[str] | None = None, *, use_ptxas: bool = True) -> list[StaticConfig]:
    """Lower ``unit`` for cuda (dispatch targeting its arch's GPU) and analyze its Triton kernels
    at each arch of ``archs`` (default: the unit's own; another arch compiles the same Triton IR,
    e.g. to compare instruction selection) where dispatch would run it."""
    archs = (unit.arch,) if archs is None else tuple(archs)
    base = dict(op=unit.op.name, implementation=unit.implementation, family=unit.op.family, label=unit.label,
                config=config_id(unit.config), config_index=unit.config_index, heuristic=unit.heuristic)
    try:
        (lowered,) = lower_config(unit.op, unit.implementation, unit.args, unit.kwargs, config=unit.config,
                                  platform="cuda", target=_arch_target(unit.arch))
        sources = triton_sources(lowered)
    except Exception as e:  # noqa: BLE001 - a lowering failure is a finding
        return [StaticConfig(**base, arch=a, error=f"lowering failed: {type(e).__name__}: {e}"[:300]) for a in archs]
    results = []
    for arch in archs:
        if not supported_at(unit, arch):
            continue  # refused there (e.g. float8 below sm_89): dispatch never compiles it
        try:
            kernels = tuple(analyze(s, arch, use_ptxas=use_ptxas) for s in sources)
            results.append(StaticConfig(**base, arch=arch, kernels=kernels))
        except Exception as e:  # noqa: BLE001 - a compile failure is a finding
            results.append(StaticConfig(**base, arch=arch, error=f"sm_{arch.replace('.', '')} compile failed: "
                                                                  f"{type(e).__name__}: {e}"[:300]))
    return results


def run_static_tier(ops: Mapping[str, Op], archs: Iterable[str] = ARCHS, *, use_ptxas: bool = True,
                    progress: Callable[[StaticConfig], None] | None = None,
                    heuristic_only: bool = False,
                    done: Callable[[list[StaticConfig]], None] | None = None) -> list[StaticConfig]:
    """`analyze_unit` over every unit of every Triton implementation of ``ops`` at each arch (its
    own units there; only the heuristic's choices with ``heuristic_only``: the configs that decide
    the exit code, a few per kernel instead of the whole space). ``progress`` sees each reading,
    ``done`` the readings so far after each implementation and arch (to save partial runs)."""
    archs = tuple(archs)
    results = []
    for op, name in triton_implementations(ops):
        for arch in archs:
            for unit in units(op, name, arch):
                if heuristic_only and not unit.heuristic:
                    continue
                for r in analyze_unit(unit, use_ptxas=use_ptxas):
                    results.append(r)
                    if progress is not None:
                        progress(r)
            if done is not None:
                done(results)
    return results


def _kernel_line(k: KernelStatic) -> str:
    tc = ",".join(f"{d}x{n}" for d, n in sorted(k.wgmma.items()))
    mma = ",".join(f"{d}x{n}" for d, n in sorted(k.mma_sync.items()))
    parts = [f"dots {len(k.dots)}"]
    if tc:
        parts.append(f"wgmma {tc}")
    if mma:
        parts.append(f"mma.sync {mma}")
    parts.append(f"cp.async {k.cp_async}" + (f" tma {k.tma}" if k.tma else ""))
    parts.append(f"smem {k.smem_bytes / 1024:.0f}K")
    if k.ptxas is not None:
        parts.append(f"regs {k.ptxas.registers}")
        if k.ptxas.spill_stores or k.ptxas.spill_loads:
            parts.append(f"spill {k.ptxas.spill_stores}/{k.ptxas.spill_loads} B")
    if k.occupancy is not None:
        parts.append(f"{k.occupancy.warps_per_sm} warps/SM ({k.occupancy.limited_by})")
    return f"{k.name} w{k.num_warps} s{k.num_stages}: " + ", ".join(parts)


def format_findings(result: StaticConfig) -> list[str]:
    """The printed lines of one config: a header with its verdict, then one line per kernel."""
    tag = " [heuristic]" if result.heuristic else ""
    index = "" if result.config_index is None else f"cfg{result.config_index:02d} "
    verdict = "ok" if result.ok else ("FAIL" if result.heuristic else "flagged")
    lines = [f"{result.op}/{result.implementation} sm_{result.arch.replace('.', '')} {index}({result.config})"
             f"{tag} {result.label}: {verdict}"]
    lines += [f"    {_kernel_line(k)}" for k in result.kernels]
    lines += [f"    ! {f}" for f in result.failures]
    lines += [f"    ~ {w}" for w in result.warnings]
    return lines


def choosable_failures(results: Iterable[StaticConfig]) -> list[StaticConfig]:
    """Failing configs the heuristic can choose (what makes the check exit 1)."""
    return [r for r in results if r.heuristic and not r.ok]


def summary_rows(results: Iterable[StaticConfig], arch: str = "9.0") -> list[dict]:
    """Per family at ``arch``: kernels, configs, and how many configs use tensor cores
    (every dot), spill, pipeline (cp.async/TMA), fail, and fail while choosable."""
    rows: dict[str, dict] = {}
    for r in results:
        if r.arch != arch:
            continue
        row = rows.setdefault(r.family, dict(family=r.family, kernels=set(), configs=0, with_dots=0,
                                             tensor_cores=0, spill=0, pipelined=0, failing=0,
                                             failing_heuristic=0, max_registers=0, min_warps_per_sm=None))
        row["configs"] += 1
        row["kernels"].update(f"{r.op}/{k.name}" for k in r.kernels)
        dotted = [k for k in r.kernels if k.dots]
        row["with_dots"] += bool(dotted)
        row["tensor_cores"] += bool(dotted) and all(k.uses_tensor_cores for k in dotted)
        row["spill"] += any(k.spills for k in r.kernels)
        row["pipelined"] += any(k.pipelined for k in r.kernels)
        row["failing"] += not r.ok
        row["failing_heuristic"] += r.heuristic and not r.ok
        for k in r.kernels:
            if k.ptxas is not None:
                row["max_registers"] = max(row["max_registers"], k.ptxas.registers)
            if k.occupancy is not None:
                w = k.occupancy.warps_per_sm
                row["min_warps_per_sm"] = w if row["min_warps_per_sm"] is None else min(row["min_warps_per_sm"], w)
    out = []
    for row in rows.values():
        row["kernels"] = len(row["kernels"])
        out.append(row)
    return sorted(out, key=lambda r: r["family"])


def markdown_table(results: Iterable[StaticConfig], arch: str = "9.0") -> str:
    """The per-family counts as a markdown table."""
    head = ("| family | kernels | configs | with dots | all dots on tensor cores | spill | cp.async/TMA "
            "| failing (heuristic's) | max regs | min warps/SM |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in summary_rows(results, arch):
        lines.append(f"| {r['family']} | {r['kernels']} | {r['configs']} | {r['with_dots']} | {r['tensor_cores']} "
                     f"| {r['spill']} | {r['pipelined']} | {r['failing']} ({r['failing_heuristic']}) "
                     f"| {r['max_registers'] or '-'} | {r['min_warps_per_sm'] if r['min_warps_per_sm'] else '-'} |")
    return "\n".join(lines)


def write_json(results: Iterable[StaticConfig], path) -> None:
    """The results as a JSON list (``path`` ``"-"``: stdout)."""
    import sys
    from pathlib import Path

    text = json.dumps([r.to_json() for r in results], indent=1) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def run_cli(names: list[str], archs: Iterable[str] = ARCHS, *, json_path: str | None = None,
            use_ptxas: bool = True, print_fn: Callable[[str], None] = print, heuristic_only: bool = False) -> int:
    """`stellax check --static-gpu [--heuristic-only] [OPS...]`: findings per kernel and
    config, then the per-family table. Exit 1 when a config the heuristic can choose fails,
    2 when the compiler is missing or nothing matches ``names``."""
    import stellax

    from .lowering import triton_compiler_available
    from .plan import select_ops
    from .ptx_analysis import PTXAS_MISSING, ptxas_path

    available, reason = triton_compiler_available()
    if not available:
        print_fn(f"static GPU tier unavailable: {reason}")
        return 2
    archs = tuple(archs)
    for arch in archs:
        if arch not in ARCHS:
            print_fn(f"--arch: expected values in {list(ARCHS)}, got {arch!r}")
            return 2
    ops = select_ops(stellax.registered_ops(), names)
    if not triton_implementations(ops):
        print_fn(f"no Triton kernel in {names or 'the registry'}")
        return 2
    if use_ptxas and ptxas_path() is None:
        print_fn(f"note: {PTXAS_MISSING}")
    save = (lambda rs: write_json(rs, json_path)) if json_path and json_path != "-" else None
    results = run_static_tier(ops, archs, use_ptxas=use_ptxas, heuristic_only=heuristic_only,
                              progress=lambda r: print_fn("\n".join(format_findings(r))), done=save)
    if json_path:
        write_json(results, json_path)
    for arch in archs:
        print_fn(f"\nsm_{arch.replace('.', '')}:\n" + markdown_table(results, arch))
    bad = choosable_failures(results)
    flagged = [r for r in results if not r.ok and not r.heuristic]
    print_fn(f"\n{len(results)} configs: {len(bad)} failing configs the heuristic can choose, "
             f"{len(flagged)} failing configs only in the autotuning space (flagged)")
    return 1 if bad else 0


def cost_table(results: Iterable[StaticConfig], arch: str = "9.0", source: str = "") -> dict:
    """What `stellax.bench.cost_model` reads from ``stellax/bench/static_gpu_sm90.json``: per
    (op, implementation, config id) the resident blocks per SM (the fewest over its kernels)
    and the failures (configs with failures rank last)."""
    configs = []
    for r in results:
        if r.arch != arch:
            continue
        blocks = [k.occupancy.blocks_per_sm for k in r.kernels if k.occupancy is not None]
        configs.append({"op": r.op, "implementation": r.implementation, "config": r.config, "call": r.label,
                        "blocks_per_sm": min(blocks) if blocks else None, "failures": r.failures})
    return {"format": "stellax-static-gpu", "arch": arch, "source": source, "configs": configs}
