"""How the sm90 grouped-matmul kernels are launched: the limits they take, tile configs, row padding, the tile
schedule, and the epilogues the ops ask for. ``grouped_matmul`` and ``glu_mlp`` both run these kernels (the GLU MLP's
backward adds the "glu_dgrad" kernel); this module holds no choice between backends.

    kind        kernel                      computes
    fwd         sm90.grouped_matmul_rows    out [M, C] = x [M, R] . w[g] per group, any ``sm90.Epilogue``
    dgrad       sm90.grouped_matmul_rows    d x = d out . w[g]^T (the fwd kernel reading w the other way round)
    glu_dgrad   sm90.grouped_matmul_rows    the down projection's dgrad with the GLU backward in its epilogue
    wgrad       sm90_wgrad                  d w[g] = x_g^T . d out_g, contracting the group's ragged rows
    fp8 fwd     sm90.grouped_matmul_rows    the forward on block-scaled FP8 operands (sm90_fp8.py), and the dgrad
                                            dy . w[g]^T on them (w read [G, K, N]: N is its contraction)
    fp8 wgrad   sm90_fp8_wgrad              d w[g] = x_g^T . d out_g on FP8 copies in row blocks per group
                                            (token_blocks.py)

``BF16_KERNEL_GEMMS`` runs a recipe's dequantized products on the bf16 fwd and wgrad kernels, for the recipes whose
dequantized values bf16 holds exactly (reference_fp8.py: MXFP8's, but for blocks of magnitudes below about 2^-109).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax._core import hardware
from moe_jax.ops.grouped_matmul import schedule, sm90, sm90_fp8_wgrad, sm90_wgrad, token_blocks
from moe_jax.ops.grouped_matmul.config import (
    FP8_BLOCK,
    SMEM_BYTES,
    WGMMA_M,
    Config,
    fp8_config,
    fp8_scale_k_blocks,
    get_config,
    heuristic_config,
)
from moe_jax.ops.grouped_matmul.glu import glu, glu_grad, kept_pre_activation
from moe_jax.ops.grouped_matmul.packing import PACK_BLOCK
from moe_jax.ops.grouped_matmul.reference_fp8 import RECIPES, Gemms
from moe_jax.ops.quant import api as quant
from moe_jax.ops.quant.reference import BlockScaled

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)
# Mosaic GPU tiles a whole operand in GMEM by its 128-byte swizzle width (64 bf16 elements) for TMA, so K and N must
# be multiples of it; M is padded to a multiple of 8 rows (the shared-memory tile height) when it is not one.
KERNEL_DIM_MULTIPLE = 64
KERNEL_ROW_MULTIPLE = 8
# The FP8 kernel runs the fp8_block recipe: its steps are the recipe's 128-wide K blocks, one promotion each (MXFP8's
# 32-wide blocks would take four per step). It reads float8_e4m3fn.
FP8_KERNEL_QUANTIZATION = "fp8_block"
FP8_KERNEL_DTYPE = jnp.float8_e4m3fn
FP8_KERNEL_OUT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# The FP8 wgrad's consumer warpgroups: each step's chain (MMA, wait, promotion) leaves the tensor cores idle most of
# a step, which a third consumer's MMAs partly fill.
FP8_WGRAD_CONSUMERS = 3

# The GLU backwards that compute h, d_gate and d_up each in its own store's branch (sm90.Epilogue.recompute_grads),
# on tiles of at most RECOMPUTE_MAX_BLOCK_N columns: computed together next to a 128-column accumulator, gpt_oss's
# and geglu's terms spill registers (swiglu's do not), while recomputed per output nothing spills, for two more
# sigmoids (or tanhs) per element. Next to a 256-column accumulator recomputing is slower for all three.
RECOMPUTED_GRADS = ("gpt_oss", "geglu")
RECOMPUTE_MAX_BLOCK_N = 128


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


def bf16_gemms_unsupported(contraction: int, num_cols: int, names: ArgNames = GROUPED_MATMUL_NAMES) -> str | None:
    """Why ``BF16_KERNEL_GEMMS`` cannot multiply a quantized call's dequantized operands (None when they can): its
    K and N (the forward's, the dgrad's and the wgrad's dimensions) must be the bf16 kernels'. The recipe must be
    one whose dequantized values bf16 holds (``Recipe.exact_in_bf16``), which the caller checks."""
    shaped = jax.ShapeDtypeStruct((0, contraction), jnp.bfloat16)
    return kernel_unsupported(shaped, contraction, num_cols, None, names)


def fp8_kernel_unsupported(
    quantization: str,
    contraction: int,
    num_cols: int,
    activation: str | None,
    fp8_dtypes=(),
    unpacked_glu_weights: bool = False,
    out_dtype=jnp.bfloat16,
    names: ArgNames = GROUPED_MATMUL_NAMES,
) -> str | None:
    """Why the FP8 kernel cannot run this quantized call (None when it can).

    Args:
      fp8_dtypes: the value dtypes of the operands that come quantized (BlockScaled).
      unpacked_glu_weights: an activation with BlockScaled weights in [gate | up] order (not a PackedGateUp).
      out_dtype: the result's dtype.
    """
    if quantization != FP8_KERNEL_QUANTIZATION:
        return (
            f"the FP8 kernel runs quantization={FP8_KERNEL_QUANTIZATION!r} (one promotion per 128-wide K block), got "
            f"{quantization!r}"
        )
    if any(jnp.dtype(dtype) != jnp.dtype(FP8_KERNEL_DTYPE) for dtype in fp8_dtypes):
        return f"the FP8 kernel takes float8_e4m3fn BlockScaled operands, got {[jnp.dtype(d).name for d in fp8_dtypes]}"
    if contraction <= 0:
        # Any K: the kernel reads a 64-wide last block as it is, run_fp8_forward_kernel pads other partial ones.
        return f"{names.k} must be positive for the FP8 kernel, got {contraction}"
    if num_cols <= 0 or num_cols % KERNEL_DIM_MULTIPLE:
        return f"{names.n} must be a positive multiple of {KERNEL_DIM_MULTIPLE} for the FP8 kernel, got {num_cols}"
    if activation is not None and (num_cols // 2) % PACK_BLOCK:
        return f"with an activation F = {names.n}/2 must be a multiple of {PACK_BLOCK} for the FP8 kernel"
    if jnp.dtype(out_dtype) not in map(jnp.dtype, FP8_KERNEL_OUT_DTYPES):
        return f"the FP8 kernel writes float32, bfloat16 or float16, got {jnp.dtype(out_dtype).name}"
    if unpacked_glu_weights:
        return (
            f"with an activation the FP8 kernel reads packed weights: pass {names.rhs} as a PackedGateUp (or in high "
            "precision), not a BlockScaled in [gate | up] order"
        )
    return None


def fp8_dgrad_runs(contraction: int, out_dtype) -> bool:
    """Whether the FP8 kernel runs the dgrad of a quantized call it ran forward: d lhs [M, K] has K (the op's
    ``contraction``) columns, which it stores in 64-column TMA boxes (a multiple of KERNEL_DIM_MULTIPLE), in a dtype it
    writes (lhs's). Its own contraction, the op's N, may end in a partial block, as the forward's K may."""
    return contraction % KERNEL_DIM_MULTIPLE == 0 and jnp.dtype(out_dtype) in map(jnp.dtype, FP8_KERNEL_OUT_DTYPES)


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
    x_scales=None,
    w_scales=None,
    gate_up_scales=None,
):
    """fwd / dgrad / glu_dgrad kernel: x[M, R] · w[g] per group (w [G, R, C], or [G, C, R] when ``w_transposed``).

    ``config=None`` takes ``rows_config``'s choice; the tuning script and the GLU backward pass their own.
    ``epilogue``, ``row_scale`` [M] f32, ``gate_up`` [M, 2C] and ``row_tokens`` [M] int32 are
    sm90.grouped_matmul_rows's (with ``row_tokens``, x is [T, R] and row r is x[row_tokens[r]]). ``zero_tail``:
    schedule.row_tiles's (False: the outputs' rows past sum(group_sizes) are left unwritten). ``x_scales``
    [R / 128, M] and ``w_scales``: FP8 operands' scales, as sm90.grouped_matmul_rows takes them, as is
    ``gate_up_scales`` [2C / 128, M] (an FP8 gate_up's).

    Returns:
      sm90.grouped_matmul_rows's outputs, rows past M dropped; for the GLU backward (d_gate_up [M, 2C],
      h_scaled [M, C], d_row_scale [M] f32 or None), the row-scale gradient summed from the kernel's partial sums.
    """
    m = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    num_sms, interpret = hardware.num_sms(), hardware.interpret_params()
    if config is None:
        config = rows_config(kind, m, w, w_transposed=w_transposed, out_dtype=out_dtype, row_scale=epilogue.row_scale)
    if row_tokens is None:
        x = _padded_rows(x)
    else:
        row_tokens = _padded_rows(row_tokens)
    padded_m = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    if x_scales is not None:
        x_scales = jnp.pad(x_scales, [(0, 0), (0, padded_m - m)])
    if gate_up_scales is not None:
        gate_up_scales = jnp.pad(gate_up_scales, [(0, 0), (0, padded_m - m)])
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
        x_scales=x_scales,
        w_scales=w_scales,
        gate_up_scales=gate_up_scales,
    )
    if not isinstance(outs, tuple):
        return outs[:m]
    if epilogue.keep_blocks:
        out, kept_values, kept_scales = outs
        scales = schedule.gather_tile_rows(kept_scales, tiles, num_tiles, padded_m)[:, :m].T
        return out[:m], BlockScaled(kept_values[:m], scales, (1, sm90.SCALED_GATE_UP_BLOCK))
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


