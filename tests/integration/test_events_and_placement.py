"""One short real run (2 CPU workers, gloo, accelerate): which events fire, where, in what order."""

from __future__ import annotations

import pytest
from rt_support import ActorRecorder, AllRanksRecorder, TinyDataset, TinyRegressor, read_records

MICRO = ["on_before_forward", "on_after_forward", "on_before_backward", "on_after_backward"]
STEPS, ACCUM, STEPS_PER_EPOCH = 6, 2, 4


def _small_data() -> TinyDataset:
    # 160 samples, 8 held out for validation: 76 per rank = 9 micro-batches of 8 = 4 steps/epoch.
    return TinyDataset(160)


def expected_sequence() -> list[tuple[str, int]]:
    seq = [("on_init_end", 0), ("on_train_begin", 0), ("on_epoch_begin", 0)]
    for step in range(1, STEPS + 1):
        seq.append(("on_step_begin", step - 1))
        seq += [(e, step - 1) for _ in range(ACCUM) for e in MICRO]
        seq += [("on_before_optimizer_step", step - 1), ("on_after_optimizer_step", step - 1)]
        seq.append(("on_step_end", step))
        if step % 2 == 0:
            seq.append(("on_log", step))
        if step % 3 == 0:
            seq += [("on_evaluate", step), ("on_save", step)]
        if step % STEPS_PER_EPOCH == 0:
            seq += [("on_epoch_end", step), ("on_epoch_begin", step)]
    seq.append(("on_train_end", STEPS))
    return seq


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    from ray_trainer import run_training

    folder = str(tmp_path_factory.mktemp("records"))
    result = run_training(
        model=TinyRegressor,
        data=_small_data,
        max_steps=STEPS,
        batch_size=8,
        grad_accum_steps=ACCUM,
        num_workers=2,
        log_every_steps=2,
        eval_every_steps=3,
        save_every_steps=3,
        storage_path=str(tmp_path_factory.mktemp("storage")),
        run_name="events",
        callbacks=[AllRanksRecorder(folder), ActorRecorder(folder)],
    )
    return result, read_records(folder, "all_ranks"), read_records(folder, "actor")


def test_logged_loss_is_the_mean_over_ranks_and_samples_add_up(run):
    result, records, _ = run
    local = {(r["rank"], r["step"]): r["loss"] for r in records if r["event"] == "on_step_end"}
    logs = [r for r in records if r["event"] == "on_log"]
    assert {r["step"] for r in logs} == {2, 4, 6}
    for r in logs:  # on_step_end has this rank's loss; on_log the one agreed across ranks
        mean = (local[(0, r["step"])] + local[(1, r["step"])]) / 2
        assert r["loss"] == pytest.approx(mean, rel=1e-5)
    assert local[(0, 2)] != local[(1, 2)]  # the ranks saw different data
    per_step = ACCUM * 8 * 2  # micro-batches x batch_size x ranks
    assert [r["samples_seen"] for r in logs if r["rank"] == 0] == [
        2 * per_step,
        4 * per_step,
        6 * per_step,
    ]
    assert result.metrics["samples_seen"] == STEPS * per_step


def test_every_event_fires_in_order_on_every_rank(run):
    result, records, _ = run
    assert result.global_step == STEPS
    for rank in (0, 1):
        seen = [(r["event"], r["step"]) for r in records if r["rank"] == rank]
        assert seen == expected_sequence(), f"rank {rank}"


def test_micro_batch_events_once_per_micro_batch(run):
    _, records, _ = run
    rank0 = [r for r in records if r["rank"] == 0 and r["event"] == "on_before_forward"]
    assert len(rank0) == STEPS * ACCUM
    assert [r["micro_step"] for r in rank0] == [0, 1] * STEPS


def test_all_ranks_callback_sees_rank_world_size_and_model(run):
    _, records, _ = run
    assert {r["rank"] for r in records} == {0, 1}
    assert {r["world_size"] for r in records} == {2}
    assert all(r["has_model"] for r in records)
    assert len({r["pid"] for r in records}) == 2  # one process per rank


def test_actor_sees_each_rank0_event_once_in_order(run):
    result, records, actor = run
    rank0 = [(r["event"], r["step"]) for r in records if r["rank"] == 0]
    assert [(r["event"], r["step"]) for r in actor] == rank0
    assert result.events["on_step_end"] == STEPS
    assert result.events["on_save"] == 2
    assert result.undelivered_events == 0


def test_actor_runs_in_its_own_process_on_the_head_node(ray_session, run):
    import ray

    _, records, actor = run
    assert len({r["pid"] for r in actor}) == 1
    assert not {r["pid"] for r in actor} & {r["pid"] for r in records}
    head = next(n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
    assert {r["node"] for r in actor} == {head}
    assert not any(r["has_model"] for r in actor)


def test_checkpoints_and_evaluation_reach_the_callbacks(run):
    result, records, _ = run
    saves = [r for r in records if r["rank"] == 0 and r["event"] == "on_save"]
    assert [s["step"] for s in saves] == [3, 6]
    assert saves[-1]["checkpoint_path"] == result.checkpoint_path
    assert result.checkpoint_path.endswith("checkpoint_00000006")
    evals = [r for r in records if r["rank"] == 1 and r["event"] == "on_evaluate"]
    assert all(e["val_metrics"]["val_loss"] > 0 for e in evals)
    # Both ranks see the same reduced validation loss.
    e0 = [r["val_metrics"] for r in records if r["rank"] == 0 and r["event"] == "on_evaluate"]
    assert e0 == [e["val_metrics"] for e in evals]
