"""Ray actors and tasks of the tests: stand-ins for rollout engines, for the rollout queue's actor tests.

`HeldEngine` answers ``generate_timed`` as a ``RolloutActor`` does (``Completion`` records
stamped with the policy version it holds), at once or, held, only once released: a request can
be kept in flight while the test kills the engine. A threaded actor, so that `asked` answers while
a request waits. `score_where` is a picklable ``score(step, completions)`` that says where it ran.
`never_returns` is a reward function that notes it started (in the data's ``mark`` file) and
never returns; `zeros` one that returns at once (``tests/integration/test_grpo_rewards.py``).
"""

from __future__ import annotations

import os
import threading
import time

from ray_trainer._rollout.types import Completion


class HeldEngine:
    def __init__(self, version: int, hold: bool = False) -> None:
        self.version = version
        self.released = threading.Event()
        if not hold:
            self.released.set()
        self.requests = 0

    def generate_timed(self, prompts, params, rows):
        self.requests += 1
        started = time.time()
        self.released.wait()
        out = [
            Completion(row, list(ids), [row % 7 + 1, g + 1], [-0.5, -0.25], False, self.version)
            for ids, row in zip(prompts, rows, strict=True)
            for g in range(params.num_generations)
        ]
        return out, started, time.time()

    def asked(self) -> int:
        return self.requests

    def info(self) -> dict:
        return {"pid": os.getpid(), "version": self.version}


def score_where(step, completions):
    """What a scoring saw: the process, the step and the prompt rows."""
    return {"pid": os.getpid(), "step": step, "rows": [c.prompt_index for c in completions]}


def never_returns(prompts, completions, completion_ids, mark=(), **kwargs):
    """A reward function stuck for good: appends its pid to each ``mark`` file, then waits."""
    for path in sorted(set(mark)):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
    threading.Event().wait()


def zeros(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)
