"""Training worker: GRPO's per-prompt ledger, what happened to each prompt, as it happened.

Each rank notes the states its prompts go through (``_objectives/grpo_ledger.STATES``):
``queued`` when the loader deals them to the rank, ``in_flight`` when a rollout request for them
goes to an engine (its slot), ``requeued`` when that request is lost (its engine died) and they
are asked for again, ``dropped`` when their completions were sampled more than
``max_staleness`` versions ago (sampled again at once), ``scored`` once their rewards are in, and
``trained`` once the optimizer step that took them is done; rank 0 notes ``remainder`` at an
epoch's first step in a start: the rows of the epoch's order past its last whole step, which no
step deals (the loader drops an epoch's remainder too few for a step, as a ``DataLoader`` with
``drop_last`` does), so that ``audit`` knows which prompts the epoch left out. A worker-group
start notes ``start``, with the step its checkpoint restored and the steps whose rollouts the
checkpoint's queue had in flight (asked for again now); its run's clean end (the last step, or
a stop at a step boundary; never a failure) notes ``end``: where the run stopped and why, which
is what lets ``audit`` check the epoch the run ended in.

The lines of a step are written together, once per step (before it trains; its ``trained``
line with the next step's, or at the run's end), to ``<run>/ledger/attempt<a>-rank<r>.jsonl`` on
local storage (appended; one small write per step and rank, no collective). On a bucket, which cannot append, each write is a part of its own
(``...-rank<r>-<n>.jsonl``). ``_objectives/grpo_ledger.read_states`` reads the folder back and
``audit`` checks it: every prompt of an epoch trained exactly once in the run's final lineage.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any


class PromptStates:
    """One rank's ledger lines for one worker-group start (attempt).

    Args:
        folder: the run's ``ledger`` folder (a ``Location``; None: nothing written).
        rank, attempt: whose lines these are.
        clock: the wall clock a start is stamped with (starts are ordered by it).
    """

    def __init__(
        self, folder: Any, rank: int, attempt: int, clock: Callable[[], float] = time.time
    ) -> None:
        self.folder, self.clock = folder, clock
        self.rank, self.attempt = rank, attempt
        self.lines: list[str] = []
        self._parts = 0

    def start(
        self, launch: str, restored: int, in_flight_steps: list[int], prompts: int = 0
    ) -> None:
        """This worker-group start's first line: the call's `launch` id, the step its
        checkpoint restored (0: none), the steps whose rollouts that checkpoint's queue had
        in flight (their prompts are dealt and asked for again now), and the data's prompts."""
        record = {
            "state": "start", "launch": launch, "rank": self.rank, "attempt": self.attempt,
            "step": restored, "time": self.clock(), "in_flight_steps": list(in_flight_steps),
            "prompts": prompts,
        }  # fmt: skip
        self.lines.append(json.dumps(record, separators=(",", ":")))

    def end(
        self, step: int, epoch: int, step_in_epoch: int, *, steps_per_epoch: int,
        total_steps: int, per_step: int, iterations: int, stop_reason: str | None,
    ) -> None:  # fmt: skip
        """The run ended cleanly after `step` steps (its trainer state's `epoch` and
        `step_in_epoch`): its last step, or a stop at a step boundary (`stop_reason`). With it,
        the steps an epoch has (`steps_per_epoch`, optimizer steps), the run's `total_steps`,
        the prompts a rollout takes (`per_step`) and the optimizer steps it is trained for
        (`iterations`): what the audit needs to know which prompts the last epoch dealt. No
        rows (``rows: []``), so a reader that predates the line counts nothing for it."""
        record = {
            "state": "end", "step": step, "epoch": epoch, "rows": [],
            "step_in_epoch": step_in_epoch, "steps_per_epoch": steps_per_epoch,
            "total_steps": total_steps, "per_step": per_step, "iterations": iterations,
            "stop_reason": stop_reason,
        }  # fmt: skip
        self.lines.append(json.dumps(record, separators=(",", ":")))

    def note(self, state: str, step: int, epoch: int, rows: list[int], **extra: Any) -> None:
        """`rows` (data rows of epoch `epoch`) reached `state` for step `step` (1-based: the
        optimizer step that trains them)."""
        if rows:
            record = {"state": state, "step": step, "epoch": epoch, "rows": list(rows), **extra}
            self.lines.append(json.dumps(record, separators=(",", ":")))

    def remainder(self, loader: Any, step: int, epoch: int) -> None:
        """Rank 0, at epoch `epoch`'s first step in this start (`step`, 1-based): the rows the
        epoch's order puts past `loader`'s last whole step (``StepLoader.left_out``), which no
        step deals (nothing when the prompts divide into steps, or on another rank)."""
        if self.rank == 0:
            self.note("remainder", step, epoch, loader.left_out(epoch))

    def flush(self) -> None:
        """Write the lines noted since the last flush (nothing when there are none)."""
        if not self.lines or self.folder is None:
            self.lines.clear()
            return
        text = "".join(line + "\n" for line in self.lines)
        self.lines.clear()
        name = f"attempt{self.attempt}-rank{self.rank}"
        if self.folder.is_local:
            os.makedirs(self.folder.path, exist_ok=True)
            with open(os.path.join(self.folder.path, f"{name}.jsonl"), "a") as f:
                f.write(text)
            return
        self._parts += 1
        self.folder.child(f"{name}-{self._parts:06d}.jsonl").write_text(text)


def run_end(state: Any, iterations: int) -> dict[str, Any]:
    """:meth:`PromptStates.end`'s arguments read off a worker's state after the run's last step
    (or a stop at a step boundary); `iterations`: the optimizer passes over each rollout."""
    p = state.progress
    return {
        "step": p.global_step, "epoch": p.epoch, "step_in_epoch": p.step_in_epoch,
        "steps_per_epoch": state.steps_per_epoch, "total_steps": state.total_steps,
        "per_step": state.loader.per_step, "iterations": iterations,
        "stop_reason": state.stop_reason,
    }  # fmt: skip


__all__ = ["PromptStates", "run_end"]
