"""TPU generations: what each chip gives a Mosaic TPU kernel.

A TPU is recognised from its ``device_kind`` (the string jax reports:
``"TPU v5 lite"`` is a v5e, ``"TPU v5"`` a v5p, ``"TPU v6 lite"`` a v6e).
Each `TpuGeneration` records what kernel configs depend on:

* ``vmem_bytes``: the physical VMEM of one TensorCore. Measured with the real
  compiler (`libtpu` 0.0.42, no TPU needed): the largest VMEM scratch a kernel
  compiles with is 16 MiB on v4, 128 MiB on v5e and v6e, 64 MiB on v5p and TPU7x.
* ``scoped_vmem_bytes``: the compiler's default limit for a kernel's pipelined
  buffers when the kernel does not set ``vmem_limit_bytes``. Measured the same
  way (double-buffered blocks of a copy kernel; `tests/testing/test_tpu_compile.py`):
  16 MiB on v5e and v5p, 32 MiB on v6e and TPU7x. A kernel that needs more asks
  for it in its compiler params.
* ``mxu``: the systolic array's side (128 up to v5p, 256 from v6e): matmul
  tiles should be multiples of it.
* ``matmul_dtypes``: operand dtypes the MXU multiplies natively. Other float
  dtypes (fp8 before TPU7x) are stored and converted, never multiplied.
* ``hbm_bytes``: the HBM of one device (16 GiB v5e, 95 GiB v5p, 32 GiB v6e,
  192 GiB TPU7x; the compiler rejects programs whose temporaries exceed it).
* ``cores_per_chip``: TensorCores one jax device drives (2 on v4 and v5p,
  "megacore"); a ``parallel`` grid axis is split across them.
* ``topology``: the name `jax.experimental.topologies.get_topology_desc` takes
  to compile for this generation without the hardware (the compile tier).
* ``kernels``: whether stellax's Mosaic TPU kernels target it (v5e and newer).
"""

from __future__ import annotations

import dataclasses

MIB = 1024 * 1024
GIB = 1024 * MIB


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation (see the module docstring for the fields)."""

    name: str
    device_kinds: tuple[str, ...]
    vmem_bytes: int
    scoped_vmem_bytes: int
    mxu: int
    matmul_dtypes: tuple[str, ...]
    cores_per_chip: int
    hbm_bytes: int
    topology: str
    kernels: bool = True

    @property
    def tuning_vmem_bytes(self) -> int:
        """The VMEM a config of a matmul kernel's autotuning space may need: half the physical
        VMEM (64 MiB on v5e and v6e, 32 MiB on v5p and TPU7x), so its raised limit fits."""
        return self.vmem_bytes // 2

    @property
    def heuristic_vmem_bytes(self) -> int:
        """The VMEM a matmul kernel's heuristic config may need: twice the scoped default, at most
        a quarter of the physical VMEM, never less than the scoped default (32 MiB on v5e, v6e and
        TPU7x, 16 on v5p)."""
        return max(self.scoped_vmem_bytes, min(2 * self.scoped_vmem_bytes, self.vmem_bytes // 4))

    def has_dtype(self, dtype) -> bool:
        """True when the MXU multiplies ``dtype`` operands natively."""
        import numpy as np

        return np.dtype(dtype).name in self.matmul_dtypes

    def describe(self) -> str:
        return (f"TPU {self.name}: VMEM {self.vmem_bytes // MIB} MiB (scoped default "
                f"{self.scoped_vmem_bytes // MIB} MiB), MXU {self.mxu}x{self.mxu}, "
                f"{self.cores_per_chip} core(s) per device, matmul {', '.join(self.matmul_dtypes)}")


_FLOAT = ("bfloat16", "float32")
TPU_GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v4", ("TPU v4",), 16 * MIB, 16 * MIB, 128, _FLOAT + ("int8",), 2, 32 * GIB,
                      "v4:2x2x1", kernels=False),
        TpuGeneration("v5e", ("TPU v5 lite", "TPU v5e"), 128 * MIB, 16 * MIB, 128,
                      _FLOAT + ("int8", "int4"), 1, 16 * GIB, "v5e:2x2"),
        TpuGeneration("v5p", ("TPU v5", "TPU v5p"), 64 * MIB, 16 * MIB, 128, _FLOAT + ("int8",), 2, 95 * GIB,
                      "v5p:2x2x1"),
        TpuGeneration("v6e", ("TPU v6 lite", "TPU v6e"), 128 * MIB, 32 * MIB, 256,
                      _FLOAT + ("int8", "int4"), 1, 32 * GIB, "v6e:2x2"),
        TpuGeneration("tpu7x", ("TPU7x", "TPU v7x", "TPU v7"), 64 * MIB, 32 * MIB, 256,
                      _FLOAT + ("float8_e4m3fn", "float8_e5m2"), 1, 192 * GIB, "TPU7x:2x2x1"),
    )
}

#: Generations the compile tier targets (the ones the kernels support).
KERNEL_GENERATIONS = tuple(name for name, g in TPU_GENERATIONS.items() if g.kernels)


def tpu_generation(device_kind: str) -> TpuGeneration | None:
    """The generation whose ``device_kind`` this is, or ``None`` (not a known TPU)."""
    kind = device_kind.strip()
    for generation in TPU_GENERATIONS.values():
        if kind in generation.device_kinds:
            return generation
    return None
