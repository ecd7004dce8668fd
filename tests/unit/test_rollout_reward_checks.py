"""GRPO rewards a run must not take (issue 74, point 3), without Ray.

- what a function returns: hypothesis over returns (floats with NaN and +-inf, None, bools,
  strings, tensors, huge ints, wrong lengths, not a list) through ``call_reward``: either
  accepted with exactly the finite numbers and NaN for None/NaN, or refused with a
  ``RewardError`` naming the function and the row (never another exception);
- a raising function's error ends with one line of function, error and row: the line the
  driver's ``RunFailedError`` quotes (``launch.root_message``);
"""

from __future__ import annotations

import math

import pytest
import torch

from ray_trainer._driver.launch import root_message
from ray_trainer._rollout.reward_checks import RewardError, checked_rewards, prompts_of
from ray_trainer._rollout.rewards import RewardBatch, call_reward, resolve_reward_fns

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
N = 4  # completions of the step


def batch() -> RewardBatch:
    return RewardBatch(
        prompts=["2+2="] * N,
        completions=["4", " 5", "", "4 "],
        completion_ids=[[1], [2, 3], [], [1, 4]],
        prompt_index=[10, 10, 11, 11],
    )


def returning(value):
    def judge(completions, **kwargs):
        return value

    (fn,) = resolve_reward_fns([judge])
    return fn


VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.integers(min_value=-(2**1100), max_value=2**1100),
    st.booleans(),
    st.text(max_size=3),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: torch.tensor(f)),
    st.just(torch.tensor([1.0, 2.0])),
    st.just([1.0]),
)
RETURNED = st.one_of(
    st.lists(VALUE, min_size=N, max_size=N),
    st.lists(VALUE, max_size=N + 2),
    st.lists(VALUE, min_size=N, max_size=N).map(tuple),
    st.floats(allow_nan=True) | st.none() | st.text(max_size=2),
)


def _expected(value) -> float | None:
    """The reward `value` is, or None when it must be refused."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    try:
        number = float(value)
    except OverflowError:
        return None
    return None if math.isinf(number) else number


@EXAMPLES
@given(returned=RETURNED)
def test_any_return_is_taken_exactly_or_refused_naming_function_and_row(returned):
    fn = returning(returned)
    whole = isinstance(returned, (list, tuple)) and len(returned) == N
    expected = [_expected(v) for v in returned] if whole else None
    try:
        rewards = call_reward(fn, batch())
    except RewardError as e:
        msg = str(e)
        assert msg.startswith("reward function 'judge' returned"), msg
        assert len(msg.splitlines()) == 1, msg  # the line a run's final error quotes
        if not whole:
            assert f"for {N} completions" in msg, msg
        else:
            bad = next(i for i, v in enumerate(expected) if v is None)  # the first refused
            assert f"for row {bad} of the step's {N} completions (prompt " in msg, msg
        return
    assert whole and None not in expected, (returned, rewards)
    assert len(rewards) == N and all(isinstance(r, float) for r in rewards)
    for got, want in zip(rewards, expected, strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == want, (returned, rewards)
        assert not math.isinf(got)


@pytest.mark.parametrize("inf", [math.inf, -math.inf, torch.tensor(math.inf), 10**400])
def test_an_infinite_reward_is_refused_naming_the_function_and_row(inf):
    with pytest.raises(RewardError) as info:
        call_reward(returning([0.0, 1.0, inf, None]), batch())
    msg = str(info.value)
    assert "reward function 'judge' returned" in msg and "inf" in msg
    assert "for row 2 of the step's 4 completions (prompt 11 of the data)" in msg
    assert "must be finite (None or NaN abstains" in msg


def test_nan_and_none_abstain_as_in_trl():
    rewards = checked_rewards("judge", [math.nan, None, 1, torch.tensor(0.5)], N, str)
    assert math.isnan(rewards[0]) and math.isnan(rewards[1]) and rewards[2:] == [1.0, 0.5]


def test_a_raising_functions_last_line_names_it_the_error_and_the_row():
    """What ``RunFailedError`` says of a raising reward function (issue 74: it said only
    "ZeroDivisionError: division by zero"): the error's last line, through Ray's wrapping."""

    def picky(completions, **kwargs):
        return [1 / len(c) for c in completions]  # the empty completion divides by zero

    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("the reward server refused a batch")
        return [0.0]

    (fn, whole) = resolve_reward_fns([picky, batch_only])
    with pytest.raises(RewardError) as info:
        call_reward(fn, batch())
    last = str(info.value).splitlines()[-1]
    assert last == (
        "reward function 'picky' raised ZeroDivisionError: division by zero on row 2 of the "
        "step's 4 completions (prompt 11 of the data)"
    )
    assert "Traceback" in str(info.value)  # the traceback is still there, above it
    wrapped = f"Training failed.\nTraceback (most recent call last):\n  ...\n{info.value}\n"
    assert root_message(RuntimeError(wrapped)) == last
    with pytest.raises(RewardError) as info:
        call_reward(whole, batch())
    assert str(info.value).splitlines()[-1] == (
        "reward function 'batch_only' raised RuntimeError: the reward server refused a batch "
        "on the step's 4 completions (no row fails alone)"
    )


def test_the_prompts_of_a_message():
    assert prompts_of([3, 3, 1]) == " (prompts 1, 3 of the data)"
    assert prompts_of([7]) == " (prompt 7 of the data)" and prompts_of(None) == ""
    assert prompts_of(list(range(20))).endswith("15 and 4 more of the data)")
