"""``moe_ffn`` with the experts sharded over a mesh axis (expert parallelism), under ``jax.shard_map``.

Two dispatches, chosen per call (``dispatch=``); docs/design.md has the traffic and memory model.

- "all_gather": each device gathers the tokens of its expert-axis group, routes all of them (every device of the
  group computes the same routing), runs its own E / P experts on the rows routed to them, combines those into a
  partial [T_group, D] and a reduce-scatter sums the partials and hands each device back its own tokens. The expert
  kernels see the whole group's rows with only the local experts' at the front (a rotation of the expert-sorted
  order); the rest lie past ``sum(group_sizes)``, where the kernels neither compute nor write (``zero_tail=False``)
  and the combine does not read (``num_rows``). The router, the routing, the combine's transpose and the gathered
  tokens are the whole group's on every device: work and memory grow with P.
- "all_to_all" (``moe_jax.parallel.all_to_all``): each device routes its own tokens and sends each routed row to the
  device that owns its expert, which computes it and sends it back; work and memory per device are those of its own
  rows, receive buffers aside (bounded by ``buffer_factor``).

``python -m benchmarks --bench ep`` measures both against one device and data parallelism.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moe_jax._core import checks
from moe_jax.ops.glu_mlp.api import dense_glu_mlp
from moe_jax.ops.grouped_matmul.api import check_quantized_master, master_weights
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, stored_array
from moe_jax.ops.moe_ffn.api import LayerBackends, MoEAux, check_moe_args, expert_rows, route_tokens, routed_experts
from moe_jax.ops.quant.reference import BlockScaled, QuantizedMaster
from moe_jax.ops.routing.api import RoutingOptions, z_loss
from moe_jax.ops.routing.reference import load_balancing_loss_from
from moe_jax.parallel import all_to_all

DISPATCHES = ("auto", "all_gather", "all_to_all")


def local_expert_rows(group_sizes, sort_indices, first_expert, num_local_experts: int):
    """The rows of experts [first_expert, first_expert + num_local_experts) in front.

    Args:
      group_sizes: [E] int32 rows per expert; sort_indices: [T*k] int32 expert-sorted assignments (``Routing``).
      first_expert: int32 scalar (may be traced); num_local_experts: static.

    Returns:
      (local_sizes [num_local_experts] int32, local_indices [T*k] int32): ``sort_indices`` rotated so that the local
      experts' rows come first, in order; every other row lies past ``sum(local_sizes)``.
    """
    first_row = lax.dynamic_slice_in_dim(jnp.cumsum(group_sizes) - group_sizes, first_expert, 1)[0]
    local_sizes = lax.dynamic_slice_in_dim(group_sizes, first_expert, num_local_experts)
    return local_sizes, jnp.roll(sort_indices, -first_row)


def choose_dispatch(dispatch: str, top_k: int, num_shards: int, capacity_factor: float | None) -> str:
    """What ``dispatch`` means for a layer of top-k routing over P = ``num_shards`` expert devices.

    "auto" follows the traffic model: per token and direction the all-gather moves P - 1 rows of D (the token to
    every other member of its group, and the partial outputs back), the all-to-all k (P - 1) / P on average (each
    routed row to its expert's device, when that is another). So all-gather while k >= P, all-to-all below. With a
    ``capacity_factor`` "auto" keeps the all-gather, whose capacity counts the tokens of the whole expert-axis group
    (the all-to-all's counts one device's).
    """
    checks.check_choice("dispatch", dispatch, DISPATCHES)
    if dispatch != "auto":
        return dispatch
    return "all_gather" if capacity_factor is not None or top_k >= num_shards else "all_to_all"


def moe_ffn_expert_parallel(
    x: jax.Array,
    router_kernel: jax.Array,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    *,
    top_k: int,
    activation: str = "swiglu",
    routing: RoutingOptions | None = None,
    bias: jax.Array | None = None,
    capacity_factor: float | None = None,
    expert_axis: str = "expert",
    dispatch: str = "auto",
    buffer_factor: float | None = None,
    num_chunks: int = 1,
    exchange: str = "auto",
    slot_factor: float | None = None,
    shared_experts: tuple | None = None,
    backend: str = "auto",
    quantization: str | None = None,
    **routing_keywords,
) -> tuple[jax.Array, MoEAux]:
    """``moe_jax.moe_ffn`` with the E experts split over the mesh axis ``expert_axis`` (P devices, E / P each).

    Call it under a mesh (``jax.set_mesh``); it runs as one ``jax.shard_map`` over all the mesh's axes. The tokens are
    split over every axis (the expert axis last, as a batch sharded over ``(data, expert)``), the expert weights
    over ``expert_axis``; the router, the bias and the shared experts are replicated. Semantics, arguments and
    results are ``moe_ffn``'s on the whole batch (y, the losses, the expert counts and every gradient), with these
    documented differences: a ``capacity_factor`` counts the tokens of one expert-axis group of P devices under
    "all_gather" (``ceil(cf * T_group * k / E)`` rows per expert) and of one device under "all_to_all"; a
    ``buffer_factor`` drops rows. Weights that several devices share (the expert weights with a data axis, the
    shared experts) reach the shard_map in f32, so their gradients are summed over the devices in f32 (the weights
    are cast to x's dtype inside).

    Traffic per token and direction, in rows of D: "all_gather" P - 1 (each token to every other member of its
    group, each partial output back); "all_to_all" k (P - 1) / P on average (a routed row to its expert's device,
    when that is another one). "auto" takes all_gather while k >= P (and whenever ``capacity_factor`` is set), else
    all_to_all (``choose_dispatch``).

    Args:
      x: [T, D], T a multiple of the mesh size (and of it times ``num_chunks``); router_kernel [D, E]; w_gate_up
        [E, D, 2F] (or its ``PackedGateUp``); w_down [E, F, D]; E a multiple of P.
      expert_axis: the mesh axis the experts are split over; its size may be 1.
      dispatch: "auto", "all_gather" or "all_to_all".
      buffer_factor: "all_to_all" only. None: dropless, every device's receive buffer holds the worst case, all
        P * T_local * k rows of its expert-axis group (T_local = T / mesh size). b > 0: each device receives at most
        ``ceil(b * T_local * k)`` rows (per chunk: ``ceil(b * T_local / num_chunks * k)``); the rows past that are
        dropped by lowest routing score (``Routing.selected_scores``; ties to the lower device, then the earlier
        expert-sorted row), contribute zero and get zero gradients, and ``MoEAux.dropped_rows`` counts them.
      num_chunks: "all_to_all" only: the local tokens are dispatched in this many equal chunks, independent of each
        other, so that one chunk's exchange can overlap another's expert GEMMs; dropless results do not depend on it.
      exchange: "all_to_all" only: how rows move, as ``moe_jax.parallel.all_to_all`` describes them: "slots"
        ("auto": one ``all_to_all`` of a fixed slot of routed rows per peer, the overflow of a skewed routing through
        a fallback exchange, exact either way), "owners" (the same of tokens: each token once to each device owning
        any of its experts, which sums their outputs before sending one row back), "padded" (``ppermute`` rounds of
        slots of the most one peer can take) or "ragged" (``ragged_all_to_all``, GPUs only: about 44x slower than
        all_gather at the qwen3-30b-a3b layer on two H200s, docs/design.md).
      slot_factor: exchange "slots" or "owners" only (default 1.25): a peer's slot holds slot_factor times what it
        takes on uniform routing per chunk (slots: ceil(slot_factor * T_local * k / P) rows; owners: that factor of
        the tokens with an expert on the peer, at most T_local), so the bytes sent are slot_factor times the rows'
        (slots) or the ideal's (owners) when nothing overflows; what overflows takes the fallback
        (``MoEAux.overflowed_rows``), which sends about P times more.
      shared_experts: optional (w_gate_up [1, D, 2F_s] or its ``PackedGateUp``, w_down [1, F_s, D]): an always-on
        gated MLP added to y (``moe_jax.dense_glu_mlp``), run inside the same shard_map on each device's own tokens.
      top_k, activation, routing (or its fields as keywords), bias, capacity_factor, backend, quantization: as in
        ``moe_jax.moe_ffn`` (the shared experts quantized too); the weights come in high precision (of a
        ``QuantizedMaster``, its master: each device quantizes its own experts per call).

    Returns:
      (y [T, D] sharded like x, MoEAux replicated, with ``received_rows`` and ``dropped_rows`` [mesh size] int32 per
      device in the order of x's shards).
    """
    routing = RoutingOptions.of(routing, routing_keywords)
    # Each device quantizes its own experts' weights, per call: a QuantizedMaster's copies are the whole weights', and
    # it enters as its master, once checked against the call.
    named = {"w_gate_up": w_gate_up, "w_down": w_down}
    if shared_experts is not None:
        named |= {"shared_experts[0]": shared_experts[0], "shared_experts[1]": shared_experts[1]}
    for name, weights in named.items():
        if isinstance(stored := stored_array(weights), QuantizedMaster):
            check_quantized_master(name, stored, quantization, transpose_rhs=False)
    w_gate_up, w_down = map(master_weights, (w_gate_up, w_down))
    if shared_experts is not None:
        shared_experts = tuple(map(master_weights, shared_experts))
    if any(isinstance(w, BlockScaled) for w in (stored_array(w_gate_up), w_down)):
        raise TypeError(
            "moe_ffn_expert_parallel quantizes its weights on every device: pass them in high precision, not as "
            "BlockScaled"
        )
    num_experts = check_moe_args(
        x,
        router_kernel,
        w_gate_up,
        w_down,
        top_k=top_k,
        activation=activation,
        capacity_factor=capacity_factor,
        routing=routing,
        bias=bias,
        quantization=quantization,
    )
    mesh = jax.sharding.get_abstract_mesh()
    if expert_axis not in mesh.axis_names:
        raise ValueError(
            f"expert_axis={expert_axis!r} is not an axis of the current mesh {dict(mesh.shape)}: call "
            "moe_ffn_expert_parallel under jax.set_mesh(mesh) with a mesh that has it"
        )
    num_shards = mesh.shape[expert_axis]
    if num_experts % num_shards:
        raise ValueError(f"E={num_experts} experts must split evenly over the {num_shards} devices of {expert_axis!r}")
    if x.shape[0] % mesh.size:
        raise ValueError(f"x.shape[0] (T={x.shape[0]}) must be a multiple of the mesh size {mesh.size}")
    dispatch = choose_dispatch(dispatch, top_k, num_shards, capacity_factor)
    checks.check_positive_int("num_chunks", num_chunks)
    checks.check_choice("exchange", exchange, ("auto", *all_to_all.EXCHANGES))
    if buffer_factor is not None and checks.check_static_float("buffer_factor", buffer_factor) <= 0:
        raise ValueError(f"buffer_factor must be > 0 (or None for dropless), got {buffer_factor}")
    if dispatch == "all_gather" and (buffer_factor is not None or num_chunks != 1):
        raise ValueError(
            f"buffer_factor={buffer_factor} and num_chunks={num_chunks} apply to dispatch='all_to_all' only; "
            f"this call dispatches by all_gather"
        )
    if (x.shape[0] // mesh.size) % num_chunks:
        raise ValueError(
            f"num_chunks={num_chunks} must divide the {x.shape[0] // mesh.size} tokens of each device "
            f"(x.shape[0]={x.shape[0]} over {mesh.size} devices)"
        )
    if exchange == "auto":
        exchange = "slots"
    if slot_factor is not None:
        if exchange not in ("slots", "owners") or dispatch != "all_to_all":
            raise ValueError(
                f"slot_factor={slot_factor} applies to exchange='slots' or 'owners' of dispatch='all_to_all' only; "
                f"this call dispatches by {dispatch} with exchange={exchange!r}"
            )
        if checks.check_static_float("slot_factor", slot_factor) <= 0:
            raise ValueError(f"slot_factor must be > 0, got {slot_factor}")
    shared = _check_shared_experts(shared_experts, x)

    data_axes = tuple(a for a in mesh.axis_names if a != expert_axis)  # across the expert-axis groups
    token_spec = P((*data_axes, expert_axis))
    backends = LayerBackends.select(
        backend,
        x,
        w_gate_up,
        w_down,
        top_k=top_k,
        activation=activation,
        routing=routing,
        quantization=quantization,
    )
    common = dict(top_k=top_k, activation=activation, expert_axis=expert_axis, data_axes=data_axes, backends=backends)
    if dispatch == "all_gather":
        layer = functools.partial(_all_gather_body, routing=routing, capacity_factor=capacity_factor, **common)
    else:
        layer = functools.partial(
            _all_to_all_body,
            routing=routing,
            capacity_factor=capacity_factor,
            buffer_factor=buffer_factor,
            num_chunks=num_chunks,
            exchange=exchange,
            slot_factor=all_to_all.DEFAULT_SLOT_FACTOR if slot_factor is None else slot_factor,
            **common,
        )
    shared_options = dict(activation=activation, backend=backend, quantization=quantization)
    body = functools.partial(_body, layer=layer, compute_dtype=x.dtype, shared_options=shared_options)

    # Weights shared by several devices enter the shard_map in f32 (and are cast to x's dtype inside): its transpose
    # sums their gradients over those devices in the operands' dtype.
    def wide(w, sharing_devices):
        return w.astype(jnp.promote_types(w.dtype, jnp.float32)) if sharing_devices > 1 else w

    expert_copies = mesh.size // num_shards
    in_specs = (token_spec, P(), P(expert_axis), P(expert_axis), P(), P())
    operands = (
        x,
        router_kernel,
        wide(w_gate_up, expert_copies),
        wide(w_down, expert_copies),
        bias,
        None if shared is None else tuple(wide(w, mesh.size) for w in shared),
    )
    if all(axis_type == AxisType.Explicit for axis_type in mesh.axis_types):
        # Under Explicit axes shard_map takes operands only as sharded as in_specs says: reshard them (a no-op where
        # they already are). Under Auto axes XLA inserts the same.
        operands = tuple(
            jax.tree.map(functools.partial(jax.sharding.reshard, out_shardings=spec), operand)
            for operand, spec in zip(operands, in_specs, strict=True)
        )
    # check_vma=False: the Mosaic GPU kernels' loop carries start from constants and so fail shard_map's
    # varying-axes check (jax 0.11.2); what is replicated here is so by the explicit collectives of the body.
    sharded = jax.shard_map(body, in_specs=in_specs, out_specs=(token_spec, P()), check_vma=False)
    return sharded(*operands)


def _check_shared_experts(shared_experts, x):
    """(w_gate_up [1, D, 2F_s], w_down [1, F_s, D]) checked, or None."""
    if shared_experts is None:
        return None
    if not isinstance(shared_experts, tuple) or len(shared_experts) != 2:
        raise TypeError("shared_experts must be a pair (w_gate_up [1, D, 2F], w_down [1, F, D]) or None")
    w_gate_up, w_down = shared_experts
    gate_up_shape = checks.check_rank("shared_experts[0]", w_gate_up, 3, "[1, D, 2F]")
    down_shape = checks.check_rank("shared_experts[1]", w_down, 3, "[1, F, D]")
    d_model = x.shape[1]
    if gate_up_shape[:2] != (1, d_model) or down_shape != (1, gate_up_shape[2] // 2, d_model):
        raise ValueError(
            f"shared_experts must be ([1, {d_model}, 2F], [1, F, {d_model}]), got {gate_up_shape} and {down_shape}"
        )
    return shared_experts


def _body(x, router_kernel, w_gate_up, w_down, bias, shared, *, layer, compute_dtype, shared_options):
    """One device: the routed layer, plus the shared experts on the same tokens (``dense_glu_mlp`` with
    ``shared_options``)."""
    y, aux = layer(x, router_kernel, w_gate_up.astype(compute_dtype), w_down.astype(compute_dtype), bias)
    if shared is not None:
        shared_gate_up, shared_down = (w.astype(compute_dtype) for w in shared)
        y = y + dense_glu_mlp(x, shared_gate_up, shared_down, **shared_options)
    return y, aux


def _whole_batch_aux(routed, counts_axes, num_token_groups, rows: all_to_all.RowCounts, all_axes) -> MoEAux:
    """The losses and counts of the whole batch from each device's routing of its tokens (or of its group's, where
    the members of a group hold the same values: ``counts_axes`` then leaves the expert axis out)."""

    def over(collective, value):
        return collective(value, counts_axes) if counts_axes else value

    counts = over(lax.psum, routed.group_sizes)
    share = counts.astype(routed.mean_probs.dtype) / (routed.sort_indices.shape[0] * num_token_groups)
    return MoEAux(
        load_balancing_loss=load_balancing_loss_from(share, over(lax.pmean, routed.mean_probs)),
        z_loss=over(lax.pmean, z_loss(routed)),
        expert_counts=counts,
        received_rows=lax.all_gather(rows.received, all_axes),
        dropped_rows=lax.all_gather(rows.dropped, all_axes),
        overflowed_rows=lax.all_gather(rows.overflowed, all_axes),
    )


def _all_gather_body(
    x, router_kernel, w_gate_up, w_down, bias, *, top_k, activation, routing, capacity_factor, expert_axis, data_axes,
    backends
):  # fmt: skip
    """One device: x [T / mesh size, D] -> (its y rows, the batch's MoEAux); w_* hold its E / P experts."""
    group_x = lax.all_gather(x, expert_axis, tiled=True)  # the tokens of this device's expert-axis group
    routed = route_tokens(group_x, router_kernel, top_k, routing, bias, backends.route)
    group_sizes, sort_indices = expert_rows(routed, capacity_factor)
    num_local = w_down.shape[0]
    local_sizes, local_indices = local_expert_rows(
        group_sizes, sort_indices, lax.axis_index(expert_axis) * num_local, num_local
    )
    partial_y = routed_experts(
        group_x,
        routed,
        local_sizes,
        local_indices,
        w_gate_up,
        w_down,
        activation=activation,
        zero_tail=False,  # the other devices' experts' rows lie past the local sum
        backends=backends,
    )
    y = lax.psum_scatter(partial_y, expert_axis, tiled=True)
    num_token_groups = math.prod(lax.axis_size(axis) for axis in data_axes)
    rows = all_to_all.RowCounts.zero()._replace(received=jnp.sum(local_sizes))
    aux = _whole_batch_aux(routed, data_axes, num_token_groups, rows, (*data_axes, expert_axis))
    return y, aux


def _all_to_all_body(
    x, router_kernel, w_gate_up, w_down, bias, *, top_k, activation, routing, capacity_factor, buffer_factor,
    num_chunks, exchange, slot_factor, expert_axis, data_axes, backends
):  # fmt: skip
    """One device: x [T_local, D] -> (y [T_local, D], the batch's MoEAux); w_* hold its E / P experts."""
    routed = route_tokens(x, router_kernel, top_k, routing, bias, backends.route)
    group_sizes, sort_indices = expert_rows(routed, capacity_factor)
    chunk_tokens = x.shape[0] // num_chunks
    bound = None if buffer_factor is None else math.ceil(buffer_factor * chunk_tokens * top_k)
    all_axes = (*data_axes, expert_axis)
    y, rows = all_to_all.dispatch(
        x,
        routed,
        group_sizes,
        sort_indices,
        w_gate_up,
        w_down,
        num_chunks=num_chunks,
        bound=bound,
        exchange_kind=exchange,
        slot_factor=slot_factor,
        axis=expert_axis,
        sync_axes=all_axes,
        activation=activation,
        backends=backends,
    )
    num_devices = math.prod(lax.axis_size(axis) for axis in all_axes)
    return y, _whole_batch_aux(routed, all_axes, num_devices, rows, all_axes)
