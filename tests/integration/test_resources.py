"""Requests the cluster can never fit fail at once with what was asked and what there is."""

from __future__ import annotations

import os

import pytest
from rt_support import TinyDataset, TinyRegressor


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"num_workers": 64}, "room for"),
        ({"use_gpu": True}, "GPU=0"),
        ({"resources_per_worker": {"CPU": 8}}, "CPU=4"),
    ],
)
def test_impossible_request_is_refused_before_any_worker_starts(
    ray_session, tmp_path, fields, needle
):
    from ray_trainer import ResourceRequestError, run_training

    with pytest.raises(ResourceRequestError) as info:
        run_training(
            model=TinyRegressor,
            data=TinyDataset,
            max_steps=1,
            storage_path=str(tmp_path),
            run_name="too-big",
            **fields,
        )
    assert needle in str(info.value)
    assert "num_workers=" in str(info.value)
    assert not os.path.exists(tmp_path / "too-big")  # nothing written for the run


# -- GRPO's reward functions: Ray tasks of their own resources, in parallel ---------------------


def _meet(me: str, other: str, folder: str) -> None:
    """Leave `me` in `folder` and wait for `other`: both return only if they run at once."""
    from pathlib import Path

    from waiting import wait_until

    Path(folder, me).touch()
    wait_until(lambda: Path(folder, other).exists(), 60, f"reward task {other}")


def reward_a(completions, meet_in, **kwargs):
    import ray

    _meet("a", "b", meet_in[0])
    return [ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)] * len(completions)


def reward_b(completions, meet_in, **kwargs):
    _meet("b", "a", meet_in[0])
    return [None if c == "" else float(len(c)) for c in completions]


def reward_raises(completions, **kwargs):
    return [1.0 / len(c) for c in completions]  # the empty completion: ZeroDivisionError


def test_reward_functions_run_as_parallel_ray_tasks_of_their_own_resources(ray_session, tmp_path):
    import math

    from ray_trainer._rollout.rewards import (
        RewardBatch,
        RewardError,
        resolve_reward_fns,
        score_on_ray,
    )

    completions = ["4", "five", "", "4"]
    batch = RewardBatch(
        prompts=["2+2="] * 4, completions=completions, completion_ids=[[1], [2, 3], [], [1]],
        columns={"meet_in": [str(tmp_path)] * 4}, prompt_index=[0, 0, 1, 1],
    )  # fmt: skip
    fns = resolve_reward_fns([reward_a, reward_b], {"reward_a": {"CPU": 0.5}}, columns=["meet_in"])
    # Each task waits for the other's marker: they ran in parallel, or this fails.
    table = score_on_ray(fns, batch, timeout_s=120)
    assert table[:, 0].tolist() == [0.5] * 4  # reward_a's own resources
    assert table[[0, 1, 3], 1].tolist() == [1.0, 4.0, 1.0] and math.isnan(table[2, 1])

    (bad,) = resolve_reward_fns([reward_raises])
    with pytest.raises(RewardError) as info:
        score_on_ray([bad], batch, timeout_s=120)
    msg = str(info.value)
    assert "reward function 'reward_raises' raised on row 2 of the step's 4 completions" in msg
    assert "(prompt 1 of the data)" in msg and "ZeroDivisionError" in msg
    assert "return [1.0 / len(c) for c in completions]" in msg  # the traceback, from the task
