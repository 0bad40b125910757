"""The training loop: one ``nnx.jit`` step (forward, backward, AdamW, aux-loss-free bias update) with no host sync
inside; metrics stay on the device and are fetched every ``log_every`` steps, evaluation and checkpoints happen
between steps.

The mesh is (data, expert). The expert axis (``TrainConfig.expert_parallelism``) carries the stacked expert weights
(``moe_jax.nn.moe.EXPERT_AXIS``); the batch is split over both axes; everything else is replicated. With an expert
axis of more than one device the MoE layers run expert-parallel (``moe_jax.parallel``, under ``jax.shard_map``).
"""

import concurrent.futures
import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import moe_jax
from moe_jax.nn.moe import EXPERT_AXIS
from train import data
from train.checkpoint import Checkpointer, Progress
from train.compilation import ExecutableStore, abstract, compile_or_load, compiler_options
from train.configs import TrainConfig
from train.metrics import JsonlWriter, MetricsBuffer, peak_flops, training_flops_per_token
from train.model import Transformer, layer_aux, parameter_counts

DATA_AXIS = "data"

# The packages whose code traces the training step: a stored step is keyed by their source.
_SOURCES = (pathlib.Path(moe_jax.__file__).parent, pathlib.Path(__file__).parent)


@dataclasses.dataclass
class RunResult:
    """What one call of ``train`` saw: per-step training losses and validation losses keyed by steps done."""

    step_losses: dict[int, float]
    validation_losses: dict[int, float]
    unigram_entropy: float
    final_validation_loss: float | None


