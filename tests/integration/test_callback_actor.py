"""The callback actor under a real run: never in the way, errors isolated, control, restarts.

The hung-hook test reads the session's `crash_then_resume` (`tests/support/shared_runs.py`,
shared with `test_faults.py`)."""

from __future__ import annotations

import threading

from rt_support import (
    ActorRecorder,
    ActorSaveCounter,
    ActorStopAt,
    AllRanksRecorder,
    GarbageReturner,
    HeldActorHook,
    RaisingActorCallback,
    Rank0GarbageReturner,
    SlowSteps,
    read_records,
    tiny_run,
)
from waiting import wait_until

# Documented bound (docs/behaviour.md, "Control from actor-side callbacks"): event_flush_interval_s (0.25 s)
# + the actor's reply wait (0.05 s) + three steps (the agreement is read one step late); with
# steps of >= 50 ms, within 9 steps of the event that caused it.
ACTOR_CONTROL_LAG_STEPS = 9


def _run(tmp_path, name, callbacks, **overrides):
    from ray_trainer import run_training

    fields = {"run_name": name, "log_every_steps": 5, "callbacks": callbacks, **overrides}
    return run_training(**tiny_run(tmp_path, **fields))


def test_slow_raising_and_garbage_callbacks_leave_training_alone(ray_session, tmp_path):
    folder = str(tmp_path / "records")
    steps = 20
    result = _run(
        tmp_path,
        "slow-raising",
        [
            AllRanksRecorder(folder),
            HeldActorHook(folder, until_step=steps),  # the actor's step 1, held until step 20
            RaisingActorCallback(),
            GarbageReturner(),
            Rank0GarbageReturner(),
        ],
        max_steps=steps,
        save_every_steps=10,
    )
    assert result.global_step == steps
    # The loop did not wait for the actor's callbacks: it ended its last step while the
    # actor's hook of step 1 was still held.
    assert read_records(folder, "held") == [{"step": 1, "training_went_on": True}]
    # ... and yet the actor handled every event before run_training returned.
    assert result.events["on_step_end"] == steps
    errors = [e for e in result.callback_errors if e["callback"] == "RaisingActorCallback"]
    assert sorted(e["step"] for e in errors if e["event"] == "on_step_end") == list(
        range(1, steps + 1)
    )
    assert [e["step"] for e in errors if e["event"] == "on_save"] == [10, 20]
    assert all("boom" in e["error"] for e in errors)
    # A hook returning garbage is recorded once per occurrence, in either process.
    garbage = [e for e in result.callback_errors if e["callback"] == "GarbageReturner"]
    assert sorted(e["step"] for e in garbage) == list(range(1, steps + 1))
    assert all(e["event"] == "on_step_end" and "returned int" in e["error"] for e in garbage)
    rank0 = [e for e in result.callback_errors if e["callback"] == "Rank0GarbageReturner"]
    assert [e["step"] for e in rank0] == [5, 10, 15, 20]  # on_log every 5 steps
    assert all("returned str" in e["error"] for e in rank0)


def test_actor_stop_request_reaches_every_rank_within_the_lag(ray_session, tmp_path):
    folder = str(tmp_path / "records")
    k = 5
    result = _run(
        tmp_path,
        "actor-stop",
        [AllRanksRecorder(folder), ActorStopAt(k), SlowSteps(0.05)],
        max_steps=40,
    )
    assert result.stopped_early
    assert result.stop_reason == "ActorStopAt"
    assert k < result.global_step <= k + ACTOR_CONTROL_LAG_STEPS
    assert result.checkpoint_path.endswith(f"checkpoint_{result.global_step:08d}")
    records = read_records(folder, "all_ranks")
    for rank in (0, 1):
        last = max(r["step"] for r in records if r["rank"] == rank and r["event"] == "on_step_end")
        assert last == result.global_step


def test_killed_actor_is_restarted_and_loses_no_save(ray_session, tmp_path):
    import ray

    from ray_trainer._contract import NAMESPACE, actor_name

    folder = str(tmp_path / "records")
    outcome: dict = {}

    def train():
        outcome["result"] = _run(
            tmp_path,
            "actor-kill",
            [ActorRecorder(folder), ActorSaveCounter(), SlowSteps(0.05)],
            max_steps=40,
            save_every_steps=5,
        )

    thread = threading.Thread(target=train)
    thread.start()
    # Wait (bounded) until the actor has handled a save, then kill it; Ray restarts it.
    wait_until(
        lambda: any(r["event"] == "on_save" for r in _safe_read(folder)),
        120,
        "the actor to handle an on_save",
        interval=0.05,
    )
    ray.kill(ray.get_actor(actor_name("actor-kill"), namespace=NAMESPACE), no_restart=False)
    thread.join(timeout=300)
    assert not thread.is_alive()
    result = outcome["result"]
    assert result.global_step == 40
    assert result.undelivered_events == 0
    records = read_records(folder, "actor")
    assert len({r["pid"] for r in records}) == 2  # before and after the restart
    saves = sorted({r["step"] for r in records if r["event"] == "on_save"})
    assert saves == [5, 10, 15, 20, 25, 30, 35, 40]
    # The restarted actor restored ActorSaveCounter from the newest checkpoint's actor state.
    counts = read_records(str(tmp_path / "storage"), "save_counter")
    assert [c["saves"] for c in counts] == [8]


def _safe_read(folder):
    try:
        return read_records(folder, "actor")
    except (FileNotFoundError, ValueError):
        return []


def test_a_hung_async_hook_is_cancelled_and_recorded_and_unpicklable_state_is_left_out(
    crash_then_resume,
):
    # The session's `crash_then_resume` (shared_runs.py): its second call, which resumes
    # test_faults.py's crashed run from step 2 to step 10, saving and logging every 5 steps.
    from ray_trainer import _checkpoint
    from ray_trainer._storage import locate

    result = crash_then_resume["resumed"]
    elapsed = crash_then_resume["resumed_seconds"]
    assert crash_then_resume["hook_timeout"] == 2.0
    # The hang held each on_log for the hook timeout, then was cancelled: the run ended within
    # the documented bound (start-up, the two cancelled logs, the end's own waits).
    assert elapsed < 90, elapsed
    hung = [e for e in result.callback_errors if e["callback"] == "HangingAsyncLogger"]
    assert [(e["event"], e["step"]) for e in hung] == [("on_log", 5), ("on_log", 10)]
    assert all("ran over the hook timeout of 2 s" in e["error"] for e in hung)
    # The events behind the hang were handled, and counted honestly.
    records = crash_then_resume["resumed_records"]
    saves = [r["step"] for r in records if r["event"] == "on_save"]
    assert saves == [5, 10]
    assert result.events["on_save"] == 2 and result.unhandled_events == {}
    # A state_dict() that cannot be pickled: recorded against its callback, on rank 0 and on
    # the actor, while the checkpoints are written without that state.
    state_errors = {
        (e["callback"], e["event"]) for e in result.callback_errors if e["event"] == "state_dict"
    }
    assert state_errors == {("LockLaterRank0", "state_dict"), ("LockLaterActor", "state_dict")}
    loaded = _checkpoint.load(locate(result.checkpoint_path), 0)  # complete: verified on load
    assert loaded.state.global_step == 10
    assert not any("LockLater" in key for key in loaded.callbacks)
