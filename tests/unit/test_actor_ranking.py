"""Checkpoint ranking and retention: which checkpoints are best, which go, and the ranking file.

The pure ranking (`_actor/ranking.py`), the actor's keeper driven with hand-made contexts on a
local run folder (`_actor/retention.py`), and the evaluation tracker's promise that a checkpoint
is always either still being evaluated or already scored. No Ray.
"""

from __future__ import annotations

import json
import threading

import pytest

from callbacks import TrainingContext
from ray_trainer._actor.evaluation import EvalTracker, _Pending
from ray_trainer._actor.ranking import Ranking
from ray_trainer._actor.retention import CheckpointKeeper
from ray_trainer._checkpoint.format import file_entry
from ray_trainer._checkpoint.names import RANKING_FILE, checkpoint_dir_name
from ray_trainer._contract import Retention
from ray_trainer._storage import locate


def _names(entries):
    return [e.name for e in entries]


# ---- the ranking ------------------------------------------------------------------------------


def test_best_in_the_middle_with_keep_1_keeps_it_and_the_newest():
    r = Ranking("acc", "max", keep=1)
    for step, acc in [(2, 0.1), (4, 0.9), (6, 0.5), (8, 0.3)]:
        r.saved(f"c{step}", step)
        r.evaluated(f"c{step}", {"acc": acc})
    assert r.best().name == "c4"
    assert _names(r.ranked()) == ["c4", "c6", "c8", "c2"]
    assert _names(r.to_delete()) == ["c2", "c6"]  # c8 is the newest: kept for resume


def test_min_order_and_ties_go_to_the_earlier_checkpoint():
    r = Ranking("val_loss", "min", keep=2)
    for step, loss in [(1, 0.5), (2, 0.2), (3, 0.2), (4, 0.7)]:
        r.saved(f"c{step}", step, metrics={"val_loss": loss})
    assert _names(r.ranked()) == ["c2", "c3", "c1", "c4"]
    assert _names(r.to_delete()) == ["c1"]


def test_unscored_rank_below_every_scored_one_newest_first():
    r = Ranking("acc", "max", keep=2)
    r.saved("c1", 1)
    r.evaluated("c1", None)  # its evaluation failed
    r.saved("c2", 2, metrics={"acc": 0.01})
    r.saved("c3", 3)  # not evaluated
    r.saved("c4", 4, metrics={"acc": float("nan")})  # NaN does not rank
    r.saved("c5", 5, metrics={"acc": "n/a"})
    assert _names(r.ranked()) == ["c2", "c5", "c4", "c3", "c1"]
    assert r.best().name == "c2"
    assert _names(r.to_delete()) == ["c1", "c3", "c4"]  # c2 and c5 (best, newest) stay


def test_an_evaluation_beats_the_logged_value_of_the_same_name():
    r = Ranking("loss", "min")
    r.saved("c1", 1, logged=0.1)  # only logged: scored from the logs
    r.saved("c2", 2, logged=0.05)
    r.evaluated("c2", {"loss": 0.9})  # the evaluation's value wins
    assert r.score(r.entries["c2"]) == 0.9 and r.source(r.entries["c2"]) == "evaluation"
    assert r.score(r.entries["c1"]) == 0.1 and r.source(r.entries["c1"]) == "log"
    assert r.best().name == "c1"


def test_pending_evaluations_are_never_deleted():
    r = Ranking("acc", "max", keep=1)
    for step in (1, 2, 3):
        r.saved(f"c{step}", step, metrics={"acc": step / 10})
    r.saved("c0", 0)  # unscored, oldest, but its evaluation is still running
    assert _names(r.to_delete({"c0"})) == ["c1", "c2"]  # c3: the best and the newest
    assert _names(r.to_delete()) == ["c0", "c1", "c2"]


def test_without_a_metric_checkpoints_go_by_age_and_none_is_best():
    r = Ranking(None, keep=2)
    for step in (1, 2, 3, 4):
        r.saved(f"c{step}", step, logged=1.0)
    assert r.best() is None
    assert _names(r.to_delete()) == ["c1", "c2"]
    assert Ranking("acc", keep=None).to_delete() == []


