"""``moe_jax.grouped_matmul``: a drop-in for ``jax.lax.ragged_dot`` with a gated-activation epilogue.

backend="pallas" runs the sm90 Mosaic GPU kernels (forward, dgrad, wgrad) behind a ``custom_vjp``. The GLU and the
row scale run in the forward kernel's epilogue on the f32 accumulator (the GLU on packed gate/up weights, packing.py);
this op's backward differentiates that epilogue in XLA from the pre-activation the forward kept, then runs the dgrad
and wgrad kernels. The fused GLU backward lives in ``moe_jax.ops.glu_mlp``, where the down projection's dgrad gives it
an epilogue to run in. The kernel runners below (``run_rows_kernel``, ``run_wgrad_kernel``, ``gemm_grads``) serve both.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax._core import checks, hardware
from moe_jax._core.backend import resolve_backend
from moe_jax.ops.grouped_matmul import reference, schedule, sm90, sm90_wgrad
from moe_jax.ops.grouped_matmul.config import Config, get_config
from moe_jax.ops.grouped_matmul.glu import glu, kept_pre_activation
from moe_jax.ops.grouped_matmul.packing import (
    PACK_BLOCK,
    PackedGateUp,
    gate_up_block,
    pack_gate_up,
    split_gate_up,
)
from moe_jax.ops.grouped_matmul.reference import ACTIVATIONS

OUTPUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
# Mosaic GPU tiles a whole operand in GMEM by its 128-byte swizzle width (64 bf16 elements) for TMA, so K and N must
# be multiples of it; M is padded to a multiple of 8 rows (the shared-memory tile height) when it is not one.
KERNEL_DIM_MULTIPLE = 64
KERNEL_ROW_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class ArgNames:
    """What the caller calls the operands and dimensions of one grouped matmul, so that a check's message names the
    caller's argument (``glu_mlp``'s ``w_down``, not ``rhs``)."""

    op: str = "grouped_matmul"
    lhs: str = "lhs"
    rhs: str = "rhs"
    k: str = "K"
    n: str = "N"


GROUPED_MATMUL_NAMES = ArgNames()


def kernel_unsupported(
    lhs, contraction: int, num_cols: int, activation: str | None = None, names: ArgNames = GROUPED_MATMUL_NAMES
) -> str | None:
    """Why the Pallas kernels cannot run this call (None when they can)."""
    if jnp.dtype(lhs.dtype) not in map(jnp.dtype, KERNEL_DTYPES):
        dtype = jnp.dtype(lhs.dtype).name
        return f"{names.lhs} and {names.rhs} must be bfloat16 or float16 for backend='pallas', got {dtype}"
    for name, size in ((names.k, contraction), (names.n, num_cols)):
        if size <= 0 or size % KERNEL_DIM_MULTIPLE:
            return f"{name} must be a positive multiple of {KERNEL_DIM_MULTIPLE} for backend='pallas', got {size}"
    if activation is not None and (num_cols // 2) % PACK_BLOCK:
        # The GLU epilogue pairs gate and up columns in blocks of PACK_BLOCK (packing.py).
        return (
            f"with an activation F = {names.n}/2 must be a multiple of {PACK_BLOCK} for backend='pallas', got "
            f"{num_cols // 2}"
        )
    return None


def check_grouped_matmul_args(
    lhs,
    rhs,
    group_sizes,
    *,
    activation,
    row_scale,
    preferred_element_type,
    transpose_rhs,
    backend="xla",
    names: ArgNames = GROUPED_MATMUL_NAMES,
) -> tuple[int, int, int, int]:
    """Validates the arguments of ``grouped_matmul`` (or of an op built on it, whose argument ``names`` the messages
    use); returns (M, K, N, G).

    With ``backend="pallas"`` the kernels' constraints are checked too (NotImplementedError naming the dimension).
    """
    lhs_name, rhs_name, k, n = names.lhs, names.rhs, names.k, names.n
    num_rows, contraction = checks.check_rank(lhs_name, lhs, 2, f"[M, {k}]")
    if isinstance(rhs, PackedGateUp):
        if activation is None:
            raise ValueError(f"{rhs_name} is a PackedGateUp ([gate | up] weights, packed): pass its activation=")
        if rhs.transposed != transpose_rhs:
            raise ValueError(f"{rhs_name} is a PackedGateUp with transposed={rhs.transposed}: transpose_rhs must match")
    rhs_layout = f"[G, {n}, {k}]" if transpose_rhs else f"[G, {k}, {n}]"
    num_groups, *rhs_dims = checks.check_rank(rhs_name, rhs, 3, rhs_layout)
    rhs_contraction, num_cols = reversed(rhs_dims) if transpose_rhs else rhs_dims
    if rhs_contraction != contraction:
        raise ValueError(
            f"{rhs_name} must have shape {rhs_layout} with {k}={contraction} (from {lhs_name} [M, {k}]), got shape "
            f"{rhs.shape}"
        )
    checks.check_rank("group_sizes", group_sizes, 1, "[G]")
    checks.check_int32("group_sizes", group_sizes)
    checks.check_dim("group_sizes", group_sizes.shape[0], num_groups, f"length (G, {rhs_name}.shape[0])")
    checks.check_float(lhs_name, lhs)
    checks.check_float(rhs_name, rhs)
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{lhs_name} and {rhs_name} must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    if activation is not None:
        checks.check_choice("activation", activation, (None, *ACTIVATIONS))
        if num_cols % 2:
            raise ValueError(
                f"{rhs_name}: with activation={activation!r} {n} holds [gate | up] and must be even, got {num_cols}"
            )
    if isinstance(rhs, PackedGateUp) and rhs.block != gate_up_block(num_cols // 2):
        raise ValueError(
            f"{rhs_name}.block must be gate_up_block(F) = {gate_up_block(num_cols // 2)} for F = {num_cols // 2} "
            f"(what pack_gate_up produces), got {rhs.block}"
        )
    if row_scale is not None:
        checks.check_rank("row_scale", row_scale, 1, "[M]")
        checks.check_dim("row_scale", row_scale.shape[0], num_rows, f"length (M, {lhs_name}.shape[0])")
        checks.check_float("row_scale", row_scale)
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) not in map(jnp.dtype, OUTPUT_DTYPES):
        raise TypeError(
            f"preferred_element_type must be one of float32, bfloat16, float16 or None, got {preferred_element_type}"
        )
    if backend == "pallas" and (reason := kernel_unsupported(lhs, contraction, num_cols, activation, names)):
        raise NotImplementedError(f"{names.op}: {reason}; use backend='xla' (or 'auto', which falls back to it)")
    return num_rows, contraction, num_cols, num_groups


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | PackedGateUp,
    group_sizes: jax.Array,
    *,
    activation: str | None = None,
    row_scale: jax.Array | None = None,
    preferred_element_type=None,
    transpose_rhs: bool = False,
    backend: str = "auto",
) -> jax.Array:
    """Ragged grouped matmul: rows ``[offset_g, offset_g + group_sizes[g])`` of ``lhs`` multiply ``rhs[g]``.

    Args:
      lhs: [M, K] rows sorted by group.
      rhs: [G, K, N] weights, or [G, N, K] (K-major) with ``transpose_rhs=True``; same dtype as lhs. With an
        activation it may also be a ``PackedGateUp`` (``pack_gate_up(rhs)``): the same [gate | up] weights with their
        columns interleaved so that one kernel tile holds matching gate and up columns. The type says the layout,
        so there is no ambiguity; a plain array is always read as [gate | up] and, on the Pallas path, packed on
        every call (one weight copy): store weights packed.
      group_sizes: [G] int32 rows per group; rows at or past ``sum(group_sizes)`` give zeros. Negative sizes count
        as 0 and rows past M are dropped (both backends).
      activation: None, or "swiglu" / "geglu" / "gpt_oss": N holds ``[gate | up]`` (F = N/2 each) and the result is
        [M, F] (g: gate, u: up): swiglu ``silu(g) * u``; geglu ``gelu(g) * u`` (tanh form, ``jax.nn.gelu``'s default);
        gpt_oss ``(u' + 1) * g' * sigmoid(1.702 * g')`` with ``g' = min(g, 7)`` and ``u' = clip(u, -7, 7)``.
      row_scale: optional [M] float multiplying each output row (routing weights folded into the down projection).
      preferred_element_type: output dtype (default: lhs.dtype); accumulation is always f32.
      transpose_rhs: rhs is laid out [G, N, K].
      backend: "auto", "xla" or "pallas". "pallas" (the default on an H100/H200 under "auto") needs bf16/f16 inputs,
        K, N multiples of 64 and, with an activation, F a multiple of 64; "auto" falls back to "xla" where those do
        not hold. With an activation or a row scale the kernel applies them in its epilogue (f32) and writes only
        the result; under differentiation it also keeps the pre-activation [M, N] for the backward.

    Returns:
      [M, N], or [M, N/2] with an activation.
    """
    check_grouped_matmul_args(
        lhs,
        rhs,
        group_sizes,
        activation=activation,
        row_scale=row_scale,
        preferred_element_type=preferred_element_type,
        transpose_rhs=transpose_rhs,
        backend=backend,
    )
    contraction = lhs.shape[1]
    num_cols = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    supported = kernel_unsupported(lhs, contraction, num_cols, activation) is None
    group_sizes = group_sizes.astype(jnp.int32)
    if resolve_backend(backend, op="grouped_matmul", has_kernel=supported) == "xla":
        return reference.grouped_matmul(
            lhs,
            rhs,
            group_sizes,
            activation=activation,
            row_scale=row_scale,
            preferred_element_type=preferred_element_type,
            transpose_rhs=transpose_rhs,
        )
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    if activation is None and row_scale is None:
        return _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs)
    if activation is not None and not isinstance(rhs, PackedGateUp):
        rhs = pack_gate_up(rhs, transposed=transpose_rhs)
    weights = rhs.array if isinstance(rhs, PackedGateUp) else rhs
    scale = None if row_scale is None else row_scale.astype(jnp.float32)
    return _pallas_epilogue_matmul(lhs, weights, group_sizes, scale, activation, out_dtype, transpose_rhs)


# ------------------------------------------------------------------------------------------- Pallas path + custom_vjp


def _padded_rows(x: jax.Array | None) -> jax.Array | None:
    """x with its rows padded to a multiple of KERNEL_ROW_MULTIPLE (a copy only when M is not one already)."""
    if x is None:
        return None
    extra = -x.shape[0] % KERNEL_ROW_MULTIPLE
    return jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1)) if extra else x


def rows_config(kind, m, w, *, w_transposed, out_dtype, row_scale: bool, clamped: bool = False) -> Config:
    """config.get_config's choice for a fwd / dgrad / glu_dgrad kernel over m rows and weights ``w`` (as
    run_rows_kernel takes them); ``clamped``: get_config's."""
    num_groups, *w_dims = w.shape
    r, c = reversed(w_dims) if w_transposed else w_dims
    # The table is keyed by the op's K, N (rhs [G, K, N]): dgrad's contraction R is the op's N.
    k, n = (c, r) if kind in ("dgrad", "glu_dgrad") else (r, c)
    itemsize = jnp.dtype(out_dtype).itemsize
    return get_config(kind, m=m, k=k, n=n, g=num_groups, out_itemsize=itemsize, row_scale=row_scale, clamped=clamped)


def run_rows_kernel(
    kind,
    x,
    w,
    group_sizes,
    *,
    w_transposed,
    out_dtype,
    config=None,
    epilogue=sm90.PLAIN,
    row_scale=None,
    gate_up=None,
    row_tokens=None,
    zero_tail=True,
):
    """fwd / dgrad / glu_dgrad kernel: x[M, R] · w[g] per group (w [G, R, C], or [G, C, R] when ``w_transposed``).

    ``config=None`` takes ``rows_config``'s choice; the tuning script and the GLU backward pass their own.
    ``epilogue``, ``row_scale`` [M] f32, ``gate_up`` [M, 2C] and ``row_tokens`` [M] int32 are
    sm90.grouped_matmul_rows's (with ``row_tokens``, x is [T, R] and row r is x[row_tokens[r]]). ``zero_tail``:
    schedule.row_tiles's (False: the outputs' rows past sum(group_sizes) are left unwritten).

    Returns:
      sm90.grouped_matmul_rows's outputs, rows past M dropped; for the GLU backward (d_gate_up [M, 2C],
      h_scaled [M, C], d_row_scale [M] f32 or None), the row-scale gradient summed from the kernel's partial sums.
    """
    m = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    num_sms, interpret = hardware.num_sms(), hardware.interpret_params()
    if config is None:
        config = rows_config(kind, m, w, w_transposed=w_transposed, out_dtype=out_dtype, row_scale=epilogue.row_scale)
    config = _fit_interpreter(config, interpret)
    if row_tokens is None:
        x = _padded_rows(x)
    else:
        row_tokens = _padded_rows(row_tokens)
    padded_m = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    tiles, num_tiles = schedule.row_tiles(group_sizes, padded_m, config.block_m, zero_tail=zero_tail)
    outs = sm90.grouped_matmul_rows(
        x,
        w,
        tiles,
        num_tiles,
        w_transposed=w_transposed,
        out_dtype=out_dtype,
        config=config,
        num_sms=num_sms,
        interpret=interpret,
        epilogue=epilogue,
        row_scale=_padded_rows(row_scale),
        gate_up=_padded_rows(gate_up),
        row_tokens=row_tokens,
    )
    if not isinstance(outs, tuple):
        return outs[:m]
    if not epilogue.backward:
        return tuple(out[:m] for out in outs)
    d_gate_up, hidden_scaled, *partials = outs
    d_row_scale = None
    if partials:
        d_row_scale = schedule.gather_row_partials(partials[0], tiles, num_tiles, padded_m)[:m]
    return d_gate_up[:m], hidden_scaled[:m], d_row_scale


def run_wgrad_kernel(x, y, group_sizes, *, out_dtype, config=None, transposed=False):
    """wgrad kernel: out[g] = x[rows of g]^T · y[rows of g] -> [G, P, Q] (the op's [G, K, N], or [G, N, K] when
    ``transposed``, which only matters for the config lookup)."""
    m, p, q = x.shape[0], x.shape[1], y.shape[1]
    k, n = (q, p) if transposed else (p, q)
    num_sms, interpret = hardware.num_sms(), hardware.interpret_params()
    if config is None:
        itemsize = jnp.dtype(out_dtype).itemsize
        config = get_config("wgrad", m=m, k=k, n=n, g=group_sizes.shape[0], out_itemsize=itemsize)
    config = _fit_interpreter(config, interpret)
    x, y = _padded_rows(x), _padded_rows(y)
    return sm90_wgrad.grouped_matmul_wgrad(
        x,
        y,
        schedule.wgrad_groups(group_sizes, y, config.block_k),
        out_dtype=out_dtype,
        config=config,
        num_sms=num_sms,
        interpret=interpret,
    )


def _fit_interpreter(config, interpret):
    """Under the interpreter a clustered config stores between its tiles: its simulated warpgroups stall on 2-CTA
    clusters with the overlapped epilogue (not the hardware: tests/gpu runs the pair). The arithmetic is the same."""
    if interpret is not None and config.cluster_m > 1 and config.overlap_epilogue:
        return dataclasses.replace(config, overlap_epilogue=False)
    return config


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs):
    """lhs [M, K] · rhs[g] ([G, K, N], or [G, N, K] with ``transpose_rhs``) -> [M, N] in ``out_dtype``."""
    return run_rows_kernel("fwd", lhs, rhs, group_sizes, w_transposed=transpose_rhs, out_dtype=out_dtype)


def _pallas_fwd(lhs, rhs, group_sizes, out_dtype, transpose_rhs):
    return _pallas_grouped_matmul(lhs, rhs, group_sizes, out_dtype, transpose_rhs), (lhs, rhs, group_sizes)


def gemm_grads(
    lhs, rhs, group_sizes, d_out, *, transpose_rhs: bool, zero_tail: bool = True
) -> tuple[jax.Array, jax.Array]:
    """(d lhs, d rhs) of lhs · rhs[g]: d lhs = d_out · rhs[g]^T (the rows kernel reading rhs the other way round);
    d rhs = lhs_g^T · d_out_g (the wgrad kernel). ``zero_tail=False`` leaves d lhs's rows past the sum unwritten."""
    d_out = d_out.astype(lhs.dtype)  # wgmma multiplies equal dtypes; accumulation stays f32
    d_lhs = run_rows_kernel(
        "dgrad", d_out, rhs, group_sizes, w_transposed=not transpose_rhs, out_dtype=lhs.dtype, zero_tail=zero_tail
    )
    # [G, N, K] weights get their gradient in the same layout: d_out_g^T · lhs_g.
    x, y = (d_out, lhs) if transpose_rhs else (lhs, d_out)
    d_rhs = run_wgrad_kernel(x, y, group_sizes, out_dtype=rhs.dtype, transposed=transpose_rhs)
    return d_lhs, d_rhs


def _pallas_bwd(out_dtype, transpose_rhs, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    return *gemm_grads(lhs, rhs, group_sizes, d_out, transpose_rhs=transpose_rhs), None


_pallas_grouped_matmul.defvjp(_pallas_fwd, _pallas_bwd)


# ------------------------------------------------------------------- Pallas path with the GLU / row scale fused


def forward_epilogue(activation: str | None, row_scale: bool, *, keep_dtype=None) -> sm90.Epilogue:
    """The forward kernel's epilogue: GLU over packed gate/up columns and/or a row scale.

    ``keep_dtype``: also store the pre-activation, in this dtype (the output's), rounded as the GLU backward needs it
    (``glu.kept_pre_activation``).
    """
    if activation is None:
        return sm90.Epilogue(row_scale=row_scale, keep_acc=keep_dtype is not None, pack=PACK_BLOCK)
    rounding = None
    if keep_dtype is not None:
        rounding = functools.partial(kept_pre_activation, activation=activation, dtype=keep_dtype)
    return sm90.Epilogue(
        activation=functools.partial(glu, activation=activation),
        row_scale=row_scale,
        keep_acc=keep_dtype is not None,
        keep_rounding=rounding,
        pack=PACK_BLOCK,
    )


def run_forward_kernel(
    lhs,
    rhs,
    group_sizes,
    row_scale,
    activation,
    out_dtype,
    transpose_rhs,
    *,
    keep: bool,
    row_tokens=None,
    zero_tail: bool = True,
):
    """The forward kernel with its epilogue (plain when neither ``activation`` nor ``row_scale``); ``keep`` also
    returns the pre-activation [M, N], rounded for the GLU backward. With ``row_tokens`` [M], lhs is [T, K] and row r
    of the product is lhs[row_tokens[r]]. ``zero_tail=False`` leaves the outputs' rows past the sum unwritten."""
    epilogue = forward_epilogue(activation, row_scale is not None, keep_dtype=out_dtype if keep else None)
    return run_rows_kernel(
        "fwd",
        lhs,
        rhs,
        group_sizes,
        w_transposed=transpose_rhs,
        out_dtype=out_dtype,
        epilogue=epilogue,
        row_scale=row_scale,
        row_tokens=row_tokens,
        zero_tail=zero_tail,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _pallas_epilogue_matmul(lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs):
    """lhs [M, K] · rhs[g] with the epilogue fused: [M, N/2] with an activation (rhs packed), else [M, N]."""
    return run_forward_kernel(lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs, keep=False)


def _epilogue_fwd(lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs):
    args = (lhs, rhs, group_sizes, row_scale, activation, out_dtype, transpose_rhs)
    out, pre = run_forward_kernel(*args, keep=True)
    return out, (lhs, rhs, group_sizes, row_scale, pre)


def _epilogue_bwd(activation, out_dtype, transpose_rhs, residuals, d_out):
    """The epilogue's VJP in XLA on the kept pre-activation [M, N], then the dgrad and wgrad kernels."""
    lhs, rhs, group_sizes, row_scale, pre = residuals

    def epilogue(acc, scale):
        if activation is not None:
            acc = reference.gated_activation(*split_gate_up(acc, PACK_BLOCK), activation)
        return acc if scale is None else acc * scale[:, None]

    _, pullback = jax.vjp(epilogue, pre.astype(jnp.float32), row_scale)
    d_pre, d_row_scale = pullback(d_out.astype(jnp.float32))
    d_lhs, d_rhs = gemm_grads(lhs, rhs, group_sizes, d_pre, transpose_rhs=transpose_rhs)
    return d_lhs, d_rhs, None, d_row_scale


_pallas_epilogue_matmul.defvjp(_epilogue_fwd, _epilogue_bwd)
