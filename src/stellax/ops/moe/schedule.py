"""Group bounds and the group-aware tile schedule, computed on device.

Rows of ``lhs`` are sorted by group. ``group_sizes [G]`` are clamped the way
every stellax grouped matmul reads them (the documented behaviour under
``jit``, where sizes cannot be checked):

    sizes  = max(group_sizes, 0)
    ends   = min(cumsum(sizes), M)          # a group running past M is cut
    starts = ends - sizes (clamped at 0)    # i.e. the previous end

A shard that holds groups ``[offset, offset + L)`` (expert parallelism) only
computes the rows of those groups; rows outside ``[begin, end)`` — the rows
of other groups and the rows past ``sum(group_sizes)`` — are zero in the
output. A traced offset outside ``[0, len(group_sizes) - L]`` names no groups:
the ops return NaN everywhere (`poison_bad_offset`), never a plausible zero.

The tile schedule splits every local group into tiles of ``block_m`` rows
that *start at the group's first row*: a tile never holds rows of two groups
(the last tile of a group is partial and masked), and an empty group has no
tile at all. With ``fill=True`` two pseudo-groups cover the rows before
``begin`` and after ``end`` with zero-fill tiles (group id ``-1``), so every
output row is written by exactly one tile. The number of tiles is at most

    T_max = ceil(M / block_m) + (number of groups incl. pseudo-groups) - 1

(each group wastes less than one tile), the static grid size; tiles past the
real count have ``rows == 0`` and do nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ...core.checks import concrete_values


@dataclasses.dataclass(frozen=True)
class GroupBounds:
    """Row ranges of the local groups (int32 arrays on device)."""

    starts: jax.Array  # [L] first row of each local group
    sizes: jax.Array   # [L] rows of each local group (clamped)
    begin: jax.Array   # [] first row of the local groups
    end: jax.Array     # [] one past the last row of the local groups


def group_bounds(group_sizes, group_offset, num_local: int, m: int) -> GroupBounds:
    """Clamped row ranges of groups ``[offset, offset + num_local)``.

    Traced values are made safe, not trusted: sizes are clamped into ``[0,
    m]`` and summed with a saturating add (in uint32: the running sum of
    sizes near 2³¹ would wrap around in int32), so every group ends at or
    before row ``m``; an offset outside ``[0, len(group_sizes) - num_local]``
    selects no group here (every row zero), it is not clamped onto other
    groups; the ops then poison their whole result with NaN (`poison_bad_offset`)."""
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m).astype(jnp.uint32)
    cap = jnp.uint32(m)
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, cap), sizes).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    offset = jnp.zeros((), jnp.int32) if group_offset is None else group_offset.astype(jnp.int32)
    in_range = (offset >= 0) & (offset <= group_sizes.shape[0] - num_local)
    local_starts = jnp.where(in_range, jax.lax.dynamic_slice_in_dim(starts, offset, num_local), 0)
    local_ends = jnp.where(in_range, jax.lax.dynamic_slice_in_dim(ends, offset, num_local), 0)
    return GroupBounds(local_starts, local_ends - local_starts, local_starts[0], local_ends[-1])


def offset_in_range(group_sizes, group_offset, num_local: int):
    """Whether ``group_offset`` selects ``num_local`` groups of ``group_sizes``: ``0 <= offset <=
    len(group_sizes) - num_local`` (a traced bool scalar)."""
    offset = group_offset.astype(jnp.int32)
    return (offset >= 0) & (offset <= group_sizes.shape[0] - num_local)


def poison_bad_offset(out, group_sizes, group_offset, num_local: int):
    """``out`` with every element NaN when a *traced* ``group_offset`` is outside ``[0,
    len(group_sizes) - num_local]`` (it names no groups: no row of the result is defined). Nothing
    is added when there is no offset or it is concrete (checked on the host, `checks.check_group_values`)."""
    if group_offset is None or concrete_values(group_offset) is not None:
        return out
    ok = offset_in_range(group_sizes, group_offset, num_local)
    return jnp.where(ok, out, jnp.array(jnp.nan, out.dtype))


@dataclasses.dataclass(frozen=True)
class TileSchedule:
    """One entry per tile (int32 arrays ``[T_max]``) and the real tile count."""

    group: jax.Array  # local group of the tile; -1 for a zero-fill tile
    start: jax.Array  # first row of the tile
    rows: jax.Array   # valid rows (≤ block_m); 0 for tiles past the count
    count: jax.Array  # [] number of real tiles

    @property
    def max_tiles(self) -> int:
        """The tile bound ``⌈m / block_m⌉ + num_groups - 1`` (each group adds at most one partial tile)."""
        return int(self.group.shape[0])


def max_tiles(m: int, num_groups: int, block_m: int) -> int:
    """The tile bound ``⌈m / block_m⌉ + num_groups - 1`` (each group adds at most one partial tile)."""
    return max(1, -(-m // block_m) + num_groups - 1)


def tile_schedule(bounds: GroupBounds, m: int, block_m: int, *, fill: bool) -> TileSchedule:
    """Tiles of ``block_m`` rows for every local group (see the module doc)."""
    sizes, starts = bounds.sizes, bounds.starts
    groups = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    if fill:
        zero = jnp.zeros((1,), jnp.int32)
        sizes = jnp.concatenate([bounds.begin[None], sizes, (m - bounds.end)[None]])
        starts = jnp.concatenate([zero, starts, bounds.end[None]])
        groups = jnp.concatenate([zero - 1, groups, zero - 1])
    n_groups = int(sizes.shape[0])
    t_max = max_tiles(m, n_groups, block_m)
    tiles = (sizes + block_m - 1) // block_m
    last = jnp.cumsum(tiles)                       # one past the last tile of each group
    t = jnp.arange(t_max, dtype=jnp.int32)
    owner = jnp.sum(last[None, :] <= t[:, None], axis=1).astype(jnp.int32)
    valid = owner < n_groups
    owner = jnp.minimum(owner, n_groups - 1)
    index_in_group = t - (last[owner] - tiles[owner])
    start = starts[owner] + index_in_group * block_m
    rows = jnp.where(valid, jnp.minimum(block_m, starts[owner] + sizes[owner] - start), 0)
    return TileSchedule(groups[owner], jnp.where(valid, start, 0), rows.astype(jnp.int32), last[-1])