def test_the_file_round_trips_and_another_metric_does_not_rank():
    r = Ranking("acc", "max", keep=3)
    r.saved("c1", 1, logged=0.4)
    r.evaluated("c1", {"f1": 0.7})
    data = json.loads(json.dumps(r.to_dict()))
    again = Ranking("acc", "max", keep=3)
    again.load(data)
    assert again.score(again.entries["c1"]) == 0.4
    other = Ranking("f1", "max")
    other.load(data)
    assert other.score(other.entries["c1"]) == 0.7  # from the evaluation's metrics
    with pytest.raises(ValueError, match="format"):
        Ranking("acc").load({"format": 99})


# ---- the keeper on a run folder ---------------------------------------------------------------


class _Tracker:
    def __init__(self):
        self.pending: set[str] = set()

    def pending_paths(self):
        return set(self.pending)


def _checkpoint(run, step, complete=True, save=None):
    """A checkpoint folder that `verify` accepts (one rank, one file), or an incomplete one;
    `save`: the save id its manifest names (``<run_id>.<launch>.<attempt>``)."""
    folder = run / checkpoint_dir_name(step)
    folder.mkdir(parents=True)
    state = json.dumps({"format": 2, "global_step": step})
    (folder / "trainer_state.json").write_text(state)
    if complete:
        manifest = {
            "format": 2,
            "rank": 0,
            "world_size": 1,
            "files": {"trainer_state.json": file_entry(str(folder), "trainer_state.json")},
            **({"save": save} if save else {}),
        }
        (folder / "rank0.complete").write_text(json.dumps(manifest))
    return str(folder)


def _keeper(run, keep=1, attribute="acc", order="max", run_id=None):
    keeper = CheckpointKeeper(Retention(keep, attribute, order, run_id), locate(str(run)))
    keeper.tracker = _Tracker()
    return keeper


def _save(keeper, run, step):
    path = _checkpoint(run, step)
    context = TrainingContext(global_step=step, checkpoint_path=path)
    keeper.on_save(context)  # the actor's first callback records the save ...
    keeper.pruner.on_save(context)  # ... and its last deletes what is not kept
    return path


def _on_disk(run):
    return sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint_"))


def test_keeper_deletes_all_but_the_best_and_the_newest(tmp_path):
    run = tmp_path / "run"
    keeper = _keeper(run)
    paths = {}
    for step, acc in [(2, 0.1), (4, 0.9), (6, 0.5), (8, 0.3)]:
        paths[step] = _save(keeper, run, step)
        keeper.record_evaluation(paths[step], {"acc": acc})
        keeper.pruner.on_evaluate(TrainingContext(global_step=step), eval_step=step, source="x")
    assert _on_disk(run) == [checkpoint_dir_name(4), checkpoint_dir_name(8)]
    best, metrics = keeper.best()
    assert best == paths[4] and metrics == {"acc": 0.9}
    saved = json.loads((run / RANKING_FILE).read_text())
    assert [c["name"] for c in saved["checkpoints"]] == _on_disk(run)


def test_keeper_keeps_a_checkpoint_while_its_evaluation_runs(tmp_path):
    run = tmp_path / "run"
    keeper = _keeper(run)
    slow = _save(keeper, run, 2)
    keeper.tracker.pending.add(slow)  # its evaluation is running
    for step in (4, 6):
        path = _save(keeper, run, step)
        keeper.record_evaluation(path, {"acc": step / 10})
    assert checkpoint_dir_name(2) in _on_disk(run)
    keeper.record_evaluation(slow, {"acc": 0.01})  # then the tracker stops counting it
    keeper.tracker.pending.clear()
    keeper.pruner.on_train_end(TrainingContext())
    assert _on_disk(run) == [checkpoint_dir_name(6)]  # best and newest at once


def test_keeper_scores_from_the_last_log_at_or_before_the_save(tmp_path):
    run = tmp_path / "run"
    keeper = _keeper(run, keep=None, attribute="loss", order="min")
    keeper.on_log(TrainingContext(global_step=3, loss=0.7))
    keeper.on_log(TrainingContext(global_step=4, batch_metrics={"loss": 0.5}))
    first = _save(keeper, run, 4)
    keeper.on_log(TrainingContext(global_step=9, loss=0.1))  # then the workers restarted
    keeper.on_log(TrainingContext(global_step=5, loss=0.8))  # ... from checkpoint 4
    _save(keeper, run, 6)  # the step-9 log belongs to the abandoned steps, not to this save
    _save(keeper, run, 8)
    rows = {r["step"]: r for r in keeper.rows()}
    assert rows[4]["score"] == 0.5 and rows[4]["source"] == "log"
    assert rows[6]["score"] == 0.8 and rows[8]["score"] == 0.8
    assert keeper.best()[0] == first


