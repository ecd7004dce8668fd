"""The rollout actor's options (`_rollout/actor.py`, no Ray): ``rollout_resources`` become Ray's
actor options, fractions kept, and a bad value is refused naming the key and the fix; rank 0
creates a GRPO run's engines when its setup begins (they load beside the ranks) unless they take
a fraction of the ranks' GPU, under the names the other ranks look up. The actor
itself runs in tests/integration/test_eval_on_save.py (one real Ray actor)."""

from __future__ import annotations

import pytest

from ray_trainer._rollout.actor import actor_options


def test_rollout_resources_become_the_actors_options():
    assert actor_options(None) == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {}}
    assert actor_options({"GPU": 0.3}) == {"num_cpus": 0.0, "num_gpus": 0.3, "resources": {}}
    assert actor_options({"CPU": 0.5, "GPU": 1, "accel": 2}) == {
        "num_cpus": 0.5, "num_gpus": 1.0, "resources": {"accel": 2.0},
    }  # fmt: skip
    for bad in ({"GPU": -1}, {"CPU": "one"}, {"CPU": True}):
        with pytest.raises(ValueError, match=r"rollout_resources\['(GPU|CPU)'\] must be a number"):
            actor_options(bad)


def test_engines_start_loading_with_the_ranks_unless_they_share_the_ranks_gpu(monkeypatch):
    from types import SimpleNamespace

    from ray_trainer import TrainingArgs
    from ray_trainer._worker.objectives import grpo_engines
    from ray_trainer._worker.objectives.grpo import GrpoObjective
    from ray_trainer._worker.objectives.grpo_engines import engine_name, starts_early

    assert starts_early(None) and starts_early({"CPU": 1}) and starts_early({"GPU": 1})
    assert not starts_early({"GPU": 0.3})  # vLLM would size its memory while the ranks load
    made = []

    class Recorded:
        def __init__(self, backend, spec, resources, *, name, namespace):
            made.append((name, namespace, resources))

    monkeypatch.setattr(grpo_engines, "RemoteEngine", Recorded)

    def reward(prompts, completions, completion_ids, **kwargs):
        return [0.0] * len(completions)

    spec = SimpleNamespace(actor_name="ray-trainer:run", actor_namespace="ns", launch_id="l")
    for rank, resources, expected in ((1, {"CPU": 1}, 0), (0, {"GPU": 0.5}, 0), (0, None, 2)):
        made.clear()
        args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m",
                                   reward_fns=[reward], rollout_workers=2,
                                   rollout_resources=resources)  # fmt: skip
        objective = GrpoObjective(args)
        objective.begin(spec, rank, attempt=3)
        assert len(made) == expected, (rank, resources, made)
    # The names the other ranks look up when the engines are first used (`Engines.start`).
    assert [m[0] for m in made] == [engine_name("ray-trainer:run", 3, 0, i) for i in range(2)]
    assert sorted(objective._started) == [0, 1] and made[0][1] == "ns"
