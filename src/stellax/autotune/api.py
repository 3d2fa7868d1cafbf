"""`autotune(fn, *args)`: find every stellax op inside ``fn`` and tune it."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax

from ..core.call import Call
from ..core.op import registered_ops
from ..core.platform import current_platform
from ..core.selection import observe_calls, use_configs
from ..bench import inputs as inputs_lib
from . import cache as cache_lib
from . import keys as keys_lib
from . import sources
from .search import TuneError, TuneResult, tune_call

RESULT_FORMAT = "stellax-autotune-result"


@dataclasses.dataclass
class ObservedCall:
    """One distinct (op, implementation, abstract call) found in a function."""

    op: Any
    implementation: str
    call: Call
    concrete: dict

    @property
    def key(self) -> keys_lib.Key:
        return keys_lib.call_key(self.op.name, self.implementation, self.call)


def find_calls(fn: Callable[..., Any], *args, implementations: Sequence[str] | None = None,
               **kwargs) -> list[ObservedCall]:
    """Every distinct stellax op call made when ``fn(*args, **kwargs)`` is
    traced (including backward ops under ``jax.grad``), as the implementation
    dispatch picked plus any of ``implementations`` the op has and supports.

    Array arguments are traced abstractly; other arguments are static. JAX's
    trace caches are cleared first so functions jitted earlier are re-traced.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dyn_idx = [i for i, leaf in enumerate(leaves) if inputs_lib.is_array(leaf)]
    concrete_by_id: dict[int, Any] = {}
    found: dict[str, ObservedCall] = {}

    def wrapper(dyn):
        full = list(leaves)
        for i, tracer in zip(dyn_idx, dyn):
            full[i] = tracer
            concrete_by_id[id(tracer)] = leaves[i]
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return fn(*a, **k)

    def observer(op, implementation, call, config):
        concrete = {name: concrete_by_id[id(v)] for name, v in call.arrays.items()
                    if v is not None and id(v) in concrete_by_id and not inputs_lib.is_float(v)
                    and not isinstance(concrete_by_id[id(v)], jax.ShapeDtypeStruct)}
        names = [implementation.name] + [n for n in (implementations or ()) if n != implementation.name]
        abstract = call.abstract()
        for name in names:
            impl = op.implementations.get(name)
            if impl is None or impl.config_type is None:
                continue
            if name != implementation.name and not impl.supported(abstract):
                continue
            item = ObservedCall(op, name, abstract, concrete)
            found.setdefault(keys_lib.key_to_string(item.key), item)

    jax.clear_caches()
    token = sources.DISCOVERING.set(True)
    try:
        with observe_calls(observer):
            jax.make_jaxpr(wrapper)([leaves[i] for i in dyn_idx])
    finally:
        sources.DISCOVERING.reset(token)
    return list(found.values())


@dataclasses.dataclass
class ResultEntry:
    """A config of an autotuning result and where it came from
    (``tuned``, ``user-cache``, ``shipped-cache`` or ``loaded``)."""

    entry: cache_lib.Entry
    source: str
    tune: TuneResult | None = None

    def to_json(self) -> dict:
        out = self.entry.to_json()
        out["source"] = self.source
        if self.tune is not None:
            out["search"] = [c.to_json() for c in self.tune.candidates]
            out["elapsed_s"] = self.tune.elapsed_s
        return out


