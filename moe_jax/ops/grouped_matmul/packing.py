"""Gate/up weights packed for the fused GLU epilogue: ``PackedGateUp``, ``pack_gate_up``, ``unpack_gate_up``.

A CTA of the GLU GEMM computes ``act(gate) * up`` in registers, so it must hold the gate and the up columns of the same
F range. In the public ``[gate | up]`` layout (docs/design.md) those are F columns apart; packed, they sit side by side.
The N axis (2F) is cut into blocks of ``block`` gate columns, each followed by the matching ``block`` up columns:

    [gate | up]   g0 g1 ... g63 g64 ... g(F-1) | u0 u1 ... u63 u64 ... u(F-1)
    packed        g0 ... g63 u0 ... u63 | g64 ... g127 u64 ... u127 | ...          (block = 64)

Every GEMM output tile of 2 * block * j packed columns then holds the gate and up columns of j * block hidden
columns, whatever the kernel's tile width (128 or 256). The pre-activation ``x @ w`` [M, 2F], its gradient and the
weight gradient all stay in the packed order, so the Pallas path never unpacks anything; the XLA path splits the GEMM
output instead (``split_gate_up``, a strided view of the activations, no weight copy).

``block`` is 64 (one 128-byte swizzle row of bf16, the kernels' epilogue chunk) when F is a multiple of 64. Otherwise
it is F, which makes the packed layout the unpacked one (no kernel runs such shapes anyway).
"""

import dataclasses

import jax
import jax.numpy as jnp

PACK_BLOCK = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedGateUp:
    """Gate/up weights in the packed layout (a pytree: ``array`` is its only leaf; gradients come back packed).

    Attributes:
      array: [G, K, 2F] in packed column order, or [G, 2F, K] (K-major) when ``transposed``.
      block: the interleave width (``gate_up_block(F)``).
      transposed: the array is [G, 2F, K]; ``grouped_matmul``'s ``transpose_rhs`` must say the same.
    """

    array: jax.Array
    block: int = dataclasses.field(metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape: packing permutes columns, so it is the unpacked shape too."""
        return self.array.shape

    @property
    def dtype(self):
        return self.array.dtype

    def astype(self, dtype) -> "PackedGateUp":
        return dataclasses.replace(self, array=self.array.astype(dtype))


def stored_array(weights):
    """The array a ``PackedGateUp`` holds; any other weights as they are."""
    return weights.array if isinstance(weights, PackedGateUp) else weights


def gate_up_block(d_ff: int) -> int:
    """The interleave width for F = ``d_ff`` hidden columns: PACK_BLOCK where it divides F, else F (no interleave)."""
    return PACK_BLOCK if d_ff % PACK_BLOCK == 0 else d_ff


def _check_gate_up(name: str, w, axis: int) -> int:
    if not hasattr(w, "shape") or len(w.shape) != 3:
        layout = "[G, 2F, K]" if axis == 1 else "[G, K, 2F]"
        raise ValueError(f"{name} must have shape {layout} (rank 3), got {getattr(w, 'shape', type(w).__name__)}")
    if w.shape[axis] % 2:
        raise ValueError(f"{name}: axis {axis} holds [gate | up] and must be even, got shape {w.shape}")
    return w.shape[axis] // 2


def _swap_halves_and_blocks(w: jax.Array, axis: int, block: int, *, to_packed: bool) -> jax.Array:
    """Views axis ``axis`` (2F) as (2, F/block, block) and swaps the first two of those (or the reverse)."""
    d_ff = w.shape[axis] // 2
    before, after = w.shape[:axis], w.shape[axis + 1 :]
    split = (2, d_ff // block) if to_packed else (d_ff // block, 2)
    return w.reshape(*before, *split, block, *after).swapaxes(axis, axis + 1).reshape(w.shape)


def pack_gate_up(w_gate_up: jax.Array, *, transposed: bool = False) -> PackedGateUp:
    """[gate | up] weights -> ``PackedGateUp`` (one copy: pack once, at initialisation or when loading).

    Args:
      w_gate_up: [G, K, 2F], or [G, 2F, K] with ``transposed``.
      transposed: the 2F axis is axis 1.
    """
    axis = 1 if transposed else 2
    block = gate_up_block(_check_gate_up("w_gate_up", w_gate_up, axis))
    return PackedGateUp(_swap_halves_and_blocks(w_gate_up, axis, block, to_packed=True), block, transposed)


def unpack_gate_up(packed: PackedGateUp) -> jax.Array:
    """``PackedGateUp`` -> the [gate | up] array ([G, K, 2F], or [G, 2F, K] when transposed)."""
    if not isinstance(packed, PackedGateUp):
        raise TypeError(f"packed must be a PackedGateUp, got {type(packed).__name__}")
    axis = 1 if packed.transposed else 2
    _check_gate_up("packed.array", packed.array, axis)
    return _swap_halves_and_blocks(packed.array, axis, packed.block, to_packed=False)


def split_gate_up(z: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """The gate and up halves [..., F] of a pre-activation [..., 2F] in packed order (block F: plain halves)."""
    *lead, cols = z.shape
    d_ff = cols // 2
    blocks = z.reshape(*lead, d_ff // block, 2, block)
    return blocks[..., 0, :].reshape(*lead, d_ff), blocks[..., 1, :].reshape(*lead, d_ff)


def join_gate_up(gate: jax.Array, up: jax.Array, block: int) -> jax.Array:
    """``split_gate_up``'s inverse: the halves [..., F] back into one [..., 2F] in packed order (block F: plain
    halves)."""
    *lead, d_ff = gate.shape
    blocks = [half.reshape(*lead, d_ff // block, 1, block) for half in (gate, up)]
    return jnp.concatenate(blocks, axis=-2).reshape(*lead, 2 * d_ff)
