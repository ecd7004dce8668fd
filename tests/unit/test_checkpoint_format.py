"""The checkpoint format (`_checkpoint/`): each rank's part, complete or refused, the newest
complete one, the folder names, the RNG state."""

from __future__ import annotations

import os

import pytest
import torch

from ray_trainer import _checkpoint as ckpt
from ray_trainer._storage import locate
from ray_trainer._worker.checkpoints.saving import write_state


def _write_full(folder, world=2, step=7):
    state = ckpt.TrainerState(global_step=step, epoch=1, step_in_epoch=3, world_size=world)
    model = torch.nn.Linear(2, 2)
    for rank in range(world):
        # Rank 0's whole model and optimizer, as a DDP save writes them (saving.write_state).
        files = write_state(str(folder), {"model": model.state_dict(), "optim": {"x": 1}}, 0, False)
        ckpt.write_rank_part(
            str(folder),
            rank=rank,
            world_size=world,
            callback_state={"Counter": {"n": rank + 10}},
            user_state={"seen": rank},
            **(
                dict(extra_files=files, scheduler={"y": 2}, trainer_state=state)
                if rank == 0
                else {}
            ),
        )
    return model


def test_checkpoint_round_trip_per_rank(tmp_path):
    model = _write_full(tmp_path)
    assert ckpt.verify(str(tmp_path)).global_step == 7
    for rank in (0, 1):
        loaded = ckpt.load(locate(str(tmp_path)), rank)
        assert loaded.state.step_in_epoch == 3
        assert loaded.callbacks == {"Counter": {"n": rank + 10}}
        assert loaded.user_state == {"seen": rank}
        assert torch.equal(loaded.model["weight"], model.state_dict()["weight"])
        assert loaded.rng is not None
    # A rank the checkpoint did not have (the world grew) takes rank 0's callback state.
    assert ckpt.load(locate(str(tmp_path)), 3).callbacks == {"Counter": {"n": 10}}


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
    from ray_trainer._checkpoint.names import checkpoint_names

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
