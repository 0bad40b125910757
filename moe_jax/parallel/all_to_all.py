"""The all-to-all dispatch of expert parallelism: one device's body under ``jax.shard_map``.

Each device routes its own T tokens once. Its T * k assignments, in expert-sorted order, go to the device that owns
their expert (expert e lives on device e // G, G = E / P local experts), which runs its G experts on the rows it
received only and sends each output row back; the token's home device sums its k rows (the routing weights are
applied in the down projection's epilogue, on the expert's device). The row counts travel first (an all-gather of P
counts per device), so every device knows every offset without a host sync.

Rows move by one of two exchanges behind one function (``exchange``):

- "ragged": ``jax.lax.ragged_all_to_all``, exact sizes: each row crosses the link once each way. Not implemented on
  CPU.
- "padded": P - 1 ``ppermute`` rounds, round s sending each device's rows for device (i + s) mod P as one slot of a
  fixed size (the most rows one peer can take), chained so that one slot is in flight at a time: memory stays that of
  one slot whatever P. Portable, at the price of sending the slot's padding.

Receive buffers are static: dropless (``bound=None``) a device can receive every row of its expert-axis group,
P * T * k; with a bound each device receives at most ``bound`` rows and the rest are dropped by lowest routing score
(``Routing.selected_scores``, ties to the lower sender and then the earlier sorted row), the same on every device.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from moe_jax.ops.glu_mlp import api as glu_mlp_api
from moe_jax.ops.permute import api as permute_api

EXCHANGES = ("ragged", "padded")


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


def received_experts(recv_x, recv_weights, recv_experts, w_gate_up, w_down, *, activation, backend):
    """The local experts on the received rows: recv_x [R, D], their routing weights [R] f32 and local expert ids
    [R] int32 (G for an empty slot) -> [R, D] weighted outputs in receive order (zero in empty slots)."""
    num_local = w_down.shape[0]
    order = jnp.argsort(recv_experts, stable=True).astype(jnp.int32)
    local_sizes = jnp.sum(recv_experts[None, :] == jnp.arange(num_local)[:, None], axis=1, dtype=jnp.int32)
    out_sorted = glu_mlp_api.routed_glu_mlp(
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
    )
    # top_k 1: the combine puts each row back in receive order.
    return permute_api.combine(out_sorted, order, 1, num_rows=jnp.sum(local_sizes), backend=backend.combine)


def dispatch(
    x, routed, group_sizes, sort_indices, w_gate_up, w_down, *, num_chunks, bound, exchange_kind, axis, activation,
    backends
):  # fmt: skip
    """One device's tokens through the experts of the whole expert axis.

    Args:
      x: [T, D] this device's tokens; routed: their ``Routing``; group_sizes [E], sort_indices [T*k]: the rows to
        compute (``expert_rows``: every row, or what a capacity keeps, the dropped ones past the sum).
      w_gate_up [G, D, 2F], w_down [G, F, D]: this device's G experts, experts [i * G, (i + 1) * G) on device i.
      num_chunks: dispatch the tokens in this many equal chunks (static); bound: rows each device receives per
        chunk at most, or None (dropless).

    Returns:
      (y [T, D], received rows, dropped rows): the counts int32 scalars of this device as a receiver.
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
    outputs, received, dropped = [], 0, 0
    for chunk in range(num_chunks):
        first = chunk * chunk_rows
        chunk_of = {name: value[chunk] if num_chunks > 1 else value for name, value in rows.items()}
        chunk_tokens = num_tokens // num_chunks
        x_chunk = lax.slice_in_dim(x, chunk * chunk_tokens, (chunk + 1) * chunk_tokens)
        y, chunk_received, chunk_dropped = _dispatch_chunk(
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
            axis=axis,
            activation=activation,
            backends=backends,
        )
        outputs.append(y)
        received, dropped = received + chunk_received, dropped + chunk_dropped
    return jnp.concatenate(outputs) if num_chunks > 1 else outputs[0], received, dropped


def _dispatch_chunk(
    x, ids, dest, score, local_expert, weights, w_gate_up, w_down, *, top_k, bound, exchange_kind, axis, activation,
    backends
):  # fmt: skip
    """x [T, D]; per expert-sorted row [T*k]: its assignment id (into x's T * k), receiver (P: not sent), routing
    score and local expert on the receiver; weights [T*k] f32 by assignment id. -> (y [T, D], received, dropped)."""
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
    plan = ExchangePlan.of(lax.all_gather(send_sizes, axis), lax.axis_index(axis))
    capacity = num_peers * num_rows if bound is None else min(bound, num_peers * num_rows)
    send = functools.partial(exchange, exchange_kind, plan=plan, out_rows=capacity, axis=axis)
    recv_x = send(x[ids // top_k], fill=0)
    recv_weights = send(weights[ids], fill=0)
    recv_experts = send(local_expert.astype(jnp.int32), fill=w_down.shape[0])
    out = received_experts(
        recv_x, recv_weights, recv_experts, w_gate_up, w_down, activation=activation, backend=backends
    )
    back = exchange(exchange_kind, out, plan.reversed(), num_rows, 0, axis)
    y = permute_api.combine(back, ids, top_k, num_rows=jnp.sum(send_sizes), backend=backends.combine)
    received = jnp.sum(plan.recv_sizes)
    wanted = jnp.sum(lax.all_gather(wanted_sizes, axis)[:, lax.axis_index(axis)])
    return y, received, wanted - received
