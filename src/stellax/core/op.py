"""The op framework: `Op`, `Implementation` and dispatch.

An `Op` is one public operator. It owns:

* ``check``: validates and canonicalizes user arguments into a `Call`
  (``ValueError``/``TypeError`` naming the argument, expected and actual value);
* ``reference``: the golden XLA implementation (float32 math), the ground
  truth every kernel is tested against;
* ``implementations``: ordered fastest-first; dispatch with
  ``implementation=None`` tries each that the platform supports natively and
  always ends in ``"xla"``. An explicit name (or sequence of names) that
  cannot run raises `UnsupportedError` with every reason;
* ``flops``/``bytes_accessed``: cost models for the benchmark code;
* ``examples``: small built-in calls `stellax check` validates;
* ``benchmarks``: default benchmark calls for a platform (`stellax bench`),
  and ``peers``: other libraries' functions for the same math (same
  arguments as the op) that benchmarks compare against.

Every call annotates the XLA operations it emits with its identity (op,
implementation, config, abstract call; `core.metadata`), so a compiled
program or a profile names the stellax calls inside it.

Backward passes are ops of their own (``<name>_backward``) wired in with
``jax.custom_vjp`` by the forward implementations.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterable, Sequence

from . import metadata, selection
from .call import Call
from .platform import Platform, current_platform, interpret_enabled

#: Pallas backends and what they need to run natively.
KERNEL_BACKENDS = ("triton", "mosaic_gpu", "mosaic_tpu")


class UnsupportedError(ValueError):
    """Raised when an explicitly requested implementation cannot run."""


@dataclasses.dataclass(frozen=True)
class Support:
    """Whether an implementation can run, and if not, why."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


