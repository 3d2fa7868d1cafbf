"""The Mosaic TPU GLU kernels on abstract operands, for the static schedule tool
(`stellax.testing.llo_schedule`): what one grid step of the forward kernel
costs in libtpu's compiled bundles, against its MXU time.

    python -m stellax.testing.llo_schedule stellax.ops.glu.tpu_cases:forward_case \\
        m=8192 k=7168 n=18432 block_m=512 block_n=512 block_k=1792

`forward_case` returns ``(fn, args)`` (args: shape structs): SwiGLU in bfloat16,
``x [m, k]`` and stacked weights ``[k, 2, n]``, through
`stellax.gated_linear_unit` with ``implementation="mosaic_tpu"`` at the tiles
``(block_m, block_n, block_k)``; ``grad=True`` compiles the differentiated
forward (it also writes ``gate`` and ``up``), the backward's dx and dW
kernels too. `forward_step_figures` turns the forward kernel's schedule into
the figures docs/norm_glu.md tabulates: a step's cycles over its MXU time
(`step_mxu_cycles`) and the whole kernel's static cycles (grid steps × a
step's cycles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: v5e's bfloat16 MXU peak (flop/s) and TensorCore clock (Hz) the static figures use.
V5E_PEAK_FLOPS = 197e12
V5E_CLOCK_HZ = 1.5e9
#: The forward kernel's name (`mosaic_tpu.glu_forward`); libtpu's dumps suffix it (``.1``).
FORWARD_KERNEL = "stellax_glu_forward_tpu"


def forward_case(m: int = 8192, k: int = 4096, n: int = 14336, block_m: int = 512, block_n: int = 512,
                 block_k: int = 2048, grad: bool = False):
    """``(fn, args)``: ``fn(x, w)`` = `stellax.gated_linear_unit` (SwiGLU, ``x [m, k]`` bf16,
    stacked ``w [k, 2, n]`` bf16, ``mosaic_tpu`` at ``GluTpuConfig(block_m, block_n, block_k)``);
    with ``grad`` the gradient of ``sum(y)`` with respect to both (forward, dx and dW kernels)."""
    from ...core import use_configs
    from .api import gated_linear_unit
    from .configs import GluTpuConfig

    config = GluTpuConfig(block_m=block_m, block_n=block_n, block_k=block_k)
    configs = {("gated_linear_unit", "mosaic_tpu"): config, ("gated_linear_unit_backward", "mosaic_tpu"): config}

    def forward(x, w):
        with use_configs(configs):
            return gated_linear_unit(x, w, activation="silu", implementation="mosaic_tpu")

    def loss(x, w):
        return jnp.sum(forward(x, w).astype(jnp.float32))

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 2, n), jnp.bfloat16))
    return (jax.grad(loss, argnums=(0, 1)) if grad else forward), args


def forward_schedule(schedules: dict):
    """The forward kernel's entry of `llo_schedule.kernel_schedules`' ``{kernel: schedule}``
    (its name is `FORWARD_KERNEL` with libtpu's suffix)."""
    found = [s for name, s in schedules.items() if name.split(".")[0] == FORWARD_KERNEL]
    if len(found) != 1:
        raise ValueError(f"schedules: expected one {FORWARD_KERNEL} kernel, got {sorted(schedules)}")
    return found[0]


def step_mxu_cycles(block_m: int, block_n: int, block_k: int, peak_flops: float = V5E_PEAK_FLOPS,
                    clock_hz: float = V5E_CLOCK_HZ) -> float:
    """Clock cycles the MXUs need for one forward grid step: the two products ``x @ Wg`` and
    ``x @ Wu`` of a ``[block_m, block_k]`` by ``[block_k, block_n]`` tile, ``4 · bm · bn · bk``
    flops at ``peak_flops`` (v5e: 197 TFLOP/s, 1.5 GHz: 16384 cycles at 512 × 512 × 2048)."""
    return 4.0 * block_m * block_n * block_k / peak_flops * clock_hz


def forward_step_figures(schedule, m: int, k: int, n: int, block_m: int, block_n: int, block_k: int) -> dict:
    """Static figures of the forward kernel from its `llo_schedule.KernelSchedule` ``schedule``
    (tiles as `forward_case` took them; each at most its dimension):

    * ``step_cycles``: a grid step's cycles, ``max(bundles, critical_path)`` (the kernel's code
      is one step: the grid loop runs it once per step);
    * ``step_over_mxu``: that over `step_mxu_cycles` of the step's tiles;
    * ``steps``: the grid, ``ceil(m/bm) · ceil(n/bn) · ceil(k/bk)``;
    * ``kernel_cycles``: ``steps · step_cycles`` (the masked part of a partial K step counted, as
      the chip computes it); ``kernel_over_mxu``: that over the MXU time of the call's useful
      ``4 · m · k · n`` flops."""
    bm, bn, bk = min(block_m, m), min(block_n, n), min(block_k, k)
    steps = -(-m // bm) * -(-n // bn) * -(-k // bk)
    step = schedule.bound
    useful = 4.0 * m * k * n / V5E_PEAK_FLOPS * V5E_CLOCK_HZ
    return dict(tiles=(bm, bn, bk), step_cycles=step, step_over_mxu=step / step_mxu_cycles(bm, bn, bk),
                steps=steps, kernel_cycles=steps * step, kernel_over_mxu=steps * step / useful,
                spills=schedule.spills, bundles=schedule.bundles, critical_path=schedule.critical_path)
