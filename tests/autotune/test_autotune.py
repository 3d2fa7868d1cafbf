"""`stellax.autotune`: finding ops inside functions (under jax.grad too), the
search, results as contexts and JSON, and the CLI."""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import pytest

import stellax
from stellax.autotune import cache as cache_lib
from stellax.autotune import cli as autotune_cli
from stellax.autotune import search
from stellax.core import Call, Implementation, KernelConfig, Op
from stellax.core.selection import resolve_config
from stellax.ops.norm import layer_norm_op
from stellax.testing import assert_close, random_array


def _loss(x, scale):
    return jnp.sum(stellax.layer_norm(x, scale, implementation="triton") ** 2)


def test_autotune_finds_ops_inside_grad_and_caches_them():
    x = random_array(jax.random.PRNGKey(0), (8, 48))
    scale = random_array(jax.random.PRNGKey(1), (48,))
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1)))
    with stellax.interpret_mode():
        expected = grad(x, scale)  # traced before: autotune must still see its ops
        result = stellax.autotune(grad, x, scale, max_configs=2)
        assert {(e.entry.op, e.entry.implementation) for e in result} == {
            ("layer_norm", "triton"), ("layer_norm_backward", "triton")}
        assert all(e.source == "tuned" and e.entry.candidates == 2 for e in result)
        assert not result.failures
        # Written to the user cache: a second run tunes nothing.
        again = stellax.autotune(grad, x, scale, max_configs=2)
        assert [e.source for e in again] == ["user-cache", "user-cache"]
        assert [e.entry.config for e in again] == [e.entry.config for e in result]
        # As a context: the tuned configs are chosen and the numbers do not change.
        with result:
            call = layer_norm_op.check(x, scale)
            impl = layer_norm_op.implementations["triton"]
            assert resolve_config("layer_norm", impl, call)[1] == "context"
            got = jax.jit(jax.grad(_loss, argnums=(0, 1)))(x, scale)
        for g, e in zip(got, expected):
            assert_close(g, e, gradient=True)


def test_result_json_round_trip(tmp_path):
    x = random_array(jax.random.PRNGKey(3), (4, 32))
    with stellax.interpret_mode():
        result = stellax.autotune(lambda a: stellax.layer_norm(a, implementation="triton"), x, max_configs=1,
                                  cache=False)
    assert len(result) == 1 and not cache_lib.user_cache().path.exists()
    path = tmp_path / "result.json"
    result.save(path)
    loaded = stellax.autotune.AutotuneResult.load(path)
    call = layer_norm_op.check(x)
    assert loaded.lookup("layer_norm", "triton", call) == result.lookup("layer_norm", "triton", call)
    assert loaded.config_for("layer_norm", "triton", call) == result.tuned[0].tune.config
    assert json.loads(path.read_text())["entries"][0]["search"]
    with pytest.raises(ValueError, match="not a stellax autotuning result"):
        stellax.autotune.AutotuneResult.from_json({"format": "other"})


# -- the search on a synthetic op: failures are skipped, ties are deterministic --
@dataclasses.dataclass(frozen=True)
class _Cfg(KernelConfig):
    mode: int = 0


def _run(call: Call, config):
    if config.mode == 3:
        raise RuntimeError("resource limit exceeded (planted)")
    if config.mode == 4:
        return call.x * 3.0  # a wrong result (planted)
    return call.x * 2.0


_FAKE = Op("fake_scale", check=lambda x: Call({"x": x}, {}), reference=lambda call: call.x * 2.0,
           implementations=[Implementation("xla", lambda call, config: call.x * 2.0),
                            Implementation("tuned", _run, config_type=_Cfg, heuristic=lambda call: _Cfg(0),
                                           space=lambda call: [_Cfg(m) for m in range(5)])])


