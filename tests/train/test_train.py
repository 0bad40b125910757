"""Training: a smoke run learns, an interrupted and resumed run reproduces the uninterrupted one exactly."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax.ops.grouped_matmul import api as grouped_matmul_api
from tests.helpers import virtual_devices_flags
from train import configs, main
from train.metrics import training_flops_per_token
from train.model import Transformer, attention_implementation, parameter_counts
from train.train import EXPERT_WEIGHTS, evaluation_loss, gradients, loss_fn, make_optimizer, make_train_step, train

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
    assert records[0]["compiler_options"] == {}  # XLA's defaults unless quick_compile
    train_records = [r for r in records if r["kind"] == "train"]
    assert sum(len(r["step_losses"]) for r in train_records) == SMALL.steps
    last = train_records[-1]
    for name in ("loss", "cross_entropy", "load_balancing_loss", "z_loss", "grad_norm", "tokens_per_s"):
        assert np.isfinite(last[name]), name
    load = np.array(last["expert_load"])
    assert load.shape == (SMALL.model.num_layers, SMALL.model.num_experts)
    np.testing.assert_allclose(load.sum(-1), 1.0, atol=1e-4)
    assert last["mfu"] is None  # no known peak on a CPU


def test_fp8_run_learns_close_to_the_bf16_run_and_records_its_recipe(tmp_path):
    """The MoE layers' expert GEMMs in fp8_block (the XLA path on CPU): the loss falls as the unquantized run's does,
    within 0.1 of it at the end (e4m3 perturbs each step's gradients by a few percent, not the descent), but not
    equal to it (the quantization ran), and the metrics record the recipe."""
    small = dataclasses.replace(SMALL, steps=16, log_every=8, eval_every=8)
    fp8 = dataclasses.replace(small, model=dataclasses.replace(small.model, quantization="fp8_block"))
    metrics = tmp_path / "metrics.jsonl"
    quantized = train(fp8, backend="xla", metrics_path=str(metrics), progress_bar=False)
    plain = train(small, backend="xla", progress_bar=False)
    steps = range(small.steps - 4, small.steps + 1)
    last = [np.mean([run.step_losses[step] for step in steps]) for run in (quantized, plain)]
    assert abs(last[0] - last[1]) < 0.1
    assert quantized.step_losses[small.steps] != plain.step_losses[small.steps]
    setup = json.loads(metrics.read_text().splitlines()[0])
    assert setup["config"]["model"]["quantization"] == "fp8_block"


# The scanned model resumes by the same code on another parameter tree (the scan is covered by the tests below).
@pytest.mark.parametrize("scan_layers", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["listed", "scanned"])
def test_interrupted_and_resumed_run_reproduces_the_uninterrupted_losses_exactly(tmp_path, scan_layers):
    model = dataclasses.replace(SMALL.model, scan_layers=scan_layers)
    config = dataclasses.replace(SMALL, model=model, steps=12, ckpt_every=4, eval_every=6)
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
    with pytest.raises(ValueError, match="remat"):
        dataclasses.replace(configs.TINY.model, remat="attention")
    with pytest.raises(ValueError, match="attention"):
        dataclasses.replace(configs.TINY.model, attention="flash")
    with pytest.raises(ValueError, match="quantization"):
        dataclasses.replace(configs.TINY.model, quantization="fp4")
    with pytest.raises(ValueError, match="grad_accum_steps"):
        dataclasses.replace(configs.TINY, grad_accum_steps=3)
    with pytest.raises(ValueError, match="unroll_layers needs scan_layers"):
        dataclasses.replace(configs.TINY.model, scan_layers=False, unroll_layers=True)
    with pytest.raises(ValueError, match="config"):
        configs.get_config("huge")
    with pytest.raises(SystemExit):
        main.parse_args(["--backend", "cuda"])


@pytest.mark.parametrize(
    "flags, scan_layers, unroll_layers",
    [
        ([], True, True),
        (["--no-unroll-layers"], True, False),
        (["--no-scan-layers"], False, False),
        (["--no-scan-layers", "--unroll-layers"], False, True),
    ],
)
def test_layer_flags_override_the_config(flags, scan_layers, unroll_layers):
    """gpu-moe scans and unrolls its layers; --no-scan-layers alone lists them (and so unrolls no scan); both flags
    together ask for what ModelConfig refuses."""
    config, args = configs.get_config("gpu-moe"), main.parse_args(["--config", "gpu-moe", *flags])
    if unroll_layers and not scan_layers:
        with pytest.raises(ValueError, match="unroll_layers needs scan_layers"):
            main.with_overrides(config, args)
        return
    model = main.with_overrides(config, args).model
    assert (model.scan_layers, model.unroll_layers) == (scan_layers, unroll_layers)


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
    env = {**os.environ, "XLA_FLAGS": virtual_devices_flags(2), "JAX_PLATFORMS": "cpu"}
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


EXPERT_PARALLEL_RESUME_SCRIPT = """
import dataclasses, json, sys, tempfile
import jax
from train import configs
from train.compilation import enable_compile_cache
from train.train import train
enable_compile_cache(sys.argv[2])  # the three runs compile one step function: the second and third load it
config = eval(sys.argv[1], vars(configs))
whole = train(config, backend="xla", progress_bar=False)
first = train(config, backend="xla", ckpt_dir=sys.argv[3], stop_after=3, progress_bar=False)
second = train(config, backend="xla", ckpt_dir=sys.argv[3], resume=True, progress_bar=False)
print(json.dumps({"devices": jax.device_count(), "whole": whole.step_losses, "first": first.step_losses,
                  "second": second.step_losses, "whole_validation": whole.validation_losses,
                  "second_validation": second.validation_losses}))
"""


def test_expert_parallel_run_resumes_bit_exactly(tmp_path):
    """Expert parallelism 4 on 8 virtual CPU devices (a (2, 4) mesh, the all-to-all dispatch, 2 experts a device):
    a run stopped after 3 steps and resumed from its orbax checkpoint (the expert weights and their optimizer
    moments sharded over the expert axis) reproduces the uninterrupted run's losses bit for bit."""
    model = dataclasses.replace(SMALL.model, num_layers=1, num_experts=8)
    config = dataclasses.replace(
        SMALL, model=model, steps=6, ckpt_every=3, eval_every=6, eval_batches=1, log_every=3,
        expert_parallelism=4, dispatch="all_to_all",
    )  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": virtual_devices_flags(8), "JAX_PLATFORMS": "cpu"}
    completed = subprocess.run(
        [sys.executable, "-c", EXPERT_PARALLEL_RESUME_SCRIPT, repr(config), str(tmp_path / "cache"),
         str(tmp_path / "ckpt")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["devices"] == 8
    assert sorted(report["first"], key=int) == ["1", "2", "3"] and sorted(report["second"], key=int) == ["4", "5", "6"]
    assert {**report["first"], **report["second"]} == report["whole"]
    assert report["second_validation"] == report["whole_validation"]


def test_gpu_moe_config_is_the_documented_fine_grained_model():
    """gpu-moe: D 2048, 64 experts top-8 of F 768 and a shared expert, sigmoid routing balanced by the bias, >= 64k
    tokens a step; about 2.6B parameters (0.48B active). The count comes from the constructed (abstract) model."""
    config = configs.get_config("gpu-moe")
    model = config.model
    assert (model.d_model, model.num_experts, model.top_k, model.d_ff) == (2048, 64, 8, 768)
    assert model.num_shared_experts == 1 and model.score == "sigmoid" and model.balance_bias
    assert config.bias_update_rate > 0 and model.scan_layers and model.dtype == "bfloat16"
    assert config.tokens_per_step >= 65536
    abstract_model = nnx.eval_shape(lambda: Transformer(model, backend="xla", rngs=nnx.Rngs(0)))
    shapes = jax.tree.leaves(nnx.state(abstract_model, nnx.Param))
    total = sum(int(np.prod(p.shape)) for p in shapes)
    assert parameter_counts(model)["total"] == total
    assert 2.55e9 < total < 2.65e9
    # A token uses everything but the E - k routed experts it skips and the embedding (a lookup, no matmul); of that,
    # the norm scales do no matmul work (parameter_counts's "active" leaves out the final norm's scale).
    moe = abstract_model.blocks.moe
    unused = (moe.w_gate_up.size + moe.w_down.size) * (model.num_experts - model.top_k) // model.num_experts
    active = total - unused - abstract_model.embed.size
    assert parameter_counts(model)["active"] == active - model.d_model
    assert 0.45e9 < active < 0.5e9
    norm_scales = model.num_layers * 2 * model.d_model + model.d_model
    attention_scores = 2 * model.num_layers * config.seq_len * model.d_model
    expected = 3 * (2 * (active - norm_scales) + attention_scores)
    assert training_flops_per_token(model, config.seq_len) == expected


def test_attention_takes_cudnn_only_where_it_applies():
    gpu_moe = configs.GPU_MOE.model
    assert attention_implementation(gpu_moe, "gpu") == "cudnn"
    assert attention_implementation(gpu_moe, "cpu") == "xla"
    assert attention_implementation(configs.TINY.model, "gpu") == "xla"  # f32
    with pytest.raises(ValueError, match="attention='cudnn'"):
        attention_implementation(dataclasses.replace(gpu_moe, attention="cudnn"), "cpu")
    assert attention_implementation(dataclasses.replace(gpu_moe, attention="xla"), "gpu") == "xla"


def _stacked_copy(source: Transformer, config: configs.ModelConfig) -> Transformer:
    """A scanned model holding copies of ``source``'s parameters and router biases (its blocks stacked on a layer
    axis); copies, because a training step donates the arrays it is given."""
    target = Transformer(config, backend="xla", rngs=nnx.Rngs(1))
    nnx.update(target.blocks, jax.tree.map(lambda *layers: jnp.stack(layers), *[nnx.state(b) for b in source.blocks]))
    target.final_norm.scale[...] = jnp.copy(source.final_norm.scale[...])
    target.embed[...], target.head[...] = jnp.copy(source.embed[...]), jnp.copy(source.head[...])
    return target


def _steps(model: Transformer, config: configs.TrainConfig, num_steps: int) -> list[dict]:
    """Metrics of ``num_steps`` jitted training steps on seeded random bytes."""
    optimizer = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    step = make_train_step(config, graphdef)
    fetched = []
    for key in jax.random.split(jax.random.key(7), num_steps):
        tokens = jax.random.randint(key, (config.batch_size, config.seq_len + 1), 0, 256)
        state, metrics = step(state, tokens[:, :-1], tokens[:, 1:])
        fetched.append(jax.device_get(metrics))
    return fetched


@pytest.mark.parametrize(
    "variant",
    [
        dict(scan_layers=True),
        dict(scan_layers=True, unroll_layers=True, grad_accum_steps=2),
        dict(scan_layers=True, remat="full"),
        dict(scan_layers=True, remat="moe"),
        # remat "moe" alone: the scanned case above runs the same policy.
        pytest.param(dict(remat="moe"), marks=pytest.mark.slow),
        dict(grad_accum_steps=2),
    ],
    ids=lambda v: ",".join(f"{k}={v[k]}" for k in v),
)
def test_scan_remat_and_accumulation_train_like_the_plain_step(variant):
    """Oracle: the unscanned, unrematerialised, unaccumulated step from the same parameters. Aux-loss weights are 0
    because the load-balancing loss of half a batch is not half the whole batch's (the cross-entropy's mean is)."""
    config = dataclasses.replace(SMALL, load_balancing_coef=0.0, z_loss_coef=0.0)
    model_fields = {k: v for k, v in variant.items() if k != "grad_accum_steps"}
    variant_config = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, **model_fields),
        grad_accum_steps=variant.get("grad_accum_steps", 1),
    )
    plain = Transformer(config.model, backend="xla", rngs=nnx.Rngs(0))
    if variant_config.model.scan_layers:
        other = _stacked_copy(plain, variant_config.model)
    else:
        other = Transformer(variant_config.model, backend="xla", rngs=nnx.Rngs(0))
    expected = _steps(plain, config, 2)
    actual = _steps(other, variant_config, 2)
    for want, got in zip(expected, actual, strict=True):
        for name in ("loss", "cross_entropy", "grad_norm"):
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, err_msg=name)
        # The bias step moves the routing of the next steps; equal counts show that every layer's bias moved alike.
        np.testing.assert_array_equal(got["expert_counts"], want["expert_counts"])


