"""In the callback actor: which checkpoints are best, and which may go (pure logic, no I/O).

Runs inside the callback actor process (and in unit tests). A checkpoint's score is its
evaluation's value of the ranking metric when an evaluation gave one (``EvalOnSave``, or in-loop
validation at the checkpoint's step), else the value last logged at or before its save, else
none. Scored checkpoints rank by score (the earlier checkpoint first on a tie), then the unscored
ones, newest first. Without a metric, checkpoints rank by age, newest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: The format of the ranking file (``RANKING_FILE``): bump it on an incompatible change.
FORMAT = 1


@dataclass
class Entry:
    """One checkpoint the ranking knows: its folder `name`, its step, the ranking metric's
    logged value at its save (by metric name), and its evaluations' metrics, merged."""

    name: str
    step: int
    logged: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    evaluations: int = 0  # outcomes recorded, failures included
    failures: int = 0
    own: bool = True  # written by this run's saves (False: found on storage): only own ones go


def as_score(value: Any) -> float | None:
    """A finite float, or None (missing, non-numeric, NaN and infinite values do not rank)."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class StepHistory:
    """Values seen at steps, in the order they arrived, for saves that come later: with
    asynchronous checkpoints a save's ``on_save`` arrives after the logs of the steps that
    followed it. A value at a step at or before the newest one kept (the workers went back to
    an earlier checkpoint) replaces everything from that step on."""

    def __init__(self) -> None:
        self._items: list[tuple[int, Any]] = []

    def record(self, step: int, value: Any) -> None:
        while self._items and self._items[-1][0] >= step:
            self._items.pop()
        self._items.append((step, value))

    def at_or_before(self, step: int) -> Any:
        """The last value at or before `step` (None: none)."""
        for seen, value in reversed(self._items):
            if seen <= step:
                return value
        return None

    def at(self, step: int) -> Any:
        """The value at exactly `step` (None: none)."""
        return next((value for seen, value in self._items if seen == step), None)

    def saved(self, step: int) -> None:
        """A save at `step`: later saves come at later steps, so only the last value at or
        before it and those after it can still be asked for."""
        first = max((i for i, (seen, _) in enumerate(self._items) if seen <= step), default=0)
        del self._items[:first]

    def __len__(self) -> int:
        return len(self._items)


class Ranking:
    """The checkpoints of a run, ranked by `attribute` (`order` ``"max"``/``"min"``); `keep`
    is how many of the best to keep (None: all)."""

    def __init__(self, attribute: str | None, order: str = "max", keep: int | None = None):
        if order not in ("max", "min"):
            raise ValueError(f"order must be 'max' or 'min', got {order!r}")
        self.attribute = attribute
        self.order = order
        self.keep = keep
        self.entries: dict[str, Entry] = {}
        # Own checkpoints dropped from the ranking whose folders may not be deleted yet: the next
        # start deletes them (a crash between the ranking file and the deletion).
        self.deleting: set[str] = set()

    # ---- what happened ---------------------------------------------------------------------

    def saved(
        self,
        name: str,
        step: int,
        logged: Any = None,
        metrics: dict[str, Any] | None = None,
        own: bool = True,
    ) -> Entry:
        """A checkpoint was saved (again: a save of the same folder starts it afresh), with the
        metric's last logged value and any evaluation already made at its step. `own`: this
        run's saves wrote it (False for a complete folder found on storage that no save of this
        run announced: it ranks, but retention never deletes it)."""
        self.deleting.discard(name)
        entry = Entry(name=name, step=int(step), metrics=dict(metrics or {}), own=own)
        if self.attribute is not None and as_score(logged) is not None:
            entry.logged[self.attribute] = float(logged)
        self.entries[name] = entry
        return entry

    def evaluated(self, name: str, metrics: dict[str, Any] | None) -> bool:
        """An evaluation of `name` ended: its metrics, or None when it failed. False when the
        checkpoint is not (or no longer) known."""
        entry = self.entries.get(name)
        if entry is None:
            return False
        entry.evaluations += 1
        if metrics is None:
            entry.failures += 1
        else:
            entry.metrics.update(metrics)
        return True

    def forget(self, name: str) -> None:
        self.entries.pop(name, None)

    # ---- what follows ----------------------------------------------------------------------

    def score(self, entry: Entry) -> float | None:
        """The evaluation's value of the metric, else the logged one, else None."""
        if self.attribute is None:
            return None
        value = as_score(entry.metrics.get(self.attribute))
        return value if value is not None else as_score(entry.logged.get(self.attribute))

    def source(self, entry: Entry) -> str | None:
        """Where the score comes from: ``"evaluation"``, ``"log"`` or None."""
        if self.attribute is None:
            return None
        if as_score(entry.metrics.get(self.attribute)) is not None:
            return "evaluation"
        return "log" if as_score(entry.logged.get(self.attribute)) is not None else None

    def ranked(self) -> list[Entry]:
        """Every known checkpoint, best first."""
        entries = list(self.entries.values())
        if self.attribute is None:
            return sorted(entries, key=lambda e: -e.step)
        sign = -1.0 if self.order == "max" else 1.0
        scored = [(s, e) for e in entries if (s := self.score(e)) is not None]
        unscored = [e for e in entries if self.score(e) is None]
        scored.sort(key=lambda se: (sign * se[0], se[1].step))
        return [e for _, e in scored] + sorted(unscored, key=lambda e: -e.step)

    def best(self) -> Entry | None:
        """The best scored checkpoint (None without a metric or a score)."""
        if self.attribute is None:
            return None
        ranked = self.ranked()
        return ranked[0] if ranked and self.score(ranked[0]) is not None else None

    def newest(self) -> Entry | None:
        return max(self.entries.values(), key=lambda e: e.step, default=None)

    def to_delete(self, pending: set[str] | frozenset[str] = frozenset()) -> list[Entry]:
        """The checkpoints beyond the `keep` best, except the newest, those with an evaluation
        still running or queued (`pending` names) and those this run's saves did not write,
        oldest first."""
        if self.keep is None:
            return []
        newest = self.newest()
        kept = {e.name for e in self.ranked()[: self.keep]}
        if newest is not None:
            kept.add(newest.name)
        gone = [
            e
            for e in self.entries.values()
            if e.own and e.name not in kept and e.name not in pending
        ]
        return sorted(gone, key=lambda e: e.step)

    def rows(self, pending: set[str] | frozenset[str] = frozenset()) -> list[dict[str, Any]]:
        """The ranking as plain dicts, best first (for ``status`` and the result)."""
        best = self.best()
        return [
            {
                "name": e.name,
                "step": e.step,
                "score": self.score(e),
                "source": self.source(e),
                "best": best is not None and e.name == best.name,
                "evaluating": e.name in pending,
                "evaluations": e.evaluations,
                "failures": e.failures,
                "metrics": dict(e.metrics),
            }
            for e in self.ranked()
        ]

    # ---- the file --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "attribute": self.attribute,
            "order": self.order,
            "keep": self.keep,
            "checkpoints": [vars(e) for e in sorted(self.entries.values(), key=lambda e: e.step)],
            "deleting": sorted(self.deleting),
        }

    def load(self, data: dict[str, Any]) -> None:
        """Take the entries of a saved ranking (another metric's logged values do not rank)."""
        if data.get("format") != FORMAT:
            raise ValueError(f"unknown ranking format {data.get('format')!r}")
        for raw in data.get("checkpoints", []):
            entry = Entry(
                name=str(raw["name"]),
                step=int(raw["step"]),
                logged={k: float(v) for k, v in (raw.get("logged") or {}).items()},
                metrics=dict(raw.get("metrics") or {}),
                evaluations=int(raw.get("evaluations", 0)),
                failures=int(raw.get("failures", 0)),
                own=bool(raw.get("own", True)),  # files from before ownership: saves' entries
            )
            self.entries[entry.name] = entry
        self.deleting = {str(name) for name in data.get("deleting", [])}