def test_an_asynchronous_save_is_scored_by_the_logs_up_to_its_own_step(tmp_path):
    """An asynchronous checkpoint's on_save arrives once every rank has written it, after the
    logs (and in-loop validations) of the steps trained meanwhile."""
    run = tmp_path / "run"
    keeper = _keeper(run, keep=None, attribute="val_loss", order="min")
    for step, value in [(2, 0.9), (3, 0.8), (4, 0.7), (5, 0.6)]:
        keeper.on_log(TrainingContext(global_step=step, batch_metrics={"val_loss": value}))
        if step == 4:  # rank 0's in-loop validation at the boundary of step 4
            keeper.on_evaluate(TrainingContext(val_metrics={"val_loss": 0.75}), eval_step=4)
    _save(keeper, run, 2)  # written while steps 3-5 trained
    _save(keeper, run, 4)
    rows = {r["step"]: r for r in keeper.rows()}
    assert rows[2]["score"] == 0.9 and rows[2]["source"] == "log"
    assert rows[4]["score"] == 0.75 and rows[4]["source"] == "evaluation"
    assert len(keeper._logged) == 2  # what a later save can still ask for: steps 4 and 5


def test_the_step_history_keeps_what_later_saves_can_ask_for():
    from ray_trainer._actor.ranking import StepHistory

    history = StepHistory()
    for step in (1, 2, 3, 7):
        history.record(step, step * 10)
    assert history.at_or_before(5) == 30 and history.at(7) == 70 and history.at(5) is None
    assert history.at_or_before(0) is None
    history.saved(5)
    assert len(history) == 2 and history.at_or_before(6) == 30  # 3 and 7 are left
    history.record(4, 40)  # the workers went back to step 3's checkpoint: 7 is gone
    assert history.at_or_before(9) == 40 and history.at(7) is None


def test_keeper_takes_in_loop_validation_at_the_save_step_as_an_evaluation(tmp_path):
    run = tmp_path / "run"
    keeper = _keeper(run, keep=None, attribute="val_loss", order="min")
    keeper.on_evaluate(TrainingContext(global_step=5, val_metrics={"val_loss": 0.3}), eval_step=5)
    _save(keeper, run, 5)
    _save(keeper, run, 6)  # no validation at 6: the last value seen (step 5) is its logged one
    rows = {r["step"]: r for r in keeper.rows()}
    assert rows[5]["metrics"] == {"val_loss": 0.3} and rows[5]["source"] == "evaluation"
    assert rows[6]["metrics"] == {} and rows[6]["source"] == "log" and rows[6]["score"] == 0.3


def test_a_new_keeper_reads_the_ranking_back_and_matches_it_with_storage(tmp_path):
    run = tmp_path / "run"
    keeper = _keeper(run, keep=2)
    for step, acc in [(2, 0.9), (4, 0.1)]:
        keeper.record_evaluation(_save(keeper, run, step), {"acc": acc})
    _checkpoint(run, 6)  # saved while no actor heard of it: complete, adopted unscored
    _checkpoint(run, 8, complete=False)  # half written: left alone
    again = _keeper(run, keep=1)
    assert [r["step"] for r in again.rows()] == [2, 4, 6]
    assert again.best()[1] == {"acc": 0.9}
    again.pruner.on_train_end(TrainingContext())
    assert _on_disk(run) == [checkpoint_dir_name(s) for s in (2, 6, 8)]
    # A folder deleted behind its back is dropped from the ranking.
    import shutil

    shutil.rmtree(run / checkpoint_dir_name(2))
    assert [r["step"] for r in _keeper(run, keep=1).rows()] == [6]


