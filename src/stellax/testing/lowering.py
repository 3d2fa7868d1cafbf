"""Lowering checks: does a kernel get through the real compiler front end?

* `lower_for` lowers a function for ``cuda`` or ``tpu`` on any machine (CPU
  included) inside `stellax.lowering_target`, so dispatch picks the kernel
  implementations with interpret mode off; it fails on what Pallas lowering
  rejects (non-power-of-two Triton blocks, unsupported primitives, TPU
  tiling, ...). `lower_for_gpu` is the ``cuda`` case.
* `assert_custom_call` checks the expected kernel launch is in the module
  (``__gpu$xla.gpu.triton`` for Triton, ``mosaic_gpu`` for Mosaic GPU,
  ``tpu_custom_call`` for Mosaic TPU).
* `lower_config` lowers one op with one implementation and one config for one
  platform (and its gradient) and asserts the backend's custom call;
  `check_op_lowering` runs it over a whole autotuning space.
* `compile_triton_to_ptx` (the slower tier) compiles each Triton kernel of a
  lowered module to PTX with the jax CUDA plugin's Triton compiler and reports
  shared memory, which `assert_fits_smem` checks against the SM's limit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import jax

from ..core import LOWERING_TARGETS, Op, Platform, lowering_target, use_configs
from ..core.tpu import KERNEL_GENERATIONS

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CUSTOM_CALL = "mosaic_gpu"
TPU_CUSTOM_CALL = "tpu_custom_call"
CUSTOM_CALL_OF_BACKEND = {"triton": TRITON_CUSTOM_CALL, "mosaic_gpu": MOSAIC_GPU_CUSTOM_CALL,
                          "mosaic_tpu": TPU_CUSTOM_CALL}

#: The platforms ``jax.jit(...).lower(lowering_platforms=...)`` targets for each kernel backend.
PLATFORMS_OF_BACKEND = {"triton": ("cuda",), "mosaic_gpu": ("cuda",), "mosaic_tpu": ("tpu",)}

#: The device dispatch pretends to run on while lowering for a TPU generation.
TPU_TARGETS = {name: LOWERING_TARGETS[name] for name in KERNEL_GENERATIONS}
DEFAULT_TARGET = {"cuda": "h100", "tpu": TPU_TARGETS["v6e"]}

#: Shared memory per block an SM can give (bytes).
SMEM_LIMIT = {"8.0": 163 * 1024, "9.0": 227 * 1024}


def abstract(tree):
    """Arrays → `jax.ShapeDtypeStruct`s (other leaves unchanged)."""
    def to_struct(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x
    return jax.tree_util.tree_map(to_struct, tree)


def lower_for(fn: Callable[..., Any], *args, platform: str = "cuda", target: str | Platform | None = None,
              device=None):
    """Lower ``fn(*args)`` for ``platform`` (``"cuda"`` or ``"tpu"``; args may be
    arrays or shape structs), dispatching as if on ``target`` (default: an H100
    for cuda, a TPU v6e for tpu).

    With ``device`` (a device of a compile-only topology,
    `stellax.testing.tpu_compile.topology_device`) the arguments are placed on
    it, so the result can be ``.compile()``-d by that device's real compiler."""
    if platform not in DEFAULT_TARGET:
        raise ValueError(f"platform: expected one of {sorted(DEFAULT_TARGET)}, got {platform!r}")
    with lowering_target(target if target is not None else DEFAULT_TARGET[platform]):
        if device is None:
            return jax.jit(fn).trace(*abstract(args)).lower(lowering_platforms=(platform,))
        return jax.jit(fn).trace(*on_device(args, device)).lower()


