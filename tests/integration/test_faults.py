"""Faults: a worker crash without retries, failing evaluations (real Ray, 2 workers).

Both read session runs of `tests/support/shared_runs.py`: `crash_then_resume` (its resumed run
is also `test_callback_actor.py`'s hung hook) and `evals_run` (also `test_eval_on_save.py`'s
evaluations)."""

from __future__ import annotations

from shared_runs import EVALS_SAVE_EVERY, EVALS_STEPS


def test_crash_without_retries_fails_clearly_and_leaves_a_resumable_checkpoint(
    crash_then_resume,
):
    from ray_trainer import RunFailedError
    from ray_trainer._checkpoint import verify

    failure = crash_then_resume["failure"]
    assert isinstance(failure, RunFailedError), "the run without retries did not fail"
    message = str(failure)
    assert "'crash-no-retry' failed after 1 attempt(s) (max_failures=0)" in message
    assert message.endswith("checkpoint_00000002")
    latest = message.rsplit(" ", 1)[-1]
    assert verify(latest).global_step == 2  # intact
    # The actor heard about it: on_exception, then on_train_end, once each.
    events = [r["event"] for r in crash_then_resume["crash_records"]]
    assert events.count("on_exception") == 1 and events.count("on_train_end") == 1
    assert events.index("on_exception") < events.index("on_train_end") == len(events) - 1

    # ... and the run resumes from that checkpoint with a new call.
    result = crash_then_resume["resumed"]
    assert result.global_step == 10 and result.attempts == 1


def test_failing_evaluations_are_recorded_and_do_not_block_the_end(evals_run):
    result = evals_run["result"]
    saves = list(range(EVALS_SAVE_EVERY, EVALS_STEPS + 1, EVALS_SAVE_EVERY))  # 5, 10, 15
    assert result.global_step == EVALS_STEPS
    ok = [e for e in result.evaluations if "error" not in e]
    # The callable object's, and test_eval_on_save's held ones (they read the checkpoint).
    callable_ok = [e for e in ok if "offset_step" in e["metrics"]]
    assert [e["metrics"]["offset_step"] for e in callable_ok] == [1000 + step for step in saves]
    assert len(ok) == 2 * len(saves)
    assert all("checkpoint_step" in e["metrics"] for e in ok if e not in callable_ok)
    errors = [e["error"] for e in result.evaluations if "error" in e]
    # 2 failing evaluations x 3 checkpoints, each recorded once (the held one never fails).
    assert len(errors) == 2 * len(saves)
    assert sum("eval of step" in e and "broke" in e for e in errors) == len(saves)
    assert sum("timed out" in e or "not finished" in e for e in errors) == len(saves)
    # 4 evaluations per checkpoint, in step order.
    assert [e["step"] for e in result.evaluations] == [step for step in saves for _ in range(4)]
    # The hanging evaluation held the end for at most its timeout, not its 300 s: a run whose
    # end waited for it would take over 300 s from its first save (a loaded machine: 145 s).
    assert evals_run["seconds"] < 240
