"""Driver (or whichever process feeds the rollout engines) and checkpoints: GRPO's prompt ledger.

Online RL consumes its prompts as a stream: each step takes the next prompts, the engines
sample their completions, and the step trains on them. The ledger says which prompt comes at
each *position* of that stream (epoch after epoch, each epoch a seeded shuffle of the data's
rows, so the order is a pure function of the seed and never stored), which positions were
handed out (:meth:`PromptLedger.take`) and which were trained on (:meth:`PromptLedger.commit`).
Its :meth:`~PromptLedger.state_dict` travels in the checkpoint; a run that resumes from it hands
out again every position not yet trained on, and no other: no prompt is skipped or repeated,
even when completions were in flight (taken, not committed) when the checkpoint was written,
or were trained on out of order.

Per-prompt states, as a run goes (``_worker/objectives/grpo_states.py`` writes them, one file
per rank and worker-group start in ``<run>/ledger/``): :func:`read_states` reads them back and
:func:`audit` checks that every prompt of each epoch was trained exactly once in the run's final
lineage (the steps a resume rolled back do not count), counting what was dropped for staleness
and asked for again.

A position is what ``Completion.prompt_index`` records (``ray_trainer/_rollout/types.py``);
:meth:`PromptLedger.row` turns it into the data row. Steps take positions across an epoch's end
(the last prompts of one epoch and the first of the next may share a step), so none is dropped.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: The version of :meth:`PromptLedger.state_dict`'s layout.
STATE_VERSION = 1


class LedgerError(ValueError):
    """A ledger state that does not fit this run's data or seed; the message says the fix."""