def backend_support(backend: str, platform: Platform) -> Support:
    """Can a kernel for ``backend`` run on ``platform`` (natively or interpreted)?"""
    if backend == "xla":
        return SUPPORTED
    if interpret_enabled():
        return SUPPORTED
    hint = " (or enable interpret mode: stellax.interpret_mode() / STELLAX_INTERPRET=1)"
    if backend == "triton":
        if platform.backend != "gpu":
            return Support(False, f"the Triton backend needs a GPU, this device is {platform.describe()}{hint}")
        if platform.nvidia_below((8, 0)):
            return Support(False, f"the Triton kernels need SM80 or newer, this GPU is {platform.describe()}")
        return SUPPORTED
    if backend == "mosaic_gpu":
        cc = platform.compute_capability
        if platform.backend != "gpu" or not platform.is_nvidia or cc is None or cc < (9, 0):
            return Support(False, f"Mosaic GPU kernels need an NVIDIA Hopper/Blackwell GPU, this device is {platform.describe()}{hint}")
        return SUPPORTED
    if backend == "mosaic_tpu":
        if platform.backend != "tpu":
            return Support(False, f"Mosaic TPU kernels need a TPU, this device is {platform.describe()}{hint}")
        generation = platform.tpu
        if generation is None or not generation.kernels:
            return Support(False, f"the Mosaic TPU kernels need TPU v5e or newer, this device is {platform.describe()}")
        return SUPPORTED
    return Support(False, f"unknown kernel backend {backend!r}")


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One way to compute an op.

    Attributes:
      name: ``"xla"``, ``"xla_chunked"``, ``"triton"``, ``"mosaic_gpu"``, ...
      run: ``run(call, config) -> outputs``.
      backend: ``"xla"`` or a Pallas backend from `KERNEL_BACKENDS`.
      config_type: the frozen `KernelConfig` subclass, or ``None``.
      heuristic: ``heuristic(call) -> config``, the default config.
      space: ``space(call) -> list[config]``, the autotuning space.
      requirements: ``requirements(call) -> str | None``: a reason why this
        call's shapes/options cannot run here, or ``None``.
      native: when False, ``implementation=None`` never picks it (it is used
        only on request), e.g. an XLA path that is slower by design.
      writes_float8: ``writes_float8(call) -> bool`` for a Triton kernel whose
        *outputs* may be float8 though its operands are not (quantizing to
        fp8): such calls are refused below sm_89 like float8 operands.
      defers_to_xla: ``defers_to_xla(platform) -> str | None``: why the default
        chain (``implementation=None``) passes this kernel over on ``platform``,
        where it was measured slower than XLA; an explicit request still runs it.
    """

    name: str
    run: Callable[[Call, Any], Any]
    backend: str = "xla"
    config_type: type | None = None
    heuristic: Callable[[Call], Any] | None = None
    space: Callable[[Call], list[Any]] | None = None
    requirements: Callable[[Call], str | None] | None = None
    native: bool = True
    writes_float8: Callable[[Call], bool] | None = None
    defers_to_xla: Callable[[Platform], str | None] | None = None

    def __post_init__(self):
        if self.config_type is not None and (self.heuristic is None or self.space is None):
            raise ValueError(f"implementation {self.name!r}: a config_type needs heuristic and space")

    def supported(self, call: Call, platform: Platform | None = None) -> Support:
        platform = platform or current_platform()
        support = backend_support(self.backend, platform)
        if not support:
            return support
        if self.backend == "triton":
            reason = _triton_fp8_reason(call, platform,
                                        writes=self.writes_float8 is not None and self.writes_float8(call))
            if reason:
                return Support(False, reason)
        if self.requirements is not None:
            reason = self.requirements(call)
            if reason:
                return Support(False, reason)
        return SUPPORTED

    def default_config(self, call: Call):
        return None if self.heuristic is None else self.heuristic(call)

    def config_space(self, call: Call) -> list:
        return [] if self.space is None else list(self.space(call))

    @property
    def is_kernel(self) -> bool:
        return self.backend in KERNEL_BACKENDS


_FLOAT8 = frozenset(("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
                     "float8_e8m0fnu"))


def _triton_fp8_reason(call: Call, platform: Platform, writes: bool = False) -> str | None:
    """Why a Triton kernel cannot take ``call`` on this GPU: float8 operands
    (codes, block scales, cache pages), or float8 outputs (``writes``), on an
    NVIDIA GPU below sm_89, where Triton has no float8 conversions (its compile
    aborts the process: "Conversion from/to f8e4m3nv is only supported on
    compute capability >= 89")."""
    if not platform.nvidia_below((8, 9)):
        return None
    import jax

    names = sorted({name for name, value in call.arrays.items()
                    for leaf in jax.tree_util.tree_leaves(value) if str(getattr(leaf, "dtype", "")) in _FLOAT8})
    if names:
        return (f"float8 operands ({', '.join(names)}) need sm_89 or newer in Triton kernels (no float8 "
                f"conversions below); this GPU is {platform.describe()}")
    if writes:
        return (f"float8 outputs need sm_89 or newer in Triton kernels (no float8 conversions below); this GPU is "
                f"{platform.describe()}")
    return None


@dataclasses.dataclass(frozen=True)
class Example:
    """A small built-in call for `stellax check` / `stellax bench`."""

    label: str
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)


