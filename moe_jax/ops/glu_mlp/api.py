"""``moe_jax.glu_mlp``: the routed experts' gated MLP ``(act(x W_gate) * x W_up) W_down``, scaled per row, as one op.

As two ``grouped_matmul`` calls the forward is already fused (GLU in the gate_up epilogue, row scale in the down
epilogue); what one op adds is the backward. Its ``custom_vjp`` (backend="pallas") runs

    forward   h, gu = gate_up kernel (x, W_gu)          GLU epilogue; gu = the packed pre-activation [M, 2F], kept
              y     = down kernel (h, W_d)              row-scale epilogue
    backward  d_gu, h*s, d_s = glu_dgrad kernel (dy, W_d^T; gu, s)   the GLU backward in the dgrad epilogue:
                             e = dy W_d^T, d_h = s e, (d_gate, d_up) = GLU'(gu) d_h, d_s = sum_f h e (partials)
              d W_d  = wgrad (h*s, dy)
              d x    = dgrad (d_gu, W_gu^T);  d W_gu = wgrad (x, d_gu)        both in the packed layout

so no elementwise pass over [M, 2F] runs outside a GEMM epilogue, and h is never kept: the epilogue recomputes it
from gu. What the backward keeps is x and gu (bf16, M * 2F * 2 bytes). With ``recompute_gate_up=True`` it keeps only
x and recomputes gu = x W_gu with the forward kernel at the start of the backward: one more GEMM (2 M D 2F FLOPs,
two thirds of the MLP's forward FLOPs) for M * 2F * 2 fewer bytes. Keeping gu is the default: at the
Qwen3-30B-A3B layer (M = 131072, D = 2048, F = 768) it is 0.4 GB written once and read once (~0.3 ms at 3 TB/s)
against a 0.82-TFLOP GEMM (~1.9 ms at the 430 TF/s issue #3's gate_up kernel reached). Measured on an H200
(``python -m benchmarks --bench glu``, benchmarks/RESULTS.md): the backward with gu kept took 22-26% less time than
with the recompute at the qwen3-30b, dsv3-ep8 and mixtral gate_up shapes.

``routed_glu_mlp`` (what ``moe_ffn`` calls) takes the tokens [T, D] and the routing's sort indices instead of sorted
rows: where that pays (F <= 2048) the gate_up kernel gathers its rows from the tokens, so the [T * k, D] permuted copy
is never written, and the backward keeps the tokens rather than the rows.
"""

import functools

import jax
import jax.numpy as jnp

from moe_jax._core import checks
from moe_jax._core.backend import resolve_backend
from moe_jax.ops.glu_mlp import reference
from moe_jax.ops.grouped_matmul import sm90
from moe_jax.ops.grouped_matmul.api import (
    ArgNames,
    check_grouped_matmul_args,
    gemm_grads,
    kernel_unsupported,
    rows_config,
    run_forward_kernel,
    run_rows_kernel,
    run_wgrad_kernel,
)
from moe_jax.ops.grouped_matmul.glu import glu_grad
from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK, PackedGateUp, pack_gate_up
from moe_jax.ops.grouped_matmul.reference import ACTIVATIONS
from moe_jax.ops.permute.api import combine, permute
from moe_jax.ops.permute.config import supports as permute_supports

# The two GEMMs' operands and dimensions as glu_mlp's caller knows them; the down projection's lhs is the hidden
# activation, which has x's dtype.
GATE_UP_NAMES = ArgNames(op="glu_mlp", lhs="x", rhs="w_gate_up", k="D", n="2F")
DOWN_NAMES = ArgNames(op="glu_mlp", lhs="x (the hidden activations' dtype)", rhs="w_down", k="F", n="D")

# The GLU backwards that compute h, d_gate and d_up each in its own store's branch (sm90.Epilogue.recompute_grads),
# on tiles of at most RECOMPUTE_MAX_BLOCK_N columns. Computed together, next to a 128-column accumulator, gpt_oss's
# and geglu's terms spill registers (292 / 320 bytes, swiglu's 44); recomputed per output nothing spills, for two
# more sigmoids (or tanhs) per element. CUPTI device time with GLU_DGRAD_RING, H100, row scale (benchmarks/
# RESULTS.md, 2026-11-27, twelfth session), together -> recomputed: gpt_oss 447 -> 394 us at qwen3-30b down, 2007 ->
# 1675 at gpt-oss-120b down; geglu 1891 -> 1552 at gpt-oss-120b down; swiglu 342 -> 367 and 1480 -> 1562 (slower).
# Next to a 256-column accumulator (GLU_DGRAD_WIDE_RING, dsv3-ep8 down) recomputing was slower for all three: swiglu
# 1647 -> 2111, geglu 1796 -> 2180, gpt_oss 2500 -> 2590. The same held where first measured in the thirteenth
# session (GLU_DGRAD_RING, H100): geglu 425 -> 364 us at qwen3-30b down; at mixtral down gpt_oss 4432 -> 3766, geglu
# 4168 -> 3567, swiglu 3442 -> 3589 (slower): the register counts depend on the tile, not the shape.
RECOMPUTED_GRADS = ("gpt_oss", "geglu")
RECOMPUTE_MAX_BLOCK_N = 128