def _bf16_kernel_products(x, w, group_sizes):
    """reference_fp8.Gemms.products by the bf16 fwd kernel: x [M, K] . w[g] [G, K, N] -> [M, N] f32 (rows past the
    sum zero), on dequantized values that bf16 holds (``Recipe.exact_in_bf16``: the cast loses nothing)."""
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    return run_rows_kernel("fwd", x, w, group_sizes, w_transposed=False, out_dtype=jnp.float32)


def _bf16_kernel_wgrad(x, dy, group_sizes):
    """reference_fp8.Gemms.wgrad by the bf16 wgrad kernel: x_g^T . dy_g -> [G, K, N] f32, likewise exact."""
    return run_wgrad_kernel(x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16), group_sizes, out_dtype=jnp.float32)


BF16_KERNEL_GEMMS = Gemms(_bf16_kernel_products, _bf16_kernel_wgrad)


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


def forward_epilogue(
    activation: str | None, row_scale: bool, *, keep_dtype=None, keep_blocks: bool = False
) -> sm90.Epilogue:
    """The forward kernel's epilogue: GLU over packed gate/up columns and/or a row scale.

    ``keep_dtype``: also store the pre-activation, in this dtype (the output's), rounded as the GLU backward needs it
    (``glu.kept_pre_activation``); with ``keep_blocks`` those rounded values quantized to FP8 in (1, 128) blocks
    instead (``sm90.Epilogue.keep_blocks``).
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
        keep_blocks=keep_blocks,
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
    keep_blocks: bool = False,
    row_tokens=None,
    zero_tail: bool = True,
    config=None,
    x_scales=None,
    w_scales=None,
):
    """The forward kernel with its epilogue (plain when neither ``activation`` nor ``row_scale``); ``keep`` also
    returns the pre-activation [M, N], rounded for the GLU backward (with ``keep_blocks`` as a BlockScaled of FP8
    (1, 128) blocks quantized by the epilogue). With ``row_tokens`` [M], lhs is [T, K] and row r of the product is
    lhs[row_tokens[r]]. ``zero_tail=False`` leaves the outputs' rows past the sum unwritten. ``config`` (None:
    rows_config's), ``x_scales`` and ``w_scales``: run_rows_kernel's."""
    keep_dtype = out_dtype if keep else None
    epilogue = forward_epilogue(activation, row_scale is not None, keep_dtype=keep_dtype, keep_blocks=keep_blocks)
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
        config=config,
        x_scales=x_scales,
        w_scales=w_scales,
    )


def run_fp8_forward_kernel(
    x: BlockScaled,
    w: BlockScaled,
    group_sizes,
    row_scale,
    activation,
    out_dtype,
    *,
    keep: bool,
    keep_blocks: bool = False,
    config: Config | None = None,
    row_tokens=None,
) -> jax.Array | tuple:
    """The FP8 kernel x[rows of g] . w[g]^T with its epilogue, as run_forward_kernel (``keep``: also the
    pre-activation; ``config``: None takes fp8_config's). The forward is (lhs, rhs [G, N, K]); the dgrad (d out,
    rhs [G, K, N]).

    ``keep_blocks`` (with ``keep`` and an activation): the pre-activation comes as a BlockScaled of (1, 128) FP8
    blocks, the GLU backward's operand, which the epilogue quantizes from its accumulators: the 1 x 128 quantizer's
    values and scales of the bf16 copy, bit for bit. ``fp8_config(keep_blocks=True)`` counts its buffers (an
    explicit ``config`` is taken to fit them); where they cost the pipeline a stage (three consumers), the kernel is
    still faster than keeping the bf16 copy and quantizing it in a pass.

    Args:
      x: [M, R] float8_e4m3fn in (1, 128) blocks; R, the contraction, any size. With ``row_tokens`` [M] int32,
        [T, R] tokens, R a multiple of 128, and row r of the product is x[row_tokens[r]]: the kernel gathers the
        rows (sm90_gather.py) and their scales are gathered here (M * R / 32 bytes).
      w: [G, C, R] float8_e4m3fn in (1, 128, 128) blocks (R-major: wgmma's FP8 B operand); C a multiple of 64.
      group_sizes: [G] int32; row_scale: [M] f32 or None; activation: the GLU (w packed) or None.

    The scales go to the kernel in the layouts it loads (sm90_fp8.py): x's transposed to [ceil(R / 128), M], so that
    a tile's scales of a K block are contiguous (M * R / 32 bytes: 1/32 of x's bytes), w's with the K blocks padded.
    R may end in a partial block: the kernel reads a half block (R a multiple of 64, gpt-oss's 2880) as it is
    (sm90_fp8.ring_swizzle_columns); other R are padded with zeros to a multiple of 64 here (a copy of both
    operands' values). TMA's zeros past R, and the padding's, add nothing to the partial block's product, whose
    scales the quantizer took over the values that exist.
    """
    k, (num_groups, n, _) = x.shape[1], w.shape
    m = x.shape[0] if row_tokens is None else row_tokens.shape[0]
    itemsize = jnp.dtype(out_dtype).itemsize
    keep_blocks = keep_blocks and keep and activation is not None
    if config is None:
        config = fp8_config(
            m=m,
            k=k,
            n=n,
            g=num_groups,
            out_itemsize=itemsize,
            row_scale=row_scale is not None,
            glu_forward=activation is not None,
            keep_blocks=keep_blocks,
        )
    x_values, w_values, x_scales, w_scales = _fp8_kernel_operands(x, w, row_tokens)
    return run_forward_kernel(
        x_values,
        w_values,
        group_sizes,
        row_scale,
        activation,
        out_dtype,
        True,
        keep=keep,
        keep_blocks=keep_blocks,
        row_tokens=row_tokens,
        config=config,
        x_scales=x_scales,
        w_scales=w_scales,
    )


def quantize_kernel_rows(rows: jax.Array) -> BlockScaled:
    """rows [M, C] in fp8_block's 1 x 128 blocks along C: what the FP8 kernels take as their lhs."""
    recipe = RECIPES[FP8_KERNEL_QUANTIZATION]
    return quant.quantize_blockwise(rows, recipe.lhs_block, pow2_scales=recipe.pow2_scales)


def _fp8_kernel_operands(x: BlockScaled, w: BlockScaled, row_tokens=None) -> tuple:
    """(x values, w values, x scales [ceil(R / 128), M], w scales with padded blocks): x [M, R] (or [T, R] tokens
    that ``row_tokens`` [M] gathers, whose scales are gathered here) and w [G, C, R] as the FP8 kernel reads them
    (run_fp8_forward_kernel's docstring), R padded where it must be."""
    k = x.shape[1]
    x_values, w_values = x.values, w.values
    if k % KERNEL_DIM_MULTIPLE:
        pad = KERNEL_DIM_MULTIPLE - k % KERNEL_DIM_MULTIPLE
        x_values = jnp.pad(x_values, [(0, 0), (0, pad)])
        w_values = jnp.pad(w_values, [(0, 0), (0, 0), (0, pad)])
    # One more column block: a 192-column tile loads the scales of the two blocks under it, also at the last tile.
    w_scales = jnp.pad(w.scales, [(0, 0), (0, 1), (0, fp8_scale_k_blocks(k) - w.scales.shape[2])])
    x_scales = x.scales if row_tokens is None else x.scales[row_tokens]
    return x_values, w_values, x_scales.T, w_scales


def fp8_wgrad_unsupported(quantization: str, contraction: int, num_cols: int, out_dtype) -> str | None:
    """Why the FP8 wgrad kernel cannot compute d rhs ([G, K, N] or [G, N, K]) of a quantized call it ran forward
    (None when it can): the fp8_block recipe (one promotion per 128-row block), K and N multiples of 64 (its tiles'
    TMA boxes), and an output dtype it writes (rhs's)."""
    if quantization != FP8_KERNEL_QUANTIZATION:
        return f"the FP8 wgrad kernel runs quantization={FP8_KERNEL_QUANTIZATION!r}, got {quantization!r}"
    for name, size in (("K", contraction), ("N", num_cols)):
        if size <= 0 or size % KERNEL_DIM_MULTIPLE:
            return f"{name} must be a positive multiple of {KERNEL_DIM_MULTIPLE} for the FP8 wgrad kernel, got {size}"
    if jnp.dtype(out_dtype) not in map(jnp.dtype, FP8_KERNEL_OUT_DTYPES):
        return f"the FP8 wgrad kernel writes float32, bfloat16 or float16, got {jnp.dtype(out_dtype).name}"
    return None


def fp8_wgrad_config(*, m: int, p: int, q: int, g: int, out_itemsize: int) -> Config:
    """The FP8 wgrad's config: the heuristic wgrad's tile order within a group, [192, 128] tiles on three consumers
    (64 rows each) of 128-token steps (sm90_fp8_wgrad.check), and as many stages as fit in shared memory. Not tuned;
    measurements: docs/kernels/grouped_matmul.md, "FP8 wgrad"."""
    order = heuristic_config("wgrad", m=m, k=p, n=q, g=g, out_itemsize=out_itemsize)
    config = dataclasses.replace(
        order,
        block_m=FP8_WGRAD_CONSUMERS * WGMMA_M,
        block_n=FP8_BLOCK,
        block_k=FP8_BLOCK,
        num_compute_wgs=FP8_WGRAD_CONSUMERS,
        overlap_epilogue=False,
    )
    for stages in range(8, 1, -1):
        config = dataclasses.replace(config, num_stages=stages)
        # Room for the barriers and the compiler's own scratch, as Config.fits leaves.
        if sm90_fp8_wgrad.smem_bytes(config, out_itemsize) <= SMEM_BYTES - 2048:
            break
    return config


def run_fp8_wgrad_kernel(
    x, y, group_sizes, *, out_dtype, config=None, x_row_tokens=None, y_row_tokens=None
) -> jax.Array:
    """The FP8 wgrad: out[g] = x_g^T . y_g -> [G, P, Q] with x [M, P] and y [M, Q] (high precision) quantized as the
    fp8_block recipe's wgrad does, in 128-row blocks from each group's first row.

    token_blocks.py lays both out for the kernel (transposed, group-padded; in XLA); group_sizes [G] int32 stay on
    the device. ``config=None`` takes ``fp8_wgrad_config``'s. The op's d rhs [G, K, N] is (lhs, d out); [G, N, K] is
    (d out, lhs). With ``x_row_tokens`` [M] int32, x is [T, P] tokens and its row r is ``x[x_row_tokens[r]]``,
    gathered by x's quantizer; ``y_row_tokens`` likewise for y. y may come as ``token_blocks.TokenBlocks`` already
    (``token_blocks.quantize_token_blocks_and_rows``).
    """
    recipe = RECIPES[FP8_KERNEL_QUANTIZATION]
    m = x.shape[0] if x_row_tokens is None else x_row_tokens.shape[0]
    p, q = x.shape[1], token_blocks.num_cols(y)
    if config is None:
        itemsize = jnp.dtype(out_dtype).itemsize
        config = fp8_wgrad_config(m=m, p=p, q=q, g=group_sizes.shape[0], out_itemsize=itemsize)
    x_blocks = token_blocks.quantize_token_blocks(x, group_sizes, recipe, row_tokens=x_row_tokens)
    y_blocks = y
    if not isinstance(y, token_blocks.TokenBlocks):
        y_blocks = token_blocks.quantize_token_blocks(y, group_sizes, recipe, row_tokens=y_row_tokens)
    return sm90_fp8_wgrad.grouped_matmul_wgrad_fp8(
        x_blocks.values_t,
        x_blocks.scales,
        y_blocks.values_t,
        y_blocks.scales,
        token_blocks.group_table(group_sizes, m, recipe.block),
        out_dtype=out_dtype,
        config=config,
        num_sms=hardware.num_sms(),
        interpret=hardware.interpret_params(),
    )


def rows_in_groups(group_sizes, num_rows: int) -> jax.Array:
    """int32 scalar: the rows of the M = ``num_rows`` that belong to a group, ``sum(group_sizes)`` clipped to M."""
    return jnp.minimum(jnp.sum(jnp.maximum(group_sizes, 0)), num_rows).astype(jnp.int32)


def run_glu_dgrad(
    d_y,
    w_down,
    group_sizes,
    gate_up,
    row_scale,
    activation: str,
    *,
    config=None,
    zero_tail=True,
    out_dtype=None,
    row_tokens=None,
):
    """The down projection's dgrad with the GLU backward in its epilogue (the "glu_dgrad" kernel).

    Args:
      d_y: [M, D] bf16 / f16, or a BlockScaled of it in (1, 128) blocks (the FP8 kernel: then w_down is a
        BlockScaled [G, F, D] in (1, 128, 128) blocks, its stored layout, which is K-major for this GEMM). With
        ``row_tokens`` [M] int32 (a BlockScaled d_y only, D a multiple of 128), d_y is [T, D] tokens and row r of
        the product is d_y[row_tokens[r]]: the kernel gathers the FP8 rows (sm90_gather.py), as the gate_up forward
        does, and their scales are gathered in XLA.
      w_down: [G, F, D], read transposed (the kernel's output columns are F); group_sizes: [G] int32;
      gate_up: [M, 2F] packed pre-activation, in the outputs' dtype (d_y's, for a high-precision d_y); with an FP8
        d_y also a BlockScaled of it in (1, 128) blocks (float8_e4m3fn values, f32 scales), which the epilogue
        dequantizes in f32 as it reads the rows (sm90.Epilogue.scaled_gate_up);
      row_scale: [M] f32 or None; activation: the GLU's;
      config: the tile config (None: the table's or the heuristic's, fp8_config's for FP8); zero_tail:
      run_rows_kernel's; out_dtype: the outputs' dtype, named for a BlockScaled gate_up (else gate_up's).

    Returns:
      (d_gate_up [M, 2F] packed, h * row_scale [M, F], d_row_scale [M] f32 or None), in out_dtype. Rows past
      sum(group_sizes) have no product (it is 0 there), so their d_gate_up and d_row_scale are 0; h * row_scale is
      computed from ``gate_up`` on every row (zero in ``glu_mlp``, whose forward writes zero pre-activations there).
      With ``zero_tail=False`` the first two are left unwritten there and d_row_scale is still 0.
    """
    if row_tokens is not None and not isinstance(d_y, BlockScaled):
        raise ValueError("run_glu_dgrad: row_tokens gathers the rows of a BlockScaled d_y (the FP8 kernel)")
    num_rows = d_y.shape[0] if row_tokens is None else row_tokens.shape[0]
    scaled_gate_up = isinstance(gate_up, BlockScaled)
    fp8_scales = {}
    if scaled_gate_up:
        if not isinstance(d_y, BlockScaled) or out_dtype is None:
            raise ValueError("run_glu_dgrad: a BlockScaled gate_up needs a BlockScaled d_y and out_dtype")
        if gate_up.block_shape != (1, sm90.SCALED_GATE_UP_BLOCK) or gate_up.scales.dtype != jnp.float32:
            raise ValueError(
                f"run_glu_dgrad: gate_up must be quantized in (1, {sm90.SCALED_GATE_UP_BLOCK}) blocks with f32 "
                f"scales, got block_shape {gate_up.block_shape} and {gate_up.scales.dtype} scales"
            )
        fp8_scales["gate_up_scales"] = gate_up.scales.T
        gate_up = gate_up.values
    else:
        out_dtype = gate_up.dtype
    if isinstance(d_y, BlockScaled):
        num_groups, d_ff, d_model = w_down.shape
        if config is None:
            itemsize = jnp.dtype(out_dtype).itemsize
            config = fp8_config(
                m=num_rows,
                k=d_model,
                n=d_ff,
                g=num_groups,
                out_itemsize=itemsize,
                row_scale=row_scale is not None,
                glu_backward=True,
                scaled_gate_up=scaled_gate_up,
            )
        d_y, w_down, x_scales, w_scales = _fp8_kernel_operands(d_y, w_down, row_tokens)
        fp8_scales.update(x_scales=x_scales, w_scales=w_scales)
    elif config is None:
        # gpt_oss's clamps narrow the table's tiles (config.CLAMPED_GLU_MAX_BLOCK_N).
        config = rows_config(
            "glu_dgrad",
            num_rows,
            w_down,
            w_transposed=True,
            out_dtype=out_dtype,
            row_scale=row_scale is not None,
            clamped=activation == "gpt_oss",
        )
    epilogue = sm90.Epilogue(
        activation_grad=functools.partial(glu_grad, activation=activation),
        row_scale=row_scale is not None,
        recompute_grads=activation in RECOMPUTED_GRADS and config.block_n <= RECOMPUTE_MAX_BLOCK_N,
        pack=PACK_BLOCK,
        scaled_gate_up=scaled_gate_up,
    )
    d_gate_up, hidden_scaled, d_row_scale = run_rows_kernel(
        "glu_dgrad",
        d_y,
        w_down,
        group_sizes,
        w_transposed=True,
        out_dtype=out_dtype,
        config=config,
        epilogue=epilogue,
        row_scale=row_scale,
        gate_up=gate_up,
        zero_tail=zero_tail,
        row_tokens=row_tokens,
        **fp8_scales,
    )
    if zero_tail or d_row_scale is None:
        return d_gate_up, hidden_scaled, d_row_scale
    # The row sums of rows without a tile are read from other tiles' partials: select them away.
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    d_row_scale = jnp.where(rows < rows_in_groups(group_sizes, num_rows), d_row_scale, 0)
    return d_gate_up, hidden_scaled, d_row_scale