def test_unrolled_layers_lower_the_step_without_a_loop():
    """A rolled layer scan is a while loop (whose per-layer outputs XLA writes into zero-filled [L, ...] buffers, and
    two: forward and backward); unrolled, the step of one micro-batch has no loop at all."""
    loops = {}
    for unroll_layers in (False, True):
        model_config = dataclasses.replace(SMALL.model, scan_layers=True, unroll_layers=unroll_layers)
        config = dataclasses.replace(SMALL, model=model_config)
        model = Transformer(model_config, backend="xla", rngs=nnx.Rngs(0))
        graphdef, state = nnx.split((model, nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)))
        batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
        loops[unroll_layers] = (
            make_train_step(config, graphdef).lower(state, batch, batch).as_text().count("stablehlo.while")
        )
    assert loops == {False: 2, True: 0}


@pytest.mark.parametrize("scan_layers, quantization", [(False, None), (True, "fp8_block")])
def test_expert_weights_cast_once_give_the_gradients_of_casting_in_every_layer(scan_layers, quantization):
    """``gradients`` casts the expert weights to bf16 once per step (and with fp8_block quantizes them once,
    ``quantized_experts``); the oracle differentiates each micro-batch's loss with respect to the f32 parameters,
    which the layers cast (and quantize) themselves, and averages. Both round alike, so they agree to f32 summation
    order, and every expert weight (routed and shared) is among the cast ones.

    Both programs compile with XLA's excess precision off: with it, XLA may skip a bf16 rounding between fused ops,
    and does so in one program and not the other."""
    model_config = dataclasses.replace(
        SMALL.model, dtype="bfloat16", num_shared_experts=1, scan_layers=scan_layers, quantization=quantization
    )
    config = dataclasses.replace(SMALL, model=model_config, grad_accum_steps=2)
    model = Transformer(config.model, backend="xla", rngs=nnx.Rngs(3))
    tokens = jax.random.randint(jax.random.key(4), (config.batch_size, config.seq_len + 1), 0, 256)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def rounding_every_bf16(fn, *args):
        return jax.jit(fn).lower(*args).compile({"xla_allow_excess_precision": False})(*args)

    grads, _ = rounding_every_bf16(lambda p: gradients(nnx.merge(graphdef, p, rest), inputs, targets, config), params)

    def micro_batch_grads(p):
        def loss(p, i):
            return loss_fn(nnx.merge(graphdef, p, rest), inputs[i::2], targets[i::2], config)[0]

        return jax.tree.map(lambda a, b: (a + b) / 2, jax.grad(loss)(p, 0), jax.grad(loss)(p, 1))

    expected = rounding_every_bf16(micro_batch_grads, params)
    experts = nnx.state(model, EXPERT_WEIGHTS)
    # w_gate_up and w_down, routed and shared: of each layer, or stacked over the layers.
    assert len(jax.tree.leaves(experts)) == 4 * (1 if scan_layers else config.model.num_layers)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


