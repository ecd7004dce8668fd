"""A restart's resume (`_worker/checkpoints/resume.py`): what saves cut off left is removed
before the attempt saves, so that no save writes into a crashed one's files (readers refuse a
checkpoint holding files that a reader opens but its manifests do not list: an elastic group
that shrank would otherwise leave the larger group's rank files in its next checkpoint)."""

from __future__ import annotations

import os

import pytest
from checkpoint_trees import make_model, read_every_way, resume_read, write_checkpoint

from ray_trainer import _checkpoint as ckpt
from ray_trainer._storage import locate
from ray_trainer._worker.checkpoints.resume import remove_cut_off_saves


def _cut_off(folder, sharded):
    """A two-rank save cut off before rank 1's manifest: rank 1's files written, not listed."""
    write_checkpoint(folder, sharded=sharded, world=2)
    if sharded:  # rank 1's shard file (one process writes rank 0's alone)
        shards = folder / ckpt.SHARDS_DIR
        (shards / "__1_0.distcp").write_bytes((shards / "__0_0.distcp").read_bytes())
    os.remove(folder / "rank1.complete")


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_restart_removes_what_cut_off_saves_left_and_its_saves_read_back(tmp_path, sharded):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoint_00000005", sharded=sharded, world=2)  # resumed from
    _cut_off(run / "checkpoint_00000003", sharded)  # older: never written again
    _cut_off(run / "checkpoint_00000010", sharded)
    (run / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray Train's, not a checkpoint
    # Without the removal, the next save of step 10 by one worker writes into the leftovers:
    # rank 1's files are there, unlisted, and every reader refuses the checkpoint.
    stale = tmp_path / "stale" / "checkpoint_00000010"
    _cut_off(stale, sharded)
    write_checkpoint(stale, sharded=sharded, world=1)
    leftover = "rank1.pt, shards/__1_0.distcp" if sharded else "rank1.pt"
    with pytest.raises(ckpt.CheckpointError, match=rf"holds {leftover}, which no manifest"):
        ckpt.load_model(str(stale), model=make_model)

    removed = remove_cut_off_saves(locate(str(run)), after=5)
    assert removed == ["checkpoint_00000010"]
    assert sorted(os.listdir(run)) == [
        "checkpoint_00000003", "checkpoint_00000005", "checkpoint_manager_snapshot.json"
    ]  # fmt: skip
    write_checkpoint(run / "checkpoint_00000010", sharded=sharded, world=1)
    assert read_every_way(run / "checkpoint_00000010") == {}
    assert remove_cut_off_saves(locate(str(run)), after=-1) == ["checkpoint_00000003"]


def test_a_rank_the_checkpoint_did_not_have_reads_rank_0s_part_whatever_the_folder_holds(
    tmp_path,
):
    # Which rank parts a checkpoint has is its manifests' word: rank 3 of a two-rank
    # checkpoint gets no RNG state and rank 0's callback state.
    folder = tmp_path / "run" / "checkpoint_00000005"
    write_checkpoint(folder, world=2)
    part = resume_read(folder, 3)
    assert part["rng"] is None and part["callbacks"]["Counter"]["n"] == 0
    assert resume_read(folder, 1)["callbacks"]["Counter"]["n"] == 1
