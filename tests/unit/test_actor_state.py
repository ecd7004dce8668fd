"""The actor callbacks' state beside each checkpoint (`_actor/state.py`): written only where there
is something to restore, and never an older state brought back by a restart. The writer and a
real callback manager on a local run folder of complete checkpoints; no Ray."""

from __future__ import annotations

from callbacks import TrainerCallback, TrainingContext
from ray_trainer import _checkpoint as ckpt
from ray_trainer._actor.actor import with_own_callbacks
from ray_trainer._actor.state import ActorStateWriter
from ray_trainer._checkpoint.names import ACTOR_STATE_FILE, checkpoint_dir_name
from ray_trainer._checkpoint.safe import load_file
from ray_trainer._placement import build_manager, keep_for_actor
from ray_trainer._storage import locate


class _Counter(TrainerCallback):
    """A stateful actor callback: the saves it saw."""

    runs_on = "actor"

    def __init__(self) -> None:
        self.saves = 0

    def on_save(self, context, **kwargs):
        self.saves += 1

    def state_dict(self):
        return {"saves": self.saves}

    def load_state_dict(self, state):
        self.saves = state["saves"]


def _actor(run, *user):
    """The writer and the manager as the actor builds them (the writer the last callback)."""
    writer = ActorStateWriter(locate(str(run)))
    lists = with_own_callbacks({"core": [], "user": list(user), "global": []}, writer, None)
    writer.manager = build_manager(lists, keep_for_actor)
    return writer, writer.manager


def _save(run, manager, step):
    """A complete checkpoint of one rank at `step`, then the actor's `on_save` for it."""
    folder = run / checkpoint_dir_name(step)
    folder.mkdir(parents=True)
    ckpt.write_rank_part(
        str(folder), rank=0, world_size=1, callback_state={}, user_state={},
        trainer_state=ckpt.TrainerState(global_step=step),
    )  # fmt: skip
    manager.fire("on_save", TrainingContext(global_step=step, checkpoint_path=str(folder)))
    return folder


def _state(folder):
    file = folder / ACTOR_STATE_FILE
    return load_file(str(file), file.name) if file.exists() else None


def test_a_run_with_nothing_to_restore_writes_no_actor_state(tmp_path):
    run = tmp_path / "run"
    writer, manager = _actor(run)
    assert writer.restore() is None
    folders = [_save(run, manager, step) for step in (2, 4)]
    assert [_state(f) for f in folders] == [None, None]
    assert not manager.errors
    assert _actor(run)[0].restore() is None  # a restart starts as fresh as before


def test_an_emptied_state_replaces_the_older_one_and_a_restart_keeps_writing(tmp_path):
    run = tmp_path / "run"
    writer, manager = _actor(run)
    writer.restore()
    first = _save(run, manager, 2)  # nothing yet
    manager.user_state["best"] = 0.5
    second = _save(run, manager, 4)
    manager.user_state.clear()  # emptied: the file says so, or a restart would bring 0.5 back
    third = _save(run, manager, 6)
    assert [_state(f) for f in (first, second, third)] == [
        None,
        {"callbacks": {}, "user_state": {"best": 0.5}},
        {"callbacks": {}, "user_state": {}},
    ]
    writer, manager = _actor(run)  # the actor restarted
    assert writer.restore() == str(third) and dict(manager.user_state) == {}
    assert _state(_save(run, manager, 8)) == {"callbacks": {}, "user_state": {}}


def test_a_stateful_actor_callback_is_saved_at_every_checkpoint_and_restored(tmp_path):
    run = tmp_path / "run"
    writer, manager = _actor(run, _Counter())
    writer.restore()
    folders = [_save(run, manager, step) for step in (2, 4)]
    [key] = _state(folders[0])["callbacks"]
    assert [_state(f)["callbacks"][key] for f in folders] == [{"saves": 1}, {"saves": 2}]
    counter = _Counter()
    writer, manager = _actor(run, counter)
    assert writer.restore() == str(folders[1]) and counter.saves == 2