class Op:
    """A public operator with checked arguments, a golden reference and
    several implementations. See the module docstring."""

    def __init__(
        self,
        name: str,
        *,
        check: Callable[..., Call],
        reference: Callable[[Call], Any],
        implementations: Sequence[Implementation],
        flops: Callable[[Call], float] | None = None,
        bytes_accessed: Callable[[Call], float] | None = None,
        examples: Callable[..., list[Example]] | None = None,
        benchmarks: Callable[[Platform], list[Example]] | None = None,
        peers: dict[str, Callable[..., Any]] | None = None,
        differentiable: Sequence[str] = (),
        family: str = "",
    ):
        names = [impl.name for impl in implementations]
        if "xla" not in names:
            raise ValueError(f"op {name!r}: every op needs an 'xla' implementation, got {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"op {name!r}: duplicate implementation names {names}")
        self.name = name
        self.family = family or name
        self.check = check
        self.reference_fn = reference
        self.implementations = {impl.name: impl for impl in implementations}
        self._flops = flops
        self._bytes = bytes_accessed
        self._examples = examples
        self._benchmarks = benchmarks
        self.peers = dict(peers or {})
        self.differentiable = tuple(differentiable)

    def __repr__(self) -> str:
        return f"Op({self.name!r}, implementations={list(self.implementations)})"

    # -- cost models -------------------------------------------------------
    def flops(self, call: Call) -> float:
        return float(self._flops(call)) if self._flops else 0.0

    def bytes_accessed(self, call: Call) -> float:
        return float(self._bytes(call)) if self._bytes else 0.0

    def examples(self, dtype) -> list[Example]:
        """Small calls (built from random inputs of ``dtype``) for numerics checks."""
        return self._examples(dtype) if self._examples else []

    def benchmarks(self, platform: Platform | None = None) -> list[Example]:
        """Default benchmark calls for ``platform`` (small on a CPU)."""
        if not self._benchmarks:
            return []
        return self._benchmarks(platform or current_platform())

    # -- dispatch ----------------------------------------------------------
    def reference(self, *args, **kwargs):
        """The golden result for user arguments (checked like a normal call)."""
        return self.reference_fn(self.check(*args, **kwargs))

    def candidates(self, implementation: str | Sequence[str] | None) -> tuple[list[str], bool]:
        """Implementation names to try, and whether the choice was explicit."""
        if implementation is None:
            ordered = [n for n, impl in self.implementations.items() if impl.native and n != "xla"]
            return ordered + ["xla"], False
        if isinstance(implementation, str):
            names = [implementation]
        elif isinstance(implementation, (list, tuple)) and all(isinstance(n, str) for n in implementation):
            names = list(implementation)
        else:
            raise TypeError(f"implementation: expected None, a name or a sequence of names "
                            f"(one of {list(self.implementations)}), got {implementation!r}")
        if not names:
            raise ValueError(f"implementation: expected a name or a non-empty sequence, got {implementation!r}")
        for n in names:
            if n not in self.implementations:
                raise ValueError(
                    f"implementation: {self.name} has no implementation {n!r}; "
                    f"expected one of {list(self.implementations)}"
                )
        return names, True

    def select(self, call: Call, implementation=None) -> Implementation:
        """The first implementation in the chain that supports ``call`` here."""
        names, explicit = self.candidates(implementation)
        platform = current_platform()
        reasons = []
        for n in names:
            impl = self.implementations[n]
            if not explicit and impl.is_kernel and platform.backend == "cpu":
                # Interpreted kernels are for testing; never the CPU default.
                continue
            if not explicit and impl.defers_to_xla is not None and impl.defers_to_xla(platform):
                continue  # measured slower than XLA on this platform: not the default
            support = impl.supported(call, platform)
            if support:
                return impl
            reasons.append(f"{n}: {support.reason}")
        raise UnsupportedError(
            f"{self.name}: no requested implementation can run ({call.describe()}): " + "; ".join(reasons)
        )

    def run(self, call: Call, implementation=None, config=None):
        """Dispatch an already checked call."""
        impl = self.select(call, implementation)
        cfg, _ = selection.resolve_config(self.name, impl, call, config)
        selection.notify(self, impl, call, cfg)
        with metadata.annotate(self.name, impl.name, cfg, call), _chosen(implementation is not None):
            return impl.run(call, cfg)

    def __call__(self, *args, implementation=None, config=None, **kwargs):
        """Check the user arguments, pick the implementation and its config, run it
        (`run` on an already checked call; inlined here to keep the call path short)."""
        call = self.check(*args, **kwargs)
        impl = self.select(call, implementation)
        cfg, _ = selection.resolve_config(self.name, impl, call, config)
        selection.notify(self, impl, call, cfg)
        with metadata.annotate(self.name, impl.name, cfg, call), _chosen(implementation is not None):
            return impl.run(call, cfg)

    def run_implementation(self, name: str, call: Call, config=None):
        """Run one named implementation with a given (or resolved) config, no fallback."""
        return self.run(call, implementation=name, config=config)


_REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    """Add ``op`` to the registry `stellax check`/`bench`/`autotune` iterate over."""
    if op.name in _REGISTRY and _REGISTRY[op.name] is not op:
        raise ValueError(f"op {op.name!r} registered twice")
    _REGISTRY[op.name] = op
    return op


def registered_ops() -> dict[str, Op]:
    """All registered ops by name (importing `stellax` registers them)."""
    return dict(_REGISTRY)


#: Whether the implementation now running was named by the caller (see `chosen_explicitly`).
_EXPLICIT: contextvars.ContextVar[bool] = contextvars.ContextVar("stellax_chosen_explicitly", default=False)


@contextlib.contextmanager
def _chosen(explicit: bool):
    token = _EXPLICIT.set(explicit)
    try:
        yield
    finally:
        _EXPLICIT.reset(token)


def chosen_explicitly() -> bool:
    """Inside an implementation's run: whether the caller named the implementation
    (``implementation="mosaic_tpu"`` or a sequence) rather than the default chain picking it.
    A differentiable op's run function records it for its backward (`backward_implementation`)."""
    return _EXPLICIT.get()


def backward_implementation(backward_op: Op, forward_name: str, *, explicit: bool | None = None
                            ) -> tuple[str, ...]:
    """The backward implementation chain matching a forward implementation:
    the same name first when the backward op has it, then the default chain.

    ``explicit=False`` (the forward was picked by the default chain, `chosen_explicitly`)
    lets the backward op's own default rule apply: a backward kernel that defers to XLA on
    this platform (`Implementation.defers_to_xla`, measured slower than XLA there) gives way
    to the rest of the backward op's default chain (ending in ``"xla"``) even though its
    forward kernel runs. ``True`` or ``None`` (the default) keep the forward's name: an
    explicit request is honoured."""
    if forward_name in backward_op.implementations:
        platform = current_platform()
        defers = lambda impl: impl.defers_to_xla is not None and bool(impl.defers_to_xla(platform))
        if explicit is False and defers(backward_op.implementations[forward_name]):
            names, _ = backward_op.candidates(None)
            return tuple(n for n in names if n != forward_name and not defers(backward_op.implementations[n]))
        return (forward_name,) if forward_name != "xla" else ("xla",)
    names, _ = backward_op.candidates(None)
    return tuple(names)


def names_of(implementations: Iterable[Implementation]) -> list[str]:
    return [impl.name for impl in implementations]


def refuse_interpreted_tpu_collectives(where: str, implementation, devices: int) -> None:
    """Refuse, before anything runs, a Mosaic TPU kernel interpreted on a CPU between collectives over
    ``devices`` > 1 simulated devices: jax's TPU interpreter runs each kernel as host callbacks that
    meet every device of the mesh, and with XLA:CPU's collectives in between the devices' threads
    wait on each other (seen: ring attention's backward, expert parallelism; a 2-core machine hangs
    or aborts in a rendezvous timeout). ``implementation`` is the user's choice (``None``: the
    default, which never picks an interpreted kernel on a CPU)."""
    if implementation is None or devices <= 1 or not interpret_enabled() or current_platform().backend != "cpu":
        return
    names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
    if "mosaic_tpu" in names:
        raise UnsupportedError(
            f"{where}: implementation={implementation!r} in interpret mode across {devices} simulated CPU "
            f"devices: jax's Mosaic TPU interpreter deadlocks between collectives; interpreted, use "
            f"'triton', 'xla_chunked' or 'xla' (or the default), or run the Mosaic TPU kernels on a TPU")
