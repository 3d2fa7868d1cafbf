"""FLOP/byte models and roofline numbers against hand counts."""

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.bench import Peaks, analyze, benchmark, datasheet_peaks, roofline
from stellax.testing import random_array


def _ln_inputs(rows, features, dtype=jnp.float32):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (random_array(k[0], (rows, features), dtype), random_array(k[1], (features,), dtype),
            random_array(k[2], (features,), dtype))


def test_layer_norm_models_match_hand_counts():
    rows, features = 64, 256
    x, scale, offset = _ln_inputs(rows, features)
    n = rows * features
    # Forward per element: add for the mean, subtract, square, add for the variance, scale by rstd,
    # the final scale and the bias, plus the per-row work amortized: 7 + scale + offset.
    r = benchmark(stellax.layer_norm, x, scale, offset, iterations=3)
    assert r.cost_source == "model" and r.ops == [["layer_norm", "xla"]]
    assert r.flops == n * 9
    # x read + y written (float32) + scale and offset read.
    assert r.bytes_accessed == 2 * n * 4 + 2 * features * 4
    # forward + backward: the backward op counts 12 per element; it reads dy, x (twice) and writes dx.
    fb = benchmark(stellax.layer_norm, x, scale, offset, mode="forward_backward", iterations=3)
    assert fb.ops == [["layer_norm", "xla"], ["layer_norm_backward", "xla"]]
    assert fb.flops == n * 9 + n * 12
    back = benchmark(stellax.layer_norm, x, scale, offset, mode="backward", iterations=3)
    assert back.ops == [["layer_norm_backward", "xla"]] and back.flops == n * 12


def test_glu_model_counts_two_matmuls():
    if "gated_linear_unit" not in stellax.registered_ops():
        pytest.skip("gated_linear_unit is not registered")
    m, k, n = 32, 64, 48
    x = random_array(jax.random.PRNGKey(1), (m, k))
    w = random_array(jax.random.PRNGKey(2), (k, 2, n))
    r = benchmark(stellax.gated_linear_unit, x, w, iterations=3)
    matmuls = 2 * m * k * (2 * n)  # x @ w_gate and x @ w_up
    assert matmuls <= r.flops <= matmuls + 10 * m * n  # plus the elementwise gate


def test_xla_cost_model_for_plain_functions():
    a = random_array(jax.random.PRNGKey(3), (64, 32))
    b = random_array(jax.random.PRNGKey(4), (32, 16))
    r = benchmark(lambda p, q: p @ q, a, b, iterations=3)
    assert r.cost_source == "xla" and r.ops == []
    assert r.flops == 2 * 64 * 32 * 16
    user = benchmark(lambda p, q: p @ q, a, b, iterations=3, flops=123.0, bytes_accessed=456.0)
    assert (user.flops, user.bytes_accessed, user.cost_source) == (123.0, 456.0, "user")


def test_roofline_arithmetic():
    peaks = Peaks("test", {"bfloat16": 100e12, "float32": 50e12}, 1e12)
    out = analyze(1e12, 1e9, 1.0, "bfloat16", peaks)
    assert out["tflops"] == pytest.approx(1.0) and out["gbps"] == pytest.approx(1.0)
    assert out["pct_peak_flops"] == pytest.approx(1.0) and out["pct_peak_bandwidth"] == pytest.approx(0.1)
    assert out["bound"] == "compute" and out["floor_ms"] == pytest.approx(10.0)
    assert out["pct_roofline"] == pytest.approx(1.0)
    mem = analyze(1e9, 2e12, 4.0, "float32", peaks)  # 2 s of traffic in 4 s
    assert mem["bound"] == "memory" and mem["pct_roofline"] == pytest.approx(50.0)
    assert mem["intensity"] == pytest.approx(5e-4)
    assert analyze(1.0, 1.0, None, "float32", peaks)["tflops"] is None


@pytest.mark.parametrize("kind,name,bf16,bw", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4e12, 3.35e12),
    ("NVIDIA H200", "H200 SXM", 989.4e12, 4.8e12),
    ("NVIDIA B200", "B200", 2250e12, 8e12),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 312e12, 2.039e12),
    ("TPU v5 lite", "TPU v5e", 197e12, 819e9),
    ("TPU v5p", "TPU v5p", 459e12, 2765e9),
    ("TPU v6 lite", "TPU v6e", 918e12, 1640e9),
    ("TPU7x", "TPU v7", 2307e12, 7370e9),
])
def test_peaks_table(kind, name, bf16, bw):
    peaks = datasheet_peaks(kind)
    assert peaks.name == name
    assert peaks.flops_for(jnp.bfloat16) == pytest.approx(bf16)
    assert peaks.memory_bandwidth == pytest.approx(bw)
    assert datasheet_peaks("cpu") is None


def test_measured_peaks_override_the_datasheet(monkeypatch, tmp_path):
    # Calibrations made earlier in this process (e.g. by the GPU-suite dry run) must not leak in.
    monkeypatch.setattr(roofline, "_SESSION_MEASURED", {})
    plat = stellax.current_platform()
    measured = {"matmul": {"dtype": "float32", "flops_per_s": 2e11}, "copy": {"bytes_per_s": 3e10}}
    saved = roofline.save_measured(measured, plat)
    assert str(tmp_path) in saved
    peaks = roofline.device_peaks(plat)
    assert peaks.flops_for(jnp.float32) == 2e11 and peaks.memory_bandwidth == 3e10
    assert peaks.source_of("float32") == "measured"


def test_cost_models_see_concrete_operands():
    """A data-dependent model (e.g. ragged group sizes) gets the input's values, not a tracer."""
    import numpy as np

    from stellax.core import Call, Implementation, Op

    def flops(call):
        return 2.0 * float(np.asarray(call.sizes).sum()) * call.x.shape[1]

    op = Op("fake_ragged", check=lambda x, sizes: Call({"x": x, "sizes": sizes}, {}),
            reference=lambda call: call.x, implementations=[Implementation("xla", lambda call, config: call.x * 2)],
            flops=flops, bytes_accessed=lambda call: 1.0)
    x = random_array(jax.random.PRNGKey(5), (10, 8))
    r = benchmark(lambda a, s: op(a, s), x, jnp.array([3, 0, 5]), iterations=3)
    assert r.cost_source == "model" and r.flops == 2.0 * 8 * 8
