"""Config resolution: explicit > context > user cache > shipped cache > miss policy > heuristic."""

import warnings

import jax
import pytest

import stellax
from stellax.autotune import cache as cache_lib
from stellax.autotune import keys, sources
from stellax.core.selection import resolve_config
from stellax.ops.norm import NormConfig, layer_norm_op
from stellax.testing import random_array

IMPL = layer_norm_op.implementations["triton"]


def _call(rows=16, features=128):
    x = random_array(jax.random.PRNGKey(0), (rows, features))
    return layer_norm_op.check(x, random_array(jax.random.PRNGKey(1), (features,)))


def _entry(call, config: NormConfig, **versions):
    return cache_lib.Entry("layer_norm", "triton", call.signature(), config.to_dict(), 1.0,
                           **{**cache_lib.versions(), **versions})


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    directory = tmp_path / "shipped"
    directory.mkdir()
    monkeypatch.setattr(cache_lib, "shipped_dir", lambda: directory)
    return lambda: cache_lib.ConfigCache(directory / f"{keys.device_slug()}.json")


def test_resolution_order_is_deterministic(shipped):
    call = _call()
    heuristic = IMPL.heuristic(call)
    space = IMPL.config_space(call)
    user_cfg, shipped_cfg, ctx_cfg, explicit_cfg = [c for c in space if c != heuristic][:4]

    assert resolve_config("layer_norm", IMPL, call) == (heuristic, "heuristic")
    shipped().put(_entry(call, shipped_cfg))
    assert resolve_config("layer_norm", IMPL, call) == (shipped_cfg, "shipped-cache")
    cache_lib.user_cache().put(_entry(call, user_cfg))
    for _ in range(3):  # same answer every time
        assert resolve_config("layer_norm", IMPL, call) == (user_cfg, "user-cache")
    with stellax.use_configs({("layer_norm", "triton"): ctx_cfg}):
        assert resolve_config("layer_norm", IMPL, call) == (ctx_cfg, "context")
        assert resolve_config("layer_norm", IMPL, call, explicit_cfg) == (explicit_cfg, "explicit")
    # Another shape is a different key: it falls through to the heuristic.
    other = _call(rows=3)
    assert resolve_config("layer_norm", IMPL, other) == (IMPL.heuristic(other), "heuristic")


def test_entries_from_other_versions_are_revalidated(shipped):
    call = _call()
    good = [c for c in IMPL.config_space(call) if c != IMPL.heuristic(call)][0]
    cache_lib.user_cache().put(_entry(call, good, stellax_version="0.0.1", jax_version="0.4.0"))
    assert resolve_config("layer_norm", IMPL, call) == (good, "user-cache")  # still valid: used

    bad = cache_lib.Entry("layer_norm", "triton", call.signature(),
                          {"block_rows": 4, "num_warps": 4, "num_stages": 1, "no_such_field": 1}, 1.0,
                          stellax_version="0.0.1", jax_version="0.4.0")
    outside = cache_lib.Entry("layer_norm", "triton", call.signature(),
                              {"block_rows": 4, "num_warps": 16, "num_stages": 1}, 1.0,
                              stellax_version="0.0.1", jax_version="0.4.0")
    for entry in (bad, outside):
        cache_lib.reset_warnings()
        cache_lib.user_cache().put(entry)
        with pytest.warns(cache_lib.CacheWarning, match="ignoring an entry"):
            assert resolve_config("layer_norm", IMPL, call) == (IMPL.heuristic(call), "heuristic")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            resolve_config("layer_norm", IMPL, call)  # warned once only


def test_miss_policy_error_and_heuristic():
    call = _call()
    with sources.policy("error"):
        with pytest.raises(sources.CacheMissError, match="layer_norm/triton"):
            resolve_config("layer_norm", IMPL, call)
        # A cached config is no miss.
        cache_lib.user_cache().put(_entry(call, IMPL.config_space(call)[0]))
        assert resolve_config("layer_norm", IMPL, call)[1] == "user-cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a CPU heuristic fallback
        assert resolve_config("layer_norm", IMPL, _call(rows=5))[1] == "heuristic"
    with pytest.raises(ValueError, match="policy"):
        sources.set_policy("sometimes")


def test_policy_from_environment(monkeypatch):
    monkeypatch.setenv("STELLAX_AUTOTUNE_POLICY", "error")
    assert sources.get_policy() == "error"
    with sources.policy("heuristic"):
        assert sources.get_policy() == "heuristic"
    sources.set_policy("autotune")
    assert sources.get_policy() == "autotune"


def test_miss_policy_autotune_tunes_at_trace_time(monkeypatch):
    """Under policy 'autotune', a miss inside a jitted function is tuned on the
    spot (in a helper thread), cached, and used."""
    monkeypatch.setenv("STELLAX_AUTOTUNE_MAX_CONFIGS", "2")
    x = random_array(jax.random.PRNGKey(2), (8, 32))
    with stellax.interpret_mode(), sources.policy("autotune"):
        y = jax.jit(lambda a: stellax.layer_norm(a, implementation="triton"))(x)
        call = layer_norm_op.check(x)
        config, source = resolve_config("layer_norm", IMPL, call)
    assert source == "user-cache"
    assert config in IMPL.config_space(call) + [IMPL.heuristic(call)]
    stellax.testing.assert_close(y, layer_norm_op.reference(x))
    with stellax.interpret_mode():
        entry = cache_lib.user_cache().get(keys.call_key("layer_norm", "triton", call))
    assert entry is not None and entry.candidates == 2
