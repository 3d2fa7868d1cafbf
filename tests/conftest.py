"""Test session setup: CPU only, 8 simulated devices (for the expert- and
context-parallel tests), XLA:CPU without LLVM's optimization passes (compile
time), and the JAX persistent compilation cache. This must
run before jax is imported anywhere."""

import os
import sys

#: `pytest -m tpu_hardware` (tests/tpu_hardware) runs on the TPU this host has: the session is
#: left on the default platform; every other session is CPU only.
HARDWARE_TIER = any("tpu_hardware" in arg for arg in sys.argv[1:])
if not HARDWARE_TIER:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU compile tier loads libtpu in each test worker (compile only, no TPU).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
#: XLA:CPU flags of the test session (a flag already in XLA_FLAGS is left as set). The tests
#: compile thousands of small programs (goldens, gradients, interpreted kernels) and run each a
#: few times, so LLVM's optimization time is most of their cost: without its optimization passes
#: a sample of interpreted-kernel and golden tests took 40% less CPU (cold compilation cache).
#: Numerics are checked against tolerances, and no test measures speed (`stellax check` compiles
#: at level 0 for the same reason: `stellax.cli.CHECK_XLA_FLAG`).
TEST_XLA_FLAGS = {
    "xla_force_host_platform_device_count": "8",
    "xla_backend_optimization_level": "0",
    "xla_llvm_disable_expensive_passes": "true",
}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"--{name}={value}" for name, value in TEST_XLA_FLAGS.items()
                                              if name not in _flags]).strip()
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "stellax-tests-jax-cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# A user's autotuning cache must not change the configs the tests run with.
import tempfile  # noqa: E402

os.environ["STELLAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="stellax-test-cache-")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


import pytest  # noqa: E402

# Test folders whose tests each get a private autotuning cache and fresh warning state.
_CACHE_ISOLATED_FOLDERS = ("autotune", "bench")


@pytest.fixture(autouse=True)
def isolated_cache(request, monkeypatch):
    """In tests/autotune and tests/bench: a per-test user cache directory
    (yielded) and fresh autotuning warning/policy state; elsewhere nothing."""
    if request.node.path.parent.name not in _CACHE_ISOLATED_FOLDERS:
        yield None
        return
    from stellax.autotune import cache, sources

    root = request.getfixturevalue("tmp_path") / "cache"
    monkeypatch.setenv("STELLAX_CACHE_DIR", str(root))
    monkeypatch.delenv("STELLAX_AUTOTUNE_POLICY", raising=False)
    cache.reset_warnings()
    sources.reset_miss_warnings()
    sources.set_policy(None)
    yield root
    sources.set_policy(None)


# -- the extended tier (tests/extended_tier.txt) --------------------------------------------------
_EXTENDED_LIST = os.path.join(os.path.dirname(__file__), "extended_tier.txt")
_OTHER_TIERS = ("slow", "ptx", "tpu", "vllm")


def _extended_tests() -> set[str]:
    with open(_EXTENDED_LIST) as f:
        return {line.split("#", 1)[0].strip() for line in f} - {""}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    """Mark the test functions of `tests/extended_tier.txt` ``extended``."""
    listed = _extended_tests()
    found, collected_files = set(), set()
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        collected_files.add(function.split("::", 1)[0])
        if function in listed:
            found.add(function)
            if not any(item.get_closest_marker(m) for m in _OTHER_TIERS):
                item.add_marker(pytest.mark.extended)
    stale = sorted(f for f in listed - found if f.split("::", 1)[0] in collected_files)
    if stale:
        raise pytest.UsageError(f"tests/extended_tier.txt names tests that do not exist (renamed?): {stale}")
