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
:func:`audit` checks that every prompt each epoch's steps dealt was trained exactly once in the
run's final lineage (the steps a resume rolled back do not count), counting what was dropped for
staleness and asked for again. An epoch's remainder (the prompts past its last whole step,
which the run's loader drops: its ``remainder`` line) is not due. The epoch the run ended in is
checked too when the run's last start wrote its ``end`` line (:class:`End`: the run ended
cleanly, at its last step or at a stop); without one (the run failed, or is still running) only
for prompts trained twice.

A position is what ``Completion.prompt_index`` records (``ray_trainer/_rollout/types.py``);
:meth:`PromptLedger.row` turns it into the data row. :class:`PromptLedger`'s steps take
positions across an epoch's end (the last prompts of one epoch and the first of the next may
share a step), so none is dropped; a run's step loader, which the per-prompt states record,
drops an epoch's remainder instead.
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
#: ``remainder``: past its epoch's last whole step, no step deals it (rank 0 notes it);
#: ``start`` begins a worker-group start's lines, ``end`` closes a run that ended cleanly.
STATES = (
    "queued", "in_flight", "requeued", "dropped", "scored", "training", "trained", "remainder",
)  # fmt: skip


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
    end: End | None = None  # its ``end`` line: the run ended cleanly in this start
    torn: int = 0  # its files' last lines cut short (a write killed mid-way), not read


@dataclass(frozen=True)
class End:
    """Where a run ended cleanly (a start's ``end`` line, written after the run's last step or
    at a stop at a step boundary; never after a failure): after `step` of its `total_steps`
    steps, its trainer state at `epoch`, `step_in_epoch`; the steps an epoch has, the prompts a
    rollout takes (`per_step`), the optimizer steps each rollout is trained for (`iterations`),
    and why it stopped early (`stop_reason`, None at its last step)."""

    step: int
    epoch: int
    step_in_epoch: int
    steps_per_epoch: int
    total_steps: int
    per_step: int
    iterations: int
    stop_reason: str | None

    @classmethod
    def of(cls, record: dict[str, Any]) -> End:
        return cls(
            record["step"], record["epoch"], record["step_in_epoch"], record["steps_per_epoch"],
            record["total_steps"], record["per_step"], record["iterations"],
            record.get("stop_reason"),
        )  # fmt: skip

    @property
    def ended_in(self) -> tuple[int, int]:
        """The epoch of the run's last step, and the steps the run took of it (a trainer state
        already at the next epoch's start counts as the one before, whole)."""
        if self.step_in_epoch == 0 and self.epoch > 0:
            return self.epoch - 1, self.steps_per_epoch
        return self.epoch, self.step_in_epoch

    def describe(self) -> str:
        """How the run ended, in words: stopped early, at an epoch's last step, or at its
        ``max_steps`` inside an epoch."""
        epoch, taken = self.ended_in
        where = f"after step {self.step} of {self.total_steps}"
        if self.step < self.total_steps:
            return f"the run stopped early {where} ({self.stop_reason or 'a stop request'})"
        if taken >= self.steps_per_epoch:
            return f"the run ended {where}, the last step of epoch {epoch}"
        return (
            f"the run ended {where} (its max_steps), step {taken} of epoch {epoch}'s "
            f"{self.steps_per_epoch}"
        )


def read_states(folder: Any) -> list[Segment]:
    """The segments in a run's ``ledger`` folder (a ``Location``), by start time. A file's last
    line without its newline is a write cut short (its worker killed while appending): it is
    not read, and its segment counts it (`Segment.torn`); any other line that is not a ledger
    record is a `LedgerError` naming the file and the line."""
    segments: list[Segment] = []
    current: Segment | None = None
    stem = None
    for name in sorted(folder.listdir()):  # a bucket's parts of one file follow each other
        if not name.endswith(".jsonl"):
            continue
        if _stem(name) != stem:  # another worker's (or start's) file
            stem, current = _stem(name), None
        lines = (folder.child(name).read_text() or "").split("\n")
        torn = lines.pop()  # what follows the last newline: nothing, unless a write was cut
        for number, line in enumerate(lines, 1):
            record = _record(line, f"{folder.name}/{name}:{number}")
            if record["state"] == "start":
                current = Segment(
                    record["launch"], record["rank"], record["attempt"], record["step"], record["time"],
                    record.get("in_flight_steps", []), record.get("prompts", 0),
                )  # fmt: skip
                segments.append(current)
            elif current is None:
                raise LedgerError(f"{folder.name}/{name}: a record before its start line: {line}")
            elif record["state"] == "end":
                current.end = End.of(record)
            else:
                current.records.append(record)
        if torn and current is not None:
            current.torn += 1
    return sorted(segments, key=lambda seg: (seg.started, seg.rank))


