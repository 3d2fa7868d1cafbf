import pytest


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Every test gets its own user cache directory and fresh warning state."""
    from stellax.autotune import cache, sources

    monkeypatch.setenv("STELLAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("STELLAX_AUTOTUNE_POLICY", raising=False)
    cache.reset_warnings()
    sources.reset_miss_warnings()
    sources.set_policy(None)
    yield tmp_path / "cache"
    sources.set_policy(None)
