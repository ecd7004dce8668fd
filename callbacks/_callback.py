"""``TrainerCallback``: the base class users subclass to hook into the training loop.

Where a hook runs depends on the class attribute ``runs_on``:

- ``"actor"`` (default): on the singleton callback actor on the head node, for rank-0 events,
  asynchronously (the loop never waits); ``context.model`` and other live objects are ``None``.
- ``"rank0"``: inside rank 0's training process, synchronously, with the live model.
- ``"all_ranks"``: inside every rank's training process, synchronously.
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from callbacks._events import ALIASES, EVENTS, suggest_event
from callbacks._hooks import RUNS_ON, noop_hook
from callbacks._registry import register_global_callback, unregister_last

__all__ = ["TrainerCallback"]


class TrainerCallback:
    """Base class for callbacks: override the ``on_<event>(self, context, **kwargs)`` you need.

    Only overridden hooks are subscribed, so an event nobody overrides costs nothing. A hook may
    be ``async def`` (it is awaited), may set flags on ``context.control`` or return a
    ``TrainerControl``, and must return ``None`` or a ``TrainerControl``. Alias method names
    (``on_checkpoint``, ``on_optimizer_step``, ...) are called for their event. A callback that
    defines ``state_dict()`` and ``load_state_dict(state)`` is stateful: its state is saved in
    every checkpoint under ``state_key`` and restored on resume.

    The instance is cloudpickled in the driver and unpickled where it runs (see ``runs_on``):
    create sockets, clients and locks lazily in ``on_train_begin``.

    Example:
        >>> class PrintLoss(TrainerCallback):
        ...     def on_log(self, context, **kwargs):
        ...         print(context.global_step, context.loss)
        >>> with PrintLoss():  # registered globally for the block
        ...     run_training(max_steps=10)
    """

    #: "actor" (default), "rank0" or "all_ranks"; see the module docstring.
    runs_on: ClassVar[str] = "actor"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.runs_on not in RUNS_ON:
            raise ValueError(
                f"{cls.__qualname__}.runs_on = {cls.runs_on!r}; "
                f"use one of {', '.join(map(repr, RUNS_ON))}"
            )
        for attr in cls.__dict__:
            if attr.startswith("on_") and attr not in EVENTS and attr not in ALIASES:
                guess = suggest_event(attr, cutoff=0.8)
                if guess:
                    warnings.warn(
                        f"{cls.__qualname__}.{attr} is not a callback event and will never be "
                        f"called; did you mean {guess!r}?",
                        UserWarning,
                        stacklevel=2,
                    )

    @property
    def name(self) -> str:
        """The name used in logs, errors and ``stop_reason`` (the class name by default)."""
        return type(self).__name__

    @property
    def state_key(self) -> str:
        """The key of this callback's state in checkpoints (class ``__qualname__``; ``#n``
        appended by a manager for the n-th further stateful instance of the same class)."""
        return self.__dict__.get("_state_key") or type(self).__qualname__

    def __enter__(self) -> TrainerCallback:
        register_global_callback(self)
        return self

    def __exit__(self, *exc: object) -> None:
        unregister_last(self)

    @noop_hook
    def on_init_end(self, context, **kwargs):
        """Called once the trainer is set up; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_train_begin(self, context, **kwargs):
        """Called before the first step, each attempt; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_epoch_begin(self, context, **kwargs):
        """Called at the start of each epoch; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_step_begin(self, context, **kwargs):
        """Called at the start of each optimizer step; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_before_forward(self, context, **kwargs):
        """Called before each micro-batch's forward; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_after_forward(self, context, **kwargs):
        """Called after each micro-batch's forward; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_before_backward(self, context, **kwargs):
        """Called before each micro-batch's backward; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_after_backward(self, context, **kwargs):
        """Called after each micro-batch's backward; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_before_optimizer_step(self, context, **kwargs):
        """Called before ``optimizer.step()``; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_after_optimizer_step(self, context, **kwargs):
        """Called after ``optimizer.step()``; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_log(self, context, **kwargs):
        """Called every ``log_every_steps`` steps; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_evaluate(self, context, **kwargs):
        """Called when ``val_metrics`` are available; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_save(self, context, **kwargs):
        """Called after a checkpoint is persisted; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_load_checkpoint(self, context, **kwargs):
        """Called after resuming from a checkpoint; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_step_end(self, context, **kwargs):
        """Called at the end of each optimizer step; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_epoch_end(self, context, **kwargs):
        """Called at the end of each epoch; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_train_end(self, context, **kwargs):
        """Called once on every exit path; on the actor or in-process (runs_on)."""

    @noop_hook
    def on_exception(self, context, **kwargs):
        """Called when the loop raises (then on_train_end); on the actor or in-process (runs_on)."""
