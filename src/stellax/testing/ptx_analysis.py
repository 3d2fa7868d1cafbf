"""What the PTX of one Triton kernel says about its speed (no GPU needed).

For one Triton kernel of a lowered module (`triton_sources`), `analyze`
compiles its Triton IR to PTX with the jax CUDA plugin (as
`stellax.testing.lowering.compile_triton_to_ptx` does) and reads:

* the dots of the Triton IR (``tt.dot``: operand dtypes, shapes, input
  precision) and the tensor-core instructions of the PTX (``wgmma.mma_async``
  on sm_90, ``mma.sync`` on sm_80/sm_90) by operand dtype. A dot whose operand
  dtype has no tensor-core instruction in the PTX ran on scalar FMA;
* asynchronous copies (``cp.async``, TMA ``cp.async.bulk.tensor``) and whether
  the kernel has a loop to pipeline (an ``scf.for`` of the IR that runs more
  than once: a loop of one iteration at the example's shape has nothing to
  overlap);
* local-memory traffic in the PTX (``ld.local`` / ``st.local``);
* with ``ptxas`` (the ``nvidia-cuda-nvcc`` wheel of the cuda-check extra, or
  ``$STELLAX_PTXAS``): registers per thread, stack frame, spill stores/loads
  and ptxas' "wgmma serialized" performance warning (C7514), which give
  `occupancy`: resident blocks and warps per SM.

Everything is a plain reading of compiler output; `KernelStatic.failures`
and `.warnings` turn the readings into findings.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

#: Per-SM resources (bytes, registers, warps, blocks) of the compile targets.
SM_RESOURCES = {
    "9.0": dict(smem_per_sm=228 * 1024, smem_per_block=227 * 1024, registers=65536, warps=64, blocks=32),
    "8.0": dict(smem_per_sm=164 * 1024, smem_per_block=163 * 1024, registers=65536, warps=64, blocks=32),
}
#: Shared memory the driver reserves per resident block.
SMEM_RESERVED_PER_BLOCK = 1024
#: Registers are allocated per warp in units of this many.
REGISTER_UNIT_PER_WARP = 256

#: Triton IR element types → the operand type names PTX tensor-core instructions use.
TC_DTYPE = {"bf16": "bf16", "f16": "f16", "f8E4M3FN": "e4m3", "f8E5M2": "e5m2", "f8E4M3FNUZ": "e4m3",
            "f8E5M2FNUZ": "e5m2", "i8": "s8", "f32": "tf32"}

_DOT = re.compile(r"tt\.dot(?:_scaled)? .*?(?:inputPrecision = (\w+))?\s*:\s*tensor<(\d+)x(\d+)x(\w+)>\s*\*\s*"
                  r"tensor<(\d+)x(\d+)x(\w+)>\s*->\s*tensor<\d+x\d+x(\w+)>")
_FOR = re.compile(r"scf\.for %[\w#]+ = (%[\w#]+) to (%[\w#]+) step (%[\w#]+)")
_CONSTANT = re.compile(r"^\s*(%[\w#]+) = arith\.constant (-?\d+) : i\d+", re.M)
_WGMMA = re.compile(r"wgmma\.mma_async(?:\.sp)?\.sync\.aligned\.m(\d+)n(\d+)k(\d+)\.(\w+)\.(\w+)\.(\w+)")
_MMA = re.compile(r"mma\.sync\.aligned\.m(\d+)n(\d+)k(\d+)\.row\.col(?:\.satfinite)?\.(\w+)\.(\w+)\.(\w+)\.(\w+)")


@dataclasses.dataclass(frozen=True)
class TritonSource:
    """One Triton kernel launch of a lowered module."""

    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Dot:
    """One ``tt.dot`` of the Triton IR: ``[m, k] × [k, n] → [m, n]``."""

    m: int
    n: int
    k: int
    lhs: str
    rhs: str
    acc: str
    precision: str  # "tf32", "tf32x3", ... ("" when the IR does not say: IEEE, tt.dot's default)

    @property
    def tc_dtype(self) -> str | None:
        """The operand type a tensor-core instruction for this dot would name (None: none exists)."""
        if self.lhs == "f32" and self.precision not in ("tf32", "tf32x3"):
            return None  # an IEEE float32 dot (tt.dot's default precision): FMA by construction
        return TC_DTYPE.get(self.lhs)


@dataclasses.dataclass(frozen=True)
class Ptxas:
    """What ``ptxas -v`` reports for one kernel."""

    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    serialized_wgmma: bool


@dataclasses.dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    limited_by: str  # "registers", "shared memory", "warps", "blocks"


@dataclasses.dataclass(frozen=True)
class KernelStatic:
    """The static readings of one kernel compiled for one arch."""

    name: str
    arch: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    smem_bytes: int
    dots: tuple[Dot, ...]
    wgmma: dict  # operand dtype → instruction count
    mma_sync: dict
    cp_async: int
    tma: int
    has_loop: bool  # an scf.for that runs more than once (see `has_pipelinable_loop`)
    local_ptx: int  # ld.local + st.local instructions in the PTX
    ptxas: Ptxas | None
    occupancy: Occupancy | None
    ptxas_error: str | None = None  # why ptxas gave no report (e.g. it timed out on a loaded machine)

    @property
    def tensor_core_dtypes(self) -> set:
        return set(self.wgmma) | set(self.mma_sync)

    @property
    def fma_dots(self) -> tuple[Dot, ...]:
        """Dots whose operand dtype has no tensor-core instruction in the PTX."""
        return tuple(d for d in self.dots if d.tc_dtype is None or d.tc_dtype not in self.tensor_core_dtypes)

    @property
    def uses_tensor_cores(self) -> bool:
        return bool(self.dots) and not self.fma_dots

    @property
    def spills(self) -> bool:
        p = self.ptxas
        return self.local_ptx > 0 or (p is not None and (p.spill_stores > 0 or p.spill_loads > 0))

    @property
    def pipelined(self) -> bool:
        return self.cp_async > 0 or self.tma > 0

    def failures(self) -> list[str]:
        """Findings that make the config unfit to be chosen."""
        found = []
        limit = SM_RESOURCES[self.arch]["smem_per_block"]
        if self.smem_bytes > limit:
            found.append(f"{self.smem_bytes} B shared memory > {limit} B")
        for d in self.fma_dots:
            found.append(f"dot {d.m}x{d.k}x{d.n} {d.lhs}*{d.rhs}->{d.acc}"
                         f"{' (' + d.precision + ')' if d.precision else ''} on FMA, no tensor-core instruction")
        if self.spills:
            p = self.ptxas
            detail = f"{self.local_ptx} ld/st.local in PTX"
            if p is not None:
                detail += f", {p.spill_stores} B spill stores, {p.spill_loads} B spill loads"
            found.append(f"register spills ({detail})")
        if self.num_stages > 1 and self.has_loop and self.dots and not self.pipelined:
            found.append(f"num_stages={self.num_stages} but no cp.async/TMA in the loop")
        return found

    def warnings(self) -> list[str]:
        """Findings worth knowing that do not disqualify the config."""
        found = []
        if self.arch == "9.0" and self.dots and self.mma_sync and not self.wgmma:
            found.append("mma.sync only on sm_90 (no wgmma)")
        if self.ptxas is not None and self.ptxas.serialized_wgmma:
            found.append("ptxas C7514: wgmma serialized")
        if self.num_stages > 1 and not self.has_loop:
            found.append(f"num_stages={self.num_stages} without a loop (no effect)")
        if self.ptxas_error:
            found.append(f"registers and spills unread: {self.ptxas_error}")
        if self.occupancy is not None and self.occupancy.blocks_per_sm == 0:
            found.append("does not fit on an SM")
        return found


def triton_sources(lowered) -> list[TritonSource]:
    """The Triton kernel launches of a lowered module (name, IR, warps, stages, grid)."""
    from jax._src.lib.mlir import ir

    from .lowering import _triton_custom_calls

    found = []
    for config in _triton_custom_calls(lowered):
        grid = tuple(ir.IntegerAttr(config[f"grid_{a}"]).value for a in "xyz")
        found.append(TritonSource(ir.StringAttr(config["name"]).value, bytes(ir.StringAttr(config["ir"]).value_bytes),
                                  ir.IntegerAttr(config["num_warps"]).value,
                                  ir.IntegerAttr(config["num_stages"]).value, grid))
    return found


def ir_text(source: TritonSource) -> str:
    """The Triton IR (MLIR bytecode) as text."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib import triton
    from jax._src.lib.mlir import ir

    ctx = jmlir.make_ir_context()
    triton.dialect.register_dialect(ctx)
    with ctx:
        return str(ir.Module.parse(source.ir))