def check_glu_mlp_args(x, w_gate_up, w_down, group_sizes, *, activation, row_scale, backend="xla") -> tuple:
    """Validates ``glu_mlp``'s arguments; returns (M, D, F, G). backend="pallas" checks the kernels' limits too."""
    checks.check_choice("activation", activation, ACTIVATIONS)
    if isinstance(w_gate_up, PackedGateUp) and w_gate_up.transposed:
        raise ValueError("w_gate_up: glu_mlp takes [G, D, 2F] weights; got a transposed PackedGateUp")
    num_rows, d_model, gate_up_cols, num_groups = check_grouped_matmul_args(
        x,
        w_gate_up,
        group_sizes,
        activation=activation,
        row_scale=None,
        preferred_element_type=None,
        transpose_rhs=False,
        backend=backend,
        names=GATE_UP_NAMES,
    )
    d_ff = gate_up_cols // 2
    down_shape = checks.check_rank("w_down", w_down, 3, "[G, F, D]")
    if down_shape != (num_groups, d_ff, d_model):
        raise ValueError(f"w_down must have shape [G, F, D] = {(num_groups, d_ff, d_model)}, got {down_shape}")
    hidden = jax.ShapeDtypeStruct((num_rows, d_ff), x.dtype)
    check_grouped_matmul_args(
        hidden,
        w_down,
        group_sizes,
        activation=None,
        row_scale=row_scale,
        preferred_element_type=None,
        transpose_rhs=False,
        backend=backend,
        names=DOWN_NAMES,
    )
    return num_rows, d_model, d_ff, num_groups


def glu_mlp(
    x: jax.Array,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str = "swiglu",
    row_scale: jax.Array | None = None,
    recompute_gate_up: bool = False,
    zero_tail: bool = True,
    backend: str = "auto",
) -> jax.Array:
    """Grouped gated MLP: ``y_r = row_scale_r * (act(x_r W_gate[g]) * (x_r W_up[g])) W_down[g]`` for rows r of group g.

    Equal to ``grouped_matmul(grouped_matmul(x, w_gate_up, group_sizes, activation=activation), w_down, group_sizes,
    row_scale=row_scale)`` (the hidden activations rounded to x.dtype in between), with a fused backward.

    Args:
      x: [M, D] rows sorted by group.
      w_gate_up: [G, D, 2F] ``[gate | up]`` weights, or a ``PackedGateUp`` of them (``pack_gate_up``: what the Pallas
        path reads; a plain array is packed on every call there).
      w_down: [G, F, D].
      group_sizes: [G] int32; rows at or past ``sum(group_sizes)`` give zeros.
      activation: "swiglu", "geglu" or "gpt_oss" (defined in ``grouped_matmul``).
      row_scale: optional [M] float (the routing weights); gets a gradient.
      recompute_gate_up: backend="pallas": recompute the [M, 2F] pre-activation in the backward instead of keeping
        it (less activation memory, one more GEMM).
      zero_tail: False lets the Pallas path leave the result's rows past ``sum(group_sizes)`` unwritten (their
        values unspecified) and skip them in every kernel of the backward: for callers that never read those rows,
        e.g. ``combine(..., num_rows=sum(group_sizes))``. Gradients stay exact.
      backend: "auto", "xla" or "pallas" ("pallas" needs bf16/f16, D and F multiples of 64).

    Returns:
      [M, D] in x.dtype.
    """
    _, d_model, d_ff, _ = check_glu_mlp_args(
        x, w_gate_up, w_down, group_sizes, activation=activation, row_scale=row_scale, backend=backend
    )
    supported = (
        kernel_unsupported(x, d_model, 2 * d_ff, activation) is None and kernel_unsupported(x, d_ff, d_model) is None
    )
    group_sizes = group_sizes.astype(jnp.int32)
    if resolve_backend(backend, op="glu_mlp", has_kernel=supported) == "xla":
        return reference.glu_mlp(x, w_gate_up, w_down, group_sizes, activation=activation, row_scale=row_scale)
    return _run_pallas(
        x, None, None, w_gate_up, w_down, group_sizes, row_scale, activation, recompute_gate_up, zero_tail
    )


