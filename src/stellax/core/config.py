"""Kernel configuration dataclasses and their validation helpers.

Every kernel implementation declares a frozen dataclass of tuning knobs
(block sizes, warps, stages, ...). Subclass `KernelConfig`, name the allowed
values of its fields in ``CHOICES`` and override `validate` (calling
``super().validate()``) for what a table of values cannot say; construction
fails with a message naming the field, the expected and the actual value.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar, Iterable, Mapping, TypeVar

C = TypeVar("C", bound="KernelConfig")

#: The smallest size of a Triton dot's dimensions (rows, columns, contraction): 16.
TRITON_DOT_MIN = 16
#: The tile sizes a Triton dot takes along each dimension.
TRITON_TILES = (16, 32, 64, 128, 256)


def is_power_of_two(value: int) -> bool:
    return isinstance(value, int) and value > 0 and (value & (value - 1)) == 0


def next_power_of_two(value: int) -> int:
    """Smallest power of two ≥ ``value`` (1 for ``value`` ≤ 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


def require_power_of_two(owner: str, field: str, value: Any) -> None:
    if not is_power_of_two(value):
        raise ValueError(f"{owner}.{field}: expected a positive power of two, got {value!r}")


def require_in(owner: str, field: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}.{field}: expected one of {allowed}, got {value!r}")


def require_positive(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{owner}.{field}: expected a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Base class of frozen, validated kernel configs."""

    #: ``{field: allowed values}``, checked by `validate`. A subclass's ``CHOICES`` add to those
    #: of the classes it derives from; where both name a field, the subclass's values hold.
    CHOICES: ClassVar[Mapping[str, tuple[Any, ...]]] = {}

    def __post_init__(self):
        self.validate()

    @classmethod
    def choices(cls) -> dict[str, tuple[Any, ...]]:
        """The ``CHOICES`` of this class and the classes it derives from, merged (base first)."""
        merged: dict[str, tuple[Any, ...]] = {}
        for klass in reversed(cls.__mro__):
            merged.update(vars(klass).get("CHOICES", {}))
        return merged

    def validate(self) -> None:
        """Raise ValueError naming a field when a value is invalid: here, a field outside its
        `choices`; a subclass checks more after ``super().validate()``."""
        for field, allowed in self.choices().items():
            require_in(type(self).__name__, field, getattr(self, field), allowed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}; expected {sorted(names)}")
        return cls(**data)

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class TritonConfig(KernelConfig):
    """Common knobs of a Pallas Triton kernel."""

    num_warps: int = 4
    num_stages: int = 2

    CHOICES: ClassVar[Mapping[str, tuple[Any, ...]]] = {"num_warps": (1, 2, 4, 8, 16), "num_stages": (1, 2, 3, 4, 5)}


@dataclasses.dataclass(frozen=True)
class MatmulTileConfig(TritonConfig):
    """A Triton matmul tile: ``block_m × block_n`` of the output, stepping
    ``block_k`` along the contraction (Triton dots need every dimension ≥ 16).
    Subclasses narrow the allowed sizes in their ``CHOICES``."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32

    CHOICES: ClassVar[Mapping[str, tuple[Any, ...]]] = dict.fromkeys(("block_m", "block_n", "block_k"), TRITON_TILES)


def product_space(config_type: type[C], **choices: Iterable[Any]) -> list[C]:
    """All configs from the Cartesian product of ``choices``; invalid
    combinations (those that fail validation) are dropped."""
    names = list(choices)
    out = []
    for values in itertools.product(*(tuple(choices[n]) for n in names)):
        try:
            out.append(config_type(**dict(zip(names, values))))
        except ValueError:
            continue
    return out
