"""Training worker (or the rollout queue's actor): waiting for a step's reward tasks, bounded.

Runs where a step's completions are scored on Ray (``rewards.score_on_ray``): a training worker,
or the rollout queue's actor. A reward function that never returns must not hold the run:

- past ``reward_timeout_s`` (``TrainingArgs``; None: no limit) the tasks still running are
  cancelled and the step fails with a :class:`RewardTimeout` naming the functions, the step's
  completions (and their prompts) and the time;
- a stop asked from outside while the tasks run (``ray-trainer stop``, SIGTERM or SIGINT to the
  driver: the callback actor holds the request, :class:`StopProbe` asks it) cannot wait for a
  step boundary that a stuck step never reaches: the wait asks the actor once a slice
  (:data:`SLICE_S`) while nothing returns; once it has seen a stop, the functions get
  :data:`STOP_GRACE_S` more (a slow reward that returns meanwhile lets the stop act at the next
  step boundary as any stop does, with its checkpoint), then their tasks are cancelled and the
  step ends with a :class:`RewardStopped`, which ends the run (nothing trained or saved after
  the newest checkpoint).

A quick reward costs nothing more: the actor is asked only after a whole slice passed without a
task returning. :func:`wait_for_rewards` takes Ray's ``wait`` and ``cancel`` (and a clock) as
arguments, so that its logic is tested without Ray.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray_trainer._rollout.reward_checks import RewardError

#: How long the wait lets the reward tasks run between two questions to the callback actor
#: (a stop takes effect within this, plus the actor's answer and the tasks' cancellation).
SLICE_S = 1.0
#: The longest one question to the callback actor may take (a busy or restarting actor is no
#: stop: the wait goes on).
PROBE_TIMEOUT_S = 5.0
#: How long the reward functions may still run once a stop was seen: the documented bound of a
#: stop during a stuck reward is this plus a slice (and the workers' teardown).
STOP_GRACE_S = 10.0


class RewardTimeout(RewardError):
    """A step's reward functions did not return within ``reward_timeout_s``."""


class RewardStopped(RewardError):
    """A stop was asked while a step's reward functions ran: the step ends untrained."""


class StopProbe:
    """``probe()``: the stop reason of a stop asked from outside the run and not yet acted on
    (the callback actor's ``stop_requested``), else None. Picklable (the rollout queue's actor
    gets a copy): it holds the actor's name, and looks the actor up where it is called."""

    def __init__(self, actor_name: str, namespace: str) -> None:
        self.actor_name, self.namespace = actor_name, namespace
        self._actor: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"actor_name": self.actor_name, "namespace": self.namespace, "_actor": None}

    def __call__(self) -> str | None:
        import ray

        try:
            if self._actor is None:
                self._actor = ray.get_actor(self.actor_name, namespace=self.namespace)
            return ray.get(self._actor.stop_requested.remote(), timeout=PROBE_TIMEOUT_S)
        except Exception:  # the actor restarting, gone or busy: not a stop (asked again later)
            self._actor = None
            return None


def wait_for_rewards(
    refs: Sequence[Any],
    names: dict[Any, str],
    *,
    wait: Callable[..., tuple[list[Any], list[Any]]],
    cancel: Callable[[Any], None],
    on_ready: Callable[[Any], None],
    what: str,
    timeout_s: float | None,
    stop: Callable[[], str | None] | None = None,
    slice_s: float = SLICE_S,
    stop_grace_s: float = STOP_GRACE_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Until every one of `refs` (the step's reward tasks; `names[ref]` its function's name)
    has returned, handing each to `on_ready` as it does (which raises a failed function's
    error at once: the tasks still running are cancelled). `wait` is ``ray.wait``'s signature, `cancel` one task's cancellation;
    `what` names the step's completions (``step 3's 8 completions (prompts 1, 4 of the
    data)``).

    Raises:
        RewardTimeout: `timeout_s` passed with tasks still running (cancelled).
        RewardStopped: `stop()` gave a reason while tasks ran, and they still ran
            `stop_grace_s` later (cancelled).
    """
    pending = list(refs)
    started = clock()
    reason, seen = None, 0.0  # the stop seen, and when
    while pending:
        now = clock()
        elapsed = now - started
        if reason is not None and now - seen >= stop_grace_s:
            _cancel(pending, cancel)
            raise RewardStopped(
                f"{reason}, during the rewards of {what}: reward function(s) "
                f"{_names(pending, names)} had not returned after {elapsed:.1f} s; their tasks "
                "were cancelled, the step was not trained and nothing was saved after the "
                "newest checkpoint"
            )
        if timeout_s is not None and elapsed >= timeout_s:
            _cancel(pending, cancel)
            raise RewardTimeout(
                f"reward function(s) {_names(pending, names)} did not return within "
                f"reward_timeout_s={timeout_s:g} s on {what}; their tasks were cancelled. Make "
                "them faster, or raise reward_timeout_s (None: no limit)"
            )
        left = slice_s if timeout_s is None else min(slice_s, timeout_s - elapsed)
        if reason is not None:
            left = min(left, seen + stop_grace_s - now)
        ready, pending = wait(pending, num_returns=1, timeout=max(left, 0.0))
        try:
            for ref in ready:
                on_ready(ref)
        except BaseException:  # a function failed: the step fails, the others are not waited for
            _cancel(pending, cancel)
            raise
        if ready or not pending or stop is None or reason is not None:
            continue
        if timeout_s is not None and clock() - started >= timeout_s:
            continue  # timed out: no question to ask
        reason = stop() or None  # a whole slice without an answer: was a stop asked meanwhile?
        seen = clock()


def _names(pending: Sequence[Any], names: dict[Any, str]) -> str:
    return ", ".join(repr(names[ref]) for ref in pending)


def _cancel(pending: Sequence[Any], cancel: Callable[[Any], None]) -> None:
    for ref in pending:
        with contextlib.suppress(Exception):  # a task that ended meanwhile: nothing to cancel
            cancel(ref)