def test_search_skips_failing_and_wrong_configs():
    call = _FAKE.check(jnp.ones((64, 64)))
    result = search.tune_call(_FAKE, "tuned", call, timer="wall")
    errors = {c.config["mode"]: c.error for c in result.candidates}
    assert "resource limit" in errors[3] and "wrong result" in errors[4]
    assert all(errors[m] is None for m in (0, 1, 2))
    assert result.config.mode in (0, 1, 2)
    assert result.failures == 2


def test_outputs_close_flags_misplaced_non_finite_values_and_large_distance():
    ref = jnp.array([1.0, 2.0, jnp.inf, 4.0])
    assert search._outputs_close((ref * (1 + 1e-4),), (ref,)) is None          # within tolerance
    assert "non-finite" in search._outputs_close((ref.at[0].set(jnp.nan),), (ref,))
    assert "non-finite" in search._outputs_close((ref.at[2].set(3.0),), (ref,))
    assert "rel_l2" in search._outputs_close((ref.at[3].set(5.0),), (ref,))
    big = jnp.full((8,), 3e30, jnp.float32)  # squares overflow float32 unless scaled
    assert search._outputs_close((big,), (big,)) is None
    assert "rel_l2" in search._outputs_close((big * 1.1,), (big,))
    assert "integer" in search._outputs_close((jnp.array([1, 2]),), (jnp.array([1, 3]),))


def test_search_past_its_deadline_times_only_the_default():
    call = _FAKE.check(jnp.ones((64, 64)))
    result = search.tune_call(_FAKE, "tuned", call, timer="wall", deadline=time.monotonic() - 1)
    errors = [c.error for c in result.candidates]
    assert errors[0] is None and result.candidates[0].default and result.config == _Cfg(0)
    assert errors[3].startswith("compile:"), errors  # configs still compile: a broken one is still seen
    assert all(errors[m] == "skipped: deadline reached" for m in (1, 2, 4)), errors


def test_search_fails_only_when_every_config_fails():
    broken = Op("fake_broken", check=lambda x: Call({"x": x}, {}), reference=lambda call: call.x,
                implementations=[Implementation("xla", lambda call, config: call.x),
                                 Implementation("tuned", lambda call, config: _run(call, _Cfg(3)), config_type=_Cfg,
                                                heuristic=lambda call: _Cfg(0),
                                                space=lambda call: [_Cfg(1), _Cfg(2)])])
    with pytest.raises(search.TuneError, match="every config failed"):
        search.tune_call(broken, "tuned", broken.check(jnp.ones((4,))), timer="wall")


def test_select_configs_keeps_default_first_and_thins_evenly():
    space = [_Cfg(m) for m in range(10)]
    assert search.select_configs(space, _Cfg(5), None)[0] == _Cfg(5)
    picked = search.select_configs(space, _Cfg(5), 4)
    assert len(picked) == 4 and picked[0] == _Cfg(5) and picked == search.select_configs(space, _Cfg(5), 4)


def test_cli_tunes_shapes_from_a_file(tmp_path, capsys):
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps([{"op": "layer_norm", "args": [{"shape": [6, 40], "dtype": "float32"}],
                                   "kwargs": {"subtract_mean": False}, "backward": False}]))
    out = tmp_path / "result.json"
    exported = tmp_path / "export.json"
    code = autotune_cli.main(["--shapes", str(shapes), "--interpret", "--max-configs", "2", "--quiet",
                              "--out", str(out), "--export", str(exported)])
    assert code == 0
    data = json.loads(out.read_text())
    # Interpreted, every kernel implementation of the op is tuned: Triton and Mosaic TPU.
    assert sorted((e["op"], e["implementation"]) for e in data["entries"]) == [("layer_norm", "mosaic_tpu"),
                                                                               ("layer_norm", "triton")]
    assert len(cache_lib.ConfigCache(exported).entries()) == 2
    assert "2 config(s) (2 tuned)" in capsys.readouterr().out
    # Nothing to tune natively on a CPU without --interpret.
    assert autotune_cli.main(["--shapes", str(shapes), "--quiet"]) == 0
    assert autotune_cli.main(["--shapes", str(tmp_path / "missing.json")]) == 2
