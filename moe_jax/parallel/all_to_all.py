"""The all-to-all dispatch of expert parallelism: one device's body under ``jax.shard_map``.

Each device routes its own T tokens once. Its T * k assignments, in expert-sorted order, go to the device that owns
their expert (expert e lives on device e // G, G = E / P local experts), which runs its G experts on the rows it
received only and sends each output row back; the token's home device sums its k rows (the routing weights are
applied in the down projection's epilogue, on the expert's device). The row counts travel first (an all-gather of P
counts per device), so every device knows every offset without a host sync.

Rows move by one of four exchanges:

- "slots" (``slot_round_trip``): one ``lax.all_to_all`` of a [P, S] slot per peer, S = ceil(slot_factor * N / P)
  for N = T * k rows, carrying each pair's first S rows; on uniform routing a pair holds about N / P rows, so nothing
  overflows and the bytes are slot_factor times the routed rows'. The rows of pairs past S go in a second, "padded"
  exchange under a ``lax.cond`` whose predicate every device of the mesh computes alike, so the results stay exact
  whatever the routing and only a skewed step pays for the fallback.
- "owners" (``owner_round_trip``): the slots exchange of tokens instead of routed rows: each token goes once to each
  device that owns any of its experts, with its k local expert ids and weights (the other devices' marked "no
  expert"), and that device sums the token's rows before sending one row back: the bytes of the ideal (one copy
  per distinct owner) times slot_factor. Its fast path also bounds the routed rows a device computes, at
  ceil(slot_factor * T * k); a device past that takes the fallback as well.
- "ragged": ``jax.lax.ragged_all_to_all``, exact sizes: each row crosses the link once each way. Not implemented on
  CPU.
- "padded" (``exchange``): P - 1 ``ppermute`` rounds, round s sending each device's rows for device (i + s) mod P as
  one slot of a fixed size (the most rows one peer can take), chained so that one slot is in flight at a time: memory
  stays that of one slot whatever P. Portable, at the price of sending the slot's padding.

Receive buffers are static: dropless (``bound=None``) a device can receive every row of its expert-axis group,
P * T * k; with a bound each device receives at most ``bound`` rows and the rest are dropped by lowest routing score
(``Routing.selected_scores``, ties to the lower sender and then the earlier sorted row), the same on every device.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.permute import api as permute_api

EXCHANGES = ("slots", "owners", "ragged", "padded")
DEFAULT_SLOT_FACTOR = 1.25


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """Where one device's rows go and come from, from the [P, P] matrix of rows sender -> receiver (traced arrays).

    Attributes (all [P] int32):
      send_sizes / send_offsets: this device's rows for each peer, in its send order.
      recv_sizes / recv_offsets: the rows each peer sends here, in this device's receive buffer.
      remote_offsets: where this device's rows for each peer land in that peer's receive buffer.
      return_offsets: where the rows received from each peer land back in that peer's send order.
    """

    send_sizes: jax.Array
    send_offsets: jax.Array
    recv_sizes: jax.Array
    recv_offsets: jax.Array
    remote_offsets: jax.Array
    return_offsets: jax.Array

    @classmethod
    def of(cls, counts: jax.Array, me: jax.Array) -> "ExchangePlan":
        """counts: [P, P] int32, rows sender -> receiver; me: this device's index on the expert axis."""
        before_in_row = jnp.cumsum(counts, axis=1) - counts  # [s, r]: s's rows for peers < r
        before_in_column = jnp.cumsum(counts, axis=0) - counts  # [s, r]: rows for r from senders < s
        return cls(
            send_sizes=counts[me],
            send_offsets=before_in_row[me],
            recv_sizes=counts[:, me],
            recv_offsets=before_in_column[:, me],
            remote_offsets=before_in_column[me],
            return_offsets=before_in_row[:, me],
        )

    def reversed(self) -> "ExchangePlan":
        """The plan of the way back: each device returns the rows it received to where they came from."""
        return ExchangePlan(
            send_sizes=self.recv_sizes,
            send_offsets=self.recv_offsets,
            recv_sizes=self.send_sizes,
            recv_offsets=self.send_offsets,
            remote_offsets=self.return_offsets,
            return_offsets=self.remote_offsets,
        )