def test_retention_deletes_only_what_this_runs_saves_wrote(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 2, save="other.aaaa.0")  # another run's (e.g. before the lease existed)
    _checkpoint(run, 4)  # copied in by hand: no save id
    _checkpoint(run, 6, save="mine.bbbb.0")  # this run's, whose on_save a crashed driver lost
    keeper = _keeper(run, keep=1, attribute=None, run_id="mine")
    for step in (8, 10):
        _save(keeper, run, step)
    assert _on_disk(run) == [checkpoint_dir_name(s) for s in (2, 4, 10)]
    rows = {r["step"]: r for r in keeper.rows()}
    assert sorted(rows) == [2, 4, 10]  # the others' still rank (they may be the best)
    saved = json.loads((run / RANKING_FILE).read_text())
    assert {c["step"]: c["own"] for c in saved["checkpoints"]} == {2: False, 4: False, 10: True}
    # A keeper without a run id (an old driver) owns no folder it finds.
    _checkpoint(tmp_path / "old", 2, save="mine.bbbb.0")
    assert not _keeper(tmp_path / "old", keep=1).ranking.entries[checkpoint_dir_name(2)].own


def test_a_deletion_cut_short_is_finished_by_the_next_start(tmp_path, monkeypatch):
    run = tmp_path / "run"
    keeper = _keeper(run, keep=1, attribute=None, run_id="mine")
    _save(keeper, run, 2)

    # The folder's deletion fails once (the process dies, or storage is away) ...
    def storage_away(self):
        raise OSError("storage is away")

    monkeypatch.setattr("ray_trainer._storage.Location.delete", storage_away)
    _save(keeper, run, 4)
    monkeypatch.undo()
    assert _on_disk(run) == [checkpoint_dir_name(2), checkpoint_dir_name(4)]
    saved = json.loads((run / RANKING_FILE).read_text())
    assert saved["deleting"] == [checkpoint_dir_name(2)]
    # ... and the next start deletes it, though no save id in its manifest says whose it is.
    again = _keeper(run, keep=1, attribute=None, run_id="mine")
    assert _on_disk(run) == [checkpoint_dir_name(4)]
    assert [r["step"] for r in again.rows()] == [4]
    assert json.loads((run / RANKING_FILE).read_text())["deleting"] == []


# ---- the evaluation tracker's outcomes --------------------------------------------------------


class _QuickEvaluation:
    """A user callback on the actor whose evaluation of each save ends before the callbacks
    after it (a slow tracker, say) have handled the save: the ranking must already know it."""

    runs_on = "actor"

    def __init__(self, keeper):
        self.keeper = keeper

    def on_save(self, context, **kwargs):
        self.keeper.record_evaluation(context.checkpoint_path, {"acc": context.global_step / 10})


def test_an_evaluation_ending_before_the_other_callbacks_saw_the_save_is_ranked(tmp_path):
    from ray_trainer._actor.actor import with_own_callbacks
    from ray_trainer._actor.state import ActorStateWriter
    from ray_trainer._placement import build_manager, keep_for_actor

    run = tmp_path / "run"
    keeper = _keeper(run)
    user = [_QuickEvaluation(keeper)]
    lists = with_own_callbacks(
        {"core": [], "user": user, "global": []}, ActorStateWriter(locate(str(run))), keeper
    )
    manager = build_manager(lists, keep_for_actor)
    for step in (2, 4, 6):
        path = _checkpoint(run, step)
        manager.fire("on_save", TrainingContext(global_step=step, checkpoint_path=path))
    rows = {r["step"]: r for r in keeper.rows()}
    assert rows[6]["metrics"] == {"acc": 0.6} and rows[6]["evaluations"] == 1
    assert _on_disk(run) == [checkpoint_dir_name(6)]  # best and newest: the pruner ran last


class _Manager:
    def fire(self, *args, **kwargs):
        pass


def test_an_outcome_reaches_the_ranking_before_the_evaluation_stops_being_in_flight():
    tracker = EvalTracker(_Manager(), "run")
    seen = []

    def listener(path, metrics):
        seen.append((path, metrics, path in tracker.pending_paths()))

    tracker.listener = listener
    tracker._in_flight["ref-a"] = _Pending(2, "/run/checkpoint_2", "EvalOnSave", None)
    tracker._in_flight["ref-b"] = _Pending(4, "/run/checkpoint_4", "EvalOnSave", None)
    tracker._close("ref-a", metrics={"acc": 1.0})
    tracker._close("ref-b", error="boom")
    tracker._close("ref-b", error="again")  # closed once only
    assert seen == [("/run/checkpoint_2", {"acc": 1.0}, True), ("/run/checkpoint_4", None, True)]
    assert tracker.pending_paths() == set()
    assert [("error" in r) for r in tracker.results] == [False, True]


