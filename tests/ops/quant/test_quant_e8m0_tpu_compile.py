"""E8M0 scales through the real TPU compiler (libtpu, compile only; the `tpu` tier).

XLA on a TPU rewrote a reshape that drops a size-1 dimension of an
``float8_e8m0fnu`` array into an add-reduce starting from zero, which E8M0
cannot hold (it is NaN): under `jax.jit` every scale of the Mosaic quantize
kernel came back NaN on a v5e while the same call run eagerly was exact. The
quant paths now shape E8M0 codes as integers and bitcast last
(`formats.e8m0_from_codes`); these tests read the compiled programs for any
E8M0 reduce, the shape of that bug."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.ops.quant import formats as F

pytestmark = pytest.mark.tpu



def _device():
    from stellax.testing.tpu_compile import libtpu_available, topology_device

    ok, reason = libtpu_available()
    if not ok:
        pytest.skip(reason)
    return topology_device("v5e")


def _compiled_text(fn, *args) -> str:
    from stellax.testing.lowering import on_device

    return jax.jit(fn).trace(*on_device(args, _device())).lower().compile().as_text()


def _op_compiled_text(name, implementation, args, kwargs) -> str:
    """The v5e program of ``name`` called under `jax.jit` with ``implementation``."""
    from stellax.testing.lowering import LOWERING_TARGETS, lower_config

    device = _device()
    op = stellax.registered_ops()[name]
    (lowered,) = lower_config(op, implementation, args, kwargs, platform="tpu", target=LOWERING_TARGETS["v5e"],
                              device=device)
    return lowered.compile().as_text()


def _e8m0_reduces(text: str) -> list[str]:
    return [line.strip()[:200] for line in text.splitlines()
            if "f8e8m0fnu" in line and " reduce(" in line]


def test_the_pattern_is_found_where_e8m0_is_reshaped_by_hand():
    """The guard's own check: a bare reshape of E8M0 codes of shape [n, 1] compiles
    to the E8M0 reduce (if libtpu stops doing this, the tests below lose their
    teeth and this one says so)."""
    codes = jnp.arange(28, dtype=jnp.int32).reshape(28, 1) + 100

    def bare(c):
        return jax.lax.bitcast_convert_type(c.astype(jnp.uint8), jnp.float8_e8m0fnu).reshape(4, 7)

    assert _e8m0_reduces(_compiled_text(bare, codes))


@pytest.mark.parametrize("implementation", ["mosaic_tpu", "xla"])
@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4"])
def test_quantize_under_jit_has_no_e8m0_reduce(implementation, fmt):
    x = jax.random.normal(jax.random.PRNGKey(0), (37, 200), jnp.float32)
    text = _op_compiled_text("quantize", implementation, (x,), {"format": fmt, "axis": -1, "block_shape": (1, 32)})
    assert _e8m0_reduces(text) == []


@pytest.mark.parametrize("implementation", ["mosaic_tpu", "xla"])
def test_dequantize_of_leading_unit_dims_has_no_e8m0_reduce(implementation):
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 37, 256), jnp.float32)
    q = stellax.quantize(x, "mxfp8_e4m3", implementation="xla")
    kwargs = {"format": "mxfp8_e4m3", "shape": x.shape, "block_shape": (1, 1, 32), "axis": 2, "rotation": None,
              "dtype": "float32"}
    text = _op_compiled_text("dequantize", implementation, (q.values, q.scales, None, None), kwargs)
    assert _e8m0_reduces(text) == []


def test_e8m0_from_codes_keeps_the_codes():
    codes = jnp.arange(256, dtype=jnp.int32).reshape(256, 1)
    out = jax.jit(lambda c: F.e8m0_from_codes(c.reshape(16, 16)))(codes)
    assert out.dtype == jnp.float8_e8m0fnu
    assert (jax.lax.bitcast_convert_type(out, jnp.uint8).astype(jnp.int32).reshape(-1) == jnp.arange(256)).all()
