"""Expert parallelism: `moe_mlp` with the experts sharded over a mesh axis.

Inside ``jax.shard_map`` over axis ``ax`` of size P, device ``d`` holds experts
``[d·E_l, (d+1)·E_l)`` (``E = P·E_l``) and a shard of the tokens.

``dispatch="all_to_all"`` (default; tokens stay sharded):

1. route and `permute` the local tokens by *global* expert id;
2. all-gather the per-expert counts ``counts[s, e]`` (P×E integers), so every
   device knows the whole exchange; with a capacity, copies of expert e are
   kept in global token order (source device, then local order) — the same
   copies the single-device `moe_mlp` keeps;
3. send the copies of expert e to its owner with one slice per (destination,
   local expert): the owner receives them *already sorted by local expert*
   (expert-major, source-minor), no local re-sort;
4. the two grouped matmuls on the local experts;
5. the reverse exchange puts every result back at its copy's sorted
   position; `unpermute` combines.

The exchange is ``jax.lax.ragged_all_to_all`` (``collective="ragged"``, the
default on GPU/TPU). XLA:CPU in jax 0.10.2 does not implement the
ragged-all-to-all HLO ("UNIMPLEMENTED ... not supported by XLA:CPU"), so on
the CPU (``collective="padded"``, the default there) the same exchange is an
``all_to_all`` of fixed-size buffers: each device packs its slices per
destination into ``[P, C, D]`` (C = the most rows it can send to one device),
and the receiver scatters them to the offsets ``ragged_all_to_all`` would
use. The receive buffer holds ``P·T_l·k`` rows dropless (every copy could go
to one expert) or ``E_l·capacity`` rows with a capacity factor.

``dispatch="all_gather"`` (tokens replicated, good for few tokens): all-gather
the tokens, route and permute all of them on every device, run the grouped
matmuls with ``group_offset = d·E_l`` (rows of other experts give zeros and
cost nothing), combine, and ``psum_scatter`` the partial sums back to the
token shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ...core import current_platform
from ...core.op import refuse_interpreted_tpu_collectives
from .dispatch import capacity, permute, unpermute
from .mlp import check_moe_mlp, local_experts, route_call_of
from .routing import compute_route

_DISPATCHES = ("all_to_all", "all_gather")
_COLLECTIVES = ("auto", "ragged", "padded")


def _exclusive_cumsum(x, axis):
    return jnp.cumsum(x, axis=axis) - x


def _segments(sizes, length: int):
    """For positions ``0..length-1`` of concatenated segments of ``sizes [..., S]``:
    the segment index (``S`` past the end) and the position inside it."""
    ends = jnp.cumsum(sizes, axis=-1)
    pos = jnp.arange(length, dtype=jnp.int32)
    seg = jnp.sum(ends[..., None, :] <= pos[:, None], axis=-1).astype(jnp.int32)
    clipped = jnp.minimum(seg, sizes.shape[-1] - 1)
    starts = jnp.take_along_axis(ends - sizes, clipped, axis=-1)
    return seg, clipped, pos - starts


def ragged_all_to_all_padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                             axis_name, max_send: int):
    """``jax.lax.ragged_all_to_all`` semantics from a padded ``all_to_all``.

    ``max_send`` bounds the rows one device sends to one destination (the sum
    of its slices for that destination). Differentiable (gather, all_to_all
    and scatter)."""
    p = jax.lax.axis_size(axis_name)
    per_device = input_offsets.shape[0] // p
    # Pack: row c of the buffer for destination d comes from slice seg of d.
    sizes = send_sizes.reshape(p, per_device)
    seg, clipped, inner = _segments(sizes, max_send)                      # [P, C]
    src = jnp.take_along_axis(input_offsets.reshape(p, per_device), clipped, axis=-1) + inner
    valid = seg < per_device
    packed = operand[jnp.clip(src, 0, operand.shape[0] - 1)]
    packed = jnp.where(valid.reshape(valid.shape + (1,) * (operand.ndim - 1)), packed, 0)
    received = jax.lax.all_to_all(packed, axis_name, 0, 0)                 # [P(src), C, ...]
    offsets = jax.lax.all_to_all(output_offsets.reshape(p, per_device), axis_name, 0, 0)
    seg, clipped, inner = _segments(recv_sizes.reshape(p, per_device), max_send)
    dest = jnp.take_along_axis(offsets, clipped, axis=-1) + inner
    dest = jnp.where(seg < per_device, dest, output.shape[0]).reshape(-1)
    return output.at[dest].set(received.reshape((-1,) + operand.shape[1:]), mode="drop")


def _exchange(collective, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
              max_send):
    args = (operand, output, input_offsets.astype(jnp.int32), send_sizes.astype(jnp.int32),
            output_offsets.astype(jnp.int32), recv_sizes.astype(jnp.int32))
    if collective == "ragged":
        return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)
    return ragged_all_to_all_padded(*args, axis_name=axis_name, max_send=max_send)


def moe_mlp_shard(x, router_logits, w_gate_up, w_down, *, axis_name, top_k, scoring="softmax", bias=None,
                  num_groups=None, top_k_groups=None, normalize_weights=True, routed_scaling=1.0,
                  capacity_factor=None, activation="silu", precision=None, dispatch="all_to_all", collective="auto",
                  implementation=None):
    """`moe_mlp` for one shard, called inside ``jax.shard_map`` over ``axis_name``.

    ``x [T_l, D]`` and ``router_logits [T_l, E]`` are this device's tokens;
    ``w_gate_up [E_l, D, 2, F]`` and ``w_down [E_l, F, D]`` its experts
    ``[d·E_l, (d+1)·E_l)``. Returns this device's ``[T_l, D]`` output, equal
    to the single-device `moe_mlp` on the gathered arrays (capacity included).
    See the module doc for ``dispatch`` and ``collective``.
    """
    if dispatch not in _DISPATCHES:
        raise ValueError(f"dispatch: expected one of {list(_DISPATCHES)}, got {dispatch!r}")
    if collective not in _COLLECTIVES:
        raise ValueError(f"collective: expected one of {list(_COLLECTIVES)}, got {collective!r}")
    devices = jax.lax.axis_size(axis_name)
    refuse_interpreted_tpu_collectives("moe_mlp_shard", implementation, devices)
    experts = router_logits.shape[1]
    if experts % devices:
        raise ValueError(f"router_logits: expected a number of experts divisible by the size of axis "
                         f"{axis_name!r} ({devices}), got {experts}")
    local = experts // devices
    call = check_moe_mlp(x, router_logits, w_gate_up, w_down, top_k=top_k, scoring=scoring, bias=bias,
                         num_groups=num_groups, top_k_groups=top_k_groups, normalize_weights=normalize_weights,
                         routed_scaling=routed_scaling, capacity_factor=capacity_factor, activation=activation,
                         precision=precision, num_local_experts=local)
    me = jax.lax.axis_index(axis_name).astype(jnp.int32)
    experts_of = functools.partial(local_experts, w_gate_up=w_gate_up, w_down=w_down, activation=call.activation,
                                   precision=call.precision, implementation=implementation)

    if dispatch == "all_gather":
        gathered = call.replace_arrays(x=jax.lax.all_gather(x, axis_name, tiled=True),
                                       router_logits=jax.lax.all_gather(router_logits, axis_name, tiled=True))
        weights, ids = compute_route(route_call_of(gathered))
        rows, sizes, order = permute(gathered.x, ids, experts, capacity_factor=call.capacity_factor)[:3]
        y = experts_of(rows, sizes, group_offset=me * local)
        partial = unpermute(y.astype(jnp.float32), order, weights)
        return jax.lax.psum_scatter(partial, axis_name, scatter_dimension=0, tiled=True).astype(x.dtype)

    if collective == "auto":
        collective = "padded" if current_platform().backend == "cpu" else "ragged"
    tokens = x.shape[0]
    copies = tokens * top_k
    weights, ids = compute_route(route_call_of(call))
    rows, sizes, order = permute(x, ids, experts)
    counts = jax.lax.all_gather(sizes, axis_name)                        # [P(src), E]
    if call.capacity_factor is None:
        kept, buffer_rows, max_send = counts, devices * copies, copies
    else:
        cap = capacity(tokens * devices, top_k, experts, call.capacity_factor)
        kept = jnp.clip(cap - _exclusive_cumsum(counts, 0), 0, counts)
        buffer_rows, max_send = local * cap, min(copies, local * cap)
    before = _exclusive_cumsum(kept, 0)                                  # kept copies on earlier sources
    totals = jnp.sum(kept, axis=0)                                       # [E] rows each expert receives
    base = _exclusive_cumsum(totals.reshape(devices, local), 1).reshape(experts)  # expert start at its owner

    def mine(a):  # columns of my experts: [..., E] -> [..., E_l]
        return jax.lax.dynamic_slice_in_dim(a, me * local, local, axis=a.ndim - 1)

    # Out: one slice per expert e (destination e // E_l), sorted at the owner by (expert, source).
    buffer = _exchange(collective, rows, jnp.zeros((buffer_rows,) + rows.shape[1:], rows.dtype),
                       _exclusive_cumsum(sizes, 0), kept[me], base + before[me], mine(kept).reshape(-1),
                       axis_name=axis_name, max_send=max_send)
    y = experts_of(buffer, mine(totals))
    # Back: slice (source s, local expert i) returns to s at its sorted offset of that expert.
    back = _exchange(collective, y, jnp.zeros((copies,) + y.shape[1:], y.dtype),
                     (mine(base)[None, :] + mine(before)).reshape(-1), mine(kept).reshape(-1),
                     mine(_exclusive_cumsum(counts, 1)).reshape(-1), kept[me],
                     axis_name=axis_name, max_send=max_send)
    return unpermute(back, order, weights)


def moe_mlp_expert_parallel(x, router_logits, w_gate_up, w_down, *, mesh, axis_name, top_k, bias=None, **kwargs):
    """`moe_mlp` over ``mesh`` with tokens and experts sharded over ``axis_name``.

    ``x [T, D]``, ``router_logits [T, E]``, ``w_gate_up [E, D, 2, F]``,
    ``w_down [E, F, D]`` (global arrays; T and E divisible by the axis size).
    Other keyword arguments as for `moe_mlp_shard`.
    """
    shard = PartitionSpec(axis_name)

    def body(x, logits, w_gate_up, w_down, bias):
        return moe_mlp_shard(x, logits, w_gate_up, w_down, axis_name=axis_name, top_k=top_k, bias=bias, **kwargs)

    bias_spec = None if bias is None else PartitionSpec()
    return jax.shard_map(body, mesh=mesh, in_specs=(shard, shard, shard, shard, bias_spec), out_specs=shard,
                         check_vma=False)(x, router_logits, w_gate_up, w_down, bias)
