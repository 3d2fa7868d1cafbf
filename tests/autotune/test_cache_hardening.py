"""The cache against pathological files: deep nesting, entries that no longer
validate with the same versions, stale temp files of dead writers."""

import os
import subprocess
import sys
import warnings

import jax
import pytest

from stellax.autotune import cache as cache_lib
from stellax.autotune import keys
from stellax.core.selection import resolve_config
from stellax.ops.norm import NormConfig, layer_norm_op
from stellax.testing import random_array

IMPL = layer_norm_op.implementations["triton"]


def _call(rows=16, features=128):
    x = random_array(jax.random.PRNGKey(0), (rows, features))
    return layer_norm_op.check(x, random_array(jax.random.PRNGKey(1), (features,)))


@pytest.mark.parametrize("depth", [10_000, 200_000])
@pytest.mark.parametrize("where", ["top", "entry"])
def test_deep_nesting_is_one_warning_and_ignored(tmp_path, depth, where):
    path = tmp_path / f"{keys.device_slug()}.json"
    deep = "[" * depth + "]" * depth
    if where == "top":
        path.write_text(deep)
    else:
        path.write_text('{"format": "stellax-autotune-cache", "format_version": 1, "entries": {"x": '
                        + deep + "}}")
    c = cache_lib.ConfigCache(path)
    with pytest.warns(cache_lib.CacheWarning) as record:
        assert c.entries() == {}
    assert len([w for w in record if issubclass(w.category, cache_lib.CacheWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.entries() == {}  # warned once only
    c.put(cache_lib.Entry("layer_norm", "triton", _call().signature(), NormConfig().to_dict(), 1.0,
                          **cache_lib.versions()))
    assert len(cache_lib.ConfigCache(path)) == 1  # the next write replaces the file


def test_deeply_nested_user_cache_does_not_break_op_calls(tmp_path):
    code = (
        "import warnings, jax.numpy as jnp\n"
        "import stellax\n"
        "from stellax.autotune import cache as c\n"
        "p = c.user_cache().path\n"
        "p.parent.mkdir(parents=True, exist_ok=True)\n"
        "p.write_text('[' * 500000 + ']' * 500000)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    with stellax.interpret_mode():\n"
        "        y = stellax.rms_norm(jnp.ones((4, 32)), implementation='triton')\n"
        "    assert c.user_cache().entries() == {}\n"
        "print('ok', round(float(y.sum()), 3), sum(issubclass(x.category, c.CacheWarning) for x in w))\n")
    env = {**os.environ, "STELLAX_CACHE_DIR": str(tmp_path / "stellax")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ok 128.0 1" in done.stdout, done.stdout + done.stderr[-2000:]


def test_entry_with_unknown_field_same_versions_warns_and_uses_the_heuristic():
    call = _call()
    bad = cache_lib.Entry("layer_norm", "triton", call.signature(),
                          {"block_rows": 4, "num_warps": 4, "num_stages": 1, "no_such_field": 1}, 1.0,
                          **cache_lib.versions())
    assert bad.same_versions()
    cache_lib.reset_warnings()
    cache_lib.user_cache().put(bad)
    with pytest.warns(cache_lib.CacheWarning, match="no_such_field"):
        assert resolve_config("layer_norm", IMPL, call) == (IMPL.heuristic(call), "heuristic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_config("layer_norm", IMPL, call) == (IMPL.heuristic(call), "heuristic")


def test_stale_temp_files_of_dead_writers_are_removed_on_the_next_write(tmp_path):
    path = tmp_path / "dev.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".dev.json.{dead}-abc123.tmp"      # a writer killed mid-write, fresh mtime
    alive = tmp_path / f".dev.json.{os.getppid()}-def456.tmp"  # a live process: kept
    legacy = tmp_path / ".dev.json.xyz.tmp"                 # no pid, fresh: kept (age decides)
    for f in (stale, alive, legacy):
        f.write_text("{partial")
    c = cache_lib.ConfigCache(path)
    c.put(cache_lib.Entry("layer_norm", "triton", _call().signature(), NormConfig().to_dict(), 1.0,
                          **cache_lib.versions()))
    assert not stale.exists()
    assert alive.exists() and legacy.exists()
    os.utime(legacy, (0, 0))  # an hour old and more: removed by the next write
    c.put(cache_lib.Entry("layer_norm", "triton", _call(rows=8).signature(), NormConfig().to_dict(), 1.0,
                          **cache_lib.versions()))
    assert not legacy.exists() and alive.exists()
    assert len(list(tmp_path.glob("*.tmp"))) == 1
