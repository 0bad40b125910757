"""moe_jax: fused Mixture-of-Experts layers for JAX on NVIDIA Hopper.

The public surface (re-exports only): ``route`` (with ``Routing``, ``RoutingOptions``, ``apply_capacity``,
``load_balancing_loss`` and ``z_loss``), ``grouped_matmul`` (with ``pack_gate_up`` / ``unpack_gate_up`` /
``PackedGateUp`` for the GLU weight layout), ``glu_mlp`` (``dense_glu_mlp``: its one-group form, the shared
experts'), ``permute``, ``combine``, ``moe_ffn`` (with ``MoEAux``), ``quantize_blockwise`` and
``quantize_blockwise_with_transpose`` (block-scaled FP8, ``BlockScaled``; ``from_qarray`` / ``to_qarray`` convert to
and from qwix's ``QArray``), ``quantize_master`` (weights with the FP8 kernels' copies made once,
``QuantizedMaster``), the Flax NNX modules in ``moe_jax.nn`` and expert parallelism in ``moe_jax.parallel``;
``compile_lowered`` compiles a lowered program with its Mosaic GPU kernels in parallel, and
``compiling_kernels_while_lowering`` starts each kernel's compilation as soon as it is lowered
(``moe_jax.compilation``); ``configure_cpu_interpreter`` prepares a CPU host's XLA for kernels run under the Mosaic
GPU interpreter (importing moe_jax changes no environment variable).
"""

from moe_jax import nn, parallel
from moe_jax._core.hardware import configure_cpu_interpreter
from moe_jax.compilation import compile_lowered, compiling_kernels_while_lowering
from moe_jax.ops.glu_mlp.api import dense_glu_mlp, glu_mlp
from moe_jax.ops.grouped_matmul.api import grouped_matmul, quantize_master
from moe_jax.ops.grouped_matmul.packing import PackedGateUp, pack_gate_up, unpack_gate_up
from moe_jax.ops.moe_ffn.api import MoEAux, moe_ffn
from moe_jax.ops.permute.api import combine, permute
from moe_jax.ops.quant.api import BlockScaled, quantize_blockwise, quantize_blockwise_with_transpose
from moe_jax.ops.quant.qwix_interop import from_qarray, to_qarray
from moe_jax.ops.quant.reference import QuantizedMaster
from moe_jax.ops.routing.api import Routing, RoutingOptions, apply_capacity, load_balancing_loss, route, z_loss

__all__ = [
    "BlockScaled",
    "MoEAux",
    "PackedGateUp",
    "QuantizedMaster",
    "Routing",
    "RoutingOptions",
    "apply_capacity",
    "combine",
    "compile_lowered",
    "compiling_kernels_while_lowering",
    "configure_cpu_interpreter",
    "dense_glu_mlp",
    "from_qarray",
    "glu_mlp",
    "grouped_matmul",
    "load_balancing_loss",
    "moe_ffn",
    "nn",
    "parallel",
    "pack_gate_up",
    "permute",
    "quantize_blockwise",
    "quantize_blockwise_with_transpose",
    "quantize_master",
    "route",
    "to_qarray",
    "unpack_gate_up",
    "z_loss",
]