def parse_dots(text: str) -> tuple[Dot, ...]:
    """The ``tt.dot`` operations of Triton IR text."""
    dots = []
    for m in _DOT.finditer(text):
        precision, M, K, lhs, _, N, rhs, acc = m.groups()
        dots.append(Dot(int(M), int(N), int(K), lhs, rhs, acc, precision or ""))
    return tuple(dots)


_ARITH = re.compile(r"^\s*(%[\w#]+) = arith\.(addi|subi|muli|divsi|divui|floordivsi|ceildivsi|maxsi|minsi) "
                    r"(%[\w#]+), (%[\w#]+)(?: overflow<\w+>)? : i\d+", re.M)
_FOLD = {"addi": lambda a, b: a + b, "subi": lambda a, b: a - b, "muli": lambda a, b: a * b,
         "divsi": lambda a, b: int(a / b), "divui": lambda a, b: a // b, "floordivsi": lambda a, b: a // b,
         "ceildivsi": lambda a, b: -(-a // b), "maxsi": max, "minsi": min}


def _integer_values(text: str) -> dict:
    """SSA integer values of Triton IR text that fold to constants (constants and integer
    arithmetic on them)."""
    values = {m.group(1): int(m.group(2)) for m in _CONSTANT.finditer(text)}
    pending = [m.groups() for m in _ARITH.finditer(text)]
    changed = True
    while changed and pending:
        changed, rest = False, []
        for name, fn, a, b in pending:
            if a in values and b in values and (fn not in ("divsi", "divui", "floordivsi", "ceildivsi")
                                                or values[b] != 0):
                values[name] = _FOLD[fn](values[a], values[b])
                changed = True
            else:
                rest.append((name, fn, a, b))
        pending = rest
    return values


def loop_trip_counts(text: str) -> list[int | None]:
    """The trip count of each ``scf.for`` of Triton IR text (``None`` when a bound does not fold
    to a constant)."""
    values = _integer_values(text)
    counts = []
    for m in _FOR.finditer(text):
        lo, hi, step = (values.get(x) for x in m.groups())
        counts.append(None if None in (lo, hi, step) or step <= 0 else max(0, -(-(hi - lo) // step)))
    return counts


def has_pipelinable_loop(text: str) -> bool:
    """A loop Triton could software-pipeline: an ``scf.for`` running more than once (or an
    unknown number of times); ``scf.while`` loops are not pipelined."""
    return any(c is None or c > 1 for c in loop_trip_counts(text))


def tensor_core_instructions(ptx: str) -> tuple[dict, dict]:
    """(wgmma, mma.sync) instruction counts by operand dtype."""
    wgmma, mma = {}, {}
    for m in _WGMMA.finditer(ptx):
        wgmma[m.group(5)] = wgmma.get(m.group(5), 0) + 1
    for m in _MMA.finditer(ptx):
        mma[m.group(5)] = mma.get(m.group(5), 0) + 1
    return wgmma, mma


@functools.lru_cache(maxsize=1)
def ptxas_path() -> str | None:
    """``$STELLAX_PTXAS``, ``ptxas`` on the PATH, or the one of the ``nvidia-cuda-nvcc`` wheel."""
    if os.environ.get("STELLAX_PTXAS"):
        return os.environ["STELLAX_PTXAS"]
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for sub in ("cu13", "cuda_nvcc"):
            candidate = Path(root) / sub / "bin" / "ptxas"
            if candidate.is_file():
                return str(candidate)
    return None


#: Seconds one ptxas run may take (a big kernel on a loaded 2-core machine took over 300).
PTXAS_TIMEOUT_S = 900

PTXAS_MISSING = ("no ptxas: registers and spills unread (pip install --no-deps nvidia-cuda-nvcc==13.0.88, "
                 "or set STELLAX_PTXAS)")


def run_ptxas(ptx: str, arch: str) -> Ptxas:
    """``ptxas -v`` on ``ptx`` for ``arch`` (sm_90a for "9.0")."""
    path = ptxas_path()
    if path is None:
        raise RuntimeError(PTXAS_MISSING)
    target = {"9.0": "sm_90a", "8.0": "sm_80"}[arch]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run([path, f"-arch={target}", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, timeout=PTXAS_TIMEOUT_S)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed for {target}: {text[-800:]}")
    return parse_ptxas(text)


def parse_ptxas(text: str) -> Ptxas:
    """The numbers of a ``ptxas -v`` report."""
    regs = re.search(r"Used (\d+) registers", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None or frame is None:
        raise RuntimeError(f"unexpected ptxas report: {text[-400:]}")
    return Ptxas(int(regs.group(1)), int(frame.group(1)), int(frame.group(2)), int(frame.group(3)),
                 "C7514" in text)


def occupancy(registers: int, smem_bytes: int, num_warps: int, arch: str = "9.0") -> Occupancy:
    """Resident blocks and warps per SM for a kernel of ``num_warps`` warps."""
    r = SM_RESOURCES[arch]
    per_warp = -(-registers * 32 // REGISTER_UNIT_PER_WARP) * REGISTER_UNIT_PER_WARP
    limits = {"registers": (r["registers"] // per_warp) // num_warps if per_warp else r["blocks"],
              "shared memory": r["smem_per_sm"] // (smem_bytes + SMEM_RESERVED_PER_BLOCK)
              if smem_bytes <= r["smem_per_block"] else 0,
              "warps": r["warps"] // num_warps, "blocks": r["blocks"]}
    limited_by = min(limits, key=lambda k: limits[k])
    blocks = limits[limited_by]
    return Occupancy(blocks, blocks * num_warps, limited_by)


@functools.lru_cache(maxsize=4096)
def _compile(ir: bytes, arch: str, num_warps: int, num_stages: int) -> tuple[str, int]:
    from jax._src.lib import triton

    result = triton.compile("CUDA", ir, arch, num_warps=num_warps, num_ctas=1, num_stages=num_stages)
    return result.asm, int(result.smem_bytes)


_ANALYSES: dict = {}


def analyze(source: TritonSource, arch: str = "9.0", *, use_ptxas: bool = True) -> KernelStatic:
    """Compile ``source`` for ``arch`` and read its PTX (and ptxas' report when available).
    Identical kernels (same IR, warps, stages) are analyzed once per process."""
    if arch not in SM_RESOURCES:
        raise ValueError(f"arch: expected one of {sorted(SM_RESOURCES)}, got {arch!r}")
    key = (hashlib.sha256(source.ir).hexdigest(), arch, source.num_warps, source.num_stages, source.grid,
           use_ptxas and ptxas_path() is not None)
    if key in _ANALYSES:
        return dataclasses.replace(_ANALYSES[key], name=source.name)
    text = ir_text(source)
    if float(arch) < 8.9 and re.search(r"f8E(?:4M3FN|5M2)", text):
        # Triton's LLVM aborts the whole process on float8 conversions below sm_89.
        raise ValueError(f"float8 values in the kernel: Triton cannot compile them for sm_{arch.replace('.', '')} "
                         f"(sm_89 or newer); the implementation's requirements must refuse such calls there")
    ptx, smem = _compile(source.ir, arch, source.num_warps, source.num_stages)
    wgmma, mma = tensor_core_instructions(ptx)
    report, ptxas_error = None, None
    if use_ptxas and ptxas_path() is not None:
        try:
            report = run_ptxas(ptx, arch)
        except subprocess.TimeoutExpired:
            ptxas_error = f"ptxas timed out after {PTXAS_TIMEOUT_S} s"
    occ = occupancy(report.registers, smem, source.num_warps, arch) if report is not None else None
    result = KernelStatic(
        name=source.name, arch=arch, num_warps=source.num_warps, num_stages=source.num_stages, grid=source.grid,
        smem_bytes=smem, dots=parse_dots(text), wgmma=wgmma, mma_sync=mma,
        cp_async=len(re.findall(r"cp\.async\.(?:ca|cg)\.shared", ptx)),
        tma=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)), has_loop=has_pipelinable_loop(text),
        local_ptx=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)), ptxas=report, occupancy=occ,
        ptxas_error=ptxas_error)
    _ANALYSES[key] = result
    return result
