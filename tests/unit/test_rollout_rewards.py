"""GRPO's rewards and advantages (issue 50, points 1 and 3), in one process (no Ray: the Ray
tasks are shown by tests/integration/test_resources.py).

- `reward_fns`: callables with TRL 1.16's signature or "module:function" strings, refused
  before Ray starts with the function and the fix;
- a function is called as TRL calls it (keywords, the data's columns by name); None counts as
  TRL counts it; a function that raises fails with its name, the row and the traceback;
- the weighted sum and group-relative advantages equal TRL's formulas (its own `nanstd`); a
  group of equal rewards gets 0, never NaN.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from ray_trainer._errors import TrainingArgsError
from ray_trainer._rollout.rewards import (
    RewardBatch,
    RewardError,
    RewardState,
    call_reward,
    combine_rewards,
    completion_metrics,
    group_advantages,
    nanstd,
    resolve_reward_fns,
    reward_metrics,
    reward_weights,
    score,
    score_step,
)


def exact(prompts, completions, completion_ids, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def length(completions, **kwargs):
    return [None if not c else -len(c) / 10 for c in completions]


def batch(**columns) -> RewardBatch:
    completions = ["4", " 5", "", "4 "]
    return RewardBatch(
        prompts=["2+2="] * 4,
        completions=completions,
        completion_ids=[[1], [2, 3], [], [1, 4]],
        columns={"answer": ["4"] * 4, **columns},
        prompt_index=[10, 10, 11, 11],
    )


@pytest.fixture
def module_of_rewards(monkeypatch):
    module = types.ModuleType("my_rewards_for_test")
    module.exact = exact
    module.not_callable = 3
    monkeypatch.setitem(sys.modules, "my_rewards_for_test", module)
    return module


# -- resolving -----------------------------------------------------------------------------------


def test_callables_and_module_function_strings_resolve(module_of_rewards):
    fns = resolve_reward_fns([exact, length], columns=["answer"])
    assert [f.name for f in fns] == ["exact", "length"] and fns[0].fn is exact
    (by_name,) = resolve_reward_fns("my_rewards_for_test:exact", {"exact": {"GPU": 1}})
    assert by_name.fn is exact and by_name.spec == "my_rewards_for_test:exact"
    assert by_name.resources == {"GPU": 1.0} and fns[0].resources == {"CPU": 1.0}


def test_a_reward_module_that_raises_on_import_is_refused_naming_it(tmp_path, monkeypatch):
    (tmp_path / "raising_rewards_for_test.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TrainingArgsError) as info:
        resolve_reward_fns(["raising_rewards_for_test:f"])
    assert "importing module 'raising_rewards_for_test' raised RuntimeError: no GPU here" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("fns", "kwargs", "needle"),
    [
        (None, {}, "GRPO needs at least one reward function"),
        ([], {}, "GRPO needs at least one reward function"),
        ([3], {}, "reward_fns[0]: got a int; give a function or a 'module:function' string"),
        (["my_rewards_for_test.exact"], {}, "is not a 'module:function' string"),
        (["no_such_module_x:f"], {}, "module 'no_such_module_x' does not import"),
        (["my_rewards_for_test:nope"], {}, "has no 'nope'; check the function's name"),
        (["my_rewards_for_test:not_callable"], {}, "names a int, not a function"),
        ([exact, "my_rewards_for_test:exact"], {}, "a second reward function named 'exact'"),
        ([exact], {"resources": {"exakt": {"CPU": 1}}}, "reward_resources names 'exakt'"),
        ([exact], {"resources": {"exact": {"CPU": -1}}}, "give a dict of Ray resources"),
        (
            [lambda prompts, completions: []],
            {"columns": ["answer"]},
            "cannot take 'completion_ids', 'trainer_state', 'answer'",
        ),
        ([exact], {"columns": ["completions"]}, "a column named 'completions' would shadow"),
    ],
)
def test_bad_reward_fns_are_refused_with_the_fix(module_of_rewards, fns, kwargs, needle):
    with pytest.raises(TrainingArgsError) as info:
        resolve_reward_fns(fns, **kwargs)
    assert needle in str(info.value)


# -- calling -------------------------------------------------------------------------------------


def test_functions_are_called_as_trl_calls_them_and_none_is_nan():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, step=trainer_state.global_step, **kwargs)
        return [0.5, None, 2, torch.tensor(1.5)]

    (fn,) = resolve_reward_fns([spy], columns=["answer", "level"])
    rewards = call_reward(fn, batch(level=[1, 2, 3, 4]), RewardState(global_step=7))
    assert rewards[0] == 0.5 and math.isnan(rewards[1]) and rewards[2:] == [2.0, 1.5]
    assert seen == {
        "prompts": ["2+2="] * 4,
        "ids": batch().completion_ids,
        "step": 7,
        "level": [1, 2, 3, 4],
    }


def test_a_function_that_raises_names_itself_the_row_and_the_traceback():
    def picky(completions, **kwargs):
        return [1 / len(c) for c in completions]  # the empty completion divides by zero

    (fn,) = resolve_reward_fns([picky])
    with pytest.raises(RewardError) as info:
        call_reward(fn, batch())
    msg = str(info.value)
    assert "reward function 'picky' raised on row 2 of the step's 4 completions (prompt 11" in msg
    assert "completion ''" in msg and "ZeroDivisionError" in msg and "Traceback" in msg
    assert "return [1 / len(c) for c in completions]" in msg  # the user's own line


def test_a_function_failing_on_the_batch_only_is_named_with_its_traceback():
    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("the reward server refused a batch")
        return [0.0]

    (fn,) = resolve_reward_fns([batch_only])
    with pytest.raises(RewardError) as info:
        call_reward(fn, batch())
    assert "on the step's 4 completions (no row fails alone)" in str(info.value)
    assert "the reward server refused a batch" in str(info.value)


@pytest.mark.parametrize(
    ("returned", "needle"),
    [([1.0], "returned 1 values for 4 completions"), (1.0, "returned float for 4"),
     ([1.0, "x", 0, 0], "returned 'x' for row 1 of the step's 4 completions (prompt 10")],
)  # fmt: skip
def test_a_function_returning_anything_but_one_number_per_completion_is_named(returned, needle):
    def bad(completions, **kwargs):
        return returned

    (fn,) = resolve_reward_fns([bad])
    with pytest.raises(RewardError, match=r"reward function 'bad' returned") as info:
        call_reward(fn, batch())
    assert needle in str(info.value)


def test_score_gives_one_column_per_function():
    fns = resolve_reward_fns([exact, length], columns=["answer"])
    table = score(fns, batch())
    assert table.shape == (4, 2)
    assert table[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert math.isnan(table[2, 1]) and table[1, 1].item() == pytest.approx(-0.2)


# -- rewards to advantages ----------------------------------------------------------------------


def test_weights_and_none_combine_as_trls_sum_then_normalize():
    nan = math.nan
    per_function = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan], [0.5, nan]])
    weights = reward_weights([2.0, -1.0], [exact, length])
    rewards = combine_rewards(per_function, weights)
    # TRL: (rewards_per_func * weights).nansum(dim=1), NaN where every function returned None.
    assert rewards[[0, 1, 3]].tolist() == [0.0, -3.0, 1.0] and math.isnan(rewards[2])
    assert reward_weights(None, [exact]).tolist() == [1.0]
    with pytest.raises(TrainingArgsError, match=r"has 1 weight.*for 2 reward function"):
        reward_weights([1.0], [exact, length])


def test_nanstd_is_trls():
    pytest.importorskip("trl")
    from trl.trainer.utils import nanstd as trl_nanstd

    x = torch.tensor([[1.0, math.nan, 3.0, 4.0], [2.0, 2.0, math.nan, math.nan]])
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1))
    torch.testing.assert_close(nanstd(x), trl_nanstd(x))
    assert math.isnan(nanstd(torch.tensor([1.0, math.nan])))  # one value: no std


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_group_relative_as_trls(scale):
    pytest.importorskip("trl")
    from trl.trainer.utils import nanstd as trl_nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, math.nan, 0.0, 1.0])
    advantages, zero_std = group_advantages(rewards, num_generations=4, scale_rewards=scale)
    grouped = rewards.view(-1, 4)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(4)
    std = (
        trl_nanstd(grouped, dim=1).repeat_interleave(4) if scale != "batch" else trl_nanstd(rewards)
    )
    want = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
    torch.testing.assert_close(advantages, torch.nan_to_num(want, nan=0.0))
    assert advantages[5] == 0.0  # unscorable: no signal
    assert not zero_std.any()


def test_a_group_of_equal_rewards_gets_zero_advantage_never_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, math.nan, math.nan])
    for scale in ("group", "batch", "none"):
        advantages, zero_std = group_advantages(rewards, 2, scale)
        assert not torch.isnan(advantages).any(), scale
        assert advantages[:2].tolist() == [0.0, 0.0] and advantages[6:].tolist() == [0.0, 0.0]
    _, zero_std = group_advantages(rewards, 2, "group")
    assert zero_std.tolist() == [True, True, False, False, False, False, False, False]
    with pytest.raises(ValueError, match="not whole groups of num_generations=3"):
        group_advantages(rewards, 3)


def test_reward_and_completion_metrics_have_trls_names():
    nan = math.nan
    per_function = torch.tensor([[1.0, nan], [0.0, 2.0], [nan, nan], [1.0, 0.0]])
    _, zero_std = group_advantages(combine_rewards(per_function, torch.ones(2)), 2)
    metrics = reward_metrics(per_function, ["exact", "length"], torch.ones(2), zero_std)
    assert metrics["rewards/exact/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/length/mean"] == pytest.approx(1.0)
    assert metrics["reward"] == pytest.approx((1.0 + 2.0 + 1.0) / 3)  # the unscorable row left out
    assert set(metrics) == {
        "rewards/exact/mean", "rewards/exact/std", "rewards/length/mean", "rewards/length/std",
        "reward", "reward_std", "frac_reward_zero_std",
    }  # fmt: skip
    assert completion_metrics([4, 8, 2, 2], [False, True, False, False]) == {
        "completions/mean_length": 4.0,
        "completions/min_length": 2.0,
        "completions/max_length": 8.0,
        "completions/clipped_ratio": 0.25,
    }


# -- one step's Completion records ----------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """A stand-in for the rollout engines' record (the fields this side reads)."""

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    truncated: bool
    version: int = 0


