"""Frozen configurations of the toy MoE language model; ``get_config(name)`` returns a named one.

"tiny" trains on 2 CPU cores in a few minutes; "gpu" is a few hundred million parameters (about a third of them
active per token) sized for one H100/H200; "gpu-moe" is a fine-grained MoE (64 experts, top-8, a shared expert)
of about 2.6B parameters sized for one 80 GB GPU. Tests shrink them with ``dataclasses.replace``.
"""

import dataclasses

import jax.numpy as jnp

from moe_jax.ops.grouped_matmul.glu import ACTIVATIONS
from moe_jax.ops.grouped_matmul.reference_fp8 import QUANTIZATIONS
from moe_jax.ops.routing.api import SCORES
from moe_jax.parallel.expert_parallel import DISPATCHES

DTYPES = ("float32", "bfloat16")
REMATS = ("none", "moe", "full")
ATTENTIONS = ("auto", "xla", "cudnn")


def _check_positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be > 0, got {value}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer over bytes: RMSNorm, causal attention with RoPE, MoE feed-forward layers.

    Attributes:
      vocab_size: V, 256 for bytes.
      d_model: D.  num_layers: L.  num_heads: H (head size D / H).
      num_experts: E.  top_k: k.  d_ff: F, one expert's hidden size.
      activation, score, capacity_factor, num_shared_experts, balance_bias: as in ``moe_jax.nn.MoE``.
      rope_base: RoPE wavelength base.
      dtype: compute dtype.  param_dtype: parameter (and optimizer state) dtype.
      scan_layers: hold the L blocks as one block with stacked [L, ...] parameters applied by ``jax.lax.scan``, so
        that a step compiles one block instead of L (another parameter tree: checkpoints of the two do not mix).
      unroll_layers: with ``scan_layers``, unroll that scan fully (``jax.lax.scan(..., unroll=True)``), so that the
        step is straight-line code over the stacked parameters. A rolled scan is a loop whose per-layer outputs
        (the activations saved for the backward, the weights' gradients) go into [L, ...] buffers that XLA fills
        with zeros before the loop and updates a slice per layer, and whose layers' weights are copied out a slice
        per layer; unrolled, none of that is written. JAX still lowers the block once (the L calls of one body
        share a lowering); XLA compiles L copies of it, which costs compile time growing with L. The parameters are
        the same tree either way (checkpoints mix).
      remat: what the backward recomputes: "none"; "moe" (each MoE sublayer keeps its input and router logits and
        recomputes routing, permutation and the expert GLU); "full" (each block keeps only its input).
      attention: ``jax.nn.dot_product_attention``'s implementation: "xla", "cudnn" (fused; GPU, bf16/f16, head size
        a multiple of 8 up to 128) or "auto" (cuDNN where it applies, XLA elsewhere).
      quantization: None, "fp8_block" or "mxfp8": the MoE layers' expert GEMMs on block-scaled FP8 operands
        (``moe_jax.nn.MoE``'s); everything else unchanged.
    """

    d_model: int
    num_layers: int
    num_heads: int
    num_experts: int
    top_k: int
    d_ff: int
    vocab_size: int = 256
    activation: str = "swiglu"
    score: str = "softmax"
    capacity_factor: float | None = None
    num_shared_experts: int = 0
    balance_bias: bool = False
    rope_base: float = 10_000.0
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = False
    unroll_layers: bool = False
    remat: str = "none"
    attention: str = "auto"
    quantization: str | None = None

    def __post_init__(self):
        _check_positive(self, "d_model", "num_layers", "num_heads", "num_experts", "top_k", "d_ff", "vocab_size")
        if self.d_model % self.num_heads or (self.d_model // self.num_heads) % 2:
            raise ValueError(
                f"ModelConfig.num_heads must divide d_model={self.d_model} into even head sizes (RoPE rotates pairs), "
                f"got {self.num_heads}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelConfig.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.score not in SCORES:
            raise ValueError(f"ModelConfig.score must be one of {SCORES}, got {self.score!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"ModelConfig.{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.unroll_layers and not self.scan_layers:
            raise ValueError(
                "ModelConfig.unroll_layers needs scan_layers=True (it unrolls their scan; listed layers are unrolled)"
            )
        if self.remat not in REMATS:
            raise ValueError(f"ModelConfig.remat must be one of {REMATS}, got {self.remat!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"ModelConfig.attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"ModelConfig.quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self):
        return jnp.dtype(self.param_dtype)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run: model, data, optimizer schedule, losses, logging and checkpoint cadence.

    Attributes:
      model: the ``ModelConfig``.
      seq_len: S, tokens (bytes) per training window.  batch_size: B, windows per step (global, all devices).
      grad_accum_steps: A, micro-batches of B / A windows whose gradients one optimizer step sums (under the jitted
        step, by ``jax.lax.scan``), so that the activations of B / A windows bound the memory.
      steps: optimizer steps; the learning-rate schedule spans exactly these.
      peak_lr, warmup_steps, end_lr_ratio: linear warm-up to ``peak_lr``, then cosine decay to
        ``end_lr_ratio * peak_lr`` at ``steps``.
      weight_decay, b1, b2: AdamW (decay applies to matrices only).  grad_clip: global-norm clipping threshold.
      load_balancing_coef, z_loss_coef: weights of the summed per-layer aux losses in the training loss.
      bias_update_rate: aux-loss-free balancing step size per optimizer step (needs ``model.balance_bias``; 0: off).
      validation_percent: share of stdlib files held out for validation (split by file).
      eval_every, eval_batches: validation cadence (steps) and size (batches of ``batch_size`` windows).
      log_every: steps between metric fetches (the only host syncs of the loop); one JSONL record each.
      ckpt_every: steps between checkpoints (when a checkpoint directory is given).
      seed: parameter initialisation and the training data stream.
      expert_parallelism: size of the mesh's "expert" axis (the rest of the devices form the "data" axis); above 1
        the MoE layers run expert-parallel (``moe_jax.nn.MoE(expert_parallel=True)``).
      dispatch: the expert-parallel layers' ``dispatch`` ("auto", "all_gather" or "all_to_all").
    """

    model: ModelConfig
    seq_len: int
    batch_size: int
    steps: int
    peak_lr: float
    warmup_steps: int
    end_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    load_balancing_coef: float = 1e-2
    z_loss_coef: float = 1e-3
    bias_update_rate: float = 0.0
    validation_percent: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    ckpt_every: int = 100
    seed: int = 0
    expert_parallelism: int = 1
    dispatch: str = "auto"
    grad_accum_steps: int = 1

    def __post_init__(self):
        _check_positive(
            self, "seq_len", "batch_size", "steps", "peak_lr", "eval_every", "eval_batches", "log_every", "ckpt_every"
        )
        _check_positive(self, "expert_parallelism", "grad_accum_steps")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(
                f"TrainConfig.grad_accum_steps must divide batch_size={self.batch_size}, got {self.grad_accum_steps}"
            )
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"TrainConfig.warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if not 0 < self.validation_percent < 100:
            raise ValueError(f"TrainConfig.validation_percent must be in (0, 100), got {self.validation_percent}")
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"TrainConfig.dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        if self.bias_update_rate < 0:
            raise ValueError(f"TrainConfig.bias_update_rate must be >= 0, got {self.bias_update_rate}")
        if self.bias_update_rate and not self.model.balance_bias:
            raise ValueError("TrainConfig.bias_update_rate > 0 needs model.balance_bias=True (the router bias to move)")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


TINY = TrainConfig(
    model=ModelConfig(d_model=128, num_layers=3, num_heads=4, num_experts=8, top_k=2, d_ff=128, balance_bias=True),
    seq_len=128,
    batch_size=16,
    steps=400,
    peak_lr=3e-3,
    warmup_steps=40,
    bias_update_rate=1e-3,
    eval_every=200,
    log_every=20,
    ckpt_every=200,
)

GPU = TrainConfig(
    model=ModelConfig(
        d_model=1024,
        num_layers=8,
        num_heads=16,
        num_experts=8,
        top_k=2,
        d_ff=2048,
        balance_bias=True,
        dtype="bfloat16",
        scan_layers=True,
    ),
    seq_len=1024,
    # 8 x 1024 tokens: XLA's dense-masked ragged_dot keeps [E, rows, 2F] f32 temporaries for the backward (about
    # 4 GB per layer at this size), so larger batches of the "xla" backend stop fitting in an H100's 80 GB.
    batch_size=8,
    steps=2000,
    peak_lr=6e-4,
    warmup_steps=100,
    bias_update_rate=1e-3,
    eval_every=500,
    eval_batches=4,
    log_every=20,
    ckpt_every=500,
)

# A fine-grained MoE in current style (many small experts, top-8, a shared expert, sigmoid routing balanced by the
# aux-loss-free bias): about 2.6B parameters, 0.48B active per token, sized for one 80 GB GPU. Parameters, gradients
# and AdamW moments are f32 (16 bytes a parameter, about 41 GB); 64k tokens a step in 4 micro-batches of 16k keep
# the activations to a fraction of the rest.
GPU_MOE = TrainConfig(
    model=ModelConfig(
        d_model=2048,
        num_layers=8,
        num_heads=16,
        num_experts=64,
        top_k=8,
        d_ff=768,
        score="sigmoid",
        num_shared_experts=1,
        balance_bias=True,
        dtype="bfloat16",
        scan_layers=True,
        # Unrolled, the step writes no zero-filled [L, ...] buffers and copies no weight slices: on an H200 about an
        # eighth of its time, for a few seconds more of XLA compile (train/README.md).
        unroll_layers=True,
    ),
    seq_len=2048,
    batch_size=32,
    grad_accum_steps=4,
    steps=2000,
    peak_lr=4e-4,
    warmup_steps=100,
    # The bias balances the experts; a small load-balancing loss only guards against collapse within a sequence.
    load_balancing_coef=1e-4,
    z_loss_coef=0.0,
    bias_update_rate=1e-3,
    eval_every=500,
    eval_batches=2,
    log_every=10,
    ckpt_every=500,
)

CONFIGS = {"tiny": TINY, "gpu": GPU, "gpu-moe": GPU_MOE}


def get_config(name: str) -> TrainConfig:
    if name not in CONFIGS:
        raise ValueError(f"config must be one of {tuple(CONFIGS)}, got {name!r}")
    return CONFIGS[name]


__all__ = ["CONFIGS", "GPU", "GPU_MOE", "ModelConfig", "TINY", "TrainConfig", "get_config"]