class PromptLedger:
    """The order GRPO consumes its prompts in, and how far it got.

    Args:
        num_prompts: the data's rows (prompt records).
        seed: the run's seed; epoch ``e``'s order is a shuffle seeded by ``(seed, e)``.
        shuffle: False keeps every epoch in the data's order.

    Example:
        >>> ledger = PromptLedger(4, seed=0)
        >>> taken = ledger.take(3)  # positions 0, 1, 2
        >>> ledger.commit(taken)
        >>> PromptLedger.from_state(ledger.state_dict()).take(1)
        [3]
    """

    def __init__(self, num_prompts: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise LedgerError("the prompt ledger needs at least one prompt; give data with rows")
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self._next = 0  # the next position never handed out (this session)
        self._done_below = 0  # every position below it is trained on
        self._done_above: set[int] = set()  # trained positions at or above _done_below
        self._pending: list[int] = []  # positions to hand out again (not trained, resumed)
        self._orders: dict[int, list[int]] = {}

    # ---- the order --------------------------------------------------------------------------

    def order(self, epoch: int) -> list[int]:
        """The data rows in the order epoch ``epoch`` takes them."""
        if epoch not in self._orders:
            rows = list(range(self.num_prompts))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(rows)
            if len(self._orders) >= 2:  # a step spans at most an epoch's end: keep two
                self._orders.pop(min(self._orders))
            self._orders[epoch] = rows
        return self._orders[epoch]

    def row(self, position: int) -> int:
        """The data row at stream position ``position``."""
        epoch, i = divmod(position, self.num_prompts)
        return self.order(epoch)[i]

    def epoch_of(self, position: int) -> int:
        return position // self.num_prompts

    # ---- consuming --------------------------------------------------------------------------

    def take(self, n: int) -> list[int]:
        """The next ``n`` positions to sample: first those handed out before a resume and never
        trained on, then new ones. Each position is handed out once per session."""
        out = self._pending[:n]
        self._pending = self._pending[n:]
        while len(out) < n:
            out.append(self._next)
            self._next += 1
        return out

    def commit(self, positions: Iterable[int]) -> None:
        """Mark ``positions`` trained on (an optimizer step took their completions)."""
        for p in positions:
            if p >= self._next or p in self._pending:
                raise LedgerError(f"prompt position {p} was never handed out (take it first)")
            if p < self._done_below or p in self._done_above:
                raise LedgerError(f"prompt position {p} was already trained on: a step repeats it")
            self._done_above.add(p)
        while self._done_below in self._done_above:
            self._done_above.discard(self._done_below)
            self._done_below += 1

    @property
    def trained(self) -> int:
        """How many positions were trained on."""
        return self._done_below + len(self._done_above)

    @property
    def epoch(self) -> int:
        """The epoch of the first position not yet trained on."""
        return self.epoch_of(self._done_below)

    # ---- the checkpoint ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the checkpoint keeps: the data's size, the seed, and the trained positions (all
        below ``done_below``, and those above it). Positions handed out but not trained on are
        not kept: a resumed run hands them out again."""
        return {
            "version": STATE_VERSION,
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "done_below": self._done_below,
            "done_above": sorted(self._done_above),
        }

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        num_prompts: int | None = None,
        seed: int | None = None,
    ) -> PromptLedger:
        """The ledger a resumed run continues (it hands out every untrained position, in order).
        ``num_prompts`` and ``seed``, when given, are this run's: a checkpoint of other data or
        another seed is refused (its positions would name other prompts)."""
        if state.get("version") != STATE_VERSION:
            raise LedgerError(
                f"prompt ledger state version {state.get('version')!r}, this ray-trainer reads "
                f"{STATE_VERSION}; resume with the ray-trainer that wrote the checkpoint"
            )
        if num_prompts is not None and num_prompts != state["num_prompts"]:
            raise LedgerError(
                f"the checkpoint's prompt ledger is over {state['num_prompts']} prompts, this "
                f"run's data has {num_prompts}; resume with the same data, or start a new run"
            )
        if seed is not None and seed != state["seed"]:
            raise LedgerError(
                f"the checkpoint's prompts were shuffled with seed={state['seed']}, this run has "
                f"seed={seed}; resume with seed={state['seed']}, or start a new run"
            )
        ledger = cls(state["num_prompts"], state["seed"], state["shuffle"])
        ledger._done_below = int(state["done_below"])
        ledger._done_above = {int(p) for p in state["done_above"]}
        last = max(ledger._done_above, default=ledger._done_below - 1)
        ledger._pending = [
            p for p in range(ledger._done_below, last) if p not in ledger._done_above
        ]
        ledger._next = max(last + 1, ledger._done_below)
        return ledger


# ---- per-prompt states ------------------------------------------------------------------------

#: What a prompt goes through, in order (``requeued`` and ``dropped`` send it back to
#: ``in_flight``; ``training``: its step given to the optimizer, ``trained``: that step done);
#: ``start`` begins a worker-group start's lines.
STATES = ("queued", "in_flight", "requeued", "dropped", "scored", "training", "trained")


@dataclass
class Segment:
    """One rank's lines of one worker-group start (the call's launch id and the attempt name
    the start): the step its checkpoint restored, when it started, and its records in order."""

    launch: str
    rank: int
    attempt: int
    restored: int
    started: float
    in_flight_steps: list[int]
    prompts: int = 0  # the data's prompts
    records: list[dict[str, Any]] = field(default_factory=list)


def read_states(folder: Any) -> list[Segment]:
    """The segments in a run's ``ledger`` folder (a ``Location``), by start time."""
    segments: list[Segment] = []
    current: Segment | None = None
    stem = None
    for name in sorted(folder.listdir()):  # a bucket's parts of one file follow each other
        if not name.endswith(".jsonl"):
            continue
        if _stem(name) != stem:  # another worker's (or start's) file
            stem, current = _stem(name), None
        for line in (folder.child(name).read_text() or "").splitlines():
            record = json.loads(line)
            if record["state"] == "start":
                current = Segment(
                    record["launch"], record["rank"], record["attempt"], record["step"], record["time"],
                    record.get("in_flight_steps", []), record.get("prompts", 0),
                )  # fmt: skip
                segments.append(current)
            elif current is None:
                raise LedgerError(f"{folder.name}/{name}: a record before its start line: {line}")
            else:
                current.records.append(record)
    return sorted(segments, key=lambda seg: (seg.started, seg.rank))


