"""The persistent cache: keys, atomic writes, concurrent writers, bad files."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import jax
import pytest

import stellax
from stellax.autotune import cache as cache_lib
from stellax.autotune import keys
from stellax.ops.norm import layer_norm_op
from stellax.testing import random_array

SRC = str(Path(stellax.__file__).resolve().parents[1])


def _call(shape=(8, 64), **kwargs):
    x = random_array(jax.random.PRNGKey(0), shape)
    scale = random_array(jax.random.PRNGKey(1), (shape[kwargs.get("axis", -1)],))
    return layer_norm_op.check(x, scale, **kwargs)


def _entry(i: int, op="layer_norm", impl="triton", **config):
    return cache_lib.Entry(op=op, implementation=impl,
                           signature=((("x", ((i, 64), "float32")),), (("epsilon", 1e-6),)),
                           config=config or {"block_rows": 1 << (i % 5), "num_warps": 4, "num_stages": 1},
                           time_ms=float(i), **cache_lib.versions())


def test_key_round_trip():
    for call in (_call(), _call((3, 5, 17), axis=1, epsilon=1e-5, subtract_mean=False),
                 layer_norm_op.check(_call().x, None, None, residual=_call().x)):
        key = keys.call_key("layer_norm", "triton", call)
        text = keys.key_to_string(key)
        assert keys.key_from_string(text) == key
        assert keys.key_to_string(keys.key_from_string(text)) == text
        # The key is the abstract signature: same shapes/options -> same key, other options -> other key.
        assert keys.call_key("layer_norm", "triton", call.abstract()) == key
    assert keys.call_key("layer_norm", "triton", _call(epsilon=1e-5)) != keys.call_key("layer_norm", "triton", _call())
    assert keys.call_key("layer_norm", "xla", _call()) != keys.call_key("layer_norm", "triton", _call())


def test_entry_round_trip_through_a_file(tmp_path):
    call = _call((4, 1000))
    entry = cache_lib.Entry("layer_norm", "triton", call.signature(), {"block_rows": 2, "num_warps": 8,
                                                                      "num_stages": 1}, 0.5, 0.7,
                            **cache_lib.versions())
    c = cache_lib.ConfigCache(tmp_path / "dev.json")
    c.put(entry)
    again = cache_lib.ConfigCache(tmp_path / "dev.json")
    got = again.get(keys.call_key("layer_norm", "triton", call))
    assert got is not None and got.config == entry.config and got.time_ms == 0.5
    assert got.signature == call.signature()
    data = json.loads((tmp_path / "dev.json").read_text())  # plain JSON, no pickle
    assert data["format"] == cache_lib.FORMAT and len(data["entries"]) == 1


def test_device_slug():
    assert keys.slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert keys.device_slug(stellax.current_platform(), interpret=True).endswith("-interpret")
    with stellax.interpret_mode():
        assert keys.device_slug() == "cpu-interpret"
    assert keys.device_slug() == "cpu"


_WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {src!r})
    from stellax.autotune import cache as c
    path, start, count, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    cache = c.ConfigCache(path)
    pad = "x" * 2000
    for i in range(start, start + count):
        entry = c.Entry("layer_norm", "triton", ((("x", ((i, 64), "float32")),), ()),
                        {{"block_rows": 1, "num_warps": 4, "num_stages": 1, "note": pad}}, float(i), **c.versions())
        cache.put(entry)
        if pause:
            time.sleep(pause)
    print("done", flush=True)
""")


def _writer(tmp_path, path, start, count, pause=0.0):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(src=SRC))
    return subprocess.Popen([sys.executable, str(script), str(path), str(start), str(count), str(pause)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_writer_killed_mid_write_leaves_a_readable_cache(tmp_path):
    path = tmp_path / "killed.json"
    seen = 0
    for round_, delay in enumerate((0.3, 0.77)):  # kill a busy writer at two arbitrary moments
        proc = _writer(tmp_path, path, 100000 * round_, 100000)
        deadline = time.time() + 90
        while time.time() < deadline and proc.poll() is None:
            if path.exists() and len(cache_lib.ConfigCache(path).entries()) > seen + 3:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a torn file would warn
            entries = cache_lib.ConfigCache(path).entries()
        json.loads(path.read_text())  # complete JSON
        assert len(entries) > seen
        seen = len(entries)
    # The next writer goes on from there (the killed process's lock died with it).
    cache_lib.ConfigCache(path).put(_entry(999999))
    assert len(cache_lib.ConfigCache(path).entries()) == seen + 1


def test_two_processes_writing_one_cache_keep_all_entries(tmp_path):
    path = tmp_path / "shared.json"
    a = _writer(tmp_path, path, 0, 25)
    b = _writer(tmp_path, path, 1000, 25)
    for p in (a, b):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    entries = cache_lib.ConfigCache(path).entries()
    sizes = sorted(e.signature[0][0][1][0][0] for e in entries.values())
    assert sizes == list(range(25)) + list(range(1000, 1025))


def test_corrupted_file_warns_once_and_is_ignored(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "stellax-autotune-cache", "format_version": 1, "entries": {"a": ')
    c = cache_lib.ConfigCache(path)
    with pytest.warns(cache_lib.CacheWarning, match="unusable"):
        assert c.get(keys.make_key("layer_norm", "triton", ((), ()))) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(c) == 0  # no second warning for the same file
    c.put(_entry(1))  # the corrupted file is replaced (same file state: still one warning), a copy kept
    assert len(cache_lib.ConfigCache(path)) == 1
    assert (tmp_path / "bad.json.corrupt").exists()


@pytest.mark.parametrize("content", [
    '{"format": "stellax-autotune-cache", "format_version": 99, "entries": {}}',
    '{"format": "something-else", "entries": {}}',
    '[1, 2, 3]',
    '\x00\x01 not json',
])
def test_foreign_files_are_ignored_with_one_warning(tmp_path, content):
    path = tmp_path / "foreign.json"
    path.write_text(content)
    c = cache_lib.ConfigCache(path)
    with pytest.warns(cache_lib.CacheWarning):
        assert c.entries() == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.entries() == {}


def test_malformed_entries_are_skipped(tmp_path):
    path = tmp_path / "partly.json"
    good = _entry(3)
    text = cache_lib.dump_cache_text({good.key_string: good})
    data = json.loads(text)
    data["entries"]["junk"] = {"op": "layer_norm"}
    path.write_text(json.dumps(data))
    with pytest.warns(cache_lib.CacheWarning, match="malformed"):
        entries = cache_lib.ConfigCache(path).entries()
    assert list(entries) == [good.key_string]


def test_shipped_cache_files_are_valid():
    """Every cache file shipped in the package parses and names tunable
    implementations with valid configs (a guard for committed GPU results)."""
    from stellax.core.op import registered_ops

    files = sorted(cache_lib.shipped_dir().glob("*.json"))
    for path in files:
        entries, header, problems = cache_lib.parse_cache_text(path.read_text(), str(path))
        assert not problems, (path, problems)
        assert header["device"] == path.stem
        for entry in entries.values():
            impl = registered_ops()[entry.op].implementations[entry.implementation]
            assert impl.config_type is not None
            impl.config_type.from_dict(entry.config)
