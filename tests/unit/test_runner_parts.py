"""Pure parts of the runner: checkpoint files, resumable sampler, LR schedule, placement."""

from __future__ import annotations

import os

import pytest
import torch

from callbacks import TrainerCallback
from ray_trainer import _checkpoint as ckpt
from ray_trainer._placement import (
    build_manager,
    keep_for_actor,
    keep_for_worker,
    pack,
    subscribed_events,
    unpack,
)
from ray_trainer._worker.setup import lr_lambda as _lr_lambda


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


def _write_full(folder, world=2, step=7):
    state = ckpt.TrainerState(global_step=step, epoch=1, step_in_epoch=3, world_size=world)
    model = torch.nn.Linear(2, 2)
    for rank in range(world):
        ckpt.write_rank_part(
            str(folder),
            rank=rank,
            world_size=world,
            callback_state={"Counter": {"n": rank + 10}},
            user_state={"seen": rank},
            **(
                dict(
                    model=model.state_dict(),
                    optimizer={"x": 1},
                    scheduler={"y": 2},
                    trainer_state=state,
                )
                if rank == 0
                else {}
            ),
        )
    return model


def test_checkpoint_round_trip_per_rank(tmp_path):
    model = _write_full(tmp_path)
    assert ckpt.verify(str(tmp_path)).global_step == 7
    for rank in (0, 1):
        loaded = ckpt.load(str(tmp_path), rank)
        assert loaded.state.step_in_epoch == 3
        assert loaded.callbacks == {"Counter": {"n": rank + 10}}
        assert loaded.user_state == {"seen": rank}
        assert torch.equal(loaded.model["weight"], model.state_dict()["weight"])
        assert loaded.rng is not None
    # A rank the checkpoint did not have (the world grew) takes rank 0's callback state.
    assert ckpt.load(str(tmp_path), 3).callbacks == {"Counter": {"n": 10}}


@pytest.mark.parametrize("damage", ["missing_manifest", "truncated_file", "missing_rank"])
def test_incomplete_checkpoints_are_refused(tmp_path, damage):
    _write_full(tmp_path)
    if damage == "missing_manifest":
        os.remove(tmp_path / "rank0.complete")
    elif damage == "truncated_file":
        with open(tmp_path / ckpt.MODEL_FILE, "r+b") as f:
            f.truncate(10)
    else:
        os.remove(tmp_path / "rank1.complete")
    with pytest.raises(ckpt.CheckpointError, match="incomplete checkpoint"):
        ckpt.verify(str(tmp_path))


def test_latest_checkpoint_skips_incomplete_ones(tmp_path):
    (tmp_path / "checkpoint_00000002").mkdir()
    _write_full(tmp_path / "checkpoint_00000002", step=2)
    (tmp_path / "checkpoint_00000004").mkdir()  # a crash while writing
    assert ckpt.latest_checkpoint(str(tmp_path)).endswith("checkpoint_00000002")
    assert ckpt.latest_checkpoint(str(tmp_path / "nothing")) is None


def test_checkpoint_names_leave_out_ray_trains_own_files():
    from ray_trainer._contract import checkpoint_names

    names = ["checkpoint_manager_snapshot.json", "checkpoint_00000010", "run.json"]
    assert checkpoint_names([*names, "checkpoint_00000002"]) == [
        "checkpoint_00000002",
        "checkpoint_00000010",
    ]


def test_rng_state_round_trip():
    state = ckpt.rng_state()
    a = torch.rand(3)
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)


@pytest.mark.parametrize(
    ("kind", "at_end"),
    [("linear", 0.0), ("cosine", 0.0), ("constant", 1.0)],
)
def test_lr_schedule_warmup_then_decay(kind, at_end):
    f = _lr_lambda(kind, warmup=10, total=110)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(110) == pytest.approx(at_end, abs=1e-9)
    if kind != "constant":
        assert f(60) < 1.0


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


def test_workload_batches_variable_length_jsonl_for_any_model(tmp_path):
    from data_support import encode_here
    from torch.utils.data import DataLoader

    from ray_trainer import TrainingArgs
    from ray_trainer._worker.workload import build_workload

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "short"}\n{"text": "a much longer line of text"}\n' * 10)
    for model in (None, lambda: torch.nn.Linear(2, 2)):
        args = TrainingArgs(
            model=model, data=str(data), eval_every_steps=5, storage_path=str(tmp_path / "s")
        )
        wl = build_workload(args, encode_here(args))
        batch = next(iter(DataLoader(wl.train_dataset, batch_size=4, collate_fn=wl.collate_fn)))
        assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
        assert wl.val_dataset is not None and len(wl.val_dataset) == 1  # 5% held out
        assert len(wl.train_dataset) == 19 and wl.train_dataset.lengths.max() == 27  # + EOS