def routed_glu_mlp(
    x: jax.Array,
    sort_indices: jax.Array,
    top_k: int,
    w_gate_up: jax.Array | PackedGateUp,
    w_down: jax.Array,
    group_sizes: jax.Array,
    *,
    activation: str = "swiglu",
    row_scale: jax.Array | None = None,
    fuse_gather: bool | None = None,
    zero_tail: bool = True,
    positions: jax.Array | None = None,
    backend: str = "auto",
) -> jax.Array:
    """``glu_mlp(permute(x, sort_indices, top_k), ...)``, on the Pallas path with the permute fused into the gate_up
    kernel's loads where that pays.

    Fused, the expert-sorted rows [T * k, D] are never written: the gate_up kernel gathers row r from
    ``x[sort_indices[r] // top_k]`` (grouped_matmul/sm90_gather.py), and the backward recomputes the sorted rows for
    the gate_up weights' gradient and sums each token's k row gradients (``combine``) for x's. Otherwise (backend
    "xla", shapes without a kernel, or ``fuse_gather`` off) it is the composition itself.

    Args:
      x: [T, D] tokens.
      sort_indices: [T * k] int32 from ``Routing.sort_indices`` (or ``apply_capacity``).
      top_k: k, the experts per token.
      w_gate_up, w_down, group_sizes, activation, row_scale, zero_tail, backend: as ``glu_mlp``'s, for the T * k
        sorted rows.
      fuse_gather: Pallas path: gather inside the gate_up kernel (True) or permute first (False); None decides by
        the hidden width F (``fuses_gather``).
      positions: optional [T, k] int32, the inverse of ``sort_indices`` (``Routing.positions``), for ``permute``.

    Returns:
      [T * k, D] in x.dtype, in expert-sorted order (what ``combine`` takes).
    """
    num_tokens, d_model = checks.check_rank("x", x, 2, "[T, D]")
    checks.check_positive_int("top_k", top_k)
    checks.check_rank("sort_indices", sort_indices, 1, "[T * k]")
    checks.check_int32("sort_indices", sort_indices)
    checks.check_dim("sort_indices", sort_indices.shape[0], num_tokens * top_k, "length (T * top_k)")
    rows = jax.ShapeDtypeStruct((num_tokens * top_k, d_model), x.dtype)
    _, _, d_ff, _ = check_glu_mlp_args(
        rows, w_gate_up, w_down, group_sizes, activation=activation, row_scale=row_scale, backend=backend
    )
    supported = (
        kernel_unsupported(x, d_model, 2 * d_ff, activation) is None and kernel_unsupported(x, d_ff, d_model) is None
    )
    pallas = resolve_backend(backend, op="glu_mlp", has_kernel=supported) == "pallas"
    if pallas and (fuses_gather(d_ff) if fuse_gather is None else fuse_gather):
        group_sizes = group_sizes.astype(jnp.int32)
        return _run_pallas(
            x, sort_indices, top_k, w_gate_up, w_down, group_sizes, row_scale, activation, False, zero_tail
        )
    rows = permute(x, sort_indices, top_k, positions=positions, backend=_rows_backend(x) if pallas else "xla")
    mlp_backend = "pallas" if pallas else "xla"
    return glu_mlp(
        rows,
        w_gate_up,
        w_down,
        group_sizes,
        activation=activation,
        row_scale=row_scale,
        zero_tail=zero_tail,
        backend=mlp_backend,
    )


# Fusing the gather saves the permute, whose share of the gate_up kernel's time shrinks as 1 / F (bytes ~ M D against
# FLOPs ~ M D F), and changes what the kernel reads: cp.async rows of x [T, D] instead of TMA boxes of the sorted rows
# [T * k, D]. At qwen3 (F = 768) that costs the kernel 4-7% and wins (H200 and H100). At deepseek-v3 (F = 2048) the
# gathered kernel was *faster* than the one on sorted rows on an H100 on 2026-11-26 (the layer's forward span
# 23180 / 23355 -> 21651 / 21694 µs); with the configs of 2026-11-28 it is 7-9% slower as a kernel, and the layer's
# span ties with permuting first (20579 against 20590 µs, median of 60 calls each, alternating; RESULTS.md,
# 2026-11-28 twenty-third session), so gathering stays: it also keeps x [T, D] for the backward instead of the sorted
# rows. (On an H200 with the kernels of 2026-11-22 the layer was 2-6% slower gathering: RESULTS.md, 1a72dcc; not
# re-measured since.) At gpt-oss-120b (F = 2880, H100) the gather costs the kernel 187-215 µs against a 171-µs
# permute: the layer's span 5437 / 5423 -> 5471 / 5445 µs. At F = 14336 (mixtral, H200) a 5% loss.
# docs/kernels/routing.md, "The gather inside the gate_up kernel".
GATHER_MAX_D_FF = 2048