def make_mesh(expert_parallelism: int) -> jax.sharding.Mesh:
    """(data, expert) mesh over every device of every process; the expert axis has ``expert_parallelism`` devices."""
    num_devices = jax.device_count()
    if num_devices % expert_parallelism:
        raise ValueError(f"expert_parallelism={expert_parallelism} must divide the device count {num_devices}")
    shape = (num_devices // expert_parallelism, expert_parallelism)
    return jax.make_mesh(shape, (DATA_AXIS, EXPERT_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """[B, S] batches: rows over every device (expert parallelism also splits the tokens), sequence unsplit."""
    return NamedSharding(mesh, P((DATA_AXIS, EXPERT_AXIS), None))


def learning_rate(config: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.peak_lr,
        warmup_steps=config.warmup_steps,
        decay_steps=config.steps,
        end_value=config.peak_lr * config.end_lr_ratio,
    )


def decays(config: TrainConfig, params) -> object:
    """The tree of ``params`` with True where weight decay applies: matrices, not vectors (norm scales), counting
    the dimensions of one layer (a scanned block's parameters carry a leading layer axis)."""

    def is_matrix(path, param) -> bool:
        stacked = config.model.scan_layers and path[0].key == "blocks"
        return param.ndim - stacked >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with warm-up and cosine decay; no weight decay on vectors (norm scales)."""
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(
            learning_rate(config),
            b1=config.b1,
            b2=config.b2,
            weight_decay=config.weight_decay,
            mask=functools.partial(decays, config),
        ),
    )


def loss_fn(model: Transformer, inputs: jax.Array, targets: jax.Array, config: TrainConfig):
    """Mean next-byte cross-entropy plus the weighted aux losses summed over layers; aux outputs for metrics."""
    logits, intermediates = nnx.capture(model, nnx.Intermediate)(inputs)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    aux = layer_aux(intermediates)
    balance = aux.load_balancing_loss.sum()
    z = aux.z_loss.sum()
    loss = cross_entropy + config.load_balancing_coef * balance + config.z_loss_coef * z
    return loss, {
        "loss": loss,
        "cross_entropy": cross_entropy,
        "load_balancing_loss": balance,
        "z_loss": z,
        "expert_counts": aux.expert_counts,  # [L, E]
    }


# The routed and shared experts' weights (moe_jax.nn.MoE, SharedExperts), which their layers cast to the compute dtype.
EXPERT_WEIGHTS = nnx.All(nnx.Param, nnx.Any(nnx.PathContains("w_gate_up"), nnx.PathContains("w_down")))


def micro_batches(batch: jax.Array, num_micro_batches: int) -> jax.Array:
    """[B, S] -> [A, B / A, S]: micro-batch i holds rows i, i + A, i + 2A, ..., so each keeps the batch's split over
    the devices."""
    return batch.reshape(-1, num_micro_batches, batch.shape[-1]).swapaxes(0, 1)


def quantized_experts(experts: nnx.State) -> nnx.State:
    """Each expert weight of ``experts`` (arrays [..., G, K, N], stacked layers first) as a ``QuantizedMaster``:
    itself with the FP8 kernels' copies (``moe_jax.quantize_master``, one pass over all of a weight's groups)."""

    def quantize(w: jax.Array) -> moe_jax.QuantizedMaster:
        groups = moe_jax.quantize_master(w.reshape(-1, *w.shape[-2:]))  # [layers * G, K, N]
        return jax.tree.map(lambda a: a.reshape(*w.shape[:-2], *a.shape[1:]), groups)

    return jax.tree.map(quantize, experts)


def _is_quantized_master(x) -> bool:
    return isinstance(x, moe_jax.QuantizedMaster)


def _with_master(copy: moe_jax.QuantizedMaster, master: jax.Array) -> moe_jax.QuantizedMaster:
    return dataclasses.replace(copy, master=master)


def gradients(model: Transformer, inputs: jax.Array, targets: jax.Array, config: TrainConfig):
    """(gradients of the parameters, metrics) of one step's batch [B, S], in ``config.grad_accum_steps`` micro-batches.

    Micro-batches as ``micro_batches`` cuts them. Gradients and scalar metrics are means over the micro-batches;
    expert counts are their sums.

    The expert weights (``EXPERT_WEIGHTS``), most of the parameters, are cast to the compute dtype once per step, not
    by every micro-batch's layers: there each layer's cast copy is also saved for its backward. The gradients are
    the same, the cast's transpose being the same cast back, here as in the layer. With the FP8 kernels' recipe
    ("fp8_block") the cast weights are also quantized once per step (``quantized_experts``), and every micro-batch's
    layers read those copies, their gradients reaching the cast weights straight through: the values are those of
    quantizing in each layer call (the same quantization of the same weights). A layer on the XLA path quantizes per
    call as before, leaving the step's copies unused (XLA drops them); expert-parallel layers (each device
    quantizes its own experts) get no copies.
    """
    graphdef, experts, params, rest = nnx.split(model, EXPERT_WEIGHTS, nnx.Param, ...)
    dtype = jnp.dtype(config.model.dtype)
    trainable = (jax.tree.map(lambda w: w.astype(dtype), experts), params)
    # Expert-parallel layers quantize their own experts per call: no copies for them.
    once = config.model.quantization == "fp8_block" and config.expert_parallelism == 1
    copies = quantized_experts(trainable[0]) if once else None

    def micro_batch(trainable, inputs, targets):
        experts, params = trainable
        if copies is not None:
            # The gradient reaches each QuantizedMaster's master: the cast weight in ``trainable``.
            experts = jax.tree.map(_with_master, copies, experts, is_leaf=_is_quantized_master)
        return loss_fn(nnx.merge(graphdef, experts, params, rest), inputs, targets, config)

    def grad_fn(inputs, targets):
        """The micro-batch's gradients in the parameters' dtypes, one State as nnx.Param filters them."""
        (expert_grads, param_grads), metrics = jax.grad(micro_batch, has_aux=True)(trainable, inputs, targets)
        expert_grads = jax.tree.map(lambda g, w: g.astype(w.dtype), expert_grads, experts)
        return nnx.merge_state(expert_grads, param_grads), metrics

    accum = config.grad_accum_steps
    if accum == 1:
        return grad_fn(inputs, targets)

    def accumulate(grad_sum, batch):
        grads, metrics = grad_fn(*batch)
        return jax.tree.map(jnp.add, grad_sum, grads), metrics

    zeros = jax.tree.map(jnp.zeros_like, nnx.merge_state(experts, params))
    split = functools.partial(micro_batches, num_micro_batches=accum)
    grad_sum, per_micro_batch = jax.lax.scan(accumulate, zeros, (split(inputs), split(targets)))
    metrics = {name: value.mean(0) for name, value in per_micro_batch.items()}
    metrics["expert_counts"] = per_micro_batch["expert_counts"].sum(0)
    return jax.tree.map(lambda g: g / accum, grad_sum), metrics


def make_train_step(config: TrainConfig, graphdef: nnx.GraphDef):
    """``step(state, inputs, targets) -> (state, metrics)``, jitted, over ``nnx.split((model, optimizer))``'s state.

    The state (parameters, router biases, optimizer moments) is donated: XLA updates it in place, and the caller
    must drop the arrays it passed in (``nnx.update`` the model and optimizer with the returned state).
    """

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, inputs, targets):
        model, optimizer = nnx.merge(graphdef, state)
        grads, metrics = gradients(model, inputs, targets, config)
        with jax.named_scope("optimizer"):  # the scope train.profile_step reads
            optimizer.update(model, grads)
            if config.bias_update_rate:
                model.update_balancing_biases(metrics["expert_counts"], config.bias_update_rate)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return nnx.state((model, optimizer)), metrics

    return train_step


def evaluation_loss(model: Transformer, inputs: jax.Array, targets: jax.Array, num_micro_batches: int = 1) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of one batch, in micro-batches as the training step takes them (so that
    evaluation fits wherever training does)."""
    graphdef, state = nnx.split(model)

    def cross_entropy(batch):
        logits, _ = nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    if num_micro_batches == 1:
        return cross_entropy((inputs, targets))
    split = functools.partial(micro_batches, num_micro_batches=num_micro_batches)
    return jax.lax.map(cross_entropy, (split(inputs), split(targets))).mean()


def make_eval_step(config: TrainConfig, graphdef: nnx.GraphDef):
    """``evaluate(state, inputs, targets) -> loss``, jitted over ``nnx.split(model)``'s state, in the training step's
    micro-batches (``evaluation_loss``)."""

    @jax.jit
    def evaluate(state, inputs, targets):
        return evaluation_loss(nnx.merge(graphdef, state), inputs, targets, config.grad_accum_steps)

    return evaluate


def model_creator(config: TrainConfig, backend: str):
    """``create()`` -> (model, optimizer) of ``config`` at initialisation (seeded by ``config.seed``), built under the
    current mesh by one jitted function (``create.eval_shape()`` gives their shapes without building them). Built
    eagerly, each parameter's initialiser would be a program of its own, and on a cold compilation cache each of them
    (about 50 at gpu-moe) would be compiled before the first step could be."""

    @nnx.jit
    def create():
        model = Transformer(
            config.model,
            backend=backend,
            # With an expert axis the MoE layers run expert-parallel (moe_jax.parallel), not as one partitioned op.
            expert_parallel=config.expert_parallelism > 1,
            dispatch=config.dispatch,
            rngs=nnx.Rngs(config.seed),
        )
        return model, nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)

    return create


