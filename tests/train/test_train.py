"""Training: a smoke run learns, an interrupted and resumed run reproduces the uninterrupted one exactly."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from train import configs, main
from train.metrics import training_flops_per_token
from train.model import Transformer, parameter_counts
from train.train import train

REPO = pathlib.Path(__file__).resolve().parents[2]

# TINY shrunk further so that a run compiles and trains in seconds.
SMALL = dataclasses.replace(
    configs.TINY,
    model=dataclasses.replace(configs.TINY.model, d_model=32, num_layers=2, num_heads=2, num_experts=4, d_ff=32),
    seq_len=32,
    batch_size=8,
    steps=30,
    warmup_steps=3,
    peak_lr=1e-2,
    eval_every=10,
    eval_batches=2,
    log_every=4,
    ckpt_every=5,
)


def test_smoke_loss_decreases_and_metrics_are_written(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = train(SMALL, backend="xla", metrics_path=str(metrics), progress_bar=False)
    losses = [result.step_losses[step] for step in range(1, SMALL.steps + 1)]
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert result.final_validation_loss < losses[0] - 1.0

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "setup" and kinds[-1] == "final" and "eval" in kinds
    train_records = [r for r in records if r["kind"] == "train"]
    assert sum(len(r["step_losses"]) for r in train_records) == SMALL.steps
    last = train_records[-1]
    for name in ("loss", "cross_entropy", "load_balancing_loss", "z_loss", "grad_norm", "tokens_per_s"):
        assert np.isfinite(last[name]), name
    load = np.array(last["expert_load"])
    assert load.shape == (SMALL.model.num_layers, SMALL.model.num_experts)
    np.testing.assert_allclose(load.sum(-1), 1.0, atol=1e-4)
    assert last["mfu"] is None  # no known peak on a CPU


def test_interrupted_and_resumed_run_reproduces_the_uninterrupted_losses_exactly(tmp_path):
    config = dataclasses.replace(SMALL, steps=12, ckpt_every=4, eval_every=6)
    whole = train(config, backend="xla", progress_bar=False)
    ckpt_dir = str(tmp_path / "ckpt")
    first = train(config, backend="xla", ckpt_dir=ckpt_dir, stop_after=7, progress_bar=False)
    second = train(config, backend="xla", ckpt_dir=ckpt_dir, resume=True, progress_bar=False)
    assert sorted(first.step_losses) == list(range(1, 8)) and sorted(second.step_losses) == list(range(8, 13))
    # Bit-for-bit: same batches, same restored parameters, optimizer moments, step count and router biases.
    assert {**first.step_losses, **second.step_losses} == whole.step_losses
    assert second.validation_losses == {12: whole.validation_losses[12]}
    assert first.validation_losses == {6: whole.validation_losses[6]}


def test_checkpoint_directory_is_not_overwritten_without_resume(tmp_path):
    config = dataclasses.replace(SMALL, steps=4, ckpt_every=2, eval_every=4, eval_batches=1)
    train(config, backend="xla", ckpt_dir=str(tmp_path), progress_bar=False)
    with pytest.raises(ValueError, match="--resume"):
        train(config, backend="xla", ckpt_dir=str(tmp_path), progress_bar=False)
    with pytest.raises(ValueError, match="nothing left"):
        train(config, backend="xla", ckpt_dir=str(tmp_path), resume=True, progress_bar=False)
    other_model = dataclasses.replace(config, model=dataclasses.replace(config.model, d_ff=64))
    with pytest.raises(ValueError, match="by a run with other model$"):
        train(other_model, backend="xla", ckpt_dir=str(tmp_path), resume=True, progress_bar=False)
    other_schedule = dataclasses.replace(config, peak_lr=2 * config.peak_lr, steps=8)
    with pytest.raises(ValueError, match="by a run with other peak_lr, steps$"):
        train(other_schedule, backend="xla", ckpt_dir=str(tmp_path), resume=True, progress_bar=False)


def test_configs_validate_their_fields():
    with pytest.raises(ValueError, match="num_heads"):
        dataclasses.replace(configs.TINY.model, num_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(configs.TINY.model, top_k=9)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(configs.TINY.model, dtype="float16")
    with pytest.raises(ValueError, match="warmup_steps"):
        dataclasses.replace(configs.TINY, warmup_steps=configs.TINY.steps)
    with pytest.raises(ValueError, match="balance_bias"):
        dataclasses.replace(configs.TINY, model=dataclasses.replace(configs.TINY.model, balance_bias=False))
    with pytest.raises(ValueError, match="config"):
        configs.get_config("huge")
    with pytest.raises(SystemExit):
        main.parse_args(["--backend", "cuda"])


def test_parameter_count_is_the_models():
    model = Transformer(SMALL.model, backend="xla", rngs=nnx.Rngs(0))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert parameter_counts(SMALL.model)["total"] == sum(p.size for p in params)


def test_parameter_and_flop_counts_follow_the_formulas():
    model = configs.GPU.model
    counts = parameter_counts(model)
    assert 2e8 < counts["total"] < 1e9  # "hundreds of millions"
    d, f, layers = model.d_model, model.d_ff, model.num_layers
    expert_delta = layers * (model.num_experts - model.top_k) * 3 * d * f
    assert counts["total"] - counts["active"] == expert_delta + model.vocab_size * d + d
    flops = training_flops_per_token(model, seq_len=1024)
    matmul_params = counts["active"] - layers * 2 * d  # norm scales do no matmul work
    assert flops == 3 * (2 * matmul_params + 2 * layers * 1024 * d)


TWO_DEVICE_SCRIPT = """
import dataclasses, json, sys
import jax
from flax import nnx
from train import configs
from train.model import Transformer
from train.train import make_mesh, train
config = eval(sys.argv[1], vars(configs))
with jax.set_mesh(make_mesh(2)):
    model = Transformer(config.model, rngs=nnx.Rngs(0))
    spec = model.blocks[0].moe.w_gate_up[...].sharding.spec
runs = {"1": (1, "auto"), "2 all_gather": (2, "all_gather"), "2 all_to_all": (2, "all_to_all")}
losses = {name: train(dataclasses.replace(config, expert_parallelism=ep, dispatch=dispatch), backend="xla",
                      progress_bar=False).step_losses for name, (ep, dispatch) in runs.items()}
print(json.dumps({"devices": jax.device_count(), "expert_weight_spec": list(spec), "losses": losses}))
"""


def test_two_device_mesh_matches_one_device():
    """(data=2, expert=1) and (data=1, expert=2) meshes on 2 virtual CPU devices train like one device; the second
    runs the MoE layers expert-parallel (shard_map), by either dispatch."""
    config = dataclasses.replace(SMALL, steps=4, eval_every=4, eval_batches=1, log_every=2)
    single = train(config, backend="xla", progress_bar=False).step_losses
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    completed = subprocess.run(
        [sys.executable, "-c", TWO_DEVICE_SCRIPT, repr(config)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["devices"] == 2
    assert report["expert_weight_spec"] == ["expert", None, None]
    assert len(report["losses"]) == 3
    for losses in report["losses"].values():
        np.testing.assert_allclose([losses[str(s)] for s in sorted(single)], list(single.values()), rtol=1e-5)