def fuses_gather(d_ff: int) -> bool:
    """Whether ``routed_glu_mlp`` gathers inside the gate_up kernel by default, for hidden width ``d_ff`` (F)."""
    return d_ff <= GATHER_MAX_D_FF


def _rows_backend(x) -> str:
    """Where the sorted rows of x are moved: the permute/combine kernels where they take x's width, else XLA."""
    return "pallas" if permute_supports(x.shape[1], x.dtype) else "xla"


def _run_pallas(
    x, sort_indices, top_k, w_gate_up, w_down, group_sizes, row_scale, activation, recompute_gate_up, zero_tail
):
    if not isinstance(w_gate_up, PackedGateUp):
        w_gate_up = pack_gate_up(w_gate_up)
    scale = None if row_scale is None else row_scale.astype(jnp.float32)
    args = (x, w_gate_up.array, w_down, group_sizes, scale, sort_indices)
    return _pallas_glu_mlp(*args, top_k, activation, recompute_gate_up, zero_tail)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _pallas_glu_mlp(
    x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, top_k, activation, recompute_gate_up, zero_tail
):
    """x [M, D] (or [T, D] tokens gathered by sort_indices // top_k), packed w_gate_up [G, D, 2F], w_down [G, F, D]
    -> [M, D] in x.dtype (rows past the sum unwritten unless ``zero_tail``)."""
    del recompute_gate_up  # a backward option
    row_tokens = _row_tokens(sort_indices, top_k)
    hidden = _gate_up(x, w_gate_up, group_sizes, activation, row_tokens, keep=False, zero_tail=zero_tail)
    return _down(hidden, w_down, group_sizes, row_scale, zero_tail)


def _row_tokens(sort_indices, top_k):
    """The token of each sorted row (None: the rows are x's own)."""
    return None if sort_indices is None else sort_indices // top_k


def _gate_up(x, w_gate_up, group_sizes, activation, row_tokens, *, keep: bool, zero_tail: bool):
    """hidden [M, F], or (hidden, packed pre-activation [M, 2F] rounded for the backward)."""
    return run_forward_kernel(
        x,
        w_gate_up,
        group_sizes,
        None,
        activation,
        x.dtype,
        False,
        keep=keep,
        row_tokens=row_tokens,
        zero_tail=zero_tail,
    )


def _down(hidden, w_down, group_sizes, row_scale, zero_tail: bool):
    """[M, D] = hidden · w_down[g], rows scaled by ``row_scale`` (if any) in the epilogue."""
    return run_forward_kernel(
        hidden, w_down, group_sizes, row_scale, None, hidden.dtype, False, keep=False, zero_tail=zero_tail
    )


def _glu_mlp_fwd(
    x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, top_k, activation, recompute_gate_up, zero_tail
):
    row_tokens = _row_tokens(sort_indices, top_k)
    gate_up_args = (x, w_gate_up, group_sizes, activation, row_tokens)
    if recompute_gate_up:
        hidden, gate_up = _gate_up(*gate_up_args, keep=False, zero_tail=zero_tail), None
    else:
        hidden, gate_up = _gate_up(*gate_up_args, keep=True, zero_tail=zero_tail)
    y = _down(hidden, w_down, group_sizes, row_scale, zero_tail)
    return y, (x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, gate_up)


def rows_in_groups(group_sizes, num_rows: int) -> jax.Array:
    """int32 scalar: the rows of the M = ``num_rows`` that belong to a group, ``sum(group_sizes)`` clipped to M."""
    return jnp.minimum(jnp.sum(jnp.maximum(group_sizes, 0)), num_rows).astype(jnp.int32)


