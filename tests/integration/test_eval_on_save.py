"""EvalOnSave: evaluation tasks on each checkpoint while training goes on (real Ray)."""

from __future__ import annotations

import os

from rt_support import (
    AllRanksRecorder,
    SlowSteps,
    read_records,
    slow_eval,
    tiny_run,
)

from callbacks import EvalOnSave


def test_one_evaluation_per_save_in_step_order_without_waiting(ray_session, tmp_path):
    from ray_trainer import run_training

    folder = str(tmp_path / "records")
    result = run_training(
        **tiny_run(
            tmp_path,
            max_steps=15,
            save_every_steps=5,
            run_name="eval-on-save",
            callbacks=[
                AllRanksRecorder(folder),
                SlowSteps(0.05),
                EvalOnSave(slow_eval, num_gpus=0, num_cpus=1),
            ],
        )
    )
    assert [e["step"] for e in result.evaluations] == [5, 10, 15]
    for e in result.evaluations:
        assert "error" not in e, e
        assert e["metrics"]["checkpoint_step"] == e["step"]  # the task read that checkpoint
        assert e["checkpoint_path"].endswith(f"checkpoint_{e['step']:08d}")
        assert e["metrics"]["pid"] != os.getpid()
    # The loop went on right after each save: it never waited for a 3 s evaluation.
    records = [r for r in read_records(folder, "all_ranks") if r["rank"] == 0]
    for save in (r for r in records if r["event"] == "on_save" and r["step"] < 15):
        resumed = next(
            r["t"] for r in records if r["event"] == "on_step_begin" and r["step"] == save["step"]
        )
        assert resumed - save["t"] < 1.5
    # The last checkpoint's evaluation finished before run_training returned.
    assert result.events["on_train_end"] == 1


def test_early_stopping_on_an_eval_on_save_metric_stops_the_run(ray_session, tmp_path):
    from rt_support import constant_score_eval

    from callbacks import EarlyStopping
    from ray_trainer import run_training

    result = run_training(
        **tiny_run(
            tmp_path,
            max_steps=200,
            save_every_steps=4,
            run_name="early-stop",
            callbacks=[
                SlowSteps(0.05),
                EvalOnSave(constant_score_eval, num_gpus=0, num_cpus=1),
                # The score never improves after the first evaluation: stop after 2 more.
                EarlyStopping("score", mode="max", patience=2),
            ],
        )
    )
    assert result.stopped_early
    assert "EarlyStopping" in result.stop_reason
    assert 12 <= result.global_step < 200
    steps = [e["step"] for e in result.evaluations]
    assert steps[:3] == [4, 8, 12] and steps == sorted(steps)
