"""Verification cases generated from the op registry: every registered op ×
every kernel implementation × its examples and its whole config space.

`tests/test_registry_tiers.py` parametrizes its tiers with these cases (at
collection time); the GPU suite and the lab can walk the same list.

* `kernel_implementations`: the (op, implementation) pairs whose backend is a
  Pallas kernel backend (triton, mosaic_gpu, mosaic_tpu).
* `example_cases`: one case per example the implementation supports, with
  its heuristic config (``config=None``: dispatch resolves it).
* `config_cases`: one case per config of the autotuning space, on the space's
  example: the op's first example for which the implementation has a
  non-empty space (every example with ``every_example``; only the space's
  `corner_configs` with ``corners``). An implementation without configs gets
  one case with ``config=None``.

Cases carry abstract examples (`abstract_examples_of`: collecting every
op's cases compiles no random-number program); a numerics check builds its
example's arrays (`KernelCase.concrete_example`). Examples are float32 unless
told otherwise; which examples and
configs exist is decided where they run: in interpret mode for tier 1
(``platform=None``), as on the lowering target for tier 2/3
(``platform="cuda"`` or ``"tpu"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from ..core import Example, Op, interpret_mode, lowering_target
from .lowering import DEFAULT_TARGET
from .validation import abstract_examples_of, examples_of

#: Short names for config fields in case ids.
_FIELD_ABBREVIATIONS = {"num_warps": "w", "num_stages": "s"}


@dataclasses.dataclass(frozen=True)
class ImplementationCase:
    """What the verification cases (`KernelCase`, `tpu_compile.CompileCase`)
    start with: the op and one of its implementations. Their ``id`` is
    ``op-implementation-<parts>[-cfgNN(config)]`` (`_id`); a subclass has
    ``config`` and ``config_index`` (its position in the autotuning space,
    ``None`` for the heuristic's choice)."""

    op: Op
    implementation: str

    def _id(self, *parts: str) -> str:
        tail = [] if self.config_index is None else [f"cfg{self.config_index:02d}({config_id(self.config)})"]
        return "-".join([self.op.name, self.implementation, *parts, *tail])


@dataclasses.dataclass(frozen=True)
class KernelCase(ImplementationCase):
    """One (op, implementation, example, config) to verify.

    ``config`` is ``None`` for the heuristic (or an implementation without
    configs); ``config_index`` is its position in the autotuning space."""

    dtype: str
    example_index: int
    example: Example
    config: Any = None
    config_index: int | None = None
    platform: str | None = None

    def concrete_example(self) -> Example:
        """The example with its arrays (built once per op and dtype in a process)."""
        return examples_of(self.op, self.dtype)[self.example_index]

    @property
    def id(self) -> str:
        parts = [self.platform] if self.platform else []
        if self.dtype != "float32":
            parts.append(self.dtype)
        return self._id(*parts, f"ex{self.example_index}")


def config_id(config: Any) -> str:
    """A short readable name for a config: ``w4,s2,bq64,bk32``."""
    if config is None:
        return "default"
    if not dataclasses.is_dataclass(config):
        return repr(config)
    items = []
    for field in dataclasses.fields(config):
        name = _FIELD_ABBREVIATIONS.get(field.name)
        if name is None:
            name = "b" + field.name[len("block_"):] if field.name.startswith("block_") else field.name
        items.append(f"{name}{getattr(config, field.name)}")
    return ",".join(items)


def kernel_implementations(ops: Mapping[str, Op]) -> list[tuple[Op, str]]:
    """(op, implementation name) for every kernel implementation, by op name."""
    return [(op, name) for _, op in sorted(ops.items())
            for name, impl in op.implementations.items() if impl.is_kernel]


@contextlib.contextmanager
def _where(platform: str | None):
    """Interpret mode (``None``) or the default lowering target of ``platform``."""
    if platform is None:
        with interpret_mode(True):
            yield
    else:
        with lowering_target(DEFAULT_TARGET[platform]):
            yield


def _supported_examples(op: Op, implementation: str, dtype, platform: str | None) -> list[tuple[int, Example, Any]]:
    """(index, example, checked call) of the examples the implementation supports there."""
    impl = op.implementations[implementation]
    found = []
    with _where(platform):
        for index, example in enumerate(abstract_examples_of(op, jnp.dtype(dtype).name)):
            call = op.check(*example.args, **example.kwargs)
            if impl.supported(call):
                found.append((index, example, call))
    return found


def example_cases(op: Op, implementation: str, *, dtype=jnp.float32, platform: str | None = None) -> list[KernelCase]:
    """One heuristic-config case per supported example."""
    name = jnp.dtype(dtype).name
    return [KernelCase(op, implementation, name, i, example, platform=platform)
            for i, example, _ in _supported_examples(op, implementation, dtype, platform)]


def corner_configs(space: list) -> list[int]:
    """Indices of the configs at the corners of a space: for every field that
    varies, the first config with its smallest and the first with its largest
    value (block sizes at both ends are where tails, masks and single-block
    grids differ; the configs between them run the same code paths)."""
    if not space or not dataclasses.is_dataclass(space[0]):
        return list(range(len(space)))
    chosen = []
    for field in dataclasses.fields(space[0]):
        values = [getattr(c, field.name) for c in space]
        try:
            low, high = min(values), max(values)
        except TypeError:  # unordered values (None mixed in): every distinct one
            picks = [values.index(v) for v in dict.fromkeys(values)]
        else:
            picks = [values.index(low), values.index(high)] if low != high else []
        chosen += [i for i in picks if i not in chosen]
    return sorted(chosen) or [0]


def config_cases(op: Op, implementation: str, *, dtype=jnp.float32, platform: str | None = None,
                 every_example: bool = False, corners: bool = False) -> list[KernelCase]:
    """One case per config of the autotuning space (see the module docstring);
    with ``corners`` only the `corner_configs` of the space."""
    impl = op.implementations[implementation]
    name = jnp.dtype(dtype).name
    cases, first = [], None
    for i, example, call in _supported_examples(op, implementation, dtype, platform):
        if first is None:
            first = (i, example)
        with _where(platform):
            space = impl.config_space(call)
        keep = set(corner_configs(space)) if corners else set(range(len(space)))
        cases += [KernelCase(op, implementation, name, i, example, config, k, platform)
                  for k, config in enumerate(space) if k in keep]
        if space and not every_example:
            break
    if not cases and first is not None:  # no configs: the implementation's one way to run
        cases.append(KernelCase(op, implementation, name, first[0], first[1], platform=platform))
    return cases
