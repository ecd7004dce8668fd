"""A run's demand (`_driver/checks/demand.py`): what may hold a CPU at once (workers, rollout
engines, reward tasks, evaluation tasks; the callback actor asks for none), the logical CPUs the
embedded Ray offers for it, and the one line the driver prints when they share the cores.

Pure arithmetic on `TrainingArgs` and callback lists, plus the driver's start with `ray.init`
replaced: no Ray starts here.
"""

from __future__ import annotations

import pytest
import ray

from callbacks import EvalOnSave, JsonlLogger
from ray_trainer import ResourceRequestError, TrainingArgs
from ray_trainer._driver import launch
from ray_trainer._driver.checks.demand import MAX_SHARE, embedded_cpus, run_demand
from ray_trainer._driver.checks.inputs import collect_callbacks
from ray_trainer._driver.console import shared_cores_line


def exact(prompts, completions, completion_ids, **kwargs):
    return [1.0] * len(completions)


def judge(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


def evaluate(checkpoint_path, step):
    return {"score": 0.0}


#: docs/rl.md's first run, as far as resources go.
GRPO_DOC = dict(
    objective="grpo", model="m", data="p.jsonl", reward_fns=[exact], rollout_backend="hf",
    rollout_resources={"CPU": 1}, num_workers=2,
)  # fmt: skip


def demand_of(callbacks=(), **fields):
    args = TrainingArgs.coerce(**fields, callbacks=list(callbacks))
    return run_demand(args, collect_callbacks(args))


def test_the_rl_guides_first_run_needs_four_cpus_and_says_so_on_two_cores():
    demand = demand_of(**GRPO_DOC)
    assert demand.at_once("CPU") == 4.0
    assert demand.counts() == [("worker", 2), ("rollout engine", 1), ("reward task", 1)]
    assert embedded_cpus(demand, cores=2) == 4
    assert shared_cores_line(4, 2, demand.counts()) == (
        "ray-trainer: the embedded Ray offers 4 logical CPUs for this run's 2 workers, "
        "1 rollout engine and 1 reward task, on 2 cores: they share them"
    )
    assert embedded_cpus(demand, cores=8) == 8  # never fewer than the cores
    assert shared_cores_line(8, 8, demand.counts()) is None  # fits: nothing said


def test_workers_engines_rewards_evaluations_and_the_actor_add_up():
    # 2 workers x 1 + the engines' max 3 x 0.5 + two reward functions (1 and 0.5) + an
    # evaluation task of 1 CPU, two in flight; the actor-side logger's actor asks for no CPU.
    demand = demand_of(
        callbacks=[EvalOnSave(evaluate, num_gpus=0, num_cpus=1, max_in_flight=2), JsonlLogger()],
        **{**GRPO_DOC, "rollout_resources": {"CPU": 0.5}, "rollout_workers": (1, 3),
           "reward_fns": [exact, judge], "reward_resources": {"judge": {"CPU": 0.5}}},
    )  # fmt: skip
    assert demand.at_once("CPU") == 2 + 1.5 + 1.5 + 2
    assert embedded_cpus(demand, cores=2) == 7  # ceil(7.0)
    assert demand.counts() == [
        ("worker", 2), ("rollout engine", 3), ("reward task", 2), ("evaluation task", 2)
    ]  # fmt: skip
    assert not demand.asks("GPU")
    # A step waits for the workers, the engines' min and one task of the largest reward.
    needed = [(name, b.resources) for b in demand.beside for name in b.needed]
    assert needed == [
        ("rollout engine 0", {"CPU": 0.5}),
        ("a reward function's task", {"CPU": 1.0}),
    ]
    # Without callbacks (the fit check's view), nothing of the actor side is counted.
    assert run_demand(TrainingArgs.coerce(**GRPO_DOC)).at_once("CPU") == 4.0
    assert demand_of(callbacks=[JsonlLogger()], num_workers=2).at_once("CPU") == 2.0


def test_fractions_round_up_elastic_counts_its_max_and_gpu_tasks_count_their_cpus():
    assert embedded_cpus(demand_of(num_workers=3, resources_per_worker={"CPU": 0.5}), 1) == 2
    elastic = demand_of(num_workers=(1, 3))
    assert elastic.workers == (1, 3) and elastic.at_once("CPU") == 3.0
    gpu_eval = demand_of(callbacks=[EvalOnSave(evaluate)], num_workers=1)  # num_gpus=1 default
    assert gpu_eval.asks("GPU") and gpu_eval.at_once("CPU") == 2.0 and gpu_eval.at_once("GPU") == 1
    no_cpu_eval = demand_of(callbacks=[EvalOnSave(evaluate, num_cpus=0)], num_workers=1)
    assert no_cpu_eval.counts() == [("worker", 1)]  # a GPU-only task shares no core


def test_the_offer_stops_at_max_share_per_core():
    assert embedded_cpus(demand_of(num_workers=64), cores=2) == MAX_SHARE * 2
    assert embedded_cpus(demand_of(num_workers=64), cores=32) == 64


# -- the driver's start: the line only when the cores are shared, GPUs never oversubscribed ----


@pytest.fixture
def embedded(monkeypatch, capsys):
    """`launch._init_ray` on a 2-core machine without GPU, `ray.init` replaced: what it asked
    Ray for and what it printed."""
    if ray.is_initialized():
        pytest.skip("a Ray session is already up in this process")
    started = {}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launch, "embedded_resources", lambda count_gpus: {"CPU": 2.0, "GPU": 0.0})
    monkeypatch.setattr(launch, "dashboard_line", lambda url: "dashboard line")

    def fake_start(num_cpus, dashboard):
        started["num_cpus"] = num_cpus

    monkeypatch.setattr(launch, "start_embedded_ray", fake_start)

    def start(**fields):
        args = TrainingArgs.coerce(**fields)
        started.clear()
        assert launch._init_ray(args, collect_callbacks(args)) is True
        return started["num_cpus"], capsys.readouterr().out.splitlines()

    return start


def test_the_driver_sizes_the_embedded_ray_and_says_so_only_when_the_cores_are_shared(embedded):
    cpus, printed = embedded(**GRPO_DOC)
    assert cpus == 4
    assert printed == ["dashboard line", shared_cores_line(4, 2, demand_of(**GRPO_DOC).counts())]
    cpus, printed = embedded(num_workers=2)
    assert (cpus, printed) == (2, ["dashboard line"])  # fits the cores: nothing more


def test_a_gpu_run_on_a_machine_without_gpus_is_still_refused_before_ray_starts(embedded):
    with pytest.raises(ResourceRequestError, match=r"GPU=0 over 1 node\(s\), room for 0"):
        embedded(num_workers=2, use_gpu=True)
    with pytest.raises(ResourceRequestError, match=r"rollout engine 0 needs \{'GPU': 1"):
        embedded(**{**GRPO_DOC, "rollout_resources": {"GPU": 1}})