def exchange(kind: str, rows: jax.Array, plan: ExchangePlan, out_rows: int, fill, axis: str) -> jax.Array:
    """rows [N, ...] in send order -> [out_rows, ...]: the rows this device receives at ``plan.recv_offsets``,
    ``fill`` elsewhere. Gradients flow back along the same routes."""
    output = jnp.full((out_rows, *rows.shape[1:]), fill, rows.dtype)
    if kind == "ragged":
        return lax.ragged_all_to_all(
            rows,
            output,
            plan.send_offsets,
            plan.send_sizes,
            plan.remote_offsets,
            plan.recv_sizes,
            axis_name=axis,
        )
    num_peers = lax.axis_size(axis)
    me = lax.axis_index(axis)
    slot = min(rows.shape[0], out_rows)  # no peer sends more than it has or the receiver takes
    # Room past the ends, so that a slot starting at the last row still fits (dynamic slices clamp, never wrap).
    rows = jnp.concatenate([rows, jnp.zeros((slot, *rows.shape[1:]), rows.dtype)])
    output = jnp.concatenate([output, jnp.full((slot, *output.shape[1:]), fill, output.dtype)])
    lane = jnp.arange(slot).reshape((slot,) + (1,) * (rows.ndim - 1))
    for shift in range(num_peers):
        peer, source = (me + shift) % num_peers, (me - shift) % num_peers
        sent = lax.dynamic_slice_in_dim(rows, plan.send_offsets[peer], slot)
        if shift:
            # The output so far rides along as a dependence, so that the rounds run one after the other.
            sent, output = lax.optimization_barrier((sent, output))
            sent = lax.ppermute(sent, axis, [(i, (i + shift) % num_peers) for i in range(num_peers)])
        start = plan.recv_offsets[source]
        kept = lax.dynamic_slice_in_dim(output, start, slot)
        landed = jnp.where(lane < plan.recv_sizes[source], sent, kept)
        output = lax.dynamic_update_slice_in_dim(output, landed, start, axis=0)
    return output[:out_rows]


def slot_size(num_rows: int, num_peers: int, slot_factor: float) -> int:
    """Rows of one peer's slot in the "slots" exchange: ceil(slot_factor * num_rows / num_peers), at most
    ``num_rows``."""
    return min(num_rows, math.ceil(slot_factor * num_rows / num_peers))


