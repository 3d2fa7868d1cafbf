"""`corner_configs`: which configs of a space the default numerics tier runs."""

import dataclasses

from stellax.core import product_space
from stellax.core.config import KernelConfig
from stellax.testing.registry import corner_configs


@dataclasses.dataclass(frozen=True)
class Tiles(KernelConfig):
    block_q: int = 16
    block_k: int = 16
    stages: int = 1


def test_each_varying_field_at_both_ends():
    space = product_space(Tiles, block_q=(16, 32, 64), block_k=(16, 32, 64), stages=(1,))
    picked = [space[i] for i in corner_configs(space)]
    assert Tiles(16, 16, 1) in picked and Tiles(64, 16, 1) in picked and Tiles(16, 64, 1) in picked
    assert len(picked) == 3 and Tiles(32, 32, 1) not in picked  # interior configs left to the slow tier


def test_a_space_with_one_config_or_no_dataclass():
    assert corner_configs([Tiles()]) == [0]
    assert corner_configs([1, 2, 3]) == [0, 1, 2]
    assert corner_configs([]) == []