def test_fp8_expert_weights_are_quantized_once_a_step_and_the_layers_read_the_copies(monkeypatch):
    """Traced for the FP8 kernels (backend "pallas", 2 micro-batches, stacked layers, a shared expert), the step
    quantizes each expert weight once, outside the micro-batches, and every layer's FP8 GEMMs take the copies: the
    kernels' weight layouts are made from high-precision weights only for the step's QuantizedMasters."""
    model_config = dataclasses.replace(
        SMALL.model,
        d_model=128,
        d_ff=128,
        dtype="bfloat16",
        num_shared_experts=1,
        scan_layers=True,
        quantization="fp8_block",
    )
    config = dataclasses.replace(SMALL, model=model_config, grad_accum_steps=2)
    model = Transformer(config.model, backend="pallas", rngs=nnx.Rngs(5))
    made_from = []
    kernel_weights = grouped_matmul_api.kernel_weights

    def recorded(weights, *args, **kwargs):
        made_from.append(type(weights).__name__)
        return kernel_weights(weights, *args, **kwargs)

    monkeypatch.setattr(grouped_matmul_api, "kernel_weights", recorded)
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
    jax.eval_shape(lambda inputs, targets: gradients(model, inputs, targets, config), batch, batch)
    # The routed and the shared experts' w_gate_up and w_down, stacked over the layers: four quantize_master calls.
    assert len(made_from) - made_from.count("QuantizedMaster") == 4
    assert made_from.count("QuantizedMaster") >= 4


