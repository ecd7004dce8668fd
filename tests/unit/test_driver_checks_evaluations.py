"""`check_evaluations`: an `EvalOnSave` that no node could ever run is refused before training,
unless the cluster can grow (no Ray: the nodes and the autoscaler's answer are given).

The same refusal on a real cluster, and the run that goes on with ``num_gpus=0``:
``tests/integration/test_multinode.py``.
"""

from __future__ import annotations

import pytest

from callbacks import EvalOnSave, TrainerCallback
from ray_trainer import ResourceRequestError, TrainingArgs
from ray_trainer._driver.checks import resources as checks
from ray_trainer._driver.checks.inputs import collect_callbacks
from ray_trainer._driver.checks.resources import check_evaluations

CPU_ONLY = [{"CPU": 0.0}, {"CPU": 4.0}]  # a head offering no CPU, one worker node
WITH_GPU = [*CPU_ONLY, {"CPU": 8.0, "GPU": 1.0}]


def score(checkpoint_path, step):
    return {"score": float(step)}


class Recorder(TrainerCallback):
    def on_save(self, context, **kwargs):
        pass


def _lists(*callbacks):
    return collect_callbacks(TrainingArgs(callbacks=list(callbacks)))


def test_the_default_gpu_on_a_cluster_without_gpu_is_refused_naming_the_fix():
    with pytest.raises(ResourceRequestError) as info:
        check_evaluations(_lists(Recorder(), EvalOnSave(score)), CPU_ONLY, grows=False)
    message = str(info.value)
    assert message.startswith("EvalOnSave(num_gpus=1, num_cpus=1) could never run its evaluations")
    assert "asks for {'CPU': 1, 'GPU': 1}, but no node has that (cluster: CPU=4, GPU=0" in message
    assert "no autoscaler" in message
    assert "Pass num_gpus=0 to evaluate on CPU (EvalOnSave(eval_fn, num_gpus=0))" in message


def test_evaluations_that_some_node_can_run_pass():
    check_evaluations(_lists(EvalOnSave(score, num_gpus=0)), CPU_ONLY, grows=False)
    check_evaluations(_lists(EvalOnSave(score, num_gpus=0.5)), WITH_GPU, grows=False)
    check_evaluations(_lists(Recorder()), [], grows=False)  # no EvalOnSave: nothing to ask


def test_a_cluster_that_can_grow_gets_the_tasks_submitted(monkeypatch):
    check_evaluations(_lists(EvalOnSave(score)), CPU_ONLY, grows=True)
    # By default the cluster is asked (`_cluster.can_grow`), only when no node fits.
    asked = []
    monkeypatch.setattr(checks, "can_grow", lambda: asked.append(1) or True)
    check_evaluations(_lists(EvalOnSave(score, num_gpus=0)), CPU_ONLY)
    assert asked == []
    check_evaluations(_lists(EvalOnSave(score)), CPU_ONLY)
    assert asked == [1]
    monkeypatch.setattr(checks, "can_grow", lambda: False)
    with pytest.raises(ResourceRequestError, match="num_gpus=0"):
        check_evaluations(_lists(EvalOnSave(score)), CPU_ONLY)


def test_a_missing_custom_resource_is_named_without_the_gpu_advice():
    with pytest.raises(ResourceRequestError) as info:
        check_evaluations(
            _lists(EvalOnSave(score, num_gpus=0, resources={"eval_slot": 1})), CPU_ONLY, grows=False
        )
    message = str(info.value)
    assert "EvalOnSave(num_gpus=0, num_cpus=1, resources={'eval_slot': 1})" in message
    assert "'eval_slot': 1" in message and "eval_slot=0" in message
    assert "num_gpus=0 to evaluate on CPU" not in message
    assert "Ask for what a node has (num_gpus, num_cpus, resources)" in message


def test_a_global_eval_on_save_is_checked_too():
    with EvalOnSave(score, num_gpus=2):
        lists = _lists()
    with pytest.raises(ResourceRequestError, match=r"EvalOnSave\(num_gpus=2"):
        check_evaluations(lists, WITH_GPU, grows=False)


def test_workers_that_do_not_fit_now_wait_for_a_cluster_that_can_grow(monkeypatch):
    """`check_resources` on the cluster the driver joined: a shortfall is refused on a fixed
    cluster, left to the autoscaler on one that grows (a worker's request starts a node)."""
    args = TrainingArgs(num_workers=2, use_gpu=True)
    monkeypatch.delenv("RAY_TRAINER_SKIP_RESOURCE_CHECK", raising=False)
    monkeypatch.setattr(checks, "live_nodes", lambda: CPU_ONLY)
    monkeypatch.setattr(checks, "can_grow", lambda: False)
    with pytest.raises(ResourceRequestError, match=r"num_workers=2 .* room for 0 such worker"):
        checks.check_resources(args)
    monkeypatch.setattr(checks, "can_grow", lambda: True)
    checks.check_resources(args)
    # Nodes given (the embedded Ray's machine, before it starts): it never grows.
    with pytest.raises(ResourceRequestError):
        checks.check_resources(args, nodes=CPU_ONLY)
