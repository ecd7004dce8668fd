"""`EvalTracker.launch` before it submits: a task no live node can run is recorded as "cannot be
scheduled" on a fixed cluster, and submitted on one that can grow (no Ray: the nodes and the
autoscaler's answer are given)."""

from __future__ import annotations

from ray_trainer._actor import evaluation
from ray_trainer._actor.evaluation import EvalTracker, _unavailable

CPU_ONLY = [{"CPU": 0.0}, {"CPU": 4.0}]


class _Manager:
    def fire(self, *args, **kwargs):
        pass


def _cluster(monkeypatch, nodes, grows):
    asked = []
    monkeypatch.setattr(evaluation, "live_nodes", lambda: nodes)
    monkeypatch.setattr(evaluation, "can_grow", lambda: asked.append(1) or grows)
    return asked


def test_a_fixed_cluster_records_an_evaluation_it_cannot_run(monkeypatch):
    _cluster(monkeypatch, CPU_ONLY, grows=False)
    tracker = EvalTracker(_Manager(), "run")
    seen = []
    tracker.listener = lambda path, metrics: seen.append((path, metrics))
    tracker.launch(lambda p, s: {}, "/run/checkpoint_00000002", 2, num_cpus=1, num_gpus=1)
    (result,) = tracker.results
    assert result["step"] == 2 and result["source"] == "EvalOnSave"
    assert result["error"] == (
        "cannot be scheduled: asks for {'CPU': 1, 'GPU': 1}, but no node has that (cluster: "
        "CPU=4, GPU=0 over 2 node(s)) and the cluster has no autoscaler to add one"
    )
    assert seen == [("/run/checkpoint_00000002", None)]  # the ranking hears of it too
    assert tracker.in_flight() == 0


def test_a_cluster_that_can_grow_gets_the_task_submitted(monkeypatch):
    asked = _cluster(monkeypatch, CPU_ONLY, grows=True)
    assert _unavailable(1, 1, {}) is None  # submitted: its demand reaches the autoscaler
    assert asked == [1]


def test_the_autoscaler_is_asked_only_when_no_node_fits(monkeypatch):
    asked = _cluster(monkeypatch, [*CPU_ONLY, {"CPU": 1.0, "eval_slot": 2.0}], grows=False)
    assert _unavailable(1, 0, {}) is None
    assert _unavailable(1, 0, {"eval_slot": 2}) is None
    assert asked == []
    assert "'eval_slot': 3" in _unavailable(1, 0, {"eval_slot": 3})
    assert asked == [1]


def test_a_node_with_the_resource_but_too_few_cpus_does_not_count(monkeypatch):
    asked = _cluster(monkeypatch, [*CPU_ONLY, {"CPU": 1.0, "eval_slot": 2.0}], grows=False)
    reason = _unavailable(2, 0, {"eval_slot": 1})
    assert "{'CPU': 2, 'eval_slot': 1}" in reason and "CPU=5, eval_slot=2" in reason
    assert asked == [1]