def test_evaluation_in_micro_batches_matches_the_whole_batch():
    model = Transformer(SMALL.model, backend="xla", rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (SMALL.batch_size, SMALL.seq_len + 1), 0, 256)
    evaluate = nnx.jit(evaluation_loss, static_argnames="num_micro_batches")
    whole = evaluate(model, tokens[:, :-1], tokens[:, 1:])
    in_four = evaluate(model, tokens[:, :-1], tokens[:, 1:], 4)
    np.testing.assert_allclose(in_four, whole, rtol=1e-6)


def test_compile_cache_flag_fills_the_cache_directory_and_a_second_launch_loads_the_step(tmp_path):
    """Two steps of the tiny config through the command line fill the --compile-cache directory, time the
    compilation's phases and store the compiled training and evaluation steps; a second launch loads them (no
    tracing, no lowering) and reaches bit-identical training and validation losses."""
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "train", "--config", "tiny", "--steps", "2", "--no-progress"]
    records = []
    for launch in ("cold", "warm"):
        metrics = tmp_path / f"{launch}.jsonl"
        completed = subprocess.run(
            [*command, "--metrics", str(metrics), "--compile-cache", str(cache)],
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        records.append([json.loads(line) for line in metrics.read_text().splitlines()])
    (cold, warm) = ([r for r in launch if r["kind"] == "compile"][0] for launch in records)
    for name in ("trace_s", "lower_s", "compile_s", "first_step_s"):
        assert cold[name] > 0, name
    assert cold["aot"] == "saved"
    assert [p for p in cache.glob("jit_*") if p.is_file()], "the compilation cache stayed empty"
    assert warm["aot"] == "loaded" and warm["trace_s"] == warm["lower_s"] == 0
    cold_eval, warm_eval = ([r for r in launch if r["kind"] == "eval"][0] for launch in records)
    assert (cold_eval["aot"], warm_eval["aot"]) == ("saved", "loaded")
    cold_losses, warm_losses = ([r["step_losses"] for r in launch if r["kind"] == "train"] for launch in records)
    assert warm_losses == cold_losses
    assert warm_eval["validation_loss"] == cold_eval["validation_loss"]


@pytest.mark.parametrize(
    "flags, expected, executables",
    [
        ([], "runs/tiny/compile_cache", "runs/tiny/compile_cache/executables"),
        (["--no-aot"], "runs/tiny/compile_cache", None),
        (["--no-compile-cache"], None, None),
    ],
)
def test_the_cache_lies_beside_the_metrics_unless_turned_off(monkeypatch, flags, expected, executables):
    """The command line's cache and stored-step choices, with the training itself stubbed out."""
    enabled, calls = [], []
    monkeypatch.setattr("train.compilation.enable_compile_cache", enabled.append)
    monkeypatch.setattr("train.train.train", lambda *args, **kwargs: calls.append(kwargs))
    main.main(["--config", "tiny", *flags])
    assert enabled == ([] if expected is None else [expected])
    assert calls[0]["executable_dir"] == executables


@pytest.mark.parametrize("flags, quick", [([], False), (["--quick-compile"], True)])
def test_quick_compile_reaches_train(monkeypatch, flags, quick):
    calls = []
    monkeypatch.setattr("train.compilation.enable_compile_cache", lambda directory: None)
    monkeypatch.setattr("train.train.train", lambda *args, **kwargs: calls.append(kwargs))
    main.main(["--config", "tiny", *flags])
    assert calls[0]["quick_compile"] is quick
