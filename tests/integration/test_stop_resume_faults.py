"""Stop requests, continuing a run, and a worker crash with restart (real Ray, 2 workers).

Two calls of one run: the first is stopped at step 4 by a callback's request; the second
continues it and rank 1 is killed at step 7, so the group restarts from the checkpoint of step
6 and ends at 9. (The crash was a run of its own; issue 47.)"""

from __future__ import annotations

import os

import pytest
from rt_support import (
    AllRanksRecorder,
    KillRank1Once,
    Rank1SaveAfter,
    StepCounter,
    StopAt,
    TinyDataset,
    TinyRegressor,
    read_records,
    tiny_data_4_steps_per_epoch,
)


def _args(storage: str, folder: str, extra=(), data=TinyDataset, **overrides):
    return dict(
        model=TinyRegressor,
        data=data,
        batch_size=8,
        num_workers=2,
        storage_path=storage,
        log_every_steps=100,
        callbacks=[AllRanksRecorder(folder), StepCounter(), *extra],
        **overrides,
    )


@pytest.fixture(scope="module")
def stopped_then_continued(ray_session, tmp_path_factory):
    from ray_trainer import run_training

    storage = str(tmp_path_factory.mktemp("storage"))
    first_dir = str(tmp_path_factory.mktemp("first"))
    second_dir = str(tmp_path_factory.mktemp("second"))
    first = run_training(
        **_args(
            storage,
            first_dir,
            # A stop asked during step 3 acts at step 4; a save asked by rank 1 in on_step_end of
            # step 1 rides in step 2's all-reduce and acts at step 3 (loop.py's docstring).
            [StopAt(3), Rank1SaveAfter(1)],
            data=tiny_data_4_steps_per_epoch,  # step 4 is the last of epoch 0
            max_steps=10,
            run_name="stop-continue",
        ),
    )
    second = run_training(
        **_args(
            storage,
            second_dir,
            [KillRank1Once(7)],  # the restart resumes from step 6's checkpoint
            data=tiny_data_4_steps_per_epoch,
            max_steps=9,
            save_every_steps=2,
            max_failures=1,
            run_name="stop-continue",
        )
    )
    return (
        first,
        second,
        read_records(first_dir, "all_ranks"),
        read_records(second_dir, "all_ranks"),
        storage,
    )


def test_rank0_stop_request_stops_both_ranks_one_step_later(stopped_then_continued):
    first, _, records, _, _ = stopped_then_continued
    assert first.global_step == 4
    assert first.stopped_early
    assert first.stop_reason and "StopAt" in first.stop_reason
    for rank in (0, 1):
        steps = [r["step"] for r in records if r["rank"] == rank and r["event"] == "on_step_end"]
        assert steps == [1, 2, 3, 4]
        ends = [r for r in records if r["rank"] == rank and r["event"] == "on_train_end"]
        assert len(ends) == 1


def test_stop_saves_a_final_checkpoint(stopped_then_continued):
    first, _, records, _, _ = stopped_then_continued
    assert first.checkpoint_path.endswith("checkpoint_00000004")
    assert os.path.exists(os.path.join(first.checkpoint_path, "rank0.complete"))
    assert os.path.exists(os.path.join(first.checkpoint_path, "rank1.complete"))
    for rank in (0, 1):
        saves = [r["step"] for r in records if r["rank"] == rank and r["event"] == "on_save"]
        # 3: rank 1 asked in on_step_end of step 1 (after its backward: two boundaries later).
        assert saves == [3, 4]


def test_new_call_continues_from_the_checkpoint(stopped_then_continued):
    first, second, _, records, _ = stopped_then_continued
    assert second.global_step == 9 and not second.stopped_early
    loads = [r for r in records if r["event"] == "on_load_checkpoint" and r["attempt"] == 0]
    assert {r["rank"] for r in loads} == {0, 1}
    assert all(r["checkpoint_path"] == first.checkpoint_path and r["step"] == 4 for r in loads)
    steps = [
        r["step"]
        for r in records
        if r["rank"] == 0 and r["event"] == "on_step_end" and r["attempt"] == 0
    ]
    assert steps == [5, 6, 7]


def test_resuming_at_an_epoch_boundary_starts_the_next_epoch(stopped_then_continued):
    # The first run stopped (and saved) at step 4, the last step of epoch 0: the continued run
    # begins epoch 1, without an empty epoch 0 (on_epoch_begin then at once on_epoch_end).
    _, _, _, records, _ = stopped_then_continued
    for rank in (0, 1):
        epochs = [
            (r["event"], r["step"], r["epoch"])
            for r in records
            if r["rank"] == rank
            and r["attempt"] == 0
            and r["event"] in ("on_epoch_begin", "on_epoch_end")
        ]
        assert epochs == [("on_epoch_begin", 4, 1)], f"rank {rank}"


def test_worker_crash_restarts_from_latest_checkpoint(stopped_then_continued):
    _, second, _, records, storage = stopped_then_continued
    assert second.attempts == 2
    # The surviving rank 0 saw its collective fail: on_exception, then on_train_end, once each.
    first = [r["event"] for r in records if r["rank"] == 0 and r["attempt"] == 0]
    assert first[-2:] == ["on_exception", "on_train_end"]
    loads = [r for r in records if r["event"] == "on_load_checkpoint" and r["attempt"] == 1]
    assert {(r["rank"], r["step"]) for r in loads} == {(0, 6), (1, 6)}
    restarted = [
        r["step"]
        for r in records
        if r["rank"] == 1 and r["attempt"] == 1 and r["event"] == "on_step_end"
    ]
    assert restarted == [7, 8, 9]
    # StepCounter's state and user_state came back from each checkpoint on both ranks: 6 steps
    # restored (4 of the first call, 2 of this one) + 3 taken after the restart.
    counts = [c for c in read_records(storage, "counter") if c["global_step"] == 9]
    assert sorted((c["rank"], c["steps"], c["user_steps"]) for c in counts) == [
        (0, 9, 9),
        (1, 9, 9),
    ]
