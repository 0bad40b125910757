"""Throughput accounting and the JSONL metrics file.

Model FLOPs count the useful work of one training step (forward + backward = 3x forward), never the work a backend
wastes (e.g. the dense-masked ``ragged_dot`` of the XLA reference):
  per token, forward = 2 * (matmul parameters used by the token: attention projections, router, the k routed experts
  and the shared ones, the output head) + 2 * L * S * D (causal attention scores and values: on average S / 2 keys,
  two matmuls of 2 FLOPs per multiply-add).
MFU divides achieved model FLOP/s by the devices' dense peak for the compute dtype (NVIDIA datasheet figures, no
sparsity; one device's times the device count, the setup record keeping one device's); it is None where the peak is
unknown (CPUs, other GPUs).
"""

import json
import pathlib
import time

import jax
import numpy as np

from train.configs import ModelConfig

# (device_kind substring, compute dtype) -> dense peak FLOP/s. First match wins, so specific names come first.
# float32 matmuls on Hopper run as TF32 under jax's default precision, hence the TF32 peak.
PEAK_FLOPS = (
    ("H100 PCIe", "bfloat16", 756e12),
    ("H100 PCIe", "float32", 378e12),
    ("H100 NVL", "bfloat16", 835e12),
    ("H100 NVL", "float32", 418e12),
    ("H100", "bfloat16", 989e12),
    ("H100", "float32", 494e12),
    ("H200", "bfloat16", 989e12),
    ("H200", "float32", 494e12),
)


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward and backward), as described in the module docstring."""
    d, f, e, k = config.d_model, config.d_ff, config.num_experts, config.top_k
    per_layer = 4 * d * d + d * e + 3 * d * f * (k + config.num_shared_experts)
    matmul_params = config.num_layers * per_layer + d * config.vocab_size
    forward = 2 * matmul_params + 2 * config.num_layers * seq_len * d
    return 3.0 * forward


def peak_flops(device: jax.Device, dtype: str) -> float | None:
    kind = getattr(device, "device_kind", "")
    for name, peak_dtype, peak in PEAK_FLOPS:
        if name in kind and peak_dtype == dtype:
            return peak
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOP/s over ``devices`` devices' dense peak (``peak`` is one device's); None where it is unknown."""
    return None if peak is None else tokens_per_s * flops_per_token / (peak * devices)


def steady_state(records: list[dict]) -> dict:
    """A run's throughput from its metrics records (``python -m train --metrics``): tokens/s, the median over the
    intervals after the first (which holds the warm-up), its MFU from the setup record, and the peak memory in GB."""
    intervals = [r for r in records if r["kind"] == "train"]
    setup = next(r for r in records if r["kind"] == "setup")
    tokens_per_s = float(np.median([r["tokens_per_s"] for r in intervals[1:] or intervals]))
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": mfu(tokens_per_s, setup["training_flops_per_token"], setup["peak_flops"], setup["devices"]),
        "peak_memory_gb": max(r["peak_memory_bytes"] for r in intervals) / 1e9,
    }


class JsonlWriter:
    """Appends one JSON object per line (only on process 0 of a multi-process run)."""

    def __init__(self, path: str | pathlib.Path | None, *, append: bool):
        self.path = pathlib.Path(path) if path and jax.process_index() == 0 else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def summarise(fetched: list[dict]) -> dict:
    """Interval record from per-step metrics: scalar means, per-step losses, each layer's share of assignments."""
    record = {
        name: float(np.mean([m[name] for m in fetched]))
        for name in ("loss", "cross_entropy", "load_balancing_loss", "z_loss", "grad_norm")
    }
    record["step_losses"] = [float(m["loss"]) for m in fetched]
    counts = np.sum([m["expert_counts"] for m in fetched], axis=0).astype(np.float64)  # [L, E]
    load = counts / counts.sum(-1, keepdims=True)
    record["expert_load"] = np.round(load, 5).tolist()
    # 1.0 is perfect balance; E means one expert took every assignment of some layer.
    record["max_expert_load"] = float(load.max() * load.shape[-1])
    return record


class MetricsBuffer:
    """Holds each step's metrics on the device until ``flush`` fetches them all at once (the loop's only sync).

    Throughput is measured between flushes over the steps added with ``timed=True``; ``restart_clock`` drops time
    spent outside training steps (compilation, evaluation, checkpointing) from the next interval.
    """

    def __init__(self, writer: JsonlWriter, *, tokens_per_step: int, flops_per_token: float, peak: float | None):
        self.writer = writer
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.pending: list[tuple[int, dict]] = []
        self.restart_clock()

    def restart_clock(self) -> None:
        self.timed_steps = 0
        self.start = time.perf_counter()

    def add(self, step: int, metrics: dict, *, timed: bool = True) -> None:
        self.pending.append((step, metrics))
        self.timed_steps += timed

    def flush(self, **extra) -> tuple[dict, dict[int, float]]:
        """Fetches and writes one "train" record; returns it and the per-step losses it covered."""
        fetched = jax.device_get([metrics for _, metrics in self.pending])
        elapsed = time.perf_counter() - self.start
        tokens_per_s = self.timed_steps * self.tokens_per_step / elapsed if self.timed_steps else None
        record = {"kind": "train", "step": self.pending[-1][0], **summarise(fetched), **extra}
        record["tokens_per_s"] = tokens_per_s
        record["mfu"] = mfu(tokens_per_s, self.flops_per_token, self.peak) if tokens_per_s else None
        # The allocator's high-water mark on GPUs (CPUs keep no statistics).
        stats = jax.local_devices()[0].memory_stats() or {}
        record["peak_memory_bytes"] = stats.get("peak_bytes_in_use")
        self.writer.write(record)
        losses = {step: float(m["loss"]) for (step, _), m in zip(self.pending, fetched, strict=True)}
        self.pending.clear()
        self.restart_clock()
        return record, losses
