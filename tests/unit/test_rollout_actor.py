"""The rollout actor's options (`_rollout/actor.py`, no Ray): ``rollout_resources`` become Ray's
actor options, fractions kept, and a bad value is refused naming the key and the fix. The actor
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
