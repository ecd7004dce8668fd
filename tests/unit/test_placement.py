"""Which callbacks run where (`_placement.py`): every rank, rank 0, or the callback actor."""

from __future__ import annotations

from callbacks import TrainerCallback
from ray_trainer._placement import (
    build_manager,
    keep_for_actor,
    keep_for_worker,
    pack,
    subscribed_events,
    unpack,
)


class Counter(TrainerCallback):
    runs_on = "all_ranks"

    def __init__(self) -> None:
        self.n = 0

    def on_step_end(self, context, **kwargs):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class OnRank0(TrainerCallback):
    runs_on = "rank0"

    def on_log(self, context, **kwargs):
        pass


class OnActor(TrainerCallback):
    def on_evaluate(self, context, **kwargs):
        pass


def test_placement_splits_callbacks_by_process():
    def on_save(context):
        pass

    on_save.runs_on = "all_ranks"
    lists = unpack(
        pack(
            {
                "core": [],
                "user": [Counter(), OnRank0(), OnActor(), ("on_save", on_save)],
                "global": [],
            }
        )
    )
    rank0 = build_manager(lists, keep_for_worker(0, actor_available=True))
    rank1 = build_manager(lists, keep_for_worker(1, actor_available=True))
    assert [type(c).__name__ for c in rank0.callbacks][:2] == ["Counter", "OnRank0"]
    assert rank1.subscribed_events == {"on_step_end", "on_save"}
    assert subscribed_events(lists, keep_for_actor) == {"on_evaluate"}
    # Without an actor, actor-side callbacks run on rank 0 and only there.
    no_actor = build_manager(lists, keep_for_worker(0, actor_available=False))
    assert "on_evaluate" in no_actor.subscribed_events
    assert "on_evaluate" not in build_manager(lists, keep_for_worker(1, False)).subscribed_events
