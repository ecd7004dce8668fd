"""A GRPO run's per-prompt ledger (``<run>/ledger/``) written as its workers write it, without
Ray or engines: the real step loader (``StepLoader`` over a ``PromptDataset``) deals each
rank its prompts, step by step and epoch by epoch, and each rank's ``PromptStates`` notes
them (``queued`` ... ``trained``), its epoch's ``remainder`` at the epoch's first step in a
start (as ``GrpoObjective.steps`` does) and the run's ``end``. Used by the ledger's unit tests
(``test_grpo_ledger.py``, ``test_client_ledger.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ray_trainer._storage import locate
from ray_trainer._worker.objectives.grpo_batch import PromptDataset
from ray_trainer._worker.objectives.grpo_states import PromptStates
from ray_trainer._worker.step.micro_batches import StepLoader


@dataclass(frozen=True)
class Start:
    """A worker-group start: the step its checkpoint restored, and the step after which it
    crashed (None: it ran to the run's end, or to a stop, and wrote its ``end`` line)."""

    restored: int = 0
    crashed_after: int | None = None


def loaders(prompts: int, world: int, batch_size: int, seed: int = 0) -> list[StepLoader]:
    """Each rank's step loader over `prompts` prompts (``batch_size`` x `world` a step)."""
    data = PromptDataset([SimpleNamespace(prompt_ids=[1, 2]) for _ in range(prompts)])
    one = {"world": world, "batch_size": batch_size, "grad_accum": 1, "seed": seed, "pad_id": 0}
    return [StepLoader(data, rank=r, **one) for r in range(world)]


def write_run(
    folder: Path,
    prompts: int,
    *,
    world: int = 2,
    batch_size: int = 2,
    total: int | None = None,
    stopped_at: int | None = None,
    starts: tuple[Start, ...] = (Start(),),
) -> int:
    """Write a run's ledger to `folder`: `total` steps (default: two epochs), each start in
    turn (its lines stamped at its index's time), the last one ending the run at `total` (or
    a stop after `stopped_at` steps). Returns the steps an epoch has."""
    ranks = loaders(prompts, world, batch_size)
    per_epoch = ranks[0].steps_per_epoch
    total = total or 2 * per_epoch
    for attempt, start in enumerate(starts):
        last = start.crashed_after or stopped_at or total
        for rank, loader in enumerate(ranks):
            states = PromptStates(locate(str(folder)), rank, attempt, clock=lambda a=attempt: a)
            states.start("launch", start.restored, [], prompts)
            step = start.restored
            while step < last:
                epoch, first = divmod(step, per_epoch)
                states.remainder(loader, step + 1, epoch)  # each epoch's first step in a start
                for batches in loader.steps(epoch, first):
                    step += 1
                    rows = [r for m in batches for r in m.batch["prompt_index"].tolist()]
                    for state in ("queued", "in_flight", "scored", "training", "trained"):
                        states.note(state, step, epoch, rows)
                    if step >= last:
                        break
            if start.crashed_after is None:
                epoch, in_epoch = divmod(step, per_epoch)
                states.end(
                    step, epoch, in_epoch, steps_per_epoch=per_epoch, total_steps=total,
                    per_step=loader.per_step, iterations=1,
                    stop_reason=None if stopped_at is None else "a stop request",
                )  # fmt: skip
            states.flush()
    return per_epoch


def delete_line(folder: Path, attempt: int, rank: int, state: str, step: int) -> None:
    """Take out rank `rank`'s `state` line of step `step` from start `attempt`'s file."""
    path = folder / f"attempt{attempt}-rank{rank}.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    keys = [(json.loads(ln)["state"], json.loads(ln).get("step")) for ln in lines]
    keep = [ln for ln, key in zip(lines, keys, strict=True) if key != (state, step)]
    assert len(keep) == len(lines) - 1, (state, step, keys)
    path.write_text("".join(keep))
