"""Flax NNX modules: ``Router``, ``SharedExperts`` and ``MoE``. Parameters only; the math is in ``moe_jax.ops``.

Auxiliary values are *sown* as ``nnx.Intermediate`` under the name ``"moe_aux"`` (a ``MoEAux``): collect them with
``y, intermediates = nnx.capture(model, nnx.Intermediate)(x)`` (also inside ``nnx.jit`` / ``nnx.grad``).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from moe_jax.ops.glu_mlp.api import dense_glu_mlp
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, gate_up_block, pack_gate_up
from moe_jax.ops.moe_ffn.api import MoEAux, moe_ffn
from moe_jax.ops.quant.reference import QuantizedMaster
from moe_jax.ops.routing.api import Routing, RoutingOptions, balancing_bias_update, route, router_logits
from moe_jax.parallel.expert_parallel import moe_ffn_expert_parallel

# Experts are stacked on axis 0; "expert" is the mesh axis expert parallelism shards them over.
EXPERT_AXIS = "expert"


class RouterBias(nnx.Variable):
    """Aux-loss-free balancing bias [E] f32: changes which experts are selected, never the weights.

    Not an ``nnx.Param``, so an optimizer built with ``wrt=nnx.Param`` never trains it; it moves only through
    ``update_bias``.
    """


def _param(value: jax.Array, sharding: tuple[str | None, ...]) -> nnx.Param:
    """A parameter carrying its sharding names; placed eagerly only when the current mesh has those axes."""
    mesh = jax.sharding.get_abstract_mesh()
    named = {axis for axis in sharding if axis is not None}
    eager = not mesh.empty and named <= set(mesh.axis_names)
    return nnx.Param(value, out_sharding=sharding, eager_sharding=eager)


def _fan_in_init(in_axis: int, out_axis: int):
    return nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=(0,)
    )


def _packed_gate_up_init(key, shape: tuple[int, int, int], dtype) -> jax.Array:
    """A fan-in scaled [G, D, 2F] ``[gate | up]`` init, stored in the packed layout (``pack_gate_up``).

    Packing permutes columns only, so the stored array has the same shape and distribution; it happens once, here,
    and never in a step.
    """
    return pack_gate_up(_fan_in_init(1, 2)(key, shape, dtype)).array


def _weight(param: nnx.Param, dtype):
    """An expert weight parameter in the compute dtype; a ``QuantizedMaster`` as it is (the FP8 copies a training
    step made once for its micro-batches, ``moe_jax.quantize_master``, with the step's cast of the master)."""
    value = param.get_value()
    return value if isinstance(value, QuantizedMaster) else value.astype(dtype)


def _gate_up(param: nnx.Param, dtype) -> PackedGateUp:
    """A packed gate/up parameter [G, D, 2F] as the ops take it (no copy beyond the dtype cast)."""
    value = _weight(param, dtype)
    return PackedGateUp(value, gate_up_block(value.shape[2] // 2))


class Router(nnx.Module):
    """Linear router ``logits = x @ kernel`` (f32) followed by ``moe_jax.route``.

    Args:
      d_model: D.  num_experts: E.  top_k: k.
      routing: a ``RoutingOptions`` as in ``moe_jax.route``; its fields may also be passed as keywords.
      balance_bias: keep an aux-loss-free ``RouterBias`` [E] (zeros at init).
      param_dtype: dtype of the kernel [D, E].
      backend: "auto", "xla" or "pallas".
      rngs: ``nnx.Rngs`` with a ``params`` stream.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        *,
        routing: RoutingOptions | None = None,
        balance_bias: bool = False,
        param_dtype=jnp.float32,
        backend: str = "auto",
        rngs: nnx.Rngs,
        **routing_keywords,
    ):
        init = nnx.initializers.normal(d_model**-0.5)
        self.kernel = _param(init(rngs.params(), (d_model, num_experts), param_dtype), (None, None))
        self.bias = RouterBias(jnp.zeros((num_experts,), jnp.float32)) if balance_bias else None
        self.top_k = top_k
        self.routing = RoutingOptions.of(routing, routing_keywords)
        self.backend = backend

    @property
    def bias_value(self) -> jax.Array | None:
        return None if self.bias is None else self.bias[...]

    def __call__(self, x: jax.Array) -> Routing:
        """x: [T, D] -> ``Routing`` of T tokens."""
        return route(
            router_logits(x, self.kernel[...]),
            self.top_k,
            routing=self.routing,
            bias=self.bias_value,
            backend=self.backend,
        )

    def update_bias(self, expert_counts: jax.Array, rate: float) -> None:
        """One aux-loss-free balancing step from [E] per-expert counts (no-op without ``balance_bias``)."""
        if self.bias is not None:
            self.bias[...] = balancing_bias_update(self.bias[...], expert_counts, rate)


class SharedExperts(nnx.Module):
    """Always-on gated MLP ``act(x W_gate) * (x W_up) W_down`` added to the routed output (DeepSeek-style).

    Runs as ``dense_glu_mlp``, the one-group ``glu_mlp``: unquantized on XLA's dense matmuls, with ``quantization``
    as the routed experts' FP8 ``glu_mlp`` (its kernels or, with backend "xla", its reference). ``w_gate_up``
    [1, D, 2F] is stored packed, as ``MoE.w_gate_up`` is.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str,
        param_dtype,
        backend: str,
        rngs: nnx.Rngs,
        quantization: str | None = None,
    ):
        self.w_gate_up = nnx.Param(_packed_gate_up_init(rngs.params(), (1, d_model, 2 * d_ff), param_dtype))
        self.w_down = nnx.Param(_fan_in_init(1, 2)(rngs.params(), (1, d_ff, d_model), param_dtype))
        self.activation = activation
        self.backend = backend
        self.quantization = quantization

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [T, D] in the compute dtype -> [T, D]."""
        w_gate_up, w_down = _gate_up(self.w_gate_up, x.dtype), _weight(self.w_down, x.dtype)
        options = dict(activation=self.activation, backend=self.backend, quantization=self.quantization)
        return dense_glu_mlp(x, w_gate_up, w_down, **options)


class MoE(nnx.Module):
    """Mixture-of-Experts feed-forward layer (dropless by default) over ``moe_jax.moe_ffn``.

    Args:
      d_model: D.  d_ff: F, the hidden size of one expert.  num_experts: E.  top_k: k.
      activation: "swiglu", "geglu" or "gpt_oss".
      routing: a ``RoutingOptions`` as in ``moe_jax.route``; its fields may also be passed as keywords.
      capacity_factor: None (dropless) or the per-expert capacity factor.
      balance_bias: keep an aux-loss-free router bias (see ``update_bias``).
      num_shared_experts: width, in units of d_ff, of an always-on shared expert MLP (0: none).
      dtype: compute dtype (None: the input's).  param_dtype: dtype of the parameters.
      backend: "auto", "xla" or "pallas".
      quantization: None, "fp8_block" or "mxfp8": the routed and shared experts' GEMMs on block-scaled FP8 operands
        (``moe_jax.moe_ffn``'s); the parameters stay in ``param_dtype`` and are quantized on every call, unless a
        training step set them to ``QuantizedMaster`` values made once for its micro-batches (``train``'s
        ``gradients`` does); the router stays in high precision.
      expert_parallel: run the layer with the routed experts split over the current mesh's "expert" axis
        (``moe_jax.parallel.moe_ffn_expert_parallel`` under ``jax.shard_map``, the shared experts inside it); call
        the layer under ``jax.set_mesh``. False: one ``moe_ffn`` that XLA partitions.
      dispatch, buffer_factor, num_chunks: ``moe_ffn_expert_parallel``'s, with ``expert_parallel`` only.
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Parameters: ``router.kernel`` [D, E], ``w_gate_up`` [E, D, 2F], ``w_down`` [E, F, D]; the expert axis carries the
    sharding name "expert". ``w_gate_up`` is stored in the packed layout the kernels read (``moe_jax.pack_gate_up``:
    blocks of 64 gate columns, each followed by the matching 64 up columns), so no step repacks it;
    ``moe_jax.unpack_gate_up(moe_jax.PackedGateUp(w, gate_up_block(F)))`` gives the ``[gate | up]`` view (e.g. to
    export weights), with ``gate_up_block`` from ``moe_jax.ops.grouped_matmul.packing``.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        *,
        activation: str = "swiglu",
        routing: RoutingOptions | None = None,
        capacity_factor: float | None = None,
        balance_bias: bool = False,
        num_shared_experts: int = 0,
        dtype=None,
        param_dtype=jnp.float32,
        backend: str = "auto",
        quantization: str | None = None,
        expert_parallel: bool = False,
        dispatch: str = "auto",
        buffer_factor: float | None = None,
        num_chunks: int = 1,
        rngs: nnx.Rngs,
        **routing_keywords,
    ):
        self.router = Router(
            d_model,
            num_experts,
            top_k,
            routing=RoutingOptions.of(routing, routing_keywords),
            balance_bias=balance_bias,
            param_dtype=param_dtype,
            backend=backend,
            rngs=rngs,
        )
        expert_sharding = (EXPERT_AXIS, None, None)
        gate_up = _packed_gate_up_init(rngs.params(), (num_experts, d_model, 2 * d_ff), param_dtype)
        self.w_gate_up = _param(gate_up, expert_sharding)
        self.w_down = _param(
            _fan_in_init(1, 2)(rngs.params(), (num_experts, d_ff, d_model), param_dtype), expert_sharding
        )
        self.shared = (
            SharedExperts(
                d_model,
                num_shared_experts * d_ff,
                activation=activation,
                param_dtype=param_dtype,
                backend=backend,
                rngs=rngs,
                quantization=quantization,
            )
            if num_shared_experts
            else None
        )
        self.activation = activation
        self.capacity_factor = capacity_factor
        self.dtype = dtype
        self.backend = backend
        self.quantization = quantization
        self.expert_parallel = expert_parallel
        if not expert_parallel and (dispatch, buffer_factor, num_chunks) != ("auto", None, 1):
            raise ValueError(
                f"dispatch={dispatch!r}, buffer_factor={buffer_factor} and num_chunks={num_chunks} configure the "
                "expert-parallel layer: pass them with expert_parallel=True"
            )
        self.dispatch = dispatch
        self.buffer_factor = buffer_factor
        self.num_chunks = num_chunks

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in the compute dtype; sows a ``MoEAux`` as ``nnx.Intermediate`` "moe_aux"."""
        dtype = self.dtype or x.dtype
        tokens = x.reshape(-1, x.shape[-1]).astype(dtype)
        if self.expert_parallel:
            shared = None
            if self.shared is not None:
                shared = (_gate_up(self.shared.w_gate_up, dtype), _weight(self.shared.w_down, dtype))
            layer = functools.partial(
                moe_ffn_expert_parallel,
                expert_axis=EXPERT_AXIS,
                dispatch=self.dispatch,
                buffer_factor=self.buffer_factor,
                num_chunks=self.num_chunks,
                shared_experts=shared,
            )
        else:
            layer = moe_ffn
        y, aux = layer(
            tokens,
            self.router.kernel[...],
            _gate_up(self.w_gate_up, dtype),
            _weight(self.w_down, dtype),
            top_k=self.router.top_k,
            activation=self.activation,
            bias=self.router.bias_value,
            capacity_factor=self.capacity_factor,
            backend=self.backend,
            routing=self.router.routing,
            quantization=self.quantization,
        )
        if self.expert_parallel and jax.typeof(y).sharding.spec != jax.typeof(tokens).sharding.spec:
            # Under Explicit axes y comes back sharded over the tokens: back to the layout of the tokens it replaces.
            y = jax.sharding.reshard(y, jax.typeof(tokens).sharding.spec)
        if self.shared is not None and not self.expert_parallel:
            y = y + self.shared(tokens)
        # Outside nnx.capture there is nowhere to put it: sowing is then a no-op.
        self.sow(nnx.Intermediate, "moe_aux", aux, capture_noop=True)
        return y.reshape(x.shape)

    def update_bias(self, expert_counts: jax.Array, rate: float) -> None:
        """One aux-loss-free balancing step of the router bias from [E] counts (e.g. ``MoEAux.expert_counts``)."""
        self.router.update_bias(expert_counts, rate)


def update_balancing_biases(model: nnx.Module, intermediates: nnx.State, rate: float) -> None:
    """Applies ``MoE.update_bias`` to every MoE in ``model`` from the ``MoEAux`` it sowed into ``intermediates``.

    ``intermediates`` is what ``nnx.capture(model, nnx.Intermediate)`` returned beside the forward pass's output.
    """
    flat_aux = dict(nnx.to_flat_state(intermediates))
    for path, module in nnx.iter_graph(model):
        if isinstance(module, MoE):
            sown = flat_aux.get((*path, "moe_aux"))
            if sown is not None:
                # A layer called several times in one forward sowed one MoEAux per call: balance their sum.
                counts = sum(aux.expert_counts for aux in sown.get_value())
                module.update_bias(counts, rate)


__all__ = ["MoE", "MoEAux", "Router", "RouterBias", "SharedExperts", "update_balancing_biases"]