def _record(line: str, where: str) -> dict[str, Any]:
    """One ledger line's record, or `LedgerError` naming `where` (its file and line)."""
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("state"), str):
        raise LedgerError(f"{where}: not a ledger record: {line[:120]!r}")
    return record


def _stem(name: str) -> str:
    """``attempt0-rank1`` of ``attempt0-rank1.jsonl`` and of a bucket's ``...-000003.jsonl``."""
    base = name[: -len(".jsonl")]
    head, _, tail = base.rpartition("-")
    return head if tail.isdigit() and len(tail) == 6 else base


@dataclass
class Audit:
    """What :func:`audit` found: per (epoch, row), the times trained in the final lineage,
    dropped for staleness and asked for again after a lost request, and the step that took it
    to the optimizer (its ``training`` line in the final lineage: what the steps dealt); the
    prompts whose training a resume rolled back (trained again after it); how the run ended
    (None: its last start wrote no end line); and per epoch the rows its order left past its
    last whole step (``remainder`` lines: no step deals them)."""

    trained: dict[tuple[int, int], int]
    dropped: dict[tuple[int, int], int]
    requeued: dict[tuple[int, int], int]
    rolled_back: int
    num_prompts: int = 0  # the data's prompts, as the starts recorded them
    dealt: dict[tuple[int, int], int] = field(default_factory=dict)
    end: End | None = None
    remainder: dict[int, set[int]] = field(default_factory=dict)
    torn: int = 0  # files whose last line was cut short (not read)

    @property
    def last_epoch(self) -> int:
        """The epoch the run ended in (without an end line: the last its steps dealt to or
        trained; -1: none)."""
        if self.end is not None:
            return self.end.ended_in[0]
        return max((epoch for epoch, _ in [*self.trained, *self.dealt]), default=-1)

    def due(self, epoch: int) -> int | None:
        """How many prompts epoch `epoch`'s steps dealt, each due to be trained exactly once
        (None: not known, so that epoch is checked for repeats only). The rule:

        - an epoch the run went past, or ended at the last step of: every prompt of the data but
          the epoch's remainder (too few for a step: no step deals it; its ``remainder`` line;
          a ledger without one, or an older one, counts every prompt);
        - the epoch the run ended in before its last step (``max_steps`` inside it, or a stop
          at a step boundary): ``per_step`` prompts for each rollout it trained (its steps
          taken, over ``iterations``): the rows its steps noted ``training``; prompts no step
          dealt are not due;
        - the epoch a run ended in without an end line (it failed, or is still running, or an
          older ray-trainer wrote the ledger): not known; nor a whole epoch's where the starts
          did not record the data's prompts (an older ledger).
        """
        whole = self.num_prompts - len(self.remainder.get(epoch, ())) if self.num_prompts else None
        if self.whole(epoch):
            return whole
        if self.end is None or epoch > self.last_epoch:
            return None
        return self.end.ended_in[1] // self.end.iterations * self.end.per_step

    def whole(self, epoch: int) -> bool:
        """Whether every step of epoch `epoch` was taken: the run went past it, or ended at its
        last step (then all its prompts but its remainder are due)."""
        if epoch < self.last_epoch:
            return True
        if self.end is None or epoch > self.last_epoch:
            return False
        return self.end.ended_in[1] >= self.end.steps_per_epoch

    def left_out(self, epoch: int) -> list[int]:
        """The rows of epoch `epoch`'s remainder (no step deals them) where the epoch is due
        whole; none where it is not (its steps not all taken), or no line recorded them."""
        return sorted(self.remainder.get(epoch, ())) if self.whole(epoch) else []

    def report(self) -> tuple[list[str], bool]:
        """How the run ended, one line per epoch (its prompts trained once, more than once,
        never; what was dropped and asked for again), then the rolled-back count; and whether
        the ledger is whole: no prompt trained twice in an epoch, and every prompt an epoch's
        steps dealt (:meth:`due`) trained once."""
        lines, ok = [self._ending()], True
        for epoch in range(self.last_epoch + 1):
            left = self.left_out(epoch)
            trained = {row: n for (e, row), n in self.trained.items() if e == epoch}
            rows = {row: n for row, n in trained.items() if row not in left}
            twice = sorted(row for row, n in trained.items() if n > 1)
            due = self.due(epoch)
            line = f"epoch {epoch}: {sum(n == 1 for n in rows.values())} of "
            if due is None:
                line += f"{self.num_prompts} prompts trained once (not checked for prompts left "
                line += "out: " + ("see above)" if epoch == self.last_epoch else "no data size)")
            elif epoch == self.last_epoch:
                line += f"the {due} prompts its steps dealt trained once (the run's last epoch)"
            else:
                line += f"{due} prompts trained once"
            if left:
                line += f"; dropped (epoch remainder) {len(left)}: rows {left[:10]}"
            if twice:
                line += f"; trained more than once: rows {twice[:10]}"
            beyond = sorted(row for row in left if row in trained)
            if beyond:
                line += f"; trained though in the epoch's remainder: rows {beyond[:10]}"
            lost = sorted(
                (s, r) for (e, r), s in self.dealt.items() if e == epoch and r not in rows
            )
            missing = 0 if due is None else due - len(rows)
            if due is not None and (missing > 0 or lost):
                line += f"; never trained: {max(missing, len(lost))}"
                named = ", ".join(f"row {r} of step {s}" for s, r in lost[:10])
                line += f" ({named})" if named else ""
            if missing < 0:
                line += f"; trained beyond what its steps dealt: {-missing}"
            ok = ok and not twice and not beyond and (due is None or (missing == 0 and not lost))
            drops = sum(n for (e, _), n in self.dropped.items() if e == epoch)
            again = sum(n for (e, _), n in self.requeued.items() if e == epoch)
            lines.append(f"{line}; dropped as stale {drops}, asked for again {again}")
        lines.append(f"rolled back by a resume and trained again: {self.rolled_back}")
        if self.torn:
            lines.append(
                f"last line cut short (a worker killed while writing it) in {self.torn} "
                "file(s): not read, as if never written"
            )
        return lines, ok

    def _ending(self) -> str:
        if self.end is not None:
            return self.end.describe() + ": every epoch checked"
        return (
            "the run's last worker-group start wrote no end line: it failed, was killed or is "
            "still running (or an older ray-trainer wrote the ledger), so the epoch it ended in "
            "is checked for prompts trained twice only"
        )

    def problems(self, num_prompts: int, epochs: Iterable[int]) -> list[str]:
        """Every prompt of each of `epochs` not trained exactly once, or trained though in the
        epoch's remainder (no step deals it: due 0 times); empty: none."""
        out = []
        for epoch in epochs:
            left = self.remainder.get(epoch, set())
            for row in range(num_prompts):
                times, due = self.trained.get((epoch, row), 0), 0 if row in left else 1
                if times != due:
                    why = " (in the epoch's remainder, which no step deals)" if due == 0 else ""
                    out.append(f"epoch {epoch}, prompt row {row}: trained {times} times{why}")
        return out


