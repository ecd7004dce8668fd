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

A position is what ``Completion.prompt_index`` records (``ray_trainer/_rollout/types.py``);
:meth:`PromptLedger.row` turns it into the data row. Steps take positions across an epoch's end
(the last prompts of one epoch and the first of the next may share a step), so none is dropped.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
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
