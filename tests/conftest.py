"""Test session setup: CPU only, 8 simulated devices (for the expert- and
context-parallel tests), and the JAX persistent compilation cache. This must
run before jax is imported anywhere."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "stellax-tests-jax-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# A user's autotuning cache must not change the configs the tests run with.
import tempfile  # noqa: E402

os.environ["STELLAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="stellax-test-cache-")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
