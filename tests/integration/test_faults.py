"""Faults: a worker crash without retries, failing evaluations (real Ray, 2 workers)."""

from __future__ import annotations

import time

import pytest
from rt_support import (
    ActorRecorder,
    CallableEval,
    KillRank1Once,
    SlowSteps,
    hanging_eval,
    raising_eval,
    read_records,
    tiny_run,
)

from callbacks import EvalOnSave


def test_crash_without_retries_fails_clearly_and_leaves_a_resumable_checkpoint(
    ray_session, tmp_path
):
    from ray_trainer import RunFailedError, run_training
    from ray_trainer._checkpoint import verify

    folder = str(tmp_path / "records")
    with pytest.raises(RunFailedError) as info:
        run_training(
            **tiny_run(
                tmp_path,
                max_steps=8,
                save_every_steps=2,
                max_failures=0,
                run_name="crash-no-retry",
                callbacks=[KillRank1Once(3), ActorRecorder(folder)],
            )
        )
    message = str(info.value)
    assert "'crash-no-retry' failed after 1 attempt(s) (max_failures=0)" in message
    assert message.endswith("checkpoint_00000002")
    latest = message.rsplit(" ", 1)[-1]
    assert verify(latest).global_step == 2  # intact
    # The actor heard about it: on_exception, then on_train_end, once each.
    events = [r["event"] for r in read_records(folder, "actor")]
    assert events.count("on_exception") == 1 and events.count("on_train_end") == 1
    assert events.index("on_exception") < events.index("on_train_end") == len(events) - 1

    # ... and the run resumes from that checkpoint with a new call.
    result = run_training(**tiny_run(tmp_path, max_steps=4, run_name="crash-no-retry"))
    assert result.global_step == 4 and result.attempts == 1


def test_failing_evaluations_are_recorded_and_do_not_block_the_end(ray_session, tmp_path):
    from ray_trainer import run_training

    started = time.monotonic()
    result = run_training(
        **tiny_run(
            tmp_path,
            max_steps=10,
            save_every_steps=5,
            run_name="bad-evals",
            eval_timeout_s=30,  # the callable evaluations may queue behind the others: not 10
            callbacks=[
                SlowSteps(0.02),
                EvalOnSave(raising_eval, num_gpus=0),
                EvalOnSave(hanging_eval, num_gpus=0, timeout_s=2),
                EvalOnSave(CallableEval(1000), num_gpus=0),  # a callable object works too
            ],
        )
    )
    elapsed = time.monotonic() - started
    assert result.global_step == 10
    ok = [e for e in result.evaluations if "error" not in e]
    assert [e["metrics"]["offset_step"] for e in ok] == [1005, 1010]
    errors = [e["error"] for e in result.evaluations if "error" in e]
    assert len(errors) == 4  # 2 failing evaluations x 2 checkpoints, each recorded once
    assert sum("eval of step" in e and "broke" in e for e in errors) == 2
    assert sum("timed out" in e or "not finished" in e for e in errors) == 2
    assert [e["step"] for e in result.evaluations] == [5] * 3 + [10] * 3
    # The hanging evaluation held the end for at most its timeout, not its 300 s.
    assert elapsed < 120
