"""`compare_on_device` (float32 on the device, for outputs too large for the host) agrees with
`compare` (float64 on the host) on every statistic, non-finite values included."""

import jax.numpy as jnp
import numpy as np
import pytest

from stellax.testing.numerics import compare, compare_on_device


def _pair(dtype, case):
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((64, 96)).astype(np.float32)
    out = ref + 3e-3 * rng.standard_normal(ref.shape).astype(np.float32)
    if case == "nan_both":
        ref[3, 4] = out[3, 4] = np.nan
    elif case == "nan_out":
        out[5, 6] = np.nan
    elif case == "inf_same":
        ref[1, 2] = out[1, 2] = np.inf
    elif case == "inf_differs":
        ref[1, 2], out[1, 2] = np.inf, 1.0
    elif case == "huge":
        ref, out = ref * 1e30, out * 1e30
    return jnp.asarray(out, dtype), jnp.asarray(ref, dtype)


@pytest.mark.parametrize("dtype, case", [(d, c) for d in (jnp.float32, jnp.bfloat16)
                                         for c in ("plain", "nan_both", "nan_out", "inf_same", "inf_differs")]
                         + [(jnp.float32, "huge")])  # squares of 1e30 overflow float32 unless scaled
def test_device_comparison_matches_the_host_one(dtype, case):
    out, ref = _pair(dtype, case)
    host, device = compare(out, ref), compare_on_device(out, ref)
    assert (device.has_nan, device.reference_has_nan, device.passed, device.shape, device.tolerance) == \
        (host.has_nan, host.reference_has_nan, host.passed, host.shape, host.tolerance)
    if np.isfinite(host.rel_l2):
        np.testing.assert_allclose(device.rel_l2, host.rel_l2, rtol=1e-5)
        np.testing.assert_allclose(device.max_abs, host.max_abs, rtol=1e-6)
    else:
        assert not np.isfinite(device.rel_l2)
    assert abs(device.fraction_within - host.fraction_within) < 1e-6


def test_device_comparison_rejects_a_shape_mismatch():
    with pytest.raises(AssertionError, match="shape mismatch"):
        compare_on_device(jnp.zeros((2, 3)), jnp.zeros((3, 2)))
