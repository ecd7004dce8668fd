"""Training worker: what a step boundary does, as pure decisions from the agreed control.

Runs in each training worker, at every step boundary, after the ranks agreed the control
(``agreement.py``). Every rank decides from the same inputs, so every rank decides the same:
the collectives that logging, evaluation and saving make stay matched. Nothing here touches
torch, Ray or the callbacks; the unit tests call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from callbacks import TrainerControl


@dataclass(frozen=True)
class Schedule:
    """The periodic part of the decisions, from ``TrainingArgs``."""

    total_steps: int
    log_every_steps: int
    eval_every_steps: int | None = None
    save_every_steps: int | None = None
    save_at_end: bool = True


@dataclass(frozen=True)
class Decision:
    """What this boundary does, in this order: log, evaluate, save; then stop if ``stop``."""

    log: bool
    evaluate: bool
    save: bool
    stop: bool  # training ends after this boundary (the last step, a stop or an abort)
    abort: bool  # ... and saves nothing


def decide(step: int, agreed: TrainerControl, schedule: Schedule, last_saved_step: int) -> Decision:
    """The decision at the boundary after ``step`` optimizer steps.

    - log: on request, every ``log_every_steps``, and at the last step;
    - evaluate: on request and every ``eval_every_steps``;
    - save: on request, every ``save_every_steps``, at a stop before the last step, and at the
      last step with ``save_at_end``; never twice for one step, never on an abort;
    - stop: at the last step or on a stop or abort request.
    """
    finished = step >= schedule.total_steps
    abort = agreed.should_abort
    stop = finished or agreed.stops
    log = agreed.should_log or step % schedule.log_every_steps == 0 or finished
    evaluate = agreed.should_evaluate or _every(step, schedule.eval_every_steps)
    save = agreed.should_save or _every(step, schedule.save_every_steps)
    if agreed.stops and not finished:
        save = True  # a stop leaves a final checkpoint
    if finished and schedule.save_at_end:
        save = True
    save = save and not abort and last_saved_step != step
    return Decision(log=log, evaluate=evaluate, save=save, stop=stop, abort=abort)


def _every(step: int, every: int | None) -> bool:
    return bool(every) and step % every == 0
