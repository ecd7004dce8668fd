"""Parts of the chaos run that travel to the workers and the callback actor (bench_chaos.py).

Imported by the chaos driver and, through PYTHONPATH, by Ray Train's workers and the callback
actor (the model, the data and the pacing are the integration tests', from rt_support). Every ledger is a JSON-lines file appended with one flushed line per record, so the
orchestrator can read it while the run goes on and a killed process leaves at most one torn
last line (skipped on reading).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from callbacks import TrainerCallback


class _Ledger:
    def __init__(self, path: str) -> None:
        self.path = path
        self._f = None

    def write(self, **record: Any) -> None:
        if self._f is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._f = open(self.path, "a")  # noqa: SIM115  (kept open across events)
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_f": None}


def read_ledger(path: str) -> list[dict[str, Any]]:
    """Every whole record of a ledger (a torn last line is skipped); [] before it exists."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Beacon(TrainerCallback):
    """Every rank, in the training process: its pid at each attempt's start; rank 0 also
    appends each step it finishes and each checkpoint it reports saved (`on_save`)."""

    runs_on = "all_ranks"

    def __init__(self, folder: str) -> None:
        self.ranks = _Ledger(os.path.join(folder, "ranks.jsonl"))
        self.steps = _Ledger(os.path.join(folder, "steps.jsonl"))
        self.saves = _Ledger(os.path.join(folder, "saves.jsonl"))

    def on_train_begin(self, context, **kwargs):
        self.ranks.write(
            rank=context.rank, pid=os.getpid(), attempt=context.attempt, step=context.global_step
        )

    def on_step_end(self, context, **kwargs):
        if context.rank == 0:
            self.steps.write(step=context.global_step, pid=os.getpid(), t=time.time())

    def on_save(self, context, **kwargs):
        if context.rank == 0:
            self.saves.write(step=context.global_step, path=kwargs.get("checkpoint_path"))


class ActorLedger(TrainerCallback):
    """On the callback actor: its pid (at each attempt's start and each log), and every
    `on_save` it is handed."""

    runs_on = "actor"

    def __init__(self, folder: str) -> None:
        self.ledger = _Ledger(os.path.join(folder, "actor.jsonl"))

    def on_train_begin(self, context, **kwargs):
        self.ledger.write(event="begin", pid=os.getpid(), step=context.global_step)

    def on_log(self, context, **kwargs):
        self.ledger.write(event="log", pid=os.getpid(), step=context.global_step)

    def on_save(self, context, **kwargs):
        self.ledger.write(event="save", pid=os.getpid(), step=context.global_step)