def slot_round_trip(rows, fills, compute, counts, *, slot, capacity, axis, sync_axes, compute_overflows=None):
    """The "slots" exchange there and back: each device's rows to their receivers, ``compute`` on what arrived, the
    outputs home.

    Args:
      rows: {name: [N, ...]} this device's rows in send order (each receiver's rows together, receivers in order, the
        unsent past their sum); fills: {name: scalar} what an empty received row holds.
      compute: ({name: [R, ...]} received rows, fallback) -> [R, ...] outputs, zero where the rows are empty; called
        on R = P * slot rows with fallback False, or P * slot + capacity rows with fallback True when a pair
        overflows its slot (or ``compute_overflows``).
      counts: [P, P] int32 rows sender -> receiver; slot: static rows per pair in the all-to-all; capacity: static
        rows a device can receive in all; sync_axes: every mesh axis, so that every device takes the same branch.
      compute_overflows: optional bool scalar: this device's ``compute`` needs the fallback's sizes even where the
        slots hold every row.

    Returns:
      (outputs [N, ...] in send order, zero for unsent rows; int32 rows this device received past its slots).
    """
    num_peers = lax.axis_size(axis)
    me = lax.axis_index(axis)
    plan = ExchangePlan.of(counts, me)
    num_rows = next(iter(rows.values())).shape[0]
    lane = jnp.arange(slot)
    in_slot = lane[None, :] < jnp.minimum(plan.send_sizes, slot)[:, None]  # [P, slot]
    source = jnp.where(in_slot, plan.send_offsets[:, None] + lane[None, :], 0)

    def swap_slots(value):
        """[P, slot, ...]: peer q's slot -> [P * slot, ...]: peer q's slot for this device, in peer order."""
        return lax.all_to_all(value, axis, 0, 0).reshape(num_peers * slot, *value.shape[2:])

    def trailing(mask, value):
        return mask.reshape(mask.shape + (1,) * (value.ndim - mask.ndim))

    def to_slots(value, fill):
        """[N, ...] in send order -> [P, slot, ...]: each peer's first rows, ``fill`` past them."""
        picked = value[source]
        return jnp.where(trailing(in_slot, picked), picked, fill)

    received = {name: swap_slots(to_slots(value, fills[name])) for name, value in rows.items()}
    # Each send-order row's output comes back in its receiver's slot, at its place among the pair's rows.
    row = jnp.arange(num_rows)
    peer = jnp.searchsorted(jnp.cumsum(plan.send_sizes), row, side="right").astype(jnp.int32)
    place = row - plan.send_offsets[jnp.minimum(peer, num_peers - 1)]
    returned = (peer < num_peers) & (place < slot)
    back_index = jnp.where(returned, peer * slot + place, 0)

    def home(outputs):
        back = swap_slots(outputs.reshape(num_peers, slot, *outputs.shape[1:]))[back_index]
        return jnp.where(trailing(returned, back), back, 0)

    # The rows past each pair's slot: the tail of that pair's rows in the sender's order, exchanged "padded".
    overflow = jnp.maximum(counts - slot, 0)
    overflow_plan = dataclasses.replace(ExchangePlan.of(overflow, me), send_offsets=plan.send_offsets + slot)

    def fits():
        return home(compute(received, fallback=False))

    def overflows():
        rest = {name: exchange("padded", v, overflow_plan, capacity, fills[name], axis) for name, v in rows.items()}
        outputs = compute({name: jnp.concatenate([received[name], rest[name]]) for name in rows}, fallback=True)
        in_slots = num_peers * slot
        rest_back = exchange("padded", outputs[in_slots:], overflow_plan.reversed(), num_rows, 0, axis)
        return home(outputs[:in_slots]) + rest_back

    overflowing = jnp.max(overflow) > 0
    if compute_overflows is not None:
        overflowing = overflowing | compute_overflows
    any_overflow = lax.pmax(overflowing.astype(jnp.int32), sync_axes) > 0
    return lax.cond(any_overflow, overflows, fits), jnp.sum(overflow[:, me])


