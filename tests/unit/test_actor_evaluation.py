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


def test_each_outcome_records_and_tells_its_seconds_after_the_save(monkeypatch):
    """From the checkpoint's on_save reaching the actor to its metrics: a field of the record,
    and `seconds_after_save=` of on_evaluate (RayMetrics' gauge, status's column)."""
    fired = []

    class Manager:
        def fire(self, event, context, **kwargs):
            fired.append((event, context.global_step, kwargs))

    monkeypatch.setattr(evaluation.ray, "get", lambda ref: {"acc": 0.5})
    tracker = EvalTracker(Manager(), "run")
    now = evaluation.time.time()
    tracker._in_flight["ok"] = evaluation._Pending(4, "/c/4", "EvalOnSave", None, now - 2.5)
    tracker._in_flight["bad"] = evaluation._Pending(6, "/c/6", "EvalOnSave", None, now - 1.0)
    tracker._finish("ok")
    tracker._close("bad", error="RuntimeError: boom")
    ok, bad = tracker.sorted_results()
    assert ok["metrics"] == {"acc": 0.5} and 2.5 <= ok["seconds_after_save"] < 4.0
    assert bad["error"] == "RuntimeError: boom" and 1.0 <= bad["seconds_after_save"] < 2.5
    ((event, step, kwargs),) = fired
    assert event == "on_evaluate" and step == 4
    assert kwargs["seconds_after_save"] == ok["seconds_after_save"]


def test_a_persistent_eval_fn_gets_one_evaluator_actor_in_the_run_s_reservation(monkeypatch):
    """keep_engine: one evaluator actor per EvalOnSave, made when the callback actor starts,
    with EvalOnSave's resources, in an elastic run's placement group (the bundles the
    reservation holds, so the elastic sizing counts them), restarted once; ended at close."""
    from callbacks import EvalOnSave
    from ray_trainer._actor.actor import _start_evaluators

    made, killed, closed = [], [], []

    class Handle:
        def __init__(self, options, fn):
            self.options, self.fn = options, fn
            self.close = type("M", (), {"remote": lambda _: closed.append(self) or "ref"})()

    class Remote:
        def options(self, **options):
            return type("C", (), {"remote": lambda _, fn: made.append(Handle(options, fn))
                                  or made[-1]})()  # fmt: skip

    class Placement:
        def strategy(self, num_cpus, num_gpus, resources):
            return ("bundle for", num_cpus, num_gpus)

    class Kept:
        persistent = True

        def __call__(self, path, step):
            return {}

    monkeypatch.setattr(evaluation, "_REMOTE_EVALUATOR", None)
    monkeypatch.setattr(evaluation.ray, "remote", lambda cls: Remote())
    monkeypatch.setattr(evaluation.ray, "wait", lambda refs, **kw: (refs, []))
    monkeypatch.setattr(evaluation.ray, "kill", lambda actor, no_restart: killed.append(actor))
    tracker = EvalTracker(_Manager(), "run")
    tracker.placement = Placement()
    kept, once = EvalOnSave(Kept(), num_gpus=1, num_cpus=2), EvalOnSave(lambda p, s: {})
    _start_evaluators(tracker, [kept, once])
    (actor,) = made  # only the persistent one, at the start
    assert actor.options == {
        "num_cpus": 2, "num_gpus": 1, "resources": {}, "max_restarts": 1,
        "max_task_retries": 0, "scheduling_strategy": ("bundle for", 2, 1),
    }  # fmt: skip
    assert tracker.evaluator(id(kept), kept.eval_fn, 2, 1) is actor  # the same for the run
    tracker.close()
    assert closed == [actor] and killed == [actor] and tracker._evaluators == {}
