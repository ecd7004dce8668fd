"""Every process (driver, workers, callback actor): what an objective is, as all of them see it.

An objective (SFT, DPO, GRPO...) is described once, here, by an :class:`Objective`: the record
formats it trains on, the ``TrainingArgs`` fields it owns (refused under any objective that does
not own them), its own checks of the other fields, whether it needs a reference pass before
training, the names of the metrics its steps log and what its validation computes, and the
dotted name of its worker-side module (``ray_trainer/_worker/objectives/``), which the training
workers import by that name: so this shared floor never imports a process's room.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _never(args: Any) -> bool:
    return False


def _no_checks(args: Any) -> None:
    return None


@dataclass(frozen=True)
class Beside:
    """Processes of one kind that a run places on the cluster beside its training workers (GRPO's
    rollout engines and reward tasks, an ``EvalOnSave``'s evaluation tasks): one entry of the
    description that the driver's fit check and the embedded Ray's size both read
    (``_driver/checks/demand.py``).

    Args:
        noun: one of them, as the driver's console counts them (``"rollout engine"``).
        resources: the Ray resources one of them asks for.
        needed: those a step cannot go on without, each named as a refusal names it: the fit
            check places them beside the workers (``()``: a step never waits for one).
        at_once: how many may hold ``resources`` at the same time: the embedded Ray offers
            their CPUs.
    """

    noun: str
    resources: dict[str, float] = field(default_factory=dict)
    needed: tuple[str, ...] = ()
    at_once: int = 1


def _nothing_beside(args: Any) -> list[Beside]:
    return []


@dataclass(frozen=True)
class Objective:
    """One objective, as every process sees it.

    Args:
        name: the value of ``TrainingArgs.objective`` that picks it.
        summary: what it trains, for error texts (``"preference tuning"``).
        worker: the dotted name of its worker-side module; the module's ``build(args)``
            returns the objective the training loop asks (``_worker/objectives/base.py``).
        data_formats: the record formats (``ray_trainer._data.sources``) it trains on.
        data_noun: those records, as an error text names them.
        data_example: one record, as an error text shows it ("" for none).
        takes_datasets: whether it also trains on a user's torch ``Dataset`` (or a factory).
        fields: the ``TrainingArgs`` fields it owns: left at their defaults under an objective
            that does not own them. Two objectives may own one field.
        check: its own checks of a ``TrainingArgs`` (raise ``ValueError`` naming the field and
            the fix); runs once the fields are valid, under this objective only.
        needs_reference: ``needs_reference(args)``: whether the driver computes a reference
            pass (log-probs of the model as it starts) into the token cache before training.
        metrics: the names of the numbers its steps add to each log's ``batch_metrics``.
        names_cache: its name and the pairs' format are part of its token caches' fingerprint
            (SFT's caches keep the names they had before objectives existed).
        beside_workers: ``beside_workers(args)``: what it places on the cluster besides the
            training workers, a list of :class:`Beside` (GRPO: its rollout engines and reward
            tasks), so that the driver refuses a run the cluster can never hold and sizes the
            embedded Ray for what may run at once.
    """

    name: str
    summary: str
    worker: str
    data_formats: tuple[str, ...]
    data_noun: str
    data_example: str = ""
    takes_datasets: bool = False
    fields: tuple[str, ...] = ()
    check: Callable[[Any], None] = _no_checks
    needs_reference: Callable[[Any], bool] = _never
    metrics: tuple[str, ...] = ()
    names_cache: bool = True
    beside_workers: Callable[[Any], list[Beside]] = _nothing_beside
    #: ``run_metrics(args)``: the names its steps log in that run, when some are named at run
    #: time (GRPO's ``rewards/<fn>/mean``); None: ``metrics``.
    run_metrics: Callable[[Any], tuple[str, ...]] | None = None

    def metrics_of(self, args: Any) -> tuple[str, ...]:
        """The names of the metrics a run's steps log (the trackers export these)."""
        return self.metrics if self.run_metrics is None else self.run_metrics(args)

    @property
    def val_metrics(self) -> tuple[str, ...]:
        """What its validation pass reports: the loss over the validation data (its own loss,
        weighted as in training) and the means of its metrics, each prefixed ``val_``."""
        return ("val_loss", *(f"val_{m}" for m in self.metrics))

    def takes(self, fmt: str) -> bool:
        """Whether it trains on records of format `fmt`."""
        return fmt in self.data_formats
