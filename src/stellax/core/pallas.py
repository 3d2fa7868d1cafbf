"""One entry point for launching Pallas kernels.

`triton_call` wraps ``pl.pallas_call`` for the Pallas Triton backend:

* it always passes Triton compiler params (``num_warps``/``num_stages``), so
  the call goes to Triton and not to Mosaic GPU (jax 0.10 picks Mosaic GPU
  for a CUDA ``pallas_call`` without compiler params);
* it turns on ``interpret=True`` when interpret mode is on;
* in interpret mode every output starts as NaN (a NaN-filled buffer aliased
  into the output), so an element a kernel forgets to write fails the numerics
  checks instead of silently reading as zero.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from .platform import interpret_enabled


def _poison(shape_dtype: jax.ShapeDtypeStruct) -> jax.Array:
    dtype = jnp.dtype(shape_dtype.dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        fill = jnp.nan
    elif jnp.issubdtype(dtype, jnp.integer):
        fill = jnp.iinfo(dtype).min
    else:
        fill = False
    return jnp.full(shape_dtype.shape, fill, dtype)


def triton_call(
    kernel: Callable[..., None],
    *,
    out_shape: Any,
    grid: tuple[int, ...],
    in_specs: Sequence[Any],
    out_specs: Any,
    num_warps: int,
    num_stages: int,
    name: str,
    scratch_shapes: Sequence[Any] = (),
) -> Callable[..., Any]:
    """``pl.pallas_call`` for a Triton kernel; returns a function of the inputs.

    Args mirror ``pl.pallas_call``. ``out_shape``/``out_specs`` may be single
    values or sequences (then the result is a tuple).
    """
    single = not isinstance(out_shape, (list, tuple))
    out_shapes = [out_shape] if single else list(out_shape)
    out_spec_list = [out_specs] if single else list(out_specs)
    interpret = interpret_enabled()
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)

    def launch(*inputs):
        n_in = len(inputs)
        if not interpret:
            call = pl.pallas_call(
                kernel,
                out_shape=out_shapes,
                grid=grid,
                in_specs=list(in_specs),
                out_specs=out_spec_list,
                compiler_params=params,
                scratch_shapes=list(scratch_shapes),
                name=name,
            )
            outs = call(*inputs)
        else:
            n_out = len(out_shapes)

            def poisoned_kernel(*refs):
                # refs: inputs, poison inputs (aliased to the outputs), outputs, scratch.
                kernel(*refs[:n_in], *refs[n_in + n_out:])

            call = pl.pallas_call(
                poisoned_kernel,
                out_shape=out_shapes,
                grid=grid,
                in_specs=list(in_specs) + out_spec_list,
                out_specs=out_spec_list,
                compiler_params=params,
                scratch_shapes=list(scratch_shapes),
                input_output_aliases={n_in + i: i for i in range(n_out)},
                interpret=True,
                name=name,
            )
            outs = call(*inputs, *[_poison(s) for s in out_shapes])
        return outs[0] if single else tuple(outs)

    return launch
