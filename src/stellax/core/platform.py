"""Where kernels run: the current platform, interpret mode and lowering targets.

Two switches live here:

* **Interpret mode** (`interpret_mode()` or the environment variable
  ``STELLAX_INTERPRET=1``) makes every Pallas kernel run with ``interpret=True``,
  so GPU kernels execute on the CPU for testing.
  TPU kernels then run with ``pltpu.InterpretParams`` (races detected,
  uninitialized memory NaN).
* **Lowering target** (`lowering_target("h100")`, `lowering_target("v6e")`) makes dispatch behave as if it
  ran on that accelerator, so a kernel can be lowered for ``cuda`` on a CPU-only
  machine (`stellax.testing.lowering`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os

import jax

from .tpu import TPU_GENERATIONS, TpuGeneration, tpu_generation

_INTERPRET: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "stellax_interpret", default=None
)
_TARGET: contextvars.ContextVar["Platform | None"] = contextvars.ContextVar(
    "stellax_lowering_target", default=None
)

_TRUE_STRINGS = ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class Platform:
    """The device kernels are dispatched for.

    Attributes:
      backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
      device_kind: the device's own name (``"NVIDIA H200"``, ``"cpu"``, ...).
      compute_capability: ``(major, minor)`` for NVIDIA GPUs, else ``None``.
      vendor: ``"nvidia"``, ``"amd"`` or ``None``.
    """

    backend: str
    device_kind: str
    compute_capability: tuple[int, int] | None = None
    vendor: str | None = None

    @property
    def is_nvidia(self) -> bool:
        return self.backend == "gpu" and self.vendor == "nvidia"

    def nvidia_below(self, capability: tuple[int, int]) -> bool:
        """Whether this is an NVIDIA GPU with a compute capability below ``capability``
        (``(9, 0)``: below Hopper, where ptxas gives mma.sync tiles more registers per
        thread than sm_90's wgmma tiles; ``(8, 9)``: no float8 in Triton)."""
        cc = self.compute_capability
        return bool(self.is_nvidia and cc is not None and tuple(cc) < tuple(capability))

    @property
    def tpu(self) -> TpuGeneration | None:
        """The TPU generation (VMEM, MXU, dtypes), or ``None`` off a known TPU."""
        return tpu_generation(self.device_kind) if self.backend == "tpu" else None

    def describe(self) -> str:
        if self.compute_capability:
            major, minor = self.compute_capability
            return f"{self.device_kind} (sm_{major}{minor})"
        if self.tpu is not None:
            return f"{self.device_kind} ({self.tpu.name})"
        return self.device_kind


def interpret_enabled() -> bool:
    """True when Pallas kernels must run interpreted (context first, then env)."""
    value = _INTERPRET.get()
    if value is not None:
        return value
    return os.environ.get("STELLAX_INTERPRET", "").strip().lower() in _TRUE_STRINGS


@contextlib.contextmanager
def interpret_mode(enabled: bool = True):
    """Run every stellax Pallas kernel with ``interpret=True`` inside the block.

    Interpreted kernels run on any backend (including the CPU) with the same
    kernel code, which is how stellax verifies GPU kernels without a GPU.
    Explicitly requested kernel implementations (``implementation="triton"``)
    become runnable on the CPU; ``implementation=None`` still prefers the
    platform's native fast path.
    """
    token = _INTERPRET.set(bool(enabled))
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def _platform_of(device) -> Platform:
    backend = device.platform
    if backend in ("cuda", "rocm", "gpu"):
        capability = getattr(device, "compute_capability", None)
        cc = None
        vendor = "amd" if backend == "rocm" else "nvidia"
        if isinstance(capability, str) and "." in capability:
            major, minor = capability.split(".")[:2]
            cc = (int(major), int(minor))
        return Platform("gpu", device.device_kind, cc, vendor)
    return Platform(backend, device.device_kind)


def current_platform() -> Platform:
    """The platform dispatch targets: a lowering target if set, else device 0."""
    target = _TARGET.get()
    if target is not None:
        return target
    return _platform_of(jax.devices()[0])


def host_platform() -> Platform:
    """The platform of the real default device, ignoring lowering targets."""
    return _platform_of(jax.devices()[0])


LOWERING_TARGETS = {
    "h100": Platform("gpu", "NVIDIA H100 80GB HBM3", (9, 0), "nvidia"),
    "h200": Platform("gpu", "NVIDIA H200", (9, 0), "nvidia"),
    "a100": Platform("gpu", "NVIDIA A100-SXM4-80GB", (8, 0), "nvidia"),
    "b200": Platform("gpu", "NVIDIA B200", (10, 0), "nvidia"),
    **{name: Platform("tpu", g.device_kinds[0]) for name, g in TPU_GENERATIONS.items()},
}


@contextlib.contextmanager
def lowering_target(target: str | Platform = "h100"):
    """Dispatch as if running on ``target`` (a name in `LOWERING_TARGETS` or a
    `Platform`), with interpret mode off, so kernels can be lowered for that
    accelerator with ``jax.jit(f).trace(...).lower(lowering_platforms=...)``
    on a machine that does not have it. Nothing can be executed inside."""
    if isinstance(target, str):
        if target not in LOWERING_TARGETS:
            raise ValueError(
                f"target: expected one of {sorted(LOWERING_TARGETS)} or a Platform, "
                f"got {target!r}"
            )
        target = LOWERING_TARGETS[target]
    token = _TARGET.set(target)
    interp = _INTERPRET.set(False)
    try:
        yield target
    finally:
        _INTERPRET.reset(interp)
        _TARGET.reset(token)


def target_generation(platform=None) -> TpuGeneration:
    """The generation TPU kernels are configured for: the platform's own (a
    TPU device or a `stellax.lowering_target`), else v6e, so interpret-mode
    runs on a CPU pick the configs a v6e would."""
    if platform is None:
        platform = current_platform()
    return platform.tpu or TPU_GENERATIONS["v6e"]