def run_glu_dgrad(d_y, w_down, group_sizes, gate_up, row_scale, activation: str, *, config=None, zero_tail=True):
    """The down projection's dgrad with the GLU backward in its epilogue (the "glu_dgrad" kernel).

    Args:
      d_y: [M, D]; w_down: [G, F, D], read transposed (the kernel's output columns are F); group_sizes: [G] int32;
      gate_up: [M, 2F] packed pre-activation in d_y's dtype; row_scale: [M] f32 or None; activation: the GLU's;
      config: the tile config (None: the table's or the heuristic's); zero_tail: run_rows_kernel's.

    Returns:
      (d_gate_up [M, 2F] packed, h * row_scale [M, F], d_row_scale [M] f32 or None), in d_y's dtype. Rows past
      sum(group_sizes) have no product (it is 0 there), so their d_gate_up and d_row_scale are 0; h * row_scale is
      computed from ``gate_up`` on every row (zero in ``glu_mlp``, whose forward writes zero pre-activations there).
      With ``zero_tail=False`` the first two are left unwritten there and d_row_scale is still 0.
    """
    if config is None:
        # gpt_oss's clamps narrow the table's tiles (config.CLAMPED_BLOCK_N).
        config = rows_config(
            "glu_dgrad",
            d_y.shape[0],
            w_down,
            w_transposed=True,
            out_dtype=d_y.dtype,
            row_scale=row_scale is not None,
            clamped=activation == "gpt_oss",
        )
    epilogue = sm90.Epilogue(
        activation_grad=functools.partial(glu_grad, activation=activation),
        row_scale=row_scale is not None,
        recompute_grads=activation in RECOMPUTED_GRADS and config.block_n <= RECOMPUTE_MAX_BLOCK_N,
        pack=PACK_BLOCK,
    )
    d_gate_up, hidden_scaled, d_row_scale = run_rows_kernel(
        "glu_dgrad",
        d_y,
        w_down,
        group_sizes,
        w_transposed=True,
        out_dtype=d_y.dtype,
        config=config,
        epilogue=epilogue,
        row_scale=row_scale,
        gate_up=gate_up,
        zero_tail=zero_tail,
    )
    if zero_tail or d_row_scale is None:
        return d_gate_up, hidden_scaled, d_row_scale
    # The row sums of rows without a tile are read from other tiles' partials: select them away.
    rows = jnp.arange(d_y.shape[0], dtype=jnp.int32)
    d_row_scale = jnp.where(rows < rows_in_groups(group_sizes, d_y.shape[0]), d_row_scale, 0)
    return d_gate_up, hidden_scaled, d_row_scale


def _glu_mlp_bwd(top_k, activation, recompute_gate_up, zero_tail, residuals, d_y):
    """The GLU MLP's VJP. Without ``zero_tail`` (d_y's rows past the sum are not the result's: ignored) the kernels
    skip those rows and what is left unwritten there never reaches a gradient: the wgrad kernels mask rows outside
    a group, d_row_scale is selected, and x's gradient comes from rows the caller reads (the dgrad writes zeros past
    the sum for an x of rows; a gathered x sums only the rows before it)."""
    x, w_gate_up, w_down, group_sizes, row_scale, sort_indices, gate_up = residuals
    d_y = d_y.astype(x.dtype)  # wgmma multiplies equal dtypes; accumulation stays f32
    if recompute_gate_up:
        # The forward kernel again, so that the backward sees the very bits it would have kept (the hidden output
        # is written and dropped: half the pre-activation's bytes, for one kernel to maintain).
        row_tokens = _row_tokens(sort_indices, top_k)
        _, gate_up = _gate_up(x, w_gate_up, group_sizes, activation, row_tokens, keep=True, zero_tail=zero_tail)
    d_gate_up, hidden_scaled, d_row_scale = run_glu_dgrad(
        d_y, w_down, group_sizes, gate_up, row_scale, activation, zero_tail=zero_tail
    )
    d_w_down = run_wgrad_kernel(hidden_scaled, d_y, group_sizes, out_dtype=w_down.dtype)
    if sort_indices is None:
        d_x, d_w_gate_up = gemm_grads(x, w_gate_up, group_sizes, d_gate_up, transpose_rhs=False)
    else:
        # The gate_up wgrad contracts the sorted rows: with the gather fused they exist only here, for the backward.
        rows_backend = _rows_backend(x)
        rows = permute(x, sort_indices, top_k, backend=rows_backend)
        d_rows, d_w_gate_up = gemm_grads(
            rows, w_gate_up, group_sizes, d_gate_up, transpose_rhs=False, zero_tail=zero_tail
        )
        num_rows = None if zero_tail else rows_in_groups(group_sizes, d_rows.shape[0])
        d_x = combine(d_rows, sort_indices, top_k, num_rows=num_rows, backend=rows_backend)
    return d_x, d_w_gate_up, d_w_down, None, d_row_scale, None


_pallas_glu_mlp.defvjp(_glu_mlp_fwd, _glu_mlp_bwd)