def create_model(config: TrainConfig, backend: str) -> tuple[Transformer, nnx.Optimizer]:
    """The model of ``config`` at initialisation and its optimizer (``model_creator``)."""
    return model_creator(config, backend)()


def _under_mesh(mesh: jax.sharding.Mesh, function):
    """``function()`` with ``mesh`` set (the mesh a thread runs under is its own)."""
    with jax.set_mesh(mesh):
        return function()


def to_device(batch: data.Batch, sharding: NamedSharding, global_batch: int) -> tuple[jax.Array, jax.Array]:
    shape = (global_batch, batch.inputs.shape[1])
    return tuple(jax.make_array_from_process_local_data(sharding, x, shape) for x in (batch.inputs, batch.targets))


def load_data(config: TrainConfig) -> tuple[data.WindowSampler, data.WindowSampler, float]:
    """Training and validation samplers (this process's rows) and the validation bytes' unigram entropy."""
    train_data = data.WindowSampler(
        data.load_corpus("train", config.validation_percent),
        config.seq_len,
        config.batch_size,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    validation_corpus = data.load_corpus("validation", config.validation_percent)
    validation_data = dataclasses.replace(train_data, corpus=validation_corpus, seed=data.VALIDATION_STREAM)
    return train_data, validation_data, data.unigram_entropy(validation_corpus)


# Cadences that do not change the parameters' trajectory: a resumed run may change them.
_CADENCE_FIELDS = ("log_every", "eval_every", "eval_batches", "ckpt_every")


def trajectory_config(config: TrainConfig) -> dict:
    """The configuration a resumed run must share with the run that wrote the checkpoint (JSON-serialisable)."""
    fields = dataclasses.asdict(config)
    return {name: value for name, value in fields.items() if name not in _CADENCE_FIELDS}


def _resume_progress(config: TrainConfig, checkpointer: Checkpointer, stop: int) -> Progress:
    """The latest checkpoint's progress, checked to belong to this run and to leave steps before ``stop``."""
    progress = checkpointer.progress()
    expected = trajectory_config(config)
    differing = sorted(name for name in expected if progress.run_config.get(name) != expected[name])
    if differing:
        raise ValueError(
            f"the checkpoint in {checkpointer.manager.directory} was written by a run with other {', '.join(differing)}"
        )
    if progress.step >= stop:
        raise ValueError(f"the checkpoint is at step {progress.step}: nothing left to do before step {stop}")
    return progress


def _setup_record(config: TrainConfig, backend: str, mesh, step: int, options: dict) -> dict:
    return {
        "kind": "setup",
        "step": step,
        "config": dataclasses.asdict(config),
        "backend": backend,
        "compiler_options": options,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "mesh": dict(mesh.shape),
        "parameters": parameter_counts(config.model),
        "training_flops_per_token": training_flops_per_token(config.model, config.seq_len),
        "peak_flops": peak_flops(jax.devices()[0], config.model.dtype),
    }


def train(
    config: TrainConfig,
    *,
    backend: str = "auto",
    ckpt_dir: str | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    metrics_path: str | None = None,
    progress_bar: bool = True,
    executable_dir: str | None = None,
    quick_compile: bool = False,
) -> RunResult:
    """Trains ``config`` for ``config.steps`` steps (or until ``stop_after`` steps are done, checkpointing there).

    Args:
      backend: the MoE layers' backend ("auto", "xla" or "pallas"), passed through to ``moe_jax``.
      ckpt_dir: orbax checkpoint directory (None: no checkpoints).  resume: continue from its latest checkpoint.
      stop_after: end this run once that many steps are done (the schedule still spans ``config.steps``); a later
        run with ``resume`` continues exactly where it stopped.
      metrics_path: JSONL file (appended to when resuming).  progress_bar: show a tqdm bar.
      executable_dir: where compiled steps are stored (``train.compilation.ExecutableStore``): a launch whose step
        is there loads it instead of tracing, lowering and compiling it (None: always compile; also with several
        processes, which would each write the same files).
      quick_compile: compile the steps with ``train.compilation.QUICK_COMPILE_OPTIONS``: seconds less to the first
        step, slightly slower steps.
    """
    stop = config.steps if stop_after is None else stop_after
    if not 0 < stop <= config.steps:
        raise ValueError(f"stop_after must be in [1, steps={config.steps}], got {stop_after}")
    if resume and ckpt_dir is None:
        raise ValueError("resume=True needs ckpt_dir, the directory of the checkpoints to resume from")
    main_process = jax.process_index() == 0
    say = tqdm.write if main_process else (lambda _: None)
    mesh = make_mesh(config.expert_parallelism)
    micro_batch = config.batch_size // config.grad_accum_steps
    if micro_batch % mesh.size:
        raise ValueError(
            f"batch_size={config.batch_size} / grad_accum_steps={config.grad_accum_steps} must be a multiple of the "
            f"device count {mesh.size}"
        )
    sharding = batch_sharding(mesh)

    with jax.set_mesh(mesh):
        checkpointer = Checkpointer(ckpt_dir) if ckpt_dir else None
        progress = _resume_progress(config, checkpointer, stop) if resume else None
        if not resume and checkpointer is not None and checkpointer.latest_step() is not None:
            raise ValueError(f"{ckpt_dir} already holds checkpoints: pass --resume, or choose another --ckpt-dir")
        start, data_position = (progress.step, progress.data_position) if progress is not None else (0, 0)
        writer = JsonlWriter(metrics_path, append=resume)
        options = compiler_options(backend=backend, quick=quick_compile)
        setup = _setup_record(config, backend, mesh, start, options)
        writer.write(setup)
        counts = setup["parameters"]
        say(
            f"{counts['total'] / 1e6:.2f}M parameters ({counts['active'] / 1e6:.2f}M active per token), "
            f"{jax.device_count()} x {setup['device_kind']}, mesh {setup['mesh']}, backend {backend!r}"
        )
        # Two threads work while the step is traced, lowered and compiled ahead of time for the batch's shape, or
        # loaded from the store of compiled steps (train.compilation.ExecutableStore), since XLA's compilation leaves
        # the interpreter free: one loads the corpus (plain Python and NumPy), the other creates the model (its
        # initialisers compiled, then run). On one device the step compiles for the state's shapes alone, every
        # placement being the same; on several it waits for the created state, whose shardings it compiles for.
        workers = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="train-setup")
        corpus = workers.submit(load_data, config)
        creator = model_creator(config, backend)
        creating = workers.submit(_under_mesh, mesh, creator)
        workers.shutdown(wait=False)
        graphdef, state_shapes = nnx.split(creator.eval_shape() if mesh.size == 1 else creating.result())
        batch_shape = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32, sharding=sharding)
        store = ExecutableStore(executable_dir) if executable_dir and jax.process_count() == 1 else None

        def compile_step(jitted, kind: str, step_state):
            """``jitted`` compiled at (``step_state``, a batch, a batch), or loaded from the store where it is."""
            description = {"config": trajectory_config(config), "backend": backend, "step": kind}
            args = (abstract(step_state), batch_shape, batch_shape)
            return compile_or_load(
                jitted, *args, store=store, description=description, sources=_SOURCES, options=options
            )

        train_step, times = compile_step(make_train_step(config, graphdef), "train", state_shapes)
        if times.aot == "loaded":
            say(f"train step loaded from {executable_dir} in {times.compile_s:.1f} s")
        else:
            say(
                f"train step compiled in {times.total_s:.1f} s (trace {times.trace_s:.1f} s, lower "
                f"{times.lower_s:.1f} s, compile {times.compile_s:.1f} s)"
            )

        model, optimizer = creating.result()
        if progress is not None:
            checkpointer.restore(model, optimizer, progress.step)
        state = nnx.state((model, optimizer))
        train_data, validation_data, unigram = corpus.result()
        validation_batches = [
            to_device(validation_data.batch(i), sharding, config.batch_size) for i in range(config.eval_batches)
        ]
        buffer = MetricsBuffer(
            writer,
            tokens_per_step=config.tokens_per_step,
            flops_per_token=setup["training_flops_per_token"],
            peak=None if setup["peak_flops"] is None else setup["peak_flops"] * setup["devices"],
        )
        schedule = learning_rate(config)
        result = RunResult({}, {}, unigram, None)
        evaluate = None
        bar = tqdm(total=stop, initial=start, disable=not (progress_bar and main_process), unit="step")
        for done in range(start + 1, stop + 1):
            inputs, targets = to_device(train_data.batch(data_position), sharding, config.batch_size)
            data_position += 1
            state, metrics = train_step(state, inputs, targets)
            # The passed-in state was donated: the model and optimizer take the new one.
            nnx.update((model, optimizer), state)
            first = done == start + 1
            buffer.add(done, metrics, timed=not first)
            if first:
                # The one sync of the first step keeps its start-up (allocation, the first transfers) out of the
                # throughput figures.
                jax.block_until_ready(metrics)
                first_step_s = time.perf_counter() - buffer.start
                writer.write(
                    {
                        "kind": "compile",
                        "step": done,
                        **dataclasses.asdict(times),
                        "first_step_s": first_step_s,
                        "seconds": times.total_s + first_step_s,
                        # Wall-clock time, so that a caller that launched the process can tell the launch's cost.
                        "unix_time": time.time(),
                    }
                )
                buffer.restart_clock()
            bar.update()
            evaluate_now = done % config.eval_every == 0 or done == config.steps
            save_now = checkpointer is not None and (done % config.ckpt_every == 0 or done == stop)
            if done % config.log_every == 0 or done == stop or evaluate_now or save_now:
                record, losses = buffer.flush(learning_rate=float(schedule(done - 1)))
                result.step_losses.update(losses)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s'] or 0:.0f}")
            if evaluate_now:
                eval_record = {"kind": "eval", "step": done}
                if evaluate is None:  # compiled (or loaded) at the first evaluation, which short runs may not reach
                    model_graphdef, model_state = nnx.split(model)
                    evaluate, eval_times = compile_step(make_eval_step(config, model_graphdef), "eval", model_state)
                    eval_record |= {"compile_s": eval_times.total_s, "aot": eval_times.aot}
                batch_losses = [evaluate(nnx.state(model), *batch) for batch in validation_batches]
                result.validation_losses[done] = float(np.mean(jax.device_get(batch_losses)))
                writer.write(eval_record | {"validation_loss": result.validation_losses[done]})
                say(f"step {done}: validation loss {result.validation_losses[done]:.4f}")
            if save_now:
                checkpointer.save(model, optimizer, Progress(done, data_position, trajectory_config(config)))
            if evaluate_now or save_now:
                buffer.restart_clock()
        bar.close()
        if checkpointer is not None:
            checkpointer.close()

    if stop < config.steps:
        say(f"stopped after step {stop} of {config.steps}; continue with --resume")
        return result
    final = result.final_validation_loss = result.validation_losses[config.steps]
    margin = unigram - final
    writer.write(
        {"kind": "final", "step": stop, "validation_loss": final, "unigram_entropy": unigram, "margin": margin}
    )
    say(
        f"final validation loss {final:.4f} nats/byte ({final / np.log(2):.3f} bits/byte); unigram entropy of the "
        f"validation bytes {unigram:.4f} nats/byte; margin {margin:.4f} nats/byte ({margin / unigram:.0%} below)"
    )
    return result
