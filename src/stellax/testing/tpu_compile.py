"""Tier 3 for Mosaic TPU kernels: the real TPU compiler, without a TPU.

With ``libtpu`` installed (the ``tpu-check`` extra, ``libtpu==0.0.42``, the
version jax 0.10.2's ``tpu`` extra pins), `jax.experimental.topologies` gives a
compile-only device of any TPU generation. Lowering a kernel for it and calling
``.compile()`` runs the real Mosaic and XLA:TPU compilers, which reject what
interpret mode and plain lowering let through: VMEM overflow ("would exceed
memory", ``CompileTimeScopedVmemOom``) and Mosaic layout errors. Nothing runs.

* `topology_device`: the device to compile for, per generation
  (`stellax.core.tpu.TPU_GENERATIONS`: ``v5e``, ``v5p``, ``v6e``, ``tpu7x``).
* `compile_config`: compile one op / implementation / config (and its
  gradient) for one generation; a `CompileResult` says whether it compiled,
  the compiler's reason if not, and the VMEM the kernels' pipeline buffers
  and scratch take (`vmem_estimate`; the compiler reports HBM temporaries in
  ``memory_analysis()`` but not VMEM, and ``cost_analysis()`` says nothing
  useful about Pallas kernels).
* `compilable_space`: the configs of an autotuning space that compile for a
  generation — the space autotuning on that generation searches.

Set ``JAX_PLATFORMS=cpu`` in processes that compile for TPUs on a CPU machine:
the CPU stays the default device and libtpu's start-up messages stay quiet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import time
from typing import Any

import jax
import numpy as np

from ..core import Op
from ..core.tpu import KERNEL_GENERATIONS, TPU_GENERATIONS
from .lowering import LOWERING_TARGETS, lower_config
from .registry import ImplementationCase

#: What the compiler says when a kernel does not fit (matched to name the cause).
_VMEM_MARKERS = ("would exceed memory", "CompileTimeScopedVmemOom", "exceeds the scoped vmem",
                 "Ran out of memory in memory space vmem")
LIBTPU_INSTALL = 'pip install "libtpu==0.0.42"  (the tpu-check extra: pip install -e ".[tpu-check]")'


def libtpu_available() -> tuple[bool, str]:
    """Whether the real TPU compiler can be loaded here, and why not."""
    if importlib.util.find_spec("libtpu") is None:
        return False, f"libtpu is not installed: {LIBTPU_INSTALL}"
    return True, ""


def _require_generation(generation: str):
    if generation not in TPU_GENERATIONS:
        raise ValueError(f"generation: expected one of {sorted(TPU_GENERATIONS)}, got {generation!r}")
    return TPU_GENERATIONS[generation]


@functools.cache
def topology_device(generation: str):
    """A compile-only device of TPU ``generation`` (one chip of its
    `TpuGeneration.topology`, e.g. ``"v6e:2x2"``)."""
    spec = _require_generation(generation)
    ok, reason = libtpu_available()
    if not ok:
        raise RuntimeError(reason)
    # libtpu takes a machine-wide lock file unless told that several processes
    # may load it; compile-only use needs no exclusive TPU (pytest -n 2 runs two).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=spec.topology, platform="tpu").devices[0]


# -- VMEM of the kernels in a program ---------------------------------------------------
def _tiled_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer after TPU tiling: the last dim padded to 128 lanes,
    the second-last to 8 sublanes of 32 bits (16 rows of bf16, 32 of int8)."""
    itemsize = np.dtype(dtype).itemsize
    dims = [int(d) for d in shape] or [1]
    dims[-1] = -(-dims[-1] // 128) * 128
    if len(dims) >= 2:
        rows = 8 * max(1, 4 // itemsize)
        dims[-2] = -(-dims[-2] // rows) * rows
    return int(np.prod(dims, dtype=np.int64)) * itemsize


def _is_vmem(aval) -> bool:
    space = str(getattr(aval, "memory_space", "")).lower()
    return not any(name in space for name in ("any", "hbm", "smem", "semaphore"))


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _pallas_calls(sub)


def kernel_vmem(eqn) -> int:
    """VMEM one ``pallas_call`` holds: each blocked operand's block, double
    buffered (or as many buffers as its pipeline mode asks) when the grid has
    more than one step, plus its VMEM scratch, all at TPU tiling."""
    mapping = eqn.params["grid_mapping"]
    steps = int(np.prod([g for g in mapping.grid if isinstance(g, int)] or [1]))
    total = 0
    for block in mapping.block_mappings:
        aval = block.block_aval
        if not _is_vmem(aval):
            continue
        buffers = getattr(block.pipeline_mode, "buffer_count", None) or (2 if steps > 1 else 1)
        total += buffers * _tiled_bytes(aval.shape, aval.dtype)
    for aval in mapping.scratch_avals:
        if _is_vmem(aval) and hasattr(aval, "shape"):
            total += _tiled_bytes(aval.shape, aval.dtype)
    return total


def vmem_estimate(fn, *args) -> int:
    """The largest VMEM any one kernel of ``fn(*args)`` holds (`kernel_vmem`);
    kernels of one program run one after another, so the largest is the need."""
    closed = jax.make_jaxpr(fn)(*args)
    return max((kernel_vmem(e) for e in _pallas_calls(closed.jaxpr)), default=0)


# -- compiling ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompileResult:
    """One compile of one config for one generation."""

    op: str
    implementation: str
    generation: str
    config: Any
    ok: bool
    vmem_bytes: int
    error: str = ""
    seconds: float = 0.0

    @property
    def vmem_overflow(self) -> bool:
        return not self.ok and any(m in self.error for m in _VMEM_MARKERS)

    def describe(self) -> str:
        where = f"{self.op}/{self.implementation} on {self.generation}"
        vmem = f"VMEM ~{self.vmem_bytes / 2**20:.2f} MiB"
        if self.ok:
            return f"{where}: compiled, {vmem} ({self.seconds:.1f} s)"
        return f"{where}: REJECTED ({'VMEM overflow' if self.vmem_overflow else 'compile error'}, {vmem}): {self.error}"


def _first_error_line(error: Exception) -> str:
    text = str(error)
    for marker in _VMEM_MARKERS:
        at = text.find(marker)
        if at >= 0:
            start = text.rfind("\n", 0, at) + 1
            lines = [line.strip() for line in text[start:].splitlines() if line.strip()]
            return " ".join(lines[:2])[:400]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:400]


def compile_config(op: Op, implementation: str, args: tuple, kwargs: dict | None = None, *,
                   generation: str, config: Any = None, grad: bool = False) -> CompileResult:
    """Compile ``op(*args, **kwargs)`` with ``implementation`` and ``config``
    (``None``: the heuristic's choice for ``generation``) for one TPU
    generation with the real compiler (and its gradient with ``grad``)."""
    _require_generation(generation)
    device = topology_device(generation)
    start = time.perf_counter()
    vmem = 0
    try:
        modules = lower_config(op, implementation, args, kwargs, config=config, platform="tpu", grad=grad,
                               target=LOWERING_TARGETS[generation], device=device)
        vmem = _program_vmem(op, implementation, args, kwargs, config, generation)
        with _no_persistent_cache():
            for lowered in modules:
                lowered.compile()
    except Exception as error:  # the compiler's verdict, reported, not raised
        return CompileResult(op.name, implementation, generation, config, False, vmem,
                             _first_error_line(error), time.perf_counter() - start)
    return CompileResult(op.name, implementation, generation, config, True, vmem,
                         seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _no_persistent_cache():
    """Compile without jax's persistent compilation cache: an entry written for
    a compile-only topology device cannot be loaded back (no TPU client to
    deserialize it with), so a second run of the same compile would fail."""
    previous = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", previous)


def _program_vmem(op, implementation, args, kwargs, config, generation) -> int:
    from ..core import lowering_target, use_configs
    from .lowering import abstract

    kwargs = dict(kwargs or {})
    arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape") and hasattr(v, "dtype")}
    static = {k: v for k, v in kwargs.items() if k not in arrays}
    table = {} if config is None else {(op.name, implementation): config}

    def forward(a, kw):
        with use_configs(table):
            return op(*a, implementation=implementation, **kw, **static)

    with lowering_target(LOWERING_TARGETS[generation]):
        return vmem_estimate(forward, abstract(tuple(args)), abstract(arrays))


def compilable_space(op: Op, implementation: str, args: tuple, kwargs: dict | None = None, *,
                     generation: str) -> tuple[list, list[CompileResult]]:
    """The configs of the autotuning space (as on ``generation``) that compile
    there, and the results of those that do not."""
    from ..core import lowering_target

    with lowering_target(LOWERING_TARGETS[generation]):
        call = op.check(*args, **dict(kwargs or {}))
        space = op.implementations[implementation].config_space(call)
    kept, rejected = [], []
    for config in space:
        result = compile_config(op, implementation, args, kwargs, generation=generation, config=config)
        (kept.append(config) if result.ok else rejected.append(result))
    return kept, rejected


# -- what the tier compiles -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompileCase(ImplementationCase):
    """One (op, implementation, call, config) to compile for one generation;
    ``config`` ``None`` is the heuristic's choice there."""

    generation: str
    label: str
    args: tuple
    kwargs: dict
    config: Any = None
    config_index: int | None = None
    grad: bool = False

    @property
    def id(self) -> str:
        return self._id(self.generation, self.label.replace(" ", "_"), *(["grad"] if self.grad else []))

    def compile(self) -> CompileResult:
        return compile_config(self.op, self.implementation, self.args, self.kwargs, generation=self.generation,
                              config=self.config, grad=self.grad)


def abstract_benchmarks(op: Op, generation: str) -> list:
    """``op.benchmarks`` for a TPU of ``generation`` (transformer-sized calls)
    with every array replaced by its shape, so nothing big is built: the
    benchmark builder is traced, not run. Builders that need concrete values
    are run for real."""
    from ..core import Example

    platform = LOWERING_TARGETS[generation]
    built = {}

    def build():
        examples = op.benchmarks(platform)
        leaves, treedef = jax.tree_util.tree_flatten([(e.args, e.kwargs) for e in examples])
        traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]
        built.update(examples=examples, leaves=leaves, treedef=treedef, traced=traced)
        return [leaves[i] for i in traced]

    try:
        shapes = jax.eval_shape(build)
    except Exception:  # a builder that reads values: build it concretely
        return op.benchmarks(platform)
    leaves = list(built["leaves"])
    for i, shape in zip(built["traced"], shapes):
        leaves[i] = shape
    structure = jax.tree_util.tree_unflatten(built["treedef"], leaves)
    return [Example(e.label, tuple(args), dict(kwargs)) for e, (args, kwargs) in zip(built["examples"], structure)]


#: A call's HBM need, as a multiple of its operands (outputs, residuals and
#: cotangents of a training step).
HBM_FACTOR = 4


def fits_hbm(example, generation: str) -> bool:
    """Whether ``HBM_FACTOR`` × the call's operand bytes fit one device of the
    generation: benchmark shapes sized for a 141 GB GPU need not fit a 16 GiB
    v5e, and a program that cannot fit the chip tests no kernel."""
    leaves = jax.tree_util.tree_leaves((example.args, example.kwargs))
    size = sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
               for x in leaves if hasattr(x, "shape") and hasattr(x, "dtype"))
    return HBM_FACTOR * size <= TPU_GENERATIONS[generation].hbm_bytes


def compile_cases(op: Op, implementation: str, generation: str, *, every_config: bool = False,
                  benchmarks: int | None = None, every_example: bool | None = None) -> list[CompileCase]:
    """The calls tier 3 compiles for one implementation and generation: the
    op's float32 examples (only the first one the implementation supports
    unless ``every_example``, which defaults to ``every_config``) and its TPU
    benchmark calls (the first ``benchmarks`` of them; all when ``None``)
    that the implementation supports there and that fit the chip
    (`fits_hbm`). The benchmark calls are the transformer-sized ones, where
    VMEM limits bite.

    With the heuristic's config (the default) the gradient is compiled too
    for differentiable ops, so the backward kernels are compiled at the same
    sizes; ``every_config`` compiles each config of the generation's
    autotuning space, forward only."""
    every_example = every_config if every_example is None else every_example
    from ..core import lowering_target
    from .validation import abstract_examples_of

    impl = op.implementations[implementation]
    examples = [(f"ex{i}", e) for i, e in enumerate(abstract_examples_of(op, "float32"))]
    if benchmarks is None or benchmarks > 0:
        examples += [(f"bench{i}", e) for i, e in enumerate(abstract_benchmarks(op, generation)[:benchmarks])]
    cases, examples_taken = [], 0
    with lowering_target(LOWERING_TARGETS[generation]):
        for label, example in examples:
            if label.startswith("ex") and examples_taken and not every_example:
                continue
            if not fits_hbm(example, generation):
                continue
            call = op.check(*example.args, **example.kwargs)
            if not impl.supported(call):
                continue
            examples_taken += label.startswith("ex")
            if not every_config:
                cases.append(CompileCase(op, implementation, generation, label, example.args, example.kwargs,
                                         grad=bool(op.differentiable)))
                continue
            space = impl.config_space(call) or [None]
            cases += [CompileCase(op, implementation, generation, label, example.args, example.kwargs, config,
                                  k if config is not None else None) for k, config in enumerate(space)]
    return cases


def run_tier(ops, generations=KERNEL_GENERATIONS, *, every_config: bool = False, benchmarks: int | None = None,
             on_result=None) -> list[CompileResult]:
    """Compile every Mosaic TPU implementation of ``ops`` (name → `Op`) for
    each of ``generations``: the heuristic config (or every config) on the
    examples and benchmark calls. ``on_result(result)`` sees each result."""
    results = []
    for _, op in sorted(ops.items()):
        for name, impl in op.implementations.items():
            if impl.backend != "mosaic_tpu":
                continue
            for generation in generations:
                for case in compile_cases(op, name, generation, every_config=every_config, benchmarks=benchmarks):
                    result = case.compile()
                    results.append(result)
                    if on_result is not None:
                        on_result(case, result)
    return results


def summary_rows(results: list[CompileResult]) -> list[dict]:
    """One row per (op, implementation, generation): compiled / rejected
    counts, the largest VMEM estimate that compiled, and the rejection reasons."""
    rows: dict[tuple, dict] = {}
    for r in results:
        row = rows.setdefault((r.op, r.implementation, r.generation), dict(
            op=r.op, implementation=r.implementation, generation=r.generation, compiled=0, rejected=0,
            max_vmem_mib=0.0, reasons=[]))
        if r.ok:
            row["compiled"] += 1
            row["max_vmem_mib"] = max(row["max_vmem_mib"], round(r.vmem_bytes / 2**20, 2))
        else:
            row["rejected"] += 1
            row["reasons"].append(r.error[:160])
    return list(rows.values())


__all__ = ["CompileCase", "CompileResult", "abstract_benchmarks", "compile_cases", "KERNEL_GENERATIONS", "LIBTPU_INSTALL", "compilable_space", "compile_config",
           "kernel_vmem", "libtpu_available", "run_tier", "summary_rows", "topology_device", "vmem_estimate"]