def audit(segments: list[Segment]) -> Audit:
    """Read the segments' records. A worker-group start that a later one followed (a restart,
    or a new call continuing the run) trained the steps up to the checkpoint that later start
    restored (the checkpoint proves them; its steps after it were rolled back); the last start
    trained the steps it noted ``trained``, and its end line (if any) says how the run ended.
    What the steps dealt is their ``training`` lines in that lineage."""
    trained: dict[tuple[int, int], int] = {}
    dropped: dict[tuple[int, int], int] = {}
    requeued: dict[tuple[int, int], int] = {}
    dealt: dict[tuple[int, int], int] = {}
    remainder: dict[int, set[int]] = {}
    rolled_back = 0
    starts: dict[tuple[str, int], tuple[float, int]] = {}  # its first start time, restored step
    for seg in segments:
        first = starts.get((seg.launch, seg.attempt), (seg.started, seg.restored))
        starts[(seg.launch, seg.attempt)] = (min(first[0], seg.started), seg.restored)
    end = None
    for seg in segments:
        began = starts[(seg.launch, seg.attempt)][0]
        cut = min((step for t, step in starts.values() if t > began), default=None)
        counts_as = "trained" if cut is None else "training"
        if cut is None and seg.end is not None:
            end = seg.end
        for r in seg.records:
            keys = [(r.get("epoch", 0), row) for row in r["rows"]]
            if r["state"] == "remainder":  # the epoch's order: the same in every start
                remainder.setdefault(r.get("epoch", 0), set()).update(r["rows"])
                continue
            if r["state"] in ("training", "trained") and cut is not None and r["step"] > cut:
                rolled_back += len(keys) if r["state"] == counts_as else 0
                continue
            if r["state"] == "training":
                dealt.update(dict.fromkeys(keys, r["step"]))
            if r["state"] == counts_as:
                for key in keys:
                    trained[key] = trained.get(key, 0) + 1
            elif r["state"] in ("dropped", "requeued"):
                counts = dropped if r["state"] == "dropped" else requeued
                for key in keys:
                    counts[key] = counts.get(key, 0) + 1
    prompts = max((seg.prompts for seg in segments), default=0)
    torn = sum(seg.torn for seg in segments)
    return Audit(trained, dropped, requeued, rolled_back, prompts, dealt, end, remainder, torn)
