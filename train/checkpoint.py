"""Orbax checkpoints of a training run: model state (parameters and router biases), optimizer state (AdamW moments
and its step count) and the run's progress (step, data position, the trajectory's config) as JSON.

Restoring targets the live model's shapes, dtypes and shardings, so a run resumes onto whatever mesh it was started
with. Saves are asynchronous; ``close`` waits for the last one.
"""

import dataclasses
import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where a run stands: ``step`` optimizer steps done; the data stream's next batch index; and the run's
    configuration as far as it shapes the trajectory (``trajectory_config``, the data seed included), which a resume
    must match."""

    step: int
    data_position: int
    run_config: dict


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 2):
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, model: nnx.Module, optimizer: nnx.Optimizer, progress: Progress) -> None:
        self.manager.save(
            progress.step,
            args=ocp.args.Composite(
                model=ocp.args.StandardSave(nnx.state(model)),
                optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
                progress=ocp.args.JsonSave(dataclasses.asdict(progress)),
            ),
        )

    def progress(self, step: int | None = None) -> Progress:
        """The progress record of checkpoint ``step`` (default: the latest), without loading any array."""
        step = self._step(step)
        restored = self.manager.restore(step, args=ocp.args.Composite(progress=ocp.args.JsonRestore()))
        return Progress(**restored.progress)

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> None:
        """Loads checkpoint ``step`` (default: the latest) into ``model`` and ``optimizer`` in place."""

        def target(state):
            return jax.tree.map(ocp.utils.to_shape_dtype_struct, state)

        restored = self.manager.restore(
            self._step(step),
            args=ocp.args.Composite(
                model=ocp.args.StandardRestore(target(nnx.state(model))),
                optimizer=ocp.args.StandardRestore(target(nnx.state(optimizer))),
            ),
        )
        nnx.update(model, restored.model)
        nnx.update(optimizer, restored.optimizer)

    def _step(self, step: int | None) -> int:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.manager.directory}")
        return step

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