def owner_slot_size(num_tokens: int, num_experts: int, num_peers: int, top_k: int, slot_factor: float) -> int:
    """Tokens of one peer's slot in the "owners" exchange: slot_factor times the tokens that pick at least one of the
    peer's E / P experts under uniform routing, T (1 - C(E - E/P, k) / C(E, k)), at most T."""
    untouched = math.comb(num_experts - num_experts // num_peers, top_k) / math.comb(num_experts, top_k)
    return min(num_tokens, math.ceil(slot_factor * num_tokens * (1 - untouched)))


def owner_round_trip(
    x, receiver, local_expert, weights, w_gate_up, w_down, *, routed_counts, slot_factor, capacity, axis, sync_axes,
    activation, backends
):  # fmt: skip
    """The "owners" exchange: each token once to each device that computes any of its rows, with its k local expert
    ids and weights; the receiver runs them and sums each token's rows before sending one row back.

    Args:
      x: [T, D]; receiver, local_expert: [T, k] int32 by assignment (receiver P: not sent); weights: [T, k] f32.
      routed_counts: [P, P] int32 routed rows sender -> receiver; capacity: static routed rows a device computes at
        most (the worst case, or the buffer bound).

    Returns:
      (y [T, D], int32 rows this device took past the fast path's sizes: tokens past its slots plus routed rows past
      ceil(slot_factor * T * k)).
    """
    num_tokens, top_k = receiver.shape
    num_peers = lax.axis_size(axis)
    num_local = w_down.shape[0]
    me = lax.axis_index(axis)
    # [P * T] (peer, token) pairs, peer-major; the needed ones first, in that order: each peer's tokens together.
    needed = jnp.any(receiver[None, :, :] == jnp.arange(num_peers)[:, None, None], axis=2)
    pairs = jnp.argsort(~needed.reshape(-1), stable=True).astype(jnp.int32)
    token, peer = pairs % num_tokens, pairs // num_tokens
    mine = receiver[token] == peer[:, None]  # [P * T, k]: the pair's assignments
    rows = dict(
        x=x[token],
        experts=jnp.where(mine, local_expert[token], num_local),
        weights=jnp.where(mine, weights[token], 0),
    )
    fills = dict(x=0, experts=num_local, weights=0)
    pair_counts = lax.all_gather(jnp.sum(needed, axis=1, dtype=jnp.int32), axis)
    fast_rows = min(capacity, math.ceil(slot_factor * num_tokens * top_k))
    slot = owner_slot_size(num_tokens, num_local * num_peers, num_peers, top_k, slot_factor)

    def compute(received, fallback):
        """[R] received tokens with their [R, k] local experts and weights -> [R, D]: each token's rows summed."""
        flat_experts = received["experts"].reshape(-1)
        rows_computed = min(flat_experts.shape[0], capacity if fallback else fast_rows)
        order = jnp.argsort(flat_experts, stable=True)[:rows_computed].astype(jnp.int32)  # the real rows first
        out = received_experts(
            received["x"][order // top_k],
            received["weights"].reshape(-1)[order],
            flat_experts[order],
            w_gate_up,
            w_down,
            activation=activation,
            backend=backends,
        )
        summed = jnp.zeros((received["x"].shape[0], out.shape[1]), jnp.float32).at[order // top_k].add(out)
        return summed.astype(out.dtype)

    computed_here = jnp.sum(routed_counts[:, me])
    back, overflowed = slot_round_trip(
        rows,
        fills,
        compute,
        pair_counts,
        slot=slot,
        capacity=min(num_peers * num_tokens, capacity),
        axis=axis,
        sync_axes=sync_axes,
        compute_overflows=computed_here > fast_rows,
    )
    y = jnp.zeros(x.shape, jnp.float32).at[token].add(back).astype(x.dtype)
    return y, overflowed + jnp.maximum(computed_here - fast_rows, 0)


def buffer_keep(dest: jax.Array, score: jax.Array, bound: int, axis: str) -> jax.Array:
    """[N] bool: which of this device's rows each receiver keeps, at most ``bound`` per receiver by routing score.

    dest: [N] int32 receiver of each row (P: not sent); score: [N] f32. Every device ranks the rows of the whole
    expert axis the same way: by receiver, descending score, then sender and row (an all-gather of 8 bytes a row).
    """
    num_rows = dest.shape[0]
    all_dest = lax.all_gather(dest, axis).reshape(-1)
    all_score = lax.all_gather(score, axis).reshape(-1)
    row_id = jnp.arange(all_dest.shape[0], dtype=jnp.int32)
    sorted_dest, _, sorted_id = lax.sort((all_dest, -all_score, row_id), num_keys=3)
    first_of_dest = jnp.searchsorted(sorted_dest, sorted_dest, side="left").astype(jnp.int32)
    rank = jnp.zeros_like(row_id).at[sorted_id].set(row_id - first_of_dest)
    mine = lax.dynamic_slice_in_dim(rank, lax.axis_index(axis) * num_rows, num_rows)
    return (dest < lax.axis_size(axis)) & (mine < bound)


class RowCounts(NamedTuple):
    """One device's rows as a receiver (int32 scalars): computed, dropped past its buffer, and received past its
    slots by the "slots" exchange's fallback."""

    received: jax.Array
    dropped: jax.Array
    overflowed: jax.Array

    @classmethod
    def zero(cls) -> "RowCounts":
        return cls(*(jnp.zeros((), jnp.int32) for _ in range(3)))


def received_experts(recv_x, recv_weights, recv_experts, w_gate_up, w_down, *, activation, backend):
    """The local experts on the received rows: recv_x [R, D], their routing weights [R] f32 and local expert ids
    [R] int32 (G for an empty slot) -> [R, D] weighted outputs in receive order (zero in empty slots)."""
    num_local = w_down.shape[0]
    order = jnp.argsort(recv_experts, stable=True).astype(jnp.int32)
    local_sizes = jnp.sum(recv_experts[None, :] == jnp.arange(num_local)[:, None], axis=1, dtype=jnp.int32)
    # top_k 1: the combine puts each row back in receive order (on the FP8 kernels inside their VJP, whose backward
    # then quantizes each received row's dy once).
    return glu_mlp_api.routed_glu_mlp(
        recv_x,
        order,
        1,
        w_gate_up,
        w_down,
        local_sizes,
        activation=activation,
        row_scale=recv_weights[order],
        zero_tail=False,  # the empty slots lie past the local sum
        backend=backend.experts,
        quantization=backend.quantization,
        combine=backend.combine,
    )


def dispatch(
    x, routed, group_sizes, sort_indices, w_gate_up, w_down, *, num_chunks, bound, exchange_kind, slot_factor, axis,
    sync_axes, activation, backends
):  # fmt: skip
    """One device's tokens through the experts of the whole expert axis.

    Args:
      x: [T, D] this device's tokens; routed: their ``Routing``; group_sizes [E], sort_indices [T*k]: the rows to
        compute (``expert_rows``: every row, or what a capacity keeps, the dropped ones past the sum).
      w_gate_up [G, D, 2F], w_down [G, F, D]: this device's G experts, experts [i * G, (i + 1) * G) on device i.
      num_chunks: dispatch the tokens in this many equal chunks (static); bound: rows each device receives per
        chunk at most, or None (dropless).
      exchange_kind: one of ``EXCHANGES``; slot_factor: the "slots" exchange's; axis: the expert axis; sync_axes:
        every mesh axis.

    Returns:
      (y [T, D], ``RowCounts`` of this device as a receiver).
    """
    num_tokens, _ = x.shape
    top_k = routed.top_k
    num_local = w_down.shape[0]
    num_rows = sort_indices.shape[0]
    experts = routed.experts.reshape(-1)[sort_indices]
    dest = jnp.where(jnp.arange(num_rows) < jnp.sum(group_sizes), experts // num_local, lax.axis_size(axis))
    rows = dict(ids=sort_indices, dest=dest, score=routed.selected_scores.reshape(-1)[sort_indices])
    rows["local_expert"] = experts % num_local
    chunk_rows = num_rows // num_chunks
    if num_chunks > 1:
        # Each chunk's rows, still in expert order (a stable sort by chunk).
        by_chunk = jnp.argsort(sort_indices // chunk_rows, stable=True)
        rows = {name: value[by_chunk].reshape(num_chunks, chunk_rows) for name, value in rows.items()}
    weights = routed.weights.reshape(-1)
    outputs, counts = [], RowCounts.zero()
    for chunk in range(num_chunks):
        first = chunk * chunk_rows
        chunk_of = {name: value[chunk] if num_chunks > 1 else value for name, value in rows.items()}
        chunk_tokens = num_tokens // num_chunks
        x_chunk = lax.slice_in_dim(x, chunk * chunk_tokens, (chunk + 1) * chunk_tokens)
        y, chunk_counts = _dispatch_chunk(
            x_chunk,
            chunk_of["ids"] - first,
            chunk_of["dest"],
            chunk_of["score"],
            chunk_of["local_expert"],
            lax.slice_in_dim(weights, first, first + chunk_rows),
            w_gate_up,
            w_down,
            top_k=top_k,
            bound=bound,
            exchange_kind=exchange_kind,
            slot_factor=slot_factor,
            axis=axis,
            sync_axes=sync_axes,
            activation=activation,
            backends=backends,
        )
        outputs.append(y)
        counts = jax.tree.map(jnp.add, counts, chunk_counts)
    return jnp.concatenate(outputs) if num_chunks > 1 else outputs[0], counts


def _dispatch_chunk(
    x, ids, dest, score, local_expert, weights, w_gate_up, w_down, *, top_k, bound, exchange_kind, slot_factor, axis,
    sync_axes, activation, backends
):  # fmt: skip
    """x [T, D]; per expert-sorted row [T*k]: its assignment id (into x's T * k), receiver (P: not sent), routing
    score and local expert on the receiver; weights [T*k] f32 by assignment id. -> (y [T, D], ``RowCounts``)."""
    num_peers = lax.axis_size(axis)
    num_rows = ids.shape[0]
    peers = jnp.arange(num_peers)[:, None]
    wanted_sizes = jnp.sum(dest[None, :] == peers, axis=1, dtype=jnp.int32)
    if bound is None:
        receiver = dest
    else:
        receiver = jnp.where(buffer_keep(dest, score, bound, axis), dest, num_peers)
        # The kept rows of each receiver together, in expert order; the dropped ones last.
        send_order = jnp.argsort(receiver, stable=True)
        ids, receiver, local_expert = ids[send_order], receiver[send_order], local_expert[send_order]
    send_sizes = jnp.sum(receiver[None, :] == peers, axis=1, dtype=jnp.int32)
    counts = lax.all_gather(send_sizes, axis)
    plan = ExchangePlan.of(counts, lax.axis_index(axis))
    capacity = num_peers * num_rows if bound is None else min(bound, num_peers * num_rows)
    rows = dict(recv_x=x[ids // top_k], recv_weights=weights[ids], recv_experts=local_expert.astype(jnp.int32))
    fills = dict(recv_x=0, recv_weights=0, recv_experts=w_down.shape[0])

    def compute(received, fallback=False):
        del fallback  # the rows come in the sizes the experts take
        return received_experts(**received, w_gate_up=w_gate_up, w_down=w_down, activation=activation, backend=backends)

    if exchange_kind == "owners":
        rows_by_id = functools.partial(jnp.full, (num_rows,), num_peers, jnp.int32)
        y, overflowed = owner_round_trip(
            x,
            rows_by_id().at[ids].set(receiver).reshape(-1, top_k),
            rows_by_id().at[ids].set(local_expert).reshape(-1, top_k),
            weights.reshape(-1, top_k),
            w_gate_up,
            w_down,
            routed_counts=counts,
            slot_factor=slot_factor,
            capacity=capacity,
            axis=axis,
            sync_axes=sync_axes,
            activation=activation,
            backends=backends,
        )
    elif exchange_kind == "slots":
        slot = slot_size(num_rows, num_peers, slot_factor)
        back, overflowed = slot_round_trip(
            rows, fills, compute, counts, slot=slot, capacity=capacity, axis=axis, sync_axes=sync_axes
        )
    else:
        send = functools.partial(exchange, exchange_kind, plan=plan, out_rows=capacity, axis=axis)
        out = compute({name: send(value, fill=fills[name]) for name, value in rows.items()})
        back = exchange(exchange_kind, out, plan.reversed(), num_rows, 0, axis)
        overflowed = jnp.zeros((), jnp.int32)
    if exchange_kind != "owners":
        y = permute_api.combine(back, ids, top_k, num_rows=jnp.sum(send_sizes), backend=backends.combine)
    received = jnp.sum(plan.recv_sizes)
    wanted = jnp.sum(lax.all_gather(wanted_sizes, axis)[:, lax.axis_index(axis)])
    return y, RowCounts(received, wanted - received, overflowed)