class AutotuneResult:
    """Configs for the ops of a function. Use it as a context manager
    (``with result: ...`` makes those ops use these configs), save it with
    `save`/`to_json` and read it back with `load`/`from_json`."""

    def __init__(self, entries: Iterable[ResultEntry] = (), *, device: str = "", device_kind: str = "",
                 failures: Sequence[dict] = ()):
        self.entries: list[ResultEntry] = list(entries)
        self.device = device
        self.device_kind = device_kind
        self.failures = list(failures)
        self._table = {e.entry.key_string: e.entry.config for e in self.entries}
        self._contexts: list = []

    # -- lookups ---------------------------------------------------------------
    def lookup(self, op_name: str, implementation: str, call: Call) -> dict | None:
        """The config for a call, or ``None`` (a `use_configs` lookup)."""
        return self._table.get(keys_lib.key_to_string(keys_lib.call_key(op_name, implementation, call)))

    def config_for(self, op_name: str, implementation: str, call: Call):
        """The config object (of the implementation's config type) or ``None``."""
        found = self.lookup(op_name, implementation, call)
        if found is None:
            return None
        return registered_ops()[op_name].implementations[implementation].config_type.from_dict(found)

    def __enter__(self) -> "AutotuneResult":
        context = use_configs(self.lookup)
        context.__enter__()
        self._contexts.append(context)
        return self

    def __exit__(self, *exc) -> None:
        self._contexts.pop().__exit__(*exc)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return iter(self.entries)

    def __repr__(self) -> str:
        tuned = sum(1 for e in self.entries if e.source == "tuned")
        return (f"AutotuneResult({len(self.entries)} configs on {self.device_kind or self.device}: "
                f"{tuned} tuned, {len(self.entries) - tuned} cached, {len(self.failures)} failed)")

    @property
    def tuned(self) -> list[ResultEntry]:
        return [e for e in self.entries if e.source == "tuned"]

    def summary(self) -> str:
        """A plain-text table of the configs."""
        lines = [repr(self)]
        for e in self.entries:
            entry = e.entry
            speed = ""
            if entry.time_ms and entry.default_time_ms:
                speed = f" {entry.time_ms:.4g} ms ({entry.default_time_ms / entry.time_ms:.2f}x vs heuristic)"
            lines.append(f"  {entry.op}/{entry.implementation} {keys_lib.describe_signature(entry.signature)}: "
                         f"{entry.config} [{e.source}]{speed}")
        for f in self.failures:
            lines.append(f"  FAILED {f['op']}/{f['implementation']} {f['call']}: {f['error']}")
        return "\n".join(lines)

    # -- serialization ---------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": RESULT_FORMAT, "format_version": 1, "device": self.device,
                "device_kind": self.device_kind, **cache_lib.versions(),
                "entries": [e.to_json() for e in self.entries], "failures": list(self.failures)}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "AutotuneResult":
        if data.get("format") != RESULT_FORMAT:
            raise ValueError(f"not a stellax autotuning result (format {data.get('format')!r})")
        entries = [ResultEntry(cache_lib.Entry.from_json(e), e.get("source", "loaded")) for e in data["entries"]]
        return cls(entries, device=data.get("device", ""), device_kind=data.get("device_kind", ""),
                   failures=data.get("failures", []))

    def save(self, path: str | os.PathLike) -> None:
        cache_lib.atomic_write_text(Path(path), self.dumps() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "AutotuneResult":
        return cls.from_json(json.loads(Path(path).read_text()))

    def write_cache(self, cache: cache_lib.ConfigCache | None = None) -> int:
        """Store every config in ``cache`` (default: the user cache of the
        device it was tuned on)."""
        cache = cache or cache_lib.user_cache(self.device, self.device_kind)
        cache.put([e.entry for e in self.entries])
        return len(self.entries)


def autotune(fn: Callable[..., Any], *args, implementations: Sequence[str] | None = None,
             max_configs: int | None = None, timer: str = "auto", force: bool = False,
             cache: bool | cache_lib.ConfigCache = True, use_shipped: bool = True,
             progress: Callable[[str, int, int], None] | bool | None = None, input_sets: int = 2,
             deadline: float | None = None, **kwargs) -> AutotuneResult:
    """Tune every stellax op called inside ``fn(*args, **kwargs)``.

    The ops are found by tracing ``fn`` (under ``jax.grad`` too: backward ops
    are ops and are tuned as well). Calls whose config is already cached
    (user cache, then shipped cache) are not re-tuned unless ``force``; the
    others are tuned (`search.tune_call`) and written to the user cache.

    Args:
      fn, args, kwargs: the function and example arguments (arrays give the
        shapes and dtypes; their float values are not used).
      implementations: also tune these implementations for every op call
        that has them (default: only what dispatch picks for each call).
      max_configs: cap on configs tried per call (evenly thinned space).
      timer: the timer (see `stellax.bench.timing`).
      force: tune even when a cached config exists.
      cache: ``True`` (the user cache), ``False`` (write nothing), or a
        `ConfigCache` to read from and write to.
      use_shipped: consult the shipped cache for already-tuned calls.
      progress: ``True`` for a console progress line, or
        ``callback(stage, done, total)``.
      deadline: a ``time.monotonic()`` time after which no further call is
        tuned (those left are reported as failures with the reason).

    Returns:
      an `AutotuneResult` (``with result: ...`` applies its configs).
    """
    calls = find_calls(fn, *args, implementations=implementations, **kwargs)
    return tune_calls(calls, max_configs=max_configs, timer=timer, force=force, cache=cache,
                      use_shipped=use_shipped, progress=progress, input_sets=input_sets, deadline=deadline)


def tune_calls(calls: Sequence[ObservedCall], *, max_configs: int | None = None, timer: str = "auto",
               force: bool = False, cache: bool | cache_lib.ConfigCache = True, use_shipped: bool = True,
               progress: Callable[[str, int, int], None] | bool | None = None, input_sets: int = 2,
               deadline: float | None = None) -> AutotuneResult:
    """Tune already found calls (`find_calls`, or calls recovered from a program's HLO or a trace:
    `stellax.autotune.programs`), in order; the arguments are those of `autotune`."""
    platform = current_platform()
    device = keys_lib.device_slug(platform)
    write_cache, read_caches = _caches(cache, use_shipped, device, platform)
    report = progress_printer() if progress is True else (progress or None)

    entries: list[ResultEntry] = []
    failures: list[dict] = []
    for n, item in enumerate(calls):
        hit = None if force else _cached_entry(item, read_caches)
        if hit is not None:
            entries.append(hit)
            if report:
                report(f"{item.op.name}/{item.implementation} cached", n + 1, len(calls))
            continue
        if deadline is not None and time.monotonic() > deadline:
            failures.append(_failure(item, "skipped: deadline reached"))
            continue
        label = f"[{n + 1}/{len(calls)}] {item.op.name}/{item.implementation} {item.call.describe()}"

        def step(stage, done, total, _label=label):
            if report:
                report(f"{_label}: {stage}", done, total)

        try:
            result = tune_call(item.op, item.implementation, item.call, max_configs=max_configs, timer=timer,
                               concrete=item.concrete, progress=step, input_sets=input_sets,
                               deadline=deadline)
        except (TuneError, Exception) as e:  # noqa: BLE001 - keep tuning the others
            failures.append(_failure(item, f"{type(e).__name__}: {e}"[:500]))
            continue
        entry = result.entry()
        if write_cache is not None:
            write_cache.put(entry)
        entries.append(ResultEntry(entry, "tuned", result))
    if report and hasattr(report, "close"):
        report.close()
    # Traces made before now chose configs without these results.
    jax.clear_caches()
    return AutotuneResult(entries, device=device, device_kind=platform.device_kind, failures=failures)


def _caches(cache, use_shipped: bool, device: str, platform):
    """``(the cache tuned results go to or None, the caches consulted in order)``."""
    if isinstance(cache, cache_lib.ConfigCache):
        write_cache, read_caches = cache, [cache]
    elif cache:
        write_cache = cache_lib.user_cache(device, platform.device_kind)
        read_caches = [write_cache]
    else:
        write_cache, read_caches = None, []
    if use_shipped:
        read_caches = read_caches + [cache_lib.shipped_cache(device)]
    return write_cache, read_caches


def _cached_entry(item, read_caches) -> ResultEntry | None:
    """The first cache's trusted entry for ``item``'s call, or ``None``."""
    for c in read_caches:
        if sources.trusted_config(c.get(item.key), item.call, c) is not None:
            return ResultEntry(c.get(item.key), c.label)
    return None


def _failure(item, error: str) -> dict:
    return {"op": item.op.name, "implementation": item.implementation, "call": item.call.describe(),
            "error": error}


class progress_printer:
    """A one-line console progress display (rich when on a terminal)."""

    def __init__(self):
        self._tty = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if not self._tty and done < total and now - self._last < 2.0:
            return
        self._last = now
        width = 24
        filled = int(width * done / max(total, 1))
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {stage}"
        if self._tty:
            sys.stderr.write("\r\033[K" + line[:160])
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self._tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