def test_outcomes_from_two_threads_are_recorded_once():
    tracker = EvalTracker(_Manager(), "run")
    calls = []
    tracker.listener = lambda path, metrics: calls.append(path)
    for i in range(50):
        tracker._in_flight[i] = _Pending(i, f"/run/c{i}", "EvalOnSave", None)
    threads = [
        threading.Thread(target=lambda: [tracker._close(i, error="x") for i in range(50)])
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == sorted(f"/run/c{i}" for i in range(50))
    assert len(tracker.results) == 50


# ---- the driver's side: args, Ray Train's list, status ---------------------------------------


def test_args_check_the_ranking_fields():
    from ray_trainer import TrainingArgs, TrainingArgsError

    ok = TrainingArgs.coerce(
        save_every_steps=10, num_checkpoints_to_keep=2, checkpoint_score_attribute="val_loss"
    )
    assert ok.checkpoint_score_order == "max"
    with pytest.raises(TrainingArgsError, match="checkpoint_score_order"):
        TrainingArgs.coerce(checkpoint_score_attribute="acc", checkpoint_score_order="best")
    with pytest.raises(TrainingArgsError, match="saves none"):
        TrainingArgs.coerce(checkpoint_score_attribute="acc", save_at_end=False)
    with pytest.raises(TrainingArgsError, match="empty"):
        TrainingArgs.coerce(checkpoint_score_attribute=" ")


def test_the_actor_is_told_what_to_keep_and_ray_trains_list_is_forgotten(tmp_path):
    from ray_trainer import TrainingArgs
    from ray_trainer._checkpoint.names import RAY_CHECKPOINT_LIST
    from ray_trainer._contract import forwarded_events
    from ray_trainer._driver.retention import forget_ray_checkpoint_list, retention_of

    assert retention_of(TrainingArgs()) is None  # nothing ranked, nothing deleted
    assert retention_of(TrainingArgs(num_checkpoints_to_keep=3)) == Retention(3, None, "max")
    args = TrainingArgs(checkpoint_score_attribute="loss", checkpoint_score_order="min")
    assert retention_of(args) == Retention(None, "loss", "min")
    assert {"on_log", "on_evaluate"} <= forwarded_events(frozenset(), ranking=True)
    assert "on_log" not in forwarded_events(frozenset())
    (tmp_path / RAY_CHECKPOINT_LIST).write_text("{}")
    forget_ray_checkpoint_list(locate(str(tmp_path)))
    forget_ray_checkpoint_list(locate(str(tmp_path)))  # nothing there: nothing to do
    assert not (tmp_path / RAY_CHECKPOINT_LIST).exists()


def test_status_lines_show_the_best_and_each_checkpoints_evaluations():
    from ray_trainer._client.status import format_checkpoints

    ranked = {
        "ranked_by": "acc",
        "order": "max",
        "best_checkpoint": "/runs/r/checkpoint_00000004",
        "best_metrics": {"acc": 0.9},
        "num_checkpoints": 2,
        "checkpoints": [
            {"name": "checkpoint_00000004", "step": 4, "metrics": {"acc": 0.9, "f1": 0.5}},
            {"name": "checkpoint_00000008", "step": 8, "metrics": {}, "evaluating": True},
        ],
    }
    assert format_checkpoints(ranked) == [
        "  best        /runs/r/checkpoint_00000004 (acc 0.9)",
        "  checkpoints 2, best first by acc (max)",
        "    checkpoint_00000004  step 4: acc 0.9, f1 0.5",
        "    checkpoint_00000008  step 8 (evaluating): -",
    ]
    plain = {"checkpoints": [{"checkpoint_path": "/r/checkpoint_00000002", "step": 2,
                              "metrics": {"x": 1}, "failures": 1}]}  # fmt: skip
    assert format_checkpoints(plain) == [
        "  checkpoints 1",
        "    checkpoint_00000002  step 2 (1 failed): x 1",
    ]
