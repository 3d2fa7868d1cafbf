"""Kernel configuration dataclasses and their validation helpers.

Every kernel implementation declares a frozen dataclass of tuning knobs
(block sizes, warps, stages, ...). Subclass `KernelConfig` and override
`validate`; construction fails with a message naming the field, the expected
and the actual value.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, ClassVar, Iterable, Mapping, TypeVar

C = TypeVar("C", bound="KernelConfig")


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

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming a field when a value is invalid."""

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

    def validate(self) -> None:
        name = type(self).__name__
        require_in(name, "num_warps", self.num_warps, (1, 2, 4, 8, 16))
        require_in(name, "num_stages", self.num_stages, (1, 2, 3, 4, 5))


@dataclasses.dataclass(frozen=True)
class MatmulTileConfig(TritonConfig):
    """A Triton matmul tile: ``block_m × block_n`` of the output, stepping
    ``block_k`` along the contraction (Triton dots need every dimension ≥ 16).
    Subclasses narrow the allowed sizes in ``TILE_SIZES``."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32

    TILE_SIZES: ClassVar[Mapping[str, tuple[int, ...]]] = {
        "block_m": (16, 32, 64, 128, 256), "block_n": (16, 32, 64, 128, 256), "block_k": (16, 32, 64, 128, 256)}

    def validate(self) -> None:
        super().validate()
        for field, allowed in self.TILE_SIZES.items():
            require_in(type(self).__name__, field, getattr(self, field), allowed)


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
