"""Every process: the contract, everything that crosses a process boundary of a run.

Imported by every process of a run: the driver, each training worker and the callback actor.
Each side imports this module; none imports another side's package (``_driver`` never imports
``_worker``; ``_worker`` and ``_actor`` never import each other). What travels, and how:

* driver -> every worker: a ``RunSpec``, as a Ray object reference in Ray Train's
  ``train_loop_config`` (Ray Train's controller holds that config too and so never unpickles
  the spec, nor imports what it names); the callbacks as one Ray object reference inside it
  (cloudpickled lists, see ``_placement.py``). The driver
  hands Ray Train the worker's entry (``_worker/entry.py``), which imports the worker loop
  only once it runs inside a worker process.
* driver -> callback actor: its constructor arguments (the same callbacks reference). Every run
  has one callback actor, named ``actor_name(run_name)`` in ``NAMESPACE``, on the head node.
* rank 0 -> callback actor: ``EventBatch`` objects (``CallbackActor.push``), each answered by a
  ``BatchReply`` that acknowledges it and carries the actor-side callbacks' ``TrainerControl``.
  Which events travel is fixed before training: ``forwarded_events``.
* rank 0 -> callback actor, at the end of an attempt: a ``WorkerSummary``
  (``CallbackActor.finish``).
* **The result has one way back: through the callback actor.** The driver asks the actor for
  its ``summary()`` (the last ``WorkerSummary`` plus what the actor itself saw: events,
  evaluations, its callbacks' errors, the checkpoints saved). Nothing of the result is read
  from a disk.
* every rank <-> every rank: the step's control and loss, agreed in one all-reduce
  (``_worker/step/agreement.py``).
* checkpoints: folders named ``checkpoint_dir_name(step)`` under the run folder, in the
  format of ``_checkpoint/`` (whose ``names.py`` names the folders and the actor's files).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from callbacks import TrainerControl
from callbacks._events import NEVER_DROPPED_EVENTS
from ray_trainer._config.args import TrainingArgs

# ---- the callback actor ---------------------------------------------------------------------

NAMESPACE = "ray_trainer"
_ACTOR_PREFIX = "ray-trainer:"


def actor_name(run_name: str) -> str:
    """The Ray name of a run's callback actor (in ``NAMESPACE``)."""
    return f"{_ACTOR_PREFIX}{run_name}"


def run_name_of_actor(name: str) -> str | None:
    """The run name inside a callback actor's Ray name, or None for any other actor."""
    return name[len(_ACTOR_PREFIX) :] if name.startswith(_ACTOR_PREFIX) else None


# ---- events from rank 0 to the actor --------------------------------------------------------

#: Events the actor needs whatever its callbacks subscribe to: ``on_save`` (it writes its own
#: callbacks' state beside each checkpoint and records the checkpoint) and ``on_train_end``.
ACTOR_EVENTS: frozenset[str] = frozenset({"on_save", "on_train_end"})
#: Events sent at once rather than batched; never dropped when the actor falls behind.
URGENT_EVENTS: frozenset[str] = NEVER_DROPPED_EVENTS
#: Keyword arguments of an event that hold live objects of the training process: never sent.
LIVE_KWARGS: frozenset[str] = frozenset(
    {"batch", "outputs", "model", "optimizer", "lr_scheduler", "exception"}
)


#: Events the actor also needs when it ranks checkpoints by a metric (``Retention.attribute``):
#: the metric comes from an evaluation or from the logs.
RANKING_EVENTS: frozenset[str] = frozenset({"on_log", "on_evaluate"})


def forwarded_events(actor_subscribed: frozenset[str], ranking: bool = False) -> frozenset[str]:
    """The events rank 0 sends to the actor: what its callbacks subscribe to, plus its own
    (and, with `ranking`, what the checkpoint ranking reads)."""
    return actor_subscribed | ACTOR_EVENTS | (RANKING_EVENTS if ranking else frozenset())


#: One event on the wire: (event name, ``TrainingContext.to_wire()``, plain keyword arguments).
WireEvent = tuple[str, dict[str, Any], dict[str, Any]]


