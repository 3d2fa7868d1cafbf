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
from ...core.runtime_checks import checks_enabled, require
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


def _poison_value(dtype):
    """What the rows of an exchange with invalid metadata hold: NaN for floats, the lowest value
    for integers, False for booleans."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.nan
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).min
    return False


def _first(mask):
    """Index of the first True of a flat bool mask (0 when none)."""
    return jnp.argmax(mask.reshape(-1))


def _overlaps(starts, sizes):
    """Bool ``[N]``: slice ``k`` (rows ``[starts[k], starts[k] + sizes[k])``, empty when
    ``sizes[k] <= 0``) overlaps the non-empty slice that starts next (sorted by start; two sorted
    intervals overlap iff some consecutive pair does). Returns the mask over the sorted order and
    the order."""
    live = sizes > 0
    key = jnp.where(live, starts, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, stable=True)
    s, z, l = starts[order], sizes[order], live[order]
    clash = l[:-1] & l[1:] & (s[1:] - s[:-1] < z[:-1])
    return clash, order


def _require_slices_inside(offsets, sizes, negative, name: str, rows: int, target: str) -> None:
    """Checked mode: every slice ``[offsets[i], offsets[i] + sizes[i])`` (of a non-negative size) lies
    inside the ``rows`` rows of ``target``."""
    outside = ((offsets < 0) | (sizes > rows - offsets)) & ~negative
    require(lambda: ~jnp.any(outside),
            f"{name}[{{index}}] = {{offset}} with send_sizes[{{index}}] = {{size}}: expected a slice inside "
            f"the {rows} rows of {target}",
            index=lambda: _first(outside), offset=lambda: offsets[_first(outside)],
            size=lambda: sizes[_first(outside)])


def _require_exchange(sizes, input_offsets, output_offsets, totals, *, operand_rows, output_rows,
                      max_send, recv_sizes, sent, received_offsets, clash, order, per_device) -> None:
    """Checked mode: each invalid slice of `ragged_all_to_all_padded`, naming the argument, the index
    and the values (``sizes``, ``totals``: this device's send sizes and per-destination sums; ``sent``,
    ``received_offsets``: what the sources say about the slices this device receives). Off, nothing."""
    if not checks_enabled():
        return
    neg = sizes < 0
    require(lambda: ~jnp.any(neg), "send_sizes[{index}] = {value}: expected a size >= 0",
            index=lambda: _first(neg), value=lambda: sizes[_first(neg)])
    for offsets, name, rows, target in ((input_offsets, "input_offsets", operand_rows, "operand"),
                                        (output_offsets, "output_offsets", output_rows, "output")):
        _require_slices_inside(offsets, sizes, neg, name, rows, target)
    over = totals > max_send
    require(lambda: ~jnp.any(over),
            f"send_sizes: {{total}} rows for device {{device}} (the sum of its {per_device} slices): expected at "
            f"most max_send = {max_send}",
            total=lambda: totals[_first(over)], device=lambda: _first(over))
    flat_recv, flat_sent = recv_sizes.reshape(-1), sent.reshape(-1)
    mismatch = flat_recv != flat_sent
    require(lambda: ~jnp.any(mismatch),
            "recv_sizes[{index}] = {value}: expected the size its source sends, {sent} (send_sizes on device "
            "{source}; recv_sizes must equal all_to_all(send_sizes))",
            index=lambda: _first(mismatch), value=lambda: flat_recv[_first(mismatch)],
            sent=lambda: flat_sent[_first(mismatch)], source=lambda: _first(mismatch) // per_device)
    starts = received_offsets.reshape(-1)
    require(lambda: ~jnp.any(clash),
            "output_offsets: the slices received from device {source_a} (rows [{start_a}, {end_a})) and from device "
            "{source_b} (rows [{start_b}, {end_b})) overlap; expected disjoint slices of output",
            source_a=lambda: order[_first(clash)] // per_device, start_a=lambda: starts[order[_first(clash)]],
            end_a=lambda: starts[order[_first(clash)]] + flat_recv[order[_first(clash)]],
            source_b=lambda: order[_first(clash) + 1] // per_device, start_b=lambda: starts[order[_first(clash) + 1]],
            end_b=lambda: starts[order[_first(clash) + 1]] + flat_recv[order[_first(clash) + 1]])


def ragged_all_to_all_padded(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                             axis_name, max_send: int):
    """``jax.lax.ragged_all_to_all`` semantics from a padded ``all_to_all`` (call inside
    ``jax.shard_map`` over ``axis_name``, size P).

    Args:
      operand: ``[N_in, ...]`` rows this device sends from.
      output: ``[N_out, ...]`` rows the received slices are written into (others kept).
      input_offsets, send_sizes, output_offsets: ``[P · S]`` integers: slice ``j`` (``S`` per
        destination) is ``operand[input_offsets[j] : + send_sizes[j]]``, sent to device ``j // S``
        and written there at ``output_offsets[j]``.
      recv_sizes: ``[P · S]``: the size of slice ``i`` received from device ``s`` at ``s · S + i``
        (equal to what ``s`` sends: ``all_to_all(send_sizes)``).
      axis_name: the mesh axis.
      max_send: a static bound on the rows one device sends to one destination (the sum of its
        ``S`` slices); the padded buffers are ``[P, max_send, ...]``.

    Returns the new ``output``. Differentiable (gather, all_to_all and scatter).

    Invalid metadata (which values cannot be checked on the host under ``jit``): a slice with a
    negative size, an input range outside ``operand``, an output range outside ``output``, a
    destination whose slices sum past ``max_send``, a ``recv_sizes`` entry that differs from its
    source's ``send_sizes``, or received slices whose output ranges overlap. Then **every row of the
    output of each device that receives such a slice is NaN** (the dtype's lowest value for
    integers, False for booleans): which rows a bad offset or size meant is unknown, so no row of
    that device is trusted; devices that receive only valid slices are exact. Checked mode
    (`stellax.checked`) states each condition as a checkify check naming the argument, the index
    and the values (``send_sizes[3] = -1: expected a size >= 0``, ``recv_sizes[2] = 4: expected
    the size its source sends, 3 ...``). ``jax.lax.ragged_all_to_all`` itself (``collective=
    "ragged"``) leaves invalid metadata undefined.
    """
    p = jax.lax.axis_size(axis_name)
    per_device = input_offsets.shape[0] // p
    rows_in, rows_out = operand.shape[0], output.shape[0]
    input_offsets, send_sizes = input_offsets.astype(jnp.int32), send_sizes.astype(jnp.int32)
    output_offsets, recv_sizes = output_offsets.astype(jnp.int32), recv_sizes.astype(jnp.int32)
    # Sender: which of its slices are invalid (negative size, outside operand or output, or past max_send).
    sizes = send_sizes.reshape(p, per_device)
    totals = jnp.sum(jnp.maximum(sizes, 0), axis=1)                                  # [P] rows per destination
    bad_send = ((send_sizes < 0) | (input_offsets < 0) | (send_sizes > rows_in - input_offsets)
                | (output_offsets < 0) | (send_sizes > rows_out - output_offsets)
                | jnp.repeat(totals > max_send, per_device))
    # Pack: row c of the buffer for destination d comes from slice seg of d.
    seg, clipped, inner = _segments(jnp.maximum(sizes, 0), max_send)                  # [P, C]
    src = jnp.take_along_axis(input_offsets.reshape(p, per_device), clipped, axis=-1) + inner
    valid = seg < per_device
    packed = operand[jnp.clip(src, 0, rows_in - 1)]
    packed = jnp.where(valid.reshape(valid.shape + (1,) * (operand.ndim - 1)), packed, 0)
    received = jax.lax.all_to_all(packed, axis_name, 0, 0)                            # [P(src), C, ...]
    # The slices' metadata travels with them: (output offset, size sent, invalid at the sender).
    meta = jnp.stack([output_offsets, send_sizes, bad_send.astype(jnp.int32)], axis=-1)
    meta = jax.lax.all_to_all(meta.reshape(p, per_device, 3), axis_name, 0, 0)       # [P(src), S, 3]
    offsets, sent, bad_from = meta[..., 0], meta[..., 1], meta[..., 2] > 0
    mine = recv_sizes.reshape(p, per_device)
    clash, order = _overlaps(offsets.reshape(-1), mine.reshape(-1))
    bad = (jnp.any(bad_from) | jnp.any(mine != sent) | jnp.any(mine < 0) | jnp.any(clash)
           | jnp.any(jnp.sum(jnp.maximum(mine, 0), axis=1) > max_send))
    _require_exchange(send_sizes, input_offsets, output_offsets, totals, operand_rows=rows_in,
                      output_rows=rows_out, max_send=max_send, recv_sizes=mine, sent=sent,
                      received_offsets=offsets, clash=clash, order=order, per_device=per_device)
    seg, clipped, inner = _segments(jnp.maximum(mine, 0), max_send)
    dest = jnp.take_along_axis(offsets, clipped, axis=-1) + inner
    dest = jnp.where(seg < per_device, dest, rows_out).reshape(-1)
    out = output.at[dest].set(received.reshape((-1,) + operand.shape[1:]), mode="drop")
    return jnp.where(bad, jnp.asarray(_poison_value(out.dtype), out.dtype), out)


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