def test_a_steps_completions_are_grouped_scored_and_turned_into_advantages():
    prompts = {
        3: SimpleNamespace(prompt="2+2=", columns={"answer": "4"}),
        5: SimpleNamespace(prompt=[{"role": "user", "content": "3+3?"}], columns={"answer": "6"}),
    }
    words = {1: "4", 2: "5", 3: "6"}
    # The engines return the completions out of prompt order.
    completions = [
        Completion(5, [9], [3], [-0.1], False),
        Completion(3, [8], [1], [-0.2], False),
        Completion(5, [9], [2, 2, 2], [-0.3] * 3, True),
        Completion(3, [8], [2], [-0.4], False),
    ]

    def match(prompts, completions, answer, **kwargs):
        text = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [float(t.startswith(a)) for t, a in zip(text, answer, strict=True)]

    fns = resolve_reward_fns([match], columns=["answer"])
    step = score_step(
        completions, prompts, fns, num_generations=2, on_ray=False,
        decode=lambda ids: "".join(words[i] for i in ids),
    )  # fmt: skip
    assert [c.prompt_index for c in step.completions] == [3, 3, 5, 5]
    assert step.per_function[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert step.advantages[0] > 0 > step.advantages[1] and step.advantages[2] > 0
    assert step.metrics["reward"] == 0.5 and step.metrics["completions/clipped_ratio"] == 0.25
    assert step.metrics["completions/max_length"] == 3.0
    with pytest.raises(
        ValueError, match="prompt 5 has 1 completions, GRPO groups num_generations=2"
    ):
        score_step(completions[1:], prompts, fns, num_generations=2, on_ray=False, decode=str)