def _stem(name: str) -> str:
    """``attempt0-rank1`` of ``attempt0-rank1.jsonl`` and of a bucket's ``...-000003.jsonl``."""
    base = name[: -len(".jsonl")]
    head, _, tail = base.rpartition("-")
    return head if tail.isdigit() and len(tail) == 6 else base


@dataclass
class Audit:
    """What :func:`audit` found: per (epoch, row), the times trained in the final lineage,
    dropped for staleness and asked for again after a lost request; the prompts whose training
    a resume rolled back (trained again after it)."""

    trained: dict[tuple[int, int], int]
    dropped: dict[tuple[int, int], int]
    requeued: dict[tuple[int, int], int]
    rolled_back: int
    num_prompts: int = 0  # the data's prompts, as the starts recorded them

    def report(self) -> tuple[list[str], bool]:
        """One line per epoch trained (its prompts trained once, more than once, never; what
        was dropped and asked for again), then the rolled-back count; and whether the ledger is
        whole: no prompt trained twice in an epoch, none missing from an epoch the run left."""
        epochs = sorted({epoch for epoch, _ in self.trained})
        lines, ok = [], True
        for epoch in epochs:
            rows = {row: n for (e, row), n in self.trained.items() if e == epoch}
            twice = sorted(row for row, n in rows.items() if n > 1)
            done = epoch < epochs[-1]  # the run went past it: every prompt is due
            missing = self.num_prompts - len(rows) if done else 0
            ok = ok and not twice and not missing
            line = f"epoch {epoch}: {sum(n == 1 for n in rows.values())} of {self.num_prompts} "
            line += "prompts trained once" + ("" if done else " (the epoch the run ended in)")
            if twice:
                line += f"; trained more than once: rows {twice[:10]}"
            if missing:
                line += f"; never trained: {missing}"
            drops = sum(n for (e, _), n in self.dropped.items() if e == epoch)
            again = sum(n for (e, _), n in self.requeued.items() if e == epoch)
            lines.append(f"{line}; dropped as stale {drops}, asked for again {again}")
        lines.append(f"rolled back by a resume and trained again: {self.rolled_back}")
        return lines, ok

    def problems(self, num_prompts: int, epochs: Iterable[int]) -> list[str]:
        """Every prompt of each of `epochs` not trained exactly once (empty: none)."""
        out = []
        for epoch in epochs:
            for row in range(num_prompts):
                times = self.trained.get((epoch, row), 0)
                if times != 1:
                    out.append(f"epoch {epoch}, prompt row {row}: trained {times} times")
        return out


def audit(segments: list[Segment]) -> Audit:
    """Read the segments' records. A worker-group start that a later one followed (a restart,
    or a new call continuing the run) trained the steps up to the checkpoint that later start
    restored (the checkpoint proves them; its steps after it were rolled back); the last start
    trained the steps it noted ``trained``."""
    trained: dict[tuple[int, int], int] = {}
    dropped: dict[tuple[int, int], int] = {}
    requeued: dict[tuple[int, int], int] = {}
    rolled_back = 0
    starts: dict[tuple[str, int], tuple[float, int]] = {}  # its first start time, restored step
    for seg in segments:
        first = starts.get((seg.launch, seg.attempt), (seg.started, seg.restored))
        starts[(seg.launch, seg.attempt)] = (min(first[0], seg.started), seg.restored)
    for seg in segments:
        began = starts[(seg.launch, seg.attempt)][0]
        cut = min((step for t, step in starts.values() if t > began), default=None)
        counts_as = "trained" if cut is None else "training"
        for r in seg.records:
            keys = [(r.get("epoch", 0), row) for row in r["rows"]]
            if r["state"] == counts_as:
                if cut is not None and r["step"] > cut:
                    rolled_back += len(keys)
                    continue
                for key in keys:
                    trained[key] = trained.get(key, 0) + 1
            elif r["state"] in ("dropped", "requeued"):
                counts = dropped if r["state"] == "dropped" else requeued
                for key in keys:
                    counts[key] = counts.get(key, 0) + 1
    prompts = max((seg.prompts for seg in segments), default=0)
    return Audit(trained, dropped, requeued, rolled_back, prompts)