@dataclass
class EventBatch:
    """Rank-0 events for the actor, in the order they fired. ``seq`` counts the batches of one
    worker-group start (``attempt``) from 1; the actor ignores a ``seq`` it has handled. A
    heartbeat has no events and carries ``progress`` (the context's wire): rank 0 sends one
    when nothing else went for ``HEARTBEAT_S``, so that requests from outside (``ray-trainer
    save``/``stop``, a signal to the driver) and ``status`` reach a run whose actor-side
    callbacks subscribe to nothing frequent. Once rank 0 has dropped events (its buffer was
    full), every batch carries their running count (``dropped``): the actor's metrics read it,
    and a run with no drop pays nothing for it."""

    attempt: int
    seq: int
    events: list[WireEvent]
    progress: dict[str, Any] | None = None
    #: Rank 0's running count of the events it dropped this attempt, by event (None: none yet).
    dropped: dict[str, int] | None = None


#: The longest rank 0 goes without a call to the actor (a heartbeat when nothing else went).
HEARTBEAT_S = 1.0

#: Requests from outside the run (``ray-trainer save``/``stop``, ``ray_trainer.save/stop``, a
#: signal to the driver, a preemption notice), and the stop reason each gives.
REQUESTS = ("save", "stop")


@dataclass
class BatchReply:
    """The actor's answer to one ``EventBatch``: the acknowledged ``seq`` and the requests of
    the actor-side callbacks that handled events so far (None when nothing was requested)."""

    ack: int
    control: TrainerControl | None = None


@dataclass
class WorkerSummary:
    """What the training workers know at the end of an attempt, gathered on rank 0."""

    attempt: int
    global_step: int
    epoch: int
    samples_seen: int
    tokens_seen: int
    loss: float | None
    val_metrics: dict[str, Any]
    checkpoint_path: str | None  # the last checkpoint this attempt wrote
    stopped_early: bool
    stop_reason: str | None
    callback_errors: list[dict[str, Any]] = field(default_factory=list)  # every rank's
    undelivered_events: int = 0
    dropped_events: dict[str, int] = field(default_factory=dict)


@dataclass
class ActorSummary:
    """The run's result as the callback actor knows it at the end (``CallbackActor.summary``):
    the driver builds ``TrainingResult`` from this alone."""

    worker: WorkerSummary | None  # the last attempt's, when rank 0 got to hand it over
    attempts: int  # worker-group starts of this launch
    last_step: int  # the newest global_step rank 0 reported
    last_checkpoint: str | None  # the newest checkpoint an on_save announced
    events: dict[str, int] = field(default_factory=dict)  # rank-0 events handled, by event
    unhandled_events: dict[str, int] = field(default_factory=dict)  # received, not handled
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    callback_errors: list[dict[str, Any]] = field(default_factory=list)  # actor-side ones
    dropped_events: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    restarted: bool = False
    restored_from: str | None = None
    best_checkpoint: str | None = None  # by Retention.attribute; None without one
    best_metrics: dict[str, Any] = field(default_factory=dict)


# ---- checkpoints ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Retention:
    """driver -> callback actor: which checkpoints the actor keeps (Ray Train keeps them all).

    The N best by ``attribute`` (``order`` ``"max"`` or ``"min"``), or the N newest without
    one, plus the newest; ``keep=None`` deletes nothing (the ranking still names the best)."""

    keep: int | None
    attribute: str | None
    order: str = "max"
    # The run's id in its folder (``run.json``): the prefix of every save id of this run, so
    # that a checkpoint found on storage is this run's own only when its manifest says so.
    run_id: str | None = None


# ---- driver -> workers ----------------------------------------------------------------------


@dataclass
class RunSpec:
    """What the driver hands every worker, by object reference through Ray Train's
    ``train_loop_config``."""

    args: TrainingArgs  # without callbacks: those travel in `callbacks_ref`
    callbacks_ref: Any  # ray.ObjectRef of the cloudpickled {"core", "user", "global"} lists
    # The run folder on storage: a local or shared path, a URI, or a path on
    # `args.storage_filesystem`; every file of the run is under it (`_storage.locate`).
    run_dir: str
    launch_id: str  # one per run_training call (`<run_id>.<hex>`): attempts are counted per launch
    actor_name: str
    actor_namespace: str = NAMESPACE
    forward_events: frozenset[str] = ACTOR_EVENTS
    # The token cache of each data field the driver encoded ("data", "val_data"): a folder on
    # the run's storage (``_data/cache.py``); and the chat template the data was rendered with.
    data_caches: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None
    # DPO: the folder of each cache's reference log-probs (``_reference.py``); complete, or
    # (a sharded model) to be filled by the workers before their first step.
    references: dict[str, str] = field(default_factory=dict)
    # GRPO: the ObjectRef of each data field's prompts (a list of ``_data.prompts.
    # EncodedPrompt``, in the data's order), encoded by the driver; no token cache.
    prompts: dict[str, Any] = field(default_factory=dict)