def on_device(tree, device):
    """Arrays → `jax.ShapeDtypeStruct`s placed on ``device`` (other leaves unchanged)."""
    sharding = jax.sharding.SingleDeviceSharding(device)

    def to_struct(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return x
    return jax.tree_util.tree_map(to_struct, tree)


def lower_for_gpu(fn: Callable[..., Any], *args, target: str = "h100"):
    """Lower ``fn(*args)`` for ``cuda`` (args may be arrays or shape structs)."""
    return lower_for(fn, *args, platform="cuda", target=target)


def assert_custom_call(lowered, name: str = TRITON_CUSTOM_CALL, *, count: int | None = None) -> int:
    """The lowered module launches kernel ``name`` (``count`` times if given)."""
    text = lowered.as_text()
    found = text.count(f"@{name}") if name.startswith("__") else text.count(name)
    if found == 0:
        raise AssertionError(f"expected a {name} custom call in the lowered module; none found")
    if count is not None and found != count:
        raise AssertionError(f"expected {count} {name} custom calls, found {found}")
    return found


def platforms_of(backend: str) -> tuple[str, ...]:
    """The lowering platforms of a kernel backend (``()`` for ``"xla"``)."""
    return PLATFORMS_OF_BACKEND.get(backend, ())


def lower_config(op: Op, implementation: str, args: tuple, kwargs: dict | None = None, *, config: Any = None,
                 platform: str | None = None, grad: bool = False, target: str | Platform | None = None,
                 device=None) -> list:
    """Lower ``op(*args, **kwargs)`` with ``implementation`` and ``config``
    (``None``: the one dispatch resolves) for ``platform`` (default: the first
    platform the implementation's backend targets) and assert the backend's
    custom call. With ``grad`` the VJP of the float arguments is lowered too;
    with ``device`` the modules are lowered for that device (see `lower_for`).
    Returns the lowered modules (forward, then gradient)."""
    kwargs = dict(kwargs or {})
    impl = op.implementations[implementation]
    if platform is None:
        platforms = platforms_of(impl.backend)
        if not platforms:
            raise ValueError(f"implementation: {op.name}/{implementation} has backend {impl.backend!r}, "
                             f"expected a kernel backend in {sorted(PLATFORMS_OF_BACKEND)}")
        platform = platforms[0]
    backend_call = CUSTOM_CALL_OF_BACKEND.get(impl.backend)
    array_kwargs = {k: v for k, v in kwargs.items() if hasattr(v, "shape") and hasattr(v, "dtype")}
    static_kwargs = {k: v for k, v in kwargs.items() if k not in array_kwargs}
    table = {} if config is None else {(op.name, implementation): config}

    def forward(*a, **kw):
        with use_configs(table):
            return op(*a, implementation=implementation, **kw, **static_kwargs)

    def loss(diff):
        out = forward(*diff[0], **diff[1])
        return sum(jax.numpy.sum(l.astype(jax.numpy.float32))
                   for l in jax.tree_util.tree_leaves(out)
                   if jax.numpy.issubdtype(l.dtype, jax.numpy.inexact))

    def grad_fn(a, kw):
        # Differentiate float leaves only; integer operands stay closed over.
        return jax.grad(lambda d: loss(_merge(d, (a, kw))))(_float_part((a, kw)))

    fns = [lambda a, kw: forward(*a, **kw)] + ([grad_fn] if grad else [])
    modules = []
    for fn in fns:
        lowered = lower_for(fn, tuple(args), array_kwargs, platform=platform, target=target, device=device)
        if backend_call:
            assert_custom_call(lowered, backend_call)
        modules.append(lowered)
    return modules


def check_op_lowering(op: Op, implementation: str, args: tuple, kwargs: dict | None = None, *,
                      configs: Iterable[Any] | None = None, grad: bool = False, target: str = "h100"):
    """Lower ``op`` with ``implementation`` for cuda once per config (default:
    the whole autotuning space of the example's call); with ``grad`` the VJP of
    the differentiable float arguments is lowered too. Returns the number of
    configs checked."""
    if configs is None:
        call = op.check(*args, **dict(kwargs or {}))
        configs = op.implementations[implementation].config_space(call) or [None]
    n = 0
    for config in configs:
        lower_config(op, implementation, args, kwargs, config=config, platform="cuda", grad=grad, target=target)
        n += 1
    return n


def _is_float(x) -> bool:
    return hasattr(x, "dtype") and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


def _float_part(tree):
    return jax.tree_util.tree_map(lambda x: x if _is_float(x) else None, tree)


def _merge(floats, full):
    return jax.tree_util.tree_map(lambda f, x: f if _is_float(x) else x, floats, full,
                                  is_leaf=lambda x: x is None)


# -- PTX tier -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PtxKernel:
    name: str
    num_warps: int
    num_stages: int
    smem_bytes: int
    ptx_lines: int


def triton_compiler_available() -> tuple[bool, str]:
    """Whether Triton IR can be compiled to PTX here, and why not."""
    try:
        jax.devices()
        from jax._src.lib import triton
    except Exception as e:  # pragma: no cover - depends on the install
        return False, f"jax Triton bindings unavailable: {e}"
    if not triton.has_compilation_handler("CUDA"):
        return False, ("no CUDA Triton compiler: install the 'cuda-check' extra "
                       "(pip install --no-deps jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2)")
    return True, ""


def _triton_custom_calls(lowered):
    from jax._src.interpreters import mlir as jmlir  # noqa: F401  (registers dialects)
    module = lowered.compiler_ir("stablehlo")
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    name = inner.operation.name
                    if name == "stablehlo.custom_call":
                        target = str(inner.attributes["call_target_name"]).strip('"')
                        if target == TRITON_CUSTOM_CALL:
                            found.append(inner.attributes["mhlo.backend_config"])
                    walk(inner.operation)

    walk(module.operation)
    return found


def compile_triton_to_ptx(lowered, arch: str = "9.0") -> list[PtxKernel]:
    """Compile every Triton kernel in ``lowered`` to PTX for ``arch``."""
    ok, reason = triton_compiler_available()
    if not ok:
        raise RuntimeError(reason)
    from jax._src.lib import triton
    from jax._src.lib.mlir import ir

    kernels = []
    for config in _triton_custom_calls(lowered):
        name = ir.StringAttr(config["name"]).value
        module_bytes = ir.StringAttr(config["ir"]).value_bytes
        num_warps = ir.IntegerAttr(config["num_warps"]).value
        num_stages = ir.IntegerAttr(config["num_stages"]).value
        result = triton.compile("CUDA", module_bytes, arch, num_warps=num_warps, num_ctas=1,
                                num_stages=num_stages)
        kernels.append(PtxKernel(name, num_warps, num_stages, int(result.smem_bytes),
                                 result.asm.count("\n")))
    if not kernels:
        raise AssertionError("no Triton kernels found in the lowered module")
    return kernels


def assert_fits_smem(kernels: Iterable[PtxKernel], arch: str = "9.0") -> None:
    limit = SMEM_LIMIT[arch]
    for k in kernels:
        if k.smem_bytes > limit:
            raise AssertionError(f"kernel {k.name}: {k.smem_bytes} bytes of shared memory > {limit} on sm_{arch}")
