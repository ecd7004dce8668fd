"""Runs on the callback actor: ``EvalOnSave``, each checkpoint evaluated in a Ray eval task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from callbacks._callback import TrainerCallback

__all__ = ["EvalOnSave"]


class EvalOnSave(TrainerCallback):
    """On each ``on_save``, run ``eval_fn(checkpoint_path, step)`` as a Ray task.

    Runs on the callback actor (``runs_on="actor"``): the training loop never waits. The task
    gets the resources asked for here, so on a GPU cluster it lands on a spare GPU; several may
    run at once (``max_in_flight``, default unbounded). ``eval_fn`` reads the persisted
    checkpoint (a folder under ``storage_path``, readable wherever the task runs) and returns a
    dict of metrics. Each result fires ``on_evaluate`` on the actor-side callbacks, with
    ``val_metrics``, ``checkpoint_path`` and ``global_step`` set to the checkpoint's, and is
    added to ``TrainingResult.evaluations``. A failing or timed-out evaluation is recorded
    there with an ``error``, never raised. At the end of the run the actor waits for the
    evaluations still running (up to ``TrainingArgs.eval_timeout_s``).

    An ``eval_fn`` whose ``persistent`` attribute is true (``GenerationEval(keep_engine=True)``)
    runs in one evaluator actor for the run instead of a task per checkpoint: the actor gets
    these resources when the run starts and keeps them (and the function's warm engine) until
    the run ends, fails or is stopped; its evaluations run one at a time.

    Args:
        eval_fn: ``(checkpoint_path: str, step: int) -> dict`` of metrics; must be picklable.
        num_gpus, num_cpus, resources: the Ray resources of each evaluation task. When no node
            has them, a run on a cluster without an autoscaler is refused before training
            (``num_gpus=0`` evaluates on CPU); with an autoscaler each task waits for a node,
            bounded by ``timeout_s``.
        max_in_flight: at most this many evaluations at once; the actor (not the training loop)
            waits for a free slot.
        timeout_s: cancel an evaluation that runs longer, and record it as timed out.
        every_n_saves: evaluate every n-th checkpoint only.

    Example:
        >>> def evaluate(path, step):
        ...     model = load_model(path)  # a factory's run: load_model(path, model=build_net)
        ...     return {"accuracy": accuracy(model)}
        >>> run_training(save_every_steps=100, callbacks=[
        ...     EvalOnSave(evaluate, num_gpus=1, timeout_s=600),
        ...     EarlyStopping("accuracy", mode="max", patience=3)])
    """

    def __init__(
        self,
        eval_fn: Callable[[str, int], dict[str, Any]],
        num_gpus: float = 1,
        num_cpus: float = 1,
        resources: dict[str, float] | None = None,
        max_in_flight: int | None = None,
        timeout_s: float | None = None,
        every_n_saves: int = 1,
    ) -> None:
        if not callable(eval_fn):
            raise TypeError(f"EvalOnSave: eval_fn must be callable, got {type(eval_fn).__name__}")
        if every_n_saves < 1:
            raise ValueError(f"EvalOnSave: every_n_saves must be >= 1, got {every_n_saves}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"EvalOnSave: max_in_flight must be >= 1 or None, got {max_in_flight}")
        self.eval_fn = eval_fn
        self.num_gpus = num_gpus
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.every_n_saves = every_n_saves
        self.saves_seen = 0

    def on_save(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor after a checkpoint is persisted; launches the task."""
        self.saves_seen += 1
        if self.saves_seen % self.every_n_saves:
            return
        launcher = getattr(context, "eval_launcher", None)
        if launcher is None:
            raise RuntimeError(
                "EvalOnSave needs the callback actor (runs_on='actor'), which launches its Ray "
                "tasks; it got no launcher in this process"
            )
        launcher.launch(
            self.eval_fn,
            context.checkpoint_path,
            context.global_step,
            num_cpus=self.num_cpus,
            num_gpus=self.num_gpus,
            resources=self.resources,
            timeout_s=self.timeout_s,
            max_in_flight=self.max_in_flight,
            source=self.name,
            key=id(self),  # this EvalOnSave's evaluator actor, for a persistent eval_fn
        )

    def state_dict(self) -> dict[str, Any]:
        return {"saves_seen": self.saves_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.saves_seen = int(state["saves_seen"])
