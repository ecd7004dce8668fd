"""`PANELS` and `RayMetrics` agree: every metric a panel queries is one that RayMetrics exports
(with a stand-in for ``ray.util.metrics`` and Ray 2.60's naming: ``ray_`` in front, ``_total``
after a counter's name). The integration test (test_prometheus.py) checks the same on a real
Prometheus for every panel but GRPO's (its run is SFT): those are checked here against the
gauges a GRPO run's logs make (its args' ``objective_metrics``, two reward functions)."""

from __future__ import annotations

import re
import types

from callbacks import CallbackManager, RayMetrics, TrainingContext
from callbacks.builtin import ray_metrics
from ray_trainer._monitoring.panels import EVAL_PREFIX, PANELS, RL_ROW

_NAME = re.compile(r"\b(ray_trainer_\w+)\{")


def exact(prompts, completions, completion_ids, **kwargs):
    return [1.0] * len(completions)


def brevity(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


def _grpo_log() -> dict:
    """The args and the batch_metrics of a GRPO run's log (every metric it names, a value;
    asynchronous: the queue's too)."""
    from ray_trainer import TrainingArgs

    args = TrainingArgs(
        model="m", data="d.jsonl", objective="grpo", reward_fns=[exact, brevity], max_staleness=1
    ).to_public_dict()
    return {"args": args, "batch_metrics": dict.fromkeys(args["objective_metrics"], 0.5)}


def _exported(monkeypatch, grpo: bool = False) -> set[str]:
    """The names one short run's events make RayMetrics export, as Ray 2.60 names them (with
    `grpo`, a GRPO run's logs)."""
    kinds: dict[str, str] = {}

    class Metric:
        def __init__(self, kind, name, **_):
            kinds[name] = kind

        def set(self, value, tags=None):
            pass

        inc = _record = set

    module = types.SimpleNamespace(
        Gauge=lambda name, **kw: Metric("gauge", name, **kw),
        Counter=lambda name, **kw: Metric("counter", name, **kw),
    )
    monkeypatch.setattr(ray_metrics, "_import_ray_metrics", lambda: module)
    cb = RayMetrics()
    manager = CallbackManager([cb], global_callbacks=[])
    actor = {"callback_errors_total": 0, "events_dropped_total": {"on_log": 0}}
    base = {"run_name": "r", **actor}
    manager.fire("on_train_begin", TrainingContext(world_size=2, **base))
    log = {"loss": 1.0, "learning_rate": 0.1, "throughput": 5.0, "grad_norm": 1.0}
    log = {"batch_metrics": {"mfu": 0.1}, **log}
    if grpo:
        own = _grpo_log()
        log = {**log, "args": own["args"], "batch_metrics": {"mfu": 0.1, **own["batch_metrics"]}}
    manager.fire("on_log", TrainingContext(global_step=1, **log, **base))
    manager.fire("on_evaluate", TrainingContext(val_metrics={"val_loss": 0.5}, **base))
    manager.fire("on_save", TrainingContext(checkpoint_path="/c", **base))
    manager.fire(
        "on_evaluate", TrainingContext(val_metrics={"acc": 1.0}, **base), seconds_after_save=2.0
    )
    manager.fire("on_train_end", TrainingContext(**base))
    return {f"ray_{n}_total" if k == "counter" else f"ray_{n}" for n, k in kinds.items()}


def test_every_metric_a_panel_queries_is_exported_by_ray_metrics(monkeypatch):
    exported = _exported(monkeypatch)
    queried = {
        name
        for panel in PANELS
        if panel.row is None
        for s in panel.series
        for name in _NAME.findall(s.expr)
    }
    assert queried, "no metric name found in the panels' queries"
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
    assert {f"{EVAL_PREFIX}val_loss", f"{EVAL_PREFIX}acc"} <= exported  # the repeat panel's


def test_no_exported_name_that_is_not_an_evaluation_starts_with_the_eval_prefix(monkeypatch):
    # The repeating panel takes every ray_trainer_eval_* name: nothing else may look like one.
    evals = {n for n in _exported(monkeypatch) if n.startswith(EVAL_PREFIX)}
    assert evals == {f"{EVAL_PREFIX}val_loss", f"{EVAL_PREFIX}acc"}


def test_every_rl_panel_reads_gauges_that_a_grpo_runs_logs_export(monkeypatch):
    exported = _exported(monkeypatch, grpo=True)
    panels = [p for p in PANELS if p.row == RL_ROW]
    queried = {name for panel in panels for s in panel.series for name in _NAME.findall(s.expr)}
    assert len(queried) >= 9  # reward, reward_std, the completions', kl, the rollout's ...
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"
    # The per-function series is a regex over names: it takes each function's mean, no other.
    [by_name] = [s for p in panels for s in p.series if "__name__" in s.expr]
    regex = re.search(r'__name__=~"([^"]+)"', by_name.expr).group(1)
    means = {n for n in exported if re.fullmatch(regex, n)}
    assert means == {"ray_trainer_rewards_exact_mean", "ray_trainer_rewards_brevity_mean"}
    assert "ray_trainer_rewards_exact_std" in exported  # exported, but not in that series
    assert not re.fullmatch(regex, "ray_trainer_rewards_chosen")  # DPO's


def test_an_sft_run_exports_none_of_the_rl_panels_gauges(monkeypatch):
    exported = _exported(monkeypatch)
    rl = {n for p in PANELS if p.row == RL_ROW for s in p.series for n in _NAME.findall(s.expr)}
    assert not rl & exported
